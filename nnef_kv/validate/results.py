"""What ``validate`` measures and reports: its options, checks, per-context results and the report
(data and the figures derived from them; the measuring itself is :mod:`.runner`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from .metrics import KL_PERCENTILES, mean_stderr, nll_of, rel_l2, summary_stats, token_measures
from .roundtrip import RoundTripResult

__all__ = ["ValidateOptions", "Check", "ParityResult", "ContextResult", "Measurement", "ValidationReport",
           "DEFAULT_CONTEXT_FLOOR", "THRESHOLDS"]


#: the default context is at least this long, and 8 x the KV ops' full-precision window
DEFAULT_CONTEXT_FLOOR = 256
#: threshold option -> (report key, "max" or "min", what it bounds)
THRESHOLDS = {
    "max_kl": ("kl_mean", "max", "mean KL(p_ref || p), nats"),
    "min_token_agreement": ("top1_agreement", "min", "same top-1 token, fraction"),
    "max_ppl_ratio": ("ppl_ratio", "max", "ppl / ppl_reference"),
    "max_attention_deviation": ("attention_deviation_max", "max", "worst per-layer attention deviation"),
}


@dataclass
class ValidateOptions:
    contexts: list[int] | None = None  # None: the default (see resolve_contexts)
    eval_tokens: int = 64
    chunk: int | None = None  # prefill in calls of this many tokens (None: one call)
    max_kl: float | None = None
    min_token_agreement: float | None = None
    max_ppl_ratio: float | None = None
    max_attention_deviation: float | None = None
    parity: bool = True
    parity_atol: float | None = None  # None: from the archive's dtype (f32 1e-4, f16 1e-3)
    parity_rtol: float | None = None  # of the largest |logit| (f32 1e-3, f16 2e-2)
    round_trip: bool = True
    allow_different_weights: bool = False

    def check(self, names: dict[str, str] | None = None) -> "ValidateOptions":
        """InputError for a value no run can use (named as ``names`` maps it: the CLI's options)."""
        nm = names or {}

        def label(k: str) -> str:
            return nm.get(k, k)

        for k in ("eval_tokens", "chunk"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise InputError(f"{label(k)} {v}: must be an integer >= 1")
        if self.contexts is not None:
            if not self.contexts:
                raise InputError(f"{label('contexts')}: no context length given")
            for c in self.contexts:
                if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
                    raise InputError(f"{label('contexts')} {c}: a context is a number of tokens >= 1")
        for k in (*THRESHOLDS, "parity_atol", "parity_rtol"):
            v = getattr(self, k)
            if v is None:
                continue
            if not isinstance(v, (int, float, np.floating)) or isinstance(v, bool):
                raise InputError(f"{label(k)} {v!r}: a number is expected")
            if math.isnan(v):
                raise InputError(f"{label(k)} {v}: not a number")
            if v < 0:
                raise InputError(f"{label(k)} {v}: must be >= 0")
            if k == "min_token_agreement" and v > 1:
                raise InputError(f"{label(k)} {v}: a fraction, in [0, 1]")
        return self

    @property
    def thresholds(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in THRESHOLDS if getattr(self, k) is not None}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class ParityResult:
    """nnef-kv vs tract on the same teacher-forced tokens (the first context).

    ``status``: ``ok``; ``mismatch`` (logits differ beyond tolerance); ``error`` (tract refused or failed
    an archive made of ops it knows: a failed check); ``skipped`` (tract not installed, or the archive
    uses nnef-kv's own ops, which tract does not implement)."""

    status: str
    reason: str = ""
    calls: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    argmax_agreement: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Measurement:
    """One model on one context: the ``N`` predictions and what the KV ops held."""

    logits: np.ndarray  # [N, V] f32
    attention: list[np.ndarray]  # per attention op: [B, Hq, N, D]
    reads: np.ndarray  # [N] quantized entries read (the most over KV ops)
    census: list[dict[str, Any]]
    kv_bytes: int
    kv_bytes_f32: int
    seconds: float
    kv_bytes_used: int = 0  # what was written: held, less the spare capacity of growing buffers
    logits_dtype: str = "float32"


@dataclass
class ContextResult:
    context: int
    eval_tokens: int
    chunk: int | None
    targets: list[int]
    archive: Measurement
    reference: Measurement | None = None
    attention_note: str = ""

    # -- per token ---------------------------------------------------------------------------
    @property
    def positions(self) -> list[int]:
        """Position of each predicted token (the first is ``context``)."""
        return [self.context + i for i in range(self.eval_tokens)]

    def token_measures(self) -> dict[str, np.ndarray] | None:
        if self.reference is None:
            return None
        return token_measures(self.reference.logits, self.archive.logits, self.targets)

    def attention_deviation(self) -> np.ndarray | None:
        """``[N, layers]`` relative L2 of each attention op's output for each evaluated token."""
        r = self.reference
        if r is None or not r.attention or len(r.attention) != len(self.archive.attention):
            return None
        rows = []
        for a, b in zip(self.archive.attention, r.attention):
            if a.shape != b.shape:
                return None
            rows.append([rel_l2(a[:, :, j], b[:, :, j]) for j in range(self.eval_tokens)])
        return np.asarray(rows, np.float64).T

    # -- summary -----------------------------------------------------------------------------
    def quantized_ops(self) -> list[dict[str, Any]]:
        return [c for c in self.archive.census if c["quantized"]]

    @property
    def quantized_tokens(self) -> int:
        """Tokens held quantized by every quantized KV op (the least over them; 0 when there is none)."""
        q = self.quantized_ops()
        return min((c["quantized_tokens"] for c in q), default=0)

    @property
    def full_precision_tokens(self) -> int:
        q = self.quantized_ops()
        return max((c["full_precision_tokens"] for c in q), default=max(
            (c["full_precision_tokens"] for c in self.archive.census), default=0))

    @property
    def reads_quantized(self) -> int:
        """Evaluated tokens whose attention read at least one quantized entry."""
        return int(np.count_nonzero(self.archive.reads))

    @property
    def first_quantized_read(self) -> int | None:
        """Index (among the evaluated tokens) of the first one that read a quantized entry."""
        nz = np.nonzero(self.archive.reads)[0]
        return int(nz[0]) if nz.size else None

    def summary(self) -> dict[str, Any]:
        a = self.archive
        out: dict[str, Any] = {
            "context": self.context, "eval_tokens": self.eval_tokens, "chunk": self.chunk,
            "quantized_tokens": self.quantized_tokens, "full_precision_tokens": self.full_precision_tokens,
            "tokens_reading_quantized": self.reads_quantized, "first_quantized_read": self.first_quantized_read,
            "kv_bytes": a.kv_bytes, "kv_bytes_used": a.kv_bytes_used, "kv_bytes_f32": a.kv_bytes_f32,
            "kv_ratio": (a.kv_bytes / a.kv_bytes_f32) if a.kv_bytes_f32 else None,
        }
        nll = nll_of(a.logits, self.targets)
        m, se = mean_stderr(nll)
        out.update({"ppl": math.exp(m), "ppl_stderr": math.exp(m) * se})
        tm = self.token_measures()
        if tm is None:
            return out
        kl = tm["kl"]
        km, kse = mean_stderr(kl)
        stats = summary_stats(kl, KL_PERCENTILES)
        top = tm["top1"].astype(np.float64)
        tmn, tse = mean_stderr(top)
        rm, rse = mean_stderr(tm["nll_reference"])
        lr, lrse = mean_stderr(tm["nll"] - tm["nll_reference"])
        out.update({
            "kl_mean": km, "kl_mean_stderr": kse, "kl_median": stats["p50"], "kl_p90": stats["p90"],
            "kl_p99": stats["p99"], "kl_p99_9": stats["p99.9"], "kl_max": stats["max"], "kl_min": stats["min"],
            "top1_agreement": tmn, "top1_agreement_stderr": tse,
            "ppl_reference": math.exp(rm), "ppl_reference_stderr": math.exp(rm) * rse,
            "ppl_ratio": math.exp(lr), "ln_ppl_ratio": lr, "ln_ppl_ratio_stderr": lrse,
            "rms_dp": float(np.sqrt(np.mean(tm["dp"] ** 2))),
        })
        dev = self.attention_deviation()
        out["attention_deviation"] = (
            None
            if dev is None
            else {
                "per_layer_mean": [float(x) for x in dev.mean(axis=0)],
                "per_layer_max": [float(x) for x in dev.max(axis=0)],
                "mean": float(dev.mean()),
                "max": float(dev.max()),
            }
        )
        out["attention_deviation_max"] = None if dev is None else float(dev.max())
        return out

    def to_dict(self) -> dict[str, Any]:
        d = self.summary()
        tm = self.token_measures()
        dev = self.attention_deviation()
        per = {"position": self.positions, "target": list(self.targets),
               "reads_quantized": [int(x) for x in self.archive.reads],
               "nll": [float(x) for x in nll_of(self.archive.logits, self.targets)]}
        if tm is not None:
            per.update({"kl": [float(x) for x in tm["kl"]], "top1": [bool(x) for x in tm["top1"]],
                        "nll_reference": [float(x) for x in tm["nll_reference"]]})
        if dev is not None:
            per["attention_deviation"] = [[float(x) for x in row] for row in dev]
        d["attention_note"] = self.attention_note
        d["kv_ops"] = self.archive.census
        d["seconds"] = {"archive": self.archive.seconds,
                        **({"reference": self.reference.seconds} if self.reference is not None else {})}
        d["per_token"] = per
        return d


@dataclass
class ValidationReport:
    archive: str
    reference: str | None
    options: ValidateOptions
    tokens: str = ""  # where the tokens came from
    n_tokens: int = 0
    kv_ops: list[dict[str, Any]] = field(default_factory=list)  # the archive's KV ops and their settings
    round_trip: RoundTripResult | None = None
    parity: ParityResult | None = None
    contexts: list[ContextResult] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def verdict(self) -> str:
        """``fail`` (a check failed), ``pass`` (thresholds were given and all hold) or ``measured``."""
        if not self.ok:
            return "fail"
        return "pass" if self.options.thresholds else "measured"

    @property
    def scheme(self) -> str:
        """A short description of the archive's KV scheme (op and bits), for titles."""
        if not self.kv_ops:
            return "no quantized KV op"
        seen: list[str] = []
        for k in self.kv_ops:
            txt = k["op"] + (f" {k['settings']}" if k.get("settings") else "")
            if txt not in seen:
                seen.append(txt)
        return "; ".join(seen)

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "format": "nnef-kv-validation", "version": 2, "verdict": self.verdict,
            "archive": self.archive, "reference": self.reference, "scheme": self.scheme,
            "tokens": self.tokens, "n_tokens": self.n_tokens, "kv_ops": self.kv_ops,
            "options": {"contexts": o.contexts, "eval_tokens": o.eval_tokens, "chunk": o.chunk,
                        **{k: getattr(o, k) for k in THRESHOLDS}, "parity_atol": o.parity_atol,
                        "parity_rtol": o.parity_rtol, "allow_different_weights": o.allow_different_weights},
            "checks": [c.to_dict() for c in self.checks], "notes": list(self.notes),
            "round_trip": None if self.round_trip is None else self.round_trip.to_dict(),
            "tract_parity": None if self.parity is None else self.parity.to_dict(),
            "contexts": [c.to_dict() for c in self.contexts],
        }


# ---------------------------------------------------------------------------------------------- model facts
