"""What ``validate`` measures and reports: its options, checks, per-context results and the report
(data and the figures derived from them; the measuring itself is :mod:`.runner`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from .metrics import KL_PERCENTILES, nll_of, rel_l2, token_measures
from .roundtrip import RoundTripResult
from .statistics import Interval, mean_interval, percentile_supported

__all__ = ["ValidateOptions", "Check", "ParityResult", "ContextResult", "Measurement", "ValidationReport",
           "DEFAULT_CONTEXT_FLOOR", "THRESHOLDS", "DEFAULT_EVAL_TOKENS", "DEFAULT_WINDOWS", "MIN_EVAL_TOKENS"]


#: the default context is at least this long, and 8 x the KV ops' full-precision window
DEFAULT_CONTEXT_FLOOR = 256
#: predictions per window by default (fewer when the model or the text cannot hold them)
DEFAULT_EVAL_TOKENS = 512
#: a default context leaves room for at least this many predictions
MIN_EVAL_TOKENS = 64
#: disjoint windows of the text by default (fewer when the text cannot hold them)
DEFAULT_WINDOWS = 4
#: threshold option -> (report key, "max" or "min", what it bounds)
THRESHOLDS = {
    "max_kl": ("kl_mean", "max", "mean KL(p_ref || p), nats"),
    "min_token_agreement": ("top1_agreement", "min", "same top-1 token, fraction"),
    "max_ppl_ratio": ("ppl_ratio", "max", "ppl / ppl_reference"),
    "max_attention_deviation": ("attention_deviation_max", "max", "worst per-layer attention deviation"),
}


@dataclass
class ValidateOptions:
    contexts: list[int] | None = None  # None: the default (see resolve_plan)
    eval_tokens: int | None = None  # predictions per window; None: DEFAULT_EVAL_TOKENS, capped (see resolve_plan)
    windows: int | None = None  # disjoint windows of the text; None: DEFAULT_WINDOWS, as many as the text holds
    windows_seed: int = 0  # 0: windows spread evenly over the text; another: placed at random by this seed
    starts: list[int] | None = None  # each window's first predicted token, given (compare's jobs, auto-bits' parts)
    chunk: int | None = None  # prefill in calls of this many tokens (None: one call)
    max_kl: float | None = None
    min_token_agreement: float | None = None
    max_ppl_ratio: float | None = None
    max_attention_deviation: float | None = None
    parity: bool = True
    parity_tokens: int | None = None  # predictions compared with tract (None: the first window's, all of them)
    parity_atol: float | None = None  # None: from the archive's dtype (f32 1e-4, f16 1e-3)
    parity_rtol: float | None = None  # of the largest |logit| (f32 1e-3, f16 2e-2)
    round_trip: bool = True
    allow_different_weights: bool = False

    def check(self, names: dict[str, str] | None = None) -> "ValidateOptions":
        """InputError for a value no run can use (named as ``names`` maps it: the CLI's options)."""
        nm = names or {}

        def label(k: str) -> str:
            return nm.get(k, k)

        for k in ("eval_tokens", "chunk", "windows", "parity_tokens"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise InputError(f"{label(k)} {v}: must be an integer >= 1")
        if isinstance(self.windows_seed, bool) or not isinstance(self.windows_seed, (int, np.integer)) \
                or self.windows_seed < 0:
            raise InputError(f"{label('windows_seed')} {self.windows_seed!r}: must be an integer >= 0")
        if self.contexts is not None:
            if isinstance(self.contexts, (str, bytes, int, np.integer)) or not hasattr(self.contexts, "__iter__"):
                raise InputError(f"{label('contexts')} {self.contexts!r}: a list of context lengths is expected "
                                 f"(e.g. [128, 512])")
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
    """One model on one context: the ``N`` predictions of each window (concatenated) and what the KV ops held
    (after the last window)."""

    logits: np.ndarray  # [windows x N, V] f32
    attention: list[np.ndarray]  # per attention op: [B, Hq, windows x N, D]
    reads: np.ndarray  # [windows x N] quantized entries read (the most over KV ops)
    census: list[dict[str, Any]]
    kv_bytes: int
    kv_bytes_f32: int
    seconds: float
    kv_bytes_used: int = 0  # what was written: held, less the spare capacity of growing buffers
    logits_dtype: str = "float32"
    starts: list[int] = field(default_factory=list)  # text index of each window's first prediction


def _interval(iv: Interval | None, fn: Any = None) -> list[float] | None:
    if iv is None:
        return None
    return [fn(iv.low), fn(iv.high)] if fn else [iv.low, iv.high]


@dataclass
class ContextResult:
    """One context: ``eval_tokens`` predictions in each window of ``starts`` (the text index of its first
    predicted token; the window's prefill is the ``context`` tokens before it). Every figure of
    :meth:`summary` is also an attribute: ``res.kl_mean``, ``res.kl_mean_ci95``, ``res.predictions``."""

    context: int
    eval_tokens: int
    chunk: int | None
    targets: list[int]
    archive: Measurement
    reference: Measurement | None = None
    attention_note: str = ""
    starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.starts:
            self.starts = [self.context]
        self._cache: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("context", "eval_tokens", "archive", "reference", "starts"):
            raise AttributeError(name)
        s = self.summary()
        if name in s:
            return s[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (the figures: {', '.join(s)})")

    # -- per token ---------------------------------------------------------------------------
    @property
    def windows(self) -> int:
        return len(self.starts)

    @property
    def n_predictions(self) -> int:
        return int(self.archive.logits.shape[0])

    @property
    def groups(self) -> np.ndarray:
        """The window of each prediction."""
        return np.repeat(np.arange(self.windows), self.eval_tokens)[:self.n_predictions]

    @property
    def positions(self) -> list[int]:
        """Cache position of each predicted token (the first of each window is ``context``)."""
        return [self.context + i for _ in self.starts for i in range(self.eval_tokens)][:self.n_predictions]

    @property
    def text_positions(self) -> list[int]:
        """Index in the text of each predicted token."""
        return [s + i for s in self.starts for i in range(self.eval_tokens)][:self.n_predictions]

    def finite_rows(self) -> np.ndarray:
        """Predictions whose logits are all finite, in the archive and in the reference (the others are
        counted, never compared)."""
        ok = np.isfinite(self.archive.logits).all(axis=-1)
        if self.reference is not None:
            ok &= np.isfinite(self.reference.logits).all(axis=-1)
        return ok

    def token_measures(self) -> dict[str, np.ndarray] | None:
        if self.reference is None:
            return None
        if "tm" not in self._cache:
            with np.errstate(invalid="ignore", over="ignore"):
                self._cache["tm"] = token_measures(self.reference.logits, self.archive.logits, self.targets)
        return self._cache["tm"]

    def attention_deviation(self) -> np.ndarray | None:
        """``[predictions, layers]`` relative L2 of each attention op's output for each evaluated token."""
        r = self.reference
        if r is None or not r.attention or len(r.attention) != len(self.archive.attention):
            return None
        if "dev" in self._cache:
            return self._cache["dev"]
        rows = []
        for a, b in zip(self.archive.attention, r.attention):
            if a.shape != b.shape:
                return None
            rows.append([rel_l2(a[:, :, j], b[:, :, j]) for j in range(a.shape[2])])
        self._cache["dev"] = np.asarray(rows, np.float64).T
        return self._cache["dev"]

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
        """Index (among a window's evaluated tokens) of the first one that read a quantized entry."""
        nz = np.nonzero(self.archive.reads[:self.eval_tokens])[0]
        if not nz.size:
            nz = np.nonzero(self.archive.reads)[0] % max(self.eval_tokens, 1)
        return int(nz.min()) if nz.size else None

    def intervals(self) -> dict[str, Interval | None]:
        """The block-bootstrap interval of each mean figure (:mod:`.statistics`), over the finite predictions."""
        if "iv" in self._cache:
            return self._cache["iv"]
        ok = self.finite_rows()
        g = self.groups[ok]
        nll = nll_of(self.archive.logits[ok], np.asarray(self.targets)[ok]) if ok.any() else np.zeros(0)
        out: dict[str, Interval | None] = {"nll": mean_interval(nll, g)}
        tm = self.token_measures()
        if tm is not None:
            out["kl"] = mean_interval(tm["kl"][ok], g, lower=0.0)
            out["top1"] = mean_interval(tm["top1"][ok].astype(np.float64), g, lower=0.0, upper=1.0)
            out["nll_reference"] = mean_interval(tm["nll_reference"][ok], g)
            out["ln_ppl_ratio"] = mean_interval((tm["nll"] - tm["nll_reference"])[ok], g)
            dev = self.attention_deviation()
            if dev is not None:
                d = dev[ok]
                fin = np.isfinite(d).all(axis=1)
                out["attention"] = mean_interval(d[fin].mean(axis=1), g[fin], lower=0.0) if d.size else None
        self._cache["iv"] = out
        return out

    def summary(self) -> dict[str, Any]:
        if "summary" in self._cache:
            return self._cache["summary"]
        a = self.archive
        ok = self.finite_rows()
        n_ok = int(ok.sum())
        out: dict[str, Any] = {
            "context": self.context, "eval_tokens": self.eval_tokens, "chunk": self.chunk,
            "windows": self.windows, "window_starts": list(self.starts),
            "predictions": n_ok, "nonfinite_predictions": int(self.n_predictions - n_ok),
            "nonfinite_archive": int((~np.isfinite(a.logits).all(axis=-1)).sum()),
            "nonfinite_reference": None if self.reference is None else
            int((~np.isfinite(self.reference.logits).all(axis=-1)).sum()),
            "quantized_tokens": self.quantized_tokens, "full_precision_tokens": self.full_precision_tokens,
            "tokens_reading_quantized": self.reads_quantized, "first_quantized_read": self.first_quantized_read,
            "kv_bytes": a.kv_bytes, "kv_bytes_used": a.kv_bytes_used, "kv_bytes_f32": a.kv_bytes_f32,
            "kv_ratio": (a.kv_bytes / a.kv_bytes_f32) if a.kv_bytes_f32 else None,
        }
        iv = self.intervals()
        nan = float("nan")
        e = iv["nll"]
        out.update({"ppl": math.exp(e.mean) if e else nan, "ppl_stderr": math.exp(e.mean) * e.se if e else nan,
                    "ppl_ci95": _interval(e, _exp)})
        tm = self.token_measures()
        if tm is None:
            self._cache["summary"] = out
            return out
        kl = tm["kl"][ok]
        k, t, r, lr = iv["kl"], iv["top1"], iv["nll_reference"], iv["ln_ppl_ratio"]
        pct = {p: (float(np.percentile(kl, p)) if kl.size and percentile_supported(p, kl.size) else None)
               for p in KL_PERCENTILES}
        out.update({
            "kl_mean": k.mean if k else nan, "kl_mean_stderr": k.se if k else nan, "kl_mean_ci95": _interval(k),
            "kl_median": pct[50.0], "kl_p90": pct[90.0], "kl_p99": pct[99.0], "kl_p99_9": pct[99.9],
            "kl_max": float(kl.max()) if kl.size else nan, "kl_min": float(kl.min()) if kl.size else nan,
            "top1_agreement": t.mean if t else nan, "top1_agreement_stderr": t.se if t else nan,
            "top1_agreement_ci95": _interval(t),
            "ppl_reference": math.exp(r.mean) if r else nan,
            "ppl_reference_stderr": math.exp(r.mean) * r.se if r else nan, "ppl_reference_ci95": _interval(r, _exp),
            "ppl_ratio": math.exp(lr.mean) if lr else nan, "ppl_ratio_ci95": _interval(lr, _exp),
            "ln_ppl_ratio": lr.mean if lr else nan, "ln_ppl_ratio_stderr": lr.se if lr else nan,
            "ln_ppl_ratio_ci95": _interval(lr),
            "rms_dp": float(np.sqrt(np.mean(tm["dp"][ok] ** 2))) if n_ok else nan,
            "bootstrap_blocks": k.blocks if k else 0,
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
                "mean_ci95": _interval(iv.get("attention")),
            }
        )
        out["attention_deviation_max"] = None if dev is None else float(dev.max())
        self._cache["summary"] = out
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.summary())
        tm = self.token_measures()
        dev = self.attention_deviation()
        per = {"position": self.positions, "text_position": self.text_positions,
               "window": [int(x) for x in self.groups], "target": list(self.targets),
               "reads_quantized": [int(x) for x in self.archive.reads],
               "nll": [float(x) for x in nll_of(self.archive.logits, self.targets)]}
        if tm is not None:
            fin = self.finite_rows()
            per.update({"kl": [float(x) for x in tm["kl"]],
                        "top1": [bool(x) if f else None for x, f in zip(tm["top1"], fin)],
                        "nll_reference": [float(x) for x in tm["nll_reference"]]})
        if dev is not None:
            per["attention_deviation"] = [[float(x) for x in row] for row in dev]
        d["attention_note"] = self.attention_note
        d["kv_ops"] = self.archive.census
        d["seconds"] = {"archive": self.archive.seconds,
                        **({"reference": self.reference.seconds} if self.reference is not None else {})}
        d["per_token"] = per
        return d


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


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
    plan: Any = None  # the runner's Plan (contexts, predictions per window, window starts)
    model_positions: int | None = None  # the most positions the model holds (None: unbounded)

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
            "format": "nnef-kv-validation", "version": 3, "verdict": self.verdict,
            "archive": self.archive, "reference": self.reference, "scheme": self.scheme,
            "tokens": self.tokens, "n_tokens": self.n_tokens, "kv_ops": self.kv_ops,
            "options": {"contexts": o.contexts, "eval_tokens": o.eval_tokens, "windows": o.windows,
                        "windows_seed": o.windows_seed, "chunk": o.chunk,
                        **{k: getattr(o, k) for k in THRESHOLDS}, "parity_atol": o.parity_atol,
                        "parity_rtol": o.parity_rtol, "allow_different_weights": o.allow_different_weights},
            "checks": [c.to_dict() for c in self.checks], "notes": list(self.notes),
            "round_trip": None if self.round_trip is None else self.round_trip.to_dict(),
            "tract_parity": None if self.parity is None else self.parity.to_dict(),
            "contexts": [c.to_dict() for c in self.contexts],
        }


# ---------------------------------------------------------------------------------------------- model facts
