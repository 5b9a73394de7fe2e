"""The KIVI op's attributes (:class:`KiviConfig`), their checks (shared with scheme ``kivi``) and the
rotation matrix of ``rotate``; the op itself is :mod:`.kivi`."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import GraphError
from ..common import check_sink_logits
from ..settings import IntSetting, Problem, first_problem

__all__ = ["CODES_LAYOUT", "KIVI_SETTINGS", "KiviConfig", "hadamard", "kivi_problem"]

CODES_LAYOUT = 2  # saved in states: 2 = GroupCodec (token-planar inside groups); 1 was planar rows


def hadamard(d: int) -> np.ndarray:
    """An orthonormal D x D rotation: Sylvester Hadamard / sqrt(D) when D is a power of two, else a
    fixed (seed 0) random orthogonal matrix."""
    if d & (d - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        return (h / np.sqrt(d)).astype(np.float32)
    rng = np.random.default_rng(0)
    qm, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (qm * np.sign(np.diag(r))).astype(np.float32)


#: the integer settings of the op; scheme ``kivi`` checks its options with :func:`kivi_problem` too
KIVI_SETTINGS = {"bits": IntSetting(1, 8, reason="scheme kivi takes 1..8 bits"), "key_group": IntSetting(1),
                 "value_group": IntSetting(1), "residual": IntSetting(0), "sinks": IntSetting(0),
                 "block_tokens": IntSetting(0)}


def kivi_problem(**values: object) -> Problem | None:
    """The first bad KIVI setting among ``values`` (names of :data:`KIVI_SETTINGS`), or None."""
    return first_problem(values, KIVI_SETTINGS)


@dataclass(frozen=True)
class KiviConfig:
    """The op's attributes (names as in the NNEF declaration)."""

    scale: float = 0.125
    bits: int = 4
    key_group: int = 32
    value_group: int = 32
    residual: int = 32
    sinks: int = 0
    is_causal: bool = True
    rotate: str = "none"
    clip: bool = False
    params: str = "f16"
    block_tokens: int = 0  # 0: chosen so that one block of codes is ~1 MiB of f32
    softcap: float = 0.0  # > 0: scores softcapped, softcap * tanh(scores / softcap) (Gemma 2); 0: none
    key_bits: int = 0  # 0: bits
    value_bits: int = 0  # 0: bits
    key_axis: str = "channel"  # "channel" (KIVI) or "token"
    window: int = 0  # > 0: a sliding window, a query at position p sees the keys in (p - window, p]
    sink_logits: tuple = ()  # one learned logit per query head, a softmax column of its own (GPT-OSS); (): none

    kbits = property(lambda self: self.key_bits or self.bits)  # the keys' bits
    vbits = property(lambda self: self.value_bits or self.bits)  # the values' bits

    @property
    def variant(self) -> bool:
        """Keys and values of different widths, or per-token keys (attention on dequantized codes)."""
        return self.kbits != self.vbits or self.key_axis == "token"

    def validate(self, who: str) -> None:
        bad = kivi_problem(bits=self.bits, key_group=self.key_group, value_group=self.value_group,
                           residual=self.residual, sinks=self.sinks, block_tokens=self.block_tokens)
        if bad is not None:
            raise GraphError(f"{who}: {bad}")
        if self.rotate not in ("none", "", "k", "v", "kv"):
            raise GraphError(f"{who}: rotate must be one of none, k, v, kv, got {self.rotate!r}")
        if self.params not in ("f16", "f32"):
            raise GraphError(f"{who}: params must be 'f16' or 'f32', got {self.params!r}")
        if not self.softcap >= 0 or self.softcap == float("inf"):
            raise GraphError(f"{who}: softcap must be a finite number >= 0 (0: none), got {self.softcap}")
        for nm in ("key_bits", "value_bits"):
            if not 0 <= getattr(self, nm) <= 8:
                raise GraphError(f"{who}: {nm}={getattr(self, nm)}: 0 (= bits) or 1..8")
        if self.key_axis not in ("channel", "token"):
            raise GraphError(f"{who}: key_axis must be 'channel' or 'token', got {self.key_axis!r}")
        if self.window < 0:
            raise GraphError(f"{who}: window must be >= 0 (0: none), got {self.window}")
        if self.window and not self.is_causal:
            raise GraphError(f"{who}: a sliding window (window = {self.window}) needs is_causal = true")
        if self.window and self.sinks:
            raise GraphError(f"{who}: sinks = {self.sinks} with a sliding window (window = {self.window}): a "
                             f"sliding layer sees no token before its window, so its first tokens are no sinks")

        check_sink_logits(who, self.sink_logits)

    @property
    def param_dtype(self) -> np.dtype:
        return np.dtype(np.float16 if self.params == "f16" else np.float32)

    def as_array(self) -> np.ndarray:
        """The config as saved in a state, with the version of the codes layout last."""
        rot = {"none": 0, "": 0, "k": 1, "v": 2, "kv": 3}[self.rotate]
        extra = [self.kbits, self.vbits, int(self.key_axis == "token")] if self.variant else []
        extra += [self.window] if self.window else []  # appended only when on: earlier states load unchanged
        return np.array([self.bits, self.key_group, self.value_group, self.residual, self.sinks,
                         rot, int(self.clip), int(self.params == "f16"), CODES_LAYOUT] + extra, np.int64)
