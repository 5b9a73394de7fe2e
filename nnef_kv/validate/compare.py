"""``nnef-kv compare``: every KV scheme on one f32 archive and one text, side by side.

For each scheme of ``--schemes`` (``kivi:4``, ``q4_0/q8_0``, ``hf:2+backend=hqq``, ``tract``...; see
:func:`parse_spec`) the f32 archive is converted in memory and measured by ``validate``'s machinery
(:func:`~.runner.validate_model`): the same contexts, prefill, stepwise teacher forcing, KL / ppl /
top-1 figures, quantized-entries-read counts and KV bytes held, against one reference run of the f32
archive shared by every scheme. Each scheme is an independent job (:mod:`.jobs`: a process pool or
Ray); a scheme that fails (refused by the converter, an op that cannot run the model, a context that
reads nothing quantized) is a row saying why, never an abort. Rows are ordered by KV bytes held at the
largest context. Whether tract 0.23.9 loads and runs each converted archive is measured, not assumed:
validate's parity run for archives of tract's ops, a load attempt for the others."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InputError, NnefKvError
from .results import Measurement, ValidateOptions

__all__ = ["SchemeSpec", "parse_spec", "parse_specs", "DEFAULT_SCHEMES", "CompareOptions", "SchemeRow",
           "CompareReport", "JobInput", "run_job", "compare_model", "ROW_KEYS"]

#: the default ``--schemes``: each registered scheme at the settings people use
DEFAULT_SCHEMES = ("kivi:8,kivi:4,kivi:2,kivi:4/2,kivi:4+key_axis=token,q8_0,q5_1,q5_0,q4_1,q4_0,q4_0/q8_0,"
                   "hf:4,hf:2,tract,tract-cache:8,tract-cache:4")
#: the per-context keys of a row in report.json (with ``scheme``, ``status``, ``tract_runs``)
ROW_KEYS = ("bits_per_value", "kv_bytes", "kv_bytes_used", "kv_bytes_f32", "kv_ratio", "kl_mean", "kl_mean_stderr",
            "kl_mean_ci95", "kl_p99", "ppl_ratio", "ppl_ratio_ci95", "top1_agreement", "top1_agreement_ci95",
            "tokens_reading_quantized", "quantized_tokens", "full_precision_tokens", "eval_tokens", "predictions",
            "nonfinite_predictions", "kl_diff", "kl_diff_ci95", "kl_diff_significant", "pareto")
#: the figures of a context that come from validate's summary (the others are added here)
_SUMMARY_KEYS = ROW_KEYS[:-4]


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class SchemeSpec:
    """One entry of ``--schemes``: the text as written, the registry scheme and its options."""

    text: str
    scheme: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)


def _value(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


def parse_spec(text: str, flag: str = "--schemes") -> SchemeSpec:
    """``NAME[:SETTING][+option=value...]``.

    ``NAME`` is a registered scheme (``kivi``, ``tract``, ``tract-cache``, ``ggml``, ``hf``, ``rotated``) or a
    level of a scheme whose ``Scheme.level_names`` says so (a llama.cpp cache type ``q8_0``: scheme ``ggml``
    with that type for keys and values). ``SETTING`` is one level or ``KEY/VALUE`` levels, given to every layer
    by the scheme's ``level_options`` (``kivi:4``, ``hf:2``, ``tract-cache:8``, ``kivi:4/2``, ``rotated:4/3``,
    ``ggml:q4_0/q8_0``, also written ``q4_0/q8_0``); KEY/VALUE where the scheme can express it. ``+option=value``
    sets any option of the scheme by its ``convert`` name (``kivi:4+residual=64+key_axis=token``,
    ``hf:4+backend=hqq``; a ``;`` in a value is a comma: ``kivi+layer_bits=8;4/2;4``); an on/off option given
    bare is on (``q4_0+rotate``). Checked against the scheme's own rules (one line naming the entry)."""
    from ..converters import schemes as S

    raw = text.strip()
    if not raw:
        raise InputError(f"{flag}: an empty entry")
    head, *extras = raw.split("+")
    name, _, setting = head.partition(":")
    name = name.strip().lower()
    opts: dict[str, Any] = {}
    if name not in S.SCHEMES:
        named = next((s for s in S.SCHEMES.values() if s.level_names and _is_level(s, name.split("/")[0])), None)
        if named is None:
            alias = [s.name for s in S.SCHEMES.values() if s.level_names]
            raise InputError(f"{flag} {raw!r}: unknown scheme {name!r} (schemes: {', '.join(S.SCHEMES)}"
                             + "".join(f"; or a level of {a}: {', '.join(map(str, S.SCHEMES[a].levels()))}"
                                       for a in alias) + ")")
        setting, name = name, named.name  # q4_0, q4_0/q8_0: scheme ggml with those types
    scheme = S.scheme(name)
    switches = {o.name for o in scheme.option_specs if o.type is bool}
    for ex in extras:
        if ex.strip().lower().replace("-", "_") in switches:  # q4_0+rotate: an on/off option given bare
            opts[ex.strip().lower().replace("-", "_")] = True
            continue
        k, eq, v = ex.partition("=")
        if not eq or not k.strip():
            raise InputError(f"{flag} {raw!r}: {ex!r} is not option=value")
        opts[k.strip().replace("-", "_")] = _value(v.strip().replace(";", ","))  # layer_bits=8;4;4 (commas split)
    if setting:
        opts = {**_setting_options(scheme, setting, raw, flag), **opts}
    unknown = [k for k in opts if k not in scheme.option_names]
    if unknown:
        raise InputError(f"{flag} {raw!r}: scheme {name} has no option {unknown[0]!r} (it takes "
                         f"{', '.join(scheme.option_names)})")
    try:
        scheme.validate(opts)
    except NnefKvError as exc:
        raise InputError(f"{flag} {raw!r}: {exc}") from None
    return SchemeSpec(raw, name, tuple(sorted(opts.items())))


def _is_level(scheme: Any, text: str) -> bool:
    try:
        scheme.parse_level(text)
    except ValueError:
        return False
    return True


def _setting_options(scheme: Any, setting: str, raw: str, flag: str) -> dict[str, Any]:
    """``SETTING`` of ``NAME:SETTING`` (one level, or KEY/VALUE levels) -> the scheme's options giving it to every
    layer (``tract:8`` too: bits 8; the values are checked by the scheme with the other options)."""
    from ..converters import schemes as S

    halves = setting.split("/")
    if len(halves) > 2:
        raise InputError(f"{flag} {raw!r}: at most one '/' (KEY/VALUE)")
    keys, values = (_value(h.strip()) for h in (halves[0], halves[-1]))  # checked by the scheme, as options
    opts = scheme.level_options(keys, values) if scheme.split or keys == values else None
    if opts is None:
        both = [s.name for s in S.SCHEMES.values() if s.split and s.level_options(0, 1) is not None]
        raise InputError(f"{flag} {raw!r}: KEY/VALUE bits are for {', '.join(both)} (scheme {scheme.name} has one "
                         f"setting for keys and values)")
    return opts


def parse_specs(text: str | Sequence[str], flag: str = "--schemes") -> list[SchemeSpec]:
    parts = [p for p in (text.split(",") if isinstance(text, str) else list(text)) if p.strip()]
    if not parts:
        raise InputError(f"{flag}: no scheme given")
    specs = [parse_spec(p, flag) for p in parts]
    seen: set[str] = set()
    for s in specs:
        if s.text in seen:
            raise InputError(f"{flag}: {s.text!r} given twice")
        seen.add(s.text)
    return specs


# ---------------------------------------------------------------------------------------------- results
@dataclass
class CompareOptions:
    contexts: list[int] | None = None
    eval_tokens: int | None = None  # per window; None: validate's default (512, capped)
    chunk: int | None = None
    tract: bool = True  # measure whether tract loads and runs each converted archive
    windows: int | None = None  # None: validate's default
    windows_seed: int = 0
    baseline: str | None = None  # the row KL differences are measured against (None: the lowest mean KL)

    def plan_options(self) -> ValidateOptions:
        return ValidateOptions(contexts=self.contexts, eval_tokens=self.eval_tokens, chunk=self.chunk,
                               windows=self.windows, windows_seed=self.windows_seed)

    def validate_options(self, contexts: list[int], eval_tokens: int | None = None,
                         starts: list[int] | None = None) -> ValidateOptions:
        return ValidateOptions(contexts=contexts, eval_tokens=eval_tokens or self.eval_tokens, chunk=self.chunk,
                               parity=self.tract, round_trip=False, starts=starts)


@dataclass
class SchemeRow:
    """One scheme: ``status`` ``measured``, ``not measured`` (a context read nothing quantized: its
    figures would say nothing about the scheme) or ``failed`` (``reason``)."""

    scheme: str
    status: str
    reason: str = ""
    settings: str = ""  # the KV op settings as validate reports them
    per_context: list[dict[str, Any]] = field(default_factory=list)
    tract_runs: bool | None = None
    tract_detail: str = ""
    seconds: float = 0.0
    family: str = ""  # the registry scheme the row measures (the plot's colour): ``ggml`` for ``q4_0+rotate``

    def at(self, context: int) -> dict[str, Any]:
        return next((c for c in self.per_context if c["context"] == context), {})

    def sort_key(self) -> tuple:
        rank = {"measured": 0, "not measured": 1, "failed": 2}[self.status]
        last = self.per_context[-1] if self.per_context else {}
        kl = last.get("kl_mean")
        return (rank, last.get("kv_bytes", math.inf), kl if kl is not None else math.inf, self.scheme)

    def to_dict(self, contexts: list[int]) -> dict[str, Any]:
        per = [{k: v for k, v in c.items() if k != "kl_tokens"} for c in self.per_context]
        d: dict[str, Any] = {"scheme": self.scheme, "status": self.status, "reason": self.reason,
                             "short_reason": short_reason(self.reason), "settings": self.settings,
                             "tract_runs": self.tract_runs, "tract_detail": self.tract_detail,
                             "contexts": list(contexts), "per_context": per, "seconds": self.seconds,
                             "family": self.family}
        for k in ROW_KEYS:
            vals = {str(c): self.at(c).get(k) for c in contexts}
            d[k] = vals[str(contexts[0])] if len(contexts) == 1 else vals
        return d


@dataclass
class CompareReport:
    archive: str
    tokens: str
    contexts: list[int]
    eval_tokens: int
    rows: list[SchemeRow]
    notes: list[str] = field(default_factory=list)
    runner: str = ""  # "process pool (N workers)" / "ray ..."
    seconds: float = 0.0
    starts: list[int] = field(default_factory=list)  # each window's first predicted token (text index)
    baseline: dict[int, str] = field(default_factory=dict)  # context -> the row KL differences are measured against
    interrupted: bool = False  # Ctrl-C: the rows measured before it, the others "not run"

    @property
    def predictions(self) -> int:
        return self.eval_tokens * max(len(self.starts), 1)

    def to_dict(self) -> dict[str, Any]:
        return {"format": "nnef-kv-compare", "version": 2, "archive": self.archive, "tokens": self.tokens,
                "contexts": self.contexts, "eval_tokens": self.eval_tokens, "windows": len(self.starts),
                "window_starts": self.starts, "predictions": self.predictions,
                "baseline": {str(k): v for k, v in self.baseline.items()}, "interrupted": self.interrupted,
                "notes": self.notes, "runner": self.runner, "seconds": self.seconds,
                "rows": [r.to_dict(self.contexts) for r in self.rows]}


# ---------------------------------------------------------------------------------------------- one job
@dataclass
class JobInput:
    """What one scheme's job needs (pickled to a worker, or put once in Ray's object store)."""

    model: Any  # the f32 Model
    ids: list[int]
    tokens: str  # where the ids came from
    options: CompareOptions
    contexts: list[int]
    reference_runs: dict[int, Measurement]
    eval_tokens: int = 0  # per window
    starts: list[int] = field(default_factory=list)  # each window's first predicted token
    plan: Any = None  # the runner's Plan (all windows; ``starts`` may be a part of them)
    schemes: tuple[Any, ...] = ()  # the plug-in schemes registered here (pickled by reference): a worker registers them


def _context_figures(res: Any) -> dict[str, Any]:
    s = res.summary()
    out: dict[str, Any] = {"context": res.context}
    for k in _SUMMARY_KEYS:
        if k != "bits_per_value":
            out[k] = s.get(k)
    tm = res.token_measures()
    if tm is not None:  # per prediction (NaN where a side's logits were not finite): the paired differences
        fin = res.finite_rows()
        out["kl_tokens"] = [float(x) if f else math.nan for x, f in zip(tm["kl"], fin)]
    f32 = s.get("kv_bytes_f32") or 0
    out["bits_per_value"] = 32.0 * s["kv_bytes"] / f32 if f32 else None
    out["tokens_reading_quantized"] = res.reads_quantized
    out["kv_ops"] = [{"node": c["node"], "op": c["op"], "bytes": c["bytes"], "bytes_f32": c["bytes_f32"]}
                     for c in res.archive.census]
    return out


def _tract_loads(model: Any) -> tuple[bool | None, str]:
    """Does tract 0.23.9 load (and run one call of) this archive? Tried, not assumed."""
    from .decode import TractDecoder, detect_signature, tract_available

    if not tract_available():
        return None, "tract is not installed"
    try:
        dec = TractDecoder(model, detect_signature(model.session().plan))  # a temporary archive of the model
        dec.prefill([0, 1])
        return True, "loads and runs (one call tried)"
    except BaseException as exc:  # tract's errors (pyo3 panics are BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        import re

        text = str(exc).split("Stack backtrace", 1)[0]
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and ln.strip() != "Caused by:"]
        lines = [re.sub(r"^\d+: ", "", ln) for ln in lines if "opening file" not in ln]  # not the temporary copy
        return False, f"tract refuses it: {' / '.join(lines) or type(exc).__name__}"


def _tract_of(rep: Any, converted: Any, options: CompareOptions) -> tuple[bool | None, str]:
    """The table's tract cell: ``True`` ("yes") only when tract runs the archive *and* its logits agree
    with nnef-kv's within the parity tolerance (for tract's quantized caches the derived one,
    :mod:`nnef_kv.validate.parity`); a mismatch is ``False``, its figures in the detail."""
    p = rep.parity
    if not options.tract:
        return None, "not tried (--no-tract)"
    if p is None:
        return None, "not run"
    if p.status == "ok":
        return True, (f"runs; logits within tolerance of nnef-kv's (max |diff| {p.max_abs:.3g} <= "
                      f"{p.atol:.3g} + {p.rtol:g} x max |logit|)" + (f"; {p.reason}" if p.reason else ""))
    if p.status == "mismatch":
        return False, f"runs, but logits differ from nnef-kv's: {p.reason}"
    if p.status == "error":
        return False, p.reason
    if "not installed" in p.reason:
        return None, p.reason
    return _tract_loads(converted)


def run_job(job: JobInput, spec: SchemeSpec, progress: Callable[[], None] | None = None) -> SchemeRow:
    """Convert ``job.model`` under ``spec`` and measure it; every failure becomes the row's reason."""
    from ..converters import convert
    from ..text import TokenSource
    from .runner import validate_model

    from ..converters.schemes import SCHEMES

    for plug in job.schemes:  # a worker process: the schemes registered where the job was made
        SCHEMES.setdefault(plug.name, plug)
    t0 = time.perf_counter()
    row = SchemeRow(spec.text, "failed", family=spec.scheme)
    tick = progress or (lambda: None)
    try:
        converted, _ = convert(job.model, scheme=spec.scheme, **spec.kwargs)
    except NnefKvError as exc:
        row.reason = f"convert: {exc}"
        return row
    except Exception as exc:  # a bug: still a row, named
        row.reason = f"convert: internal error: {type(exc).__name__}: {exc}"
        return row
    tick()
    source = TokenSource(ids=list(job.ids), option="--text", description=job.tokens)
    try:
        rep = validate_model(converted, job.model, source,
                             job.options.validate_options(job.contexts, job.eval_tokens or None, job.starts or None),
                             progress=tick, reference_runs=dict(job.reference_runs))
    except NnefKvError as exc:
        row.reason = f"measure: {exc}"
        row.seconds = time.perf_counter() - t0
        return row
    except Exception as exc:
        row.reason = f"measure: internal error: {type(exc).__name__}: {exc}"
        row.seconds = time.perf_counter() - t0
        return row
    row.settings = rep.scheme
    row.per_context = [_context_figures(res) for res in rep.contexts]
    row.tract_runs, row.tract_detail = _tract_of(rep, converted, job.options)
    vacuous = [c for c in rep.checks if c.name.startswith("quantized entries read") and not c.ok]
    row.status, row.reason = ("not measured", vacuous[0].detail) if vacuous else ("measured", "")
    row.seconds = time.perf_counter() - t0
    tick()
    return row


def worker_died(spec: SchemeSpec, exc: BaseException) -> SchemeRow:
    """The row of a scheme whose job's worker process died (its own errors are caught in :func:`run_job`)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    why = f"the job's worker died: {type(exc).__name__}" + (f": {text}" if text else "")
    return SchemeRow(spec.text, "failed", why, family=spec.scheme)


def job_steps(options: CompareOptions, contexts: list[int], windows: int = 1) -> int:
    """Progress steps of one job: convert, the prefill and the stepwise run of each context and window,
    tract (one window), done."""
    return 2 + 2 * len(contexts) * windows + (2 if options.tract else 0)


# ---------------------------------------------------------------------------------------------- all of it
def spec_windows(model: Any, specs: Sequence[SchemeSpec]) -> list[int]:
    """The full-precision window of each scheme's KV ops (converted in memory, as the jobs will; a scheme
    the converter refuses counts 0: its row will say why): the default context follows the same rule as
    ``validate`` of the converted archive."""
    from ..converters import convert
    from .runner import _decoder, _kv_op_settings

    out = []
    for spec in specs:
        try:
            converted, _ = convert(model, scheme=spec.scheme, **spec.kwargs)
            out += [k["fp_window"] for k in _kv_op_settings(_decoder(converted, False, spec.text))]
        except NnefKvError:
            continue
    return out


def prepare(model: Any, source: Any, options: CompareOptions, label: str,
            names: dict[str, str] | None = None, windows: list[int] | None = None,
            pick: Callable[[list[int]], list[int]] | None = None) -> tuple[JobInput, list[str]]:
    """The checks made before any job (one line each), the plan (validate's rule: :func:`~.runner.resolve_plan`,
    from ``windows``, the KV ops' full-precision windows) and the reference runs. ``pick``: the windows the job
    measures, from the plan's (auto-bits chooses on some and keeps the others for its held-out check)."""
    from .runner import _decoder, _measure, max_positions, resolve_plan, vocab_size

    ref_dec = _decoder(model, capture=True, what=label)
    held = ref_dec.quantized_ops()
    if held:
        raise InputError(f"{label}: holds a quantized KV cache already ({held[0][0].op} '{held[0][0].name}'): "
                         f"compare converts the f32 archive")
    vo = options.plan_options().check(names)
    source.check_vocabulary(vocab_size(ref_dec.session, ref_dec.sig))
    plan = resolve_plan(vo, len(source.ids), max_positions(ref_dec.session), list(windows or []), names)
    starts = pick(list(plan.starts)) if pick else plan.starts
    runs = {c: _measure(ref_dec, source.ids, c, plan.eval_tokens, options.chunk, None, starts) for c in plan.contexts}
    from ..converters.schemes import plugins

    job = JobInput(_portable(model), list(source.ids), source.description, options, plan.contexts, runs,
                   plan.eval_tokens, starts, plan, plugins())
    return job, list(source.notes) + plan.notes


def _portable(model: Any) -> Any:
    """``model`` without the plan the session cached on it (kernels are closures: the plan stays here)."""
    import copy

    clean = copy.copy(model)
    getattr(clean, "__dict__", {}).pop("_nnef_kv_plan", None)
    return clean


def compare_model(model: Any, source: Any, specs: Sequence[SchemeSpec], options: CompareOptions | None = None,
                  label: str = "<in memory>", jobs: int | None = None, ray: str | None = None,
                  names: dict[str, str] | None = None, show_progress: bool | None = None) -> CompareReport:
    """Measure every scheme of ``specs`` on ``model`` (the f32 Model) with the tokens of ``source``."""
    from .jobs import Interrupted, connect_ray, run_tasks
    from .statistics import preload

    o = options or CompareOptions()
    t0 = time.perf_counter()
    if ray is not None:
        connect_ray(ray)  # an unreachable cluster is refused before any work
    if o.baseline is not None and o.baseline not in [s.text for s in specs]:
        raise InputError(f"{(names or {}).get('baseline', '--baseline')} {o.baseline!r}: not one of the schemes "
                         f"({', '.join(s.text for s in specs)})")
    job, notes = prepare(model, source, o, label, names, windows=None if o.contexts else spec_windows(model, specs))
    interrupted = False
    try:
        rows, runner = run_tasks(run_job, job, list(specs), [s.text for s in specs], jobs=jobs, ray=ray,
                                 steps=job_steps(o, job.contexts, len(job.starts)), show_progress=show_progress,
                                 title="compare", on_error=worker_died, preload=preload)
    except Interrupted as stop:  # Ctrl-C: keep the rows measured
        interrupted, runner = True, stop.where
        rows = [r if r is not None else SchemeRow(sp.text, "failed", "not run: interrupted (Ctrl-C)", family=sp.scheme)
                for r, sp in zip(stop.results, specs)]
        notes.append(f"interrupted (Ctrl-C): {sum(r is not None for r in stop.results)} of {len(specs)} schemes "
                     f"measured, the others not run")
    rep = CompareReport(archive=label, tokens=source.description, contexts=job.contexts, eval_tokens=job.eval_tokens,
                        rows=rows, notes=notes, runner=runner, seconds=time.perf_counter() - t0,
                        starts=list(job.starts), interrupted=interrupted)
    paired(rep, o.baseline)
    rep.rows.sort(key=SchemeRow.sort_key)
    return rep


def short_reason(reason: str) -> str:
    """A failure's cause in a few words: the last clause of ``stage: path: ... : cause`` (the path and the
    stage dropped), for the table; report.md and report.json keep the whole reason."""
    if not reason:
        return ""
    stage, _, rest = reason.partition(": ")
    if stage not in ("convert", "measure") or not rest:
        stage, rest = "", reason
    parts = [p.strip() for p in rest.split(": ") if p.strip()]
    keep = [p for p in parts if "/" not in p and not p.endswith((".nnef", ".tgz", ".tar"))] or parts
    text = keep[-1] if len(keep[-1]) > 24 or len(keep) == 1 else ": ".join(keep[-2:])
    return (stage + ": " if stage else "") + text


def paired(rep: CompareReport, baseline: str | None = None) -> None:
    """Per context: each measured row's KL difference to the baseline row (``baseline``, else the row of lowest
    mean KL), on the same predictions, with its paired 95% interval; and the significant Pareto front
    (:func:`significant_front`)."""
    from .statistics import paired_interval

    groups = np.repeat(np.arange(max(len(rep.starts), 1)), rep.eval_tokens)
    for ctx in rep.contexts:
        rows = [r for r in rep.rows if r.status == "measured" and r.at(ctx).get("kl_tokens") is not None]
        if not rows:
            continue
        base = next((r for r in rows if r.scheme == baseline), None) if baseline else None
        if base is None:
            base = min(rows, key=lambda r: (r.at(ctx)["kl_mean"] if finite(r.at(ctx).get("kl_mean")) else math.inf))
        rep.baseline[ctx] = base.scheme
        ref = np.asarray(base.at(ctx)["kl_tokens"], np.float64)
        for r in rows:
            s = r.at(ctx)
            mine = np.asarray(s["kl_tokens"], np.float64)
            iv = paired_interval(mine, ref, groups[:len(mine)]) if len(mine) == len(ref) else None
            s["kl_diff"] = None if iv is None else iv.mean
            s["kl_diff_ci95"] = None if iv is None else iv.pair
            s["kl_diff_significant"] = None if iv is None else bool(iv.excludes_zero())
        front = significant_front(rows, ctx, groups)
        for r, on in zip(rows, front):
            r.at(ctx)["pareto"] = on


def significant_front(rows: list[SchemeRow], ctx: int, groups: np.ndarray) -> list[bool]:
    """The Pareto front that a re-run would not reorder: a row is off it only when another holds no more KV
    bytes and a mean KL lower by a paired 95% interval that excludes zero (a difference within the noise
    dominates nothing)."""
    from .statistics import paired_interval

    kl = [np.asarray(r.at(ctx)["kl_tokens"], np.float64) for r in rows]
    size = [float(r.at(ctx).get("kv_bytes") or math.inf) for r in rows]
    out = []
    for i in range(len(rows)):
        dominated = False
        for j in range(len(rows)):
            if j == i or size[j] > size[i] or len(kl[j]) != len(kl[i]):
                continue
            iv = paired_interval(kl[i], kl[j], groups[:len(kl[i])])
            if iv is not None and iv.low > 0:
                dominated = True
                break
        out.append(not dominated)
    return out


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """For (bytes, kl) points: True where no other point has bytes <= and kl <= with one strictly lower."""
    out = []
    for i, (b, k) in enumerate(points):
        dominated = any((b2 <= b and k2 <= k) and (b2 < b or k2 < k) for j, (b2, k2) in enumerate(points) if j != i)
        out.append(not dominated)
    return out


def finite(x: Any) -> bool:
    return isinstance(x, (int, float, np.floating)) and math.isfinite(float(x))
