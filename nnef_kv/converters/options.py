"""Conversion options and their validation (done before any work)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConversionError

SCHEMES = ("kivi", "tract", "tract-cache")


@dataclass(frozen=True)
class ConvertOptions:
    """What the attention/KV caches become.

    scheme: ``kivi`` (nnef-kv's ``nnef_kv_kivi_sdpa``), ``tract`` (``tract_transformers_quantized_kv_sdpa``)
    or ``tract-cache`` (``tract_transformers_quantized_dyn_kv_cache`` per cache, attention unchanged).
    bits: code bits (kivi 1..8; tract-cache 4 or 8; the tract fused op is always 8-bit and ignores it).
    key_group / value_group / residual / sinks: KIVI's grouping, full-precision window, attention sinks.
    """

    scheme: str = "kivi"
    bits: int = 4
    key_group: int = 32
    value_group: int = 32
    residual: int = 32
    sinks: int = 0

    def validate(self) -> "ConvertOptions":
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.scheme not in SCHEMES:
            raise ConversionError(f"option scheme={self.scheme!r}: expected one of {', '.join(SCHEMES)}")
        for name in ("bits", "key_group", "value_group", "residual", "sinks"):
            if not is_int(getattr(self, name)):
                raise ConversionError(f"option {name}={getattr(self, name)!r}: an integer is expected")
        if self.scheme == "kivi" and not 1 <= self.bits <= 8:
            raise ConversionError(f"option bits={self.bits}: scheme kivi takes 1..8 bits")
        if self.scheme == "tract-cache" and self.bits not in (4, 8):
            raise ConversionError(f"option bits={self.bits}: scheme tract-cache takes 4 or 8 bits")
        if self.scheme == "tract" and not 1 <= self.bits <= 8:
            raise ConversionError(f"option bits={self.bits}: expected 1..8 (scheme tract is 8-bit whatever)")
        if self.key_group < 1:
            raise ConversionError(f"option key_group={self.key_group}: must be >= 1")
        if self.value_group < 1:
            raise ConversionError(f"option value_group={self.value_group}: must be >= 1")
        if self.residual < 0:
            raise ConversionError(f"option residual={self.residual}: must be >= 0")
        if self.sinks < 0:
            raise ConversionError(f"option sinks={self.sinks}: must be >= 0")
        return self

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
