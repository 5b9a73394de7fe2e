"""``nnef-kv run``: an archive run on inputs from an ``.npz``, one or several steps (the convention is in
:mod:`nnef_kv.cli`).

Everything that can be checked is checked before the first step: the ``.npz`` (headers only:
:class:`~nnef_kv.io.npz.NpzReader`, with the resource limits), every key's name, a value for every input at
every step, the ``-o`` target, and, for a decoder whose cache grows from step to step, the positions the
steps need against the graph's ``tract_assert`` bound. Then one line per output is printed as each step
ends (stats count NaN and infinities), arrays are read from the ``.npz`` when a step needs them and
``-o`` is written as the steps go (nothing kept in memory but the previous step's outputs a cache is fed
from); the file appears only complete. A step that fails stops the run with ``step K: ...`` (exit 2); Ctrl-C
stops it with a summary line (exit 130); ``-o`` is then not written.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import NnefKvError
from .args import (EXIT_CHECK_FAILED as EXIT_MISMATCH, EXIT_INTERRUPTED, EXIT_OK, CliError, existing_path,
                   int_at_least, output_file)


@dataclass
class Keys:
    """The ``.npz`` keys sorted by role: fed every step, fed at one step, expected every step, at one step."""

    common: dict[str, str] = field(default_factory=dict)  # graph name -> npz key
    per: dict[int, dict[str, str]] = field(default_factory=dict)
    exp_common: dict[str, str] = field(default_factory=dict)
    exp_per: dict[int, dict[str, str]] = field(default_factory=dict)
    last: int = -1

    def key_at(self, name: str, k: int) -> str | None:
        return self.per.get(k, {}).get(name) or self.common.get(name)


def split_keys(keys: list[str], inputs: list[str], outputs: list[str], where: str) -> Keys:
    out = Keys()
    for key in keys:
        name, _, step = key.partition("@")
        k: int | None = None
        if step:
            if not (step.isascii() and step.isdigit()):
                raise CliError(f"{where}: key {key[:80]!r}: the step after '@' must be a non-negative integer")
            k = int(step)
            out.last = max(out.last, k)
        if name in inputs:
            (out.common if k is None else out.per.setdefault(k, {}))[name] = key
        elif name in outputs:
            (out.exp_common if k is None else out.exp_per.setdefault(k, {}))[name] = key
        else:
            from ..errors import names

            raise CliError(f"{where}: key {key[:80]!r} names no graph input or output (inputs: {names(inputs)})")
    return out


def _first_missing(keys: Keys, name: str, steps: int, fed_back: bool, empty: bool) -> int | None:
    """The first step with no value for input ``name``, or None."""
    if name in keys.common:
        return None
    if fed_back:
        return 0 if not empty and name not in keys.per.get(0, {}) else None
    k = 0
    while k < steps:
        if name not in keys.per.get(k, {}):
            return k
        k += 1
    return None


def _positions_problem(session: Any, npz: Any, keys: Keys, steps: int, feedback: dict[str, str],
                       option: str) -> str | None:
    """Why the steps cannot fit the graph's position bound (None when they do, or nothing can be said)."""
    from ..validate.runner import max_positions

    try:
        top, bound = max_positions(session)
        tok, axes = session.token_inputs()
    except NnefKvError:
        return None
    if top is None or not axes:
        return None
    ids = next(iter(axes))
    specs = {s.name: s for s in session.plan.inputs}
    past_axis = {n: i for n in feedback for i, d in enumerate(specs[n].shape) if isinstance(d, str) and d != tok}
    stateful = bool(session.states)
    accumulates = stateful or any(n not in keys.common for n in feedback)
    past = 0
    prev_s = 0
    for k in range(steps):
        key = keys.key_at(ids, k)
        if key is None:
            return None
        s = npz.entry(key).shape[axes[ids]] if len(npz.entry(key).shape) > axes[ids] else 1
        if not stateful and feedback:
            cache = next(iter(past_axis), None)
            ck = keys.key_at(cache, k) if cache is not None else None
            if ck is not None and len(npz.entry(ck).shape) > past_axis[cache]:
                past = npz.entry(ck).shape[past_axis[cache]]
            elif k > 0:
                past += prev_s
        if past + s > top:
            return (f"{option} {steps}: step {k} needs {past + s} positions ({past} cached + {s} new), the model "
                    f"holds at most {top} ({bound}); at most {k} steps fit")
        if stateful:
            past += s
        prev_s = s
        if not accumulates and k > keys.last:
            break
    return None


def _stats(a: np.ndarray) -> str:
    line = f"{a.dtype} {list(a.shape)}"
    if a.size and a.dtype.kind in "fiubc":
        af = a.real.astype(np.float64) if a.dtype.kind == "c" else a.astype(np.float64)
        fin = af[np.isfinite(af)]
        if fin.size:
            line += f" min {fin.min():.6g} max {fin.max():.6g} mean {fin.mean():.6g}"
        line += f" NaN {int(np.isnan(af).sum())} Inf {int(np.isinf(af).sum())}"
    return line


def _compare(a: np.ndarray, e: np.ndarray) -> tuple[str, float]:
    """The text after an output's stats, and its max |difference| from the expected value (inf when the shapes
    differ or a NaN is where the other holds none)."""
    if e.shape != a.shape:
        return f" | npz has shape {list(e.shape)}", float("inf")
    if not a.size:
        return " | max|diff| vs npz 0", 0.0
    af, ef = a.astype(np.float64), e.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(af - ef)
    same = (af == ef) | (np.isnan(af) & np.isnan(ef))  # equal infinities and NaN against NaN are no difference
    diff = np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))
    worst = float(np.max(diff))
    return f" | max|diff| vs npz {worst:.3g}", worst


#: ``--assert`` with no value: the largest |difference| allowed (tract's --assert-output-bundle compares f32 outputs
#: with a tolerance of the same order)
ASSERT_TOLERANCE = 1e-4


def _check_assert(tol: float, keys: Keys, outputs: list[str], steps: int, npz_path: Path) -> None:
    """``--assert TOL``: a finite number >= 0, and an expected value in the ``.npz`` for at least one step."""
    if not (np.isfinite(tol) and tol >= 0):
        raise CliError(f"--assert {tol}: the tolerance must be a finite number >= 0")
    if not keys.exp_common and not any(k < steps for k in keys.exp_per):
        raise CliError(f"--assert: --inputs {npz_path} holds no expected output for the steps run (keys named like "
                       f"an output: {', '.join(outputs[:4])}{', ...' if len(outputs) > 4 else ''})")


def _float_casts(feed: dict[str, Any], session: Any, casted: set[str], allowed: bool, where: Path) -> dict[str, Any]:
    """Float inputs cast to the float type the graph declares when ``allowed`` (tract's
    --allow-float-casts), each cast named once on stderr; else a float of another width is refused."""
    out = dict(feed)
    for spec in session.plan.inputs:
        x = out.get(spec.name)
        if x is None:
            continue
        a = np.asarray(x)
        want = np.dtype(spec.dtype)
        if a.dtype.kind == "f" and want.kind == "f" and a.dtype != want:
            if not allowed:
                raise CliError(f"--inputs {where}: input '{spec.name}' is {a.dtype}, the graph declares {want} "
                               f"(--allow-float-casts casts float inputs, as tract's flag does)")
            out[spec.name] = a.astype(want)
            if spec.name not in casted:
                casted.add(spec.name)
                print(f"note: --allow-float-casts: input '{spec.name}' {a.dtype} cast to {want}", file=sys.stderr)
    return out


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("run", help="run an archive on inputs from an .npz, one or several steps",
                        description="NPZ keys: NAME (every step) or NAME@K (step K). Missing explicit caches are fed "
                                    "back from the previous step's outputs (empty at step 0).")
    sp.add_argument("archive")
    sp.add_argument("--inputs", required=True, help=".npz of inputs (NAME or NAME@STEP keys)")
    sp.add_argument("-o", "--output", help="write outputs to this .npz")
    sp.add_argument("--steps", type=int, help="number of runs (default: 1 + the largest @STEP)")
    sp.add_argument("--assert", dest="assert_tol", type=float, nargs="?", const=ASSERT_TOLERANCE, default=None,
                    metavar="TOL", help="exit 1 when an output differs from its expected value in --inputs by more "
                    f"than TOL (max |difference|; TOL omitted: {ASSERT_TOLERANCE:g}), as tract's "
                    "--assert-output-bundle")
    sp.add_argument("--allow-float-casts", action="store_true",
                    help="cast float inputs to the float type the graph declares (e.g. f32 test io for an f16 archive)")


def cmd_run(args: argparse.Namespace) -> int:
    from ..io.archive import load
    from ..io.npz import NpzReader, NpzWriter
    from ..validate.decode import detect_signature

    steps_arg = None if args.steps is None else int_at_least("--steps", args.steps, 1)
    src = existing_path(args.archive)
    npz_path = existing_path(args.inputs, "--inputs", file_only=True)
    out_path = output_file(args.output, "-o", suffixes=(".npz",), inputs=[src, npz_path]) if args.output else None
    with NpzReader(npz_path, what="--inputs") as npz:
        model = load(src)
        session = model.session()
        inputs, outputs = list(session.input_names), list(session.output_names)
        keys = split_keys(npz.keys, inputs, outputs, f"--inputs {npz_path}")
        steps = steps_arg if steps_arg is not None else max(1, keys.last + 1)
        try:
            sig = detect_signature(session.plan, str(src))
            feedback = dict(sig.cache_outputs) if sig.explicit else {}
            empty = sig.empty_caches() if sig.explicit else {}
        except NnefKvError:
            feedback, empty = {}, {}
        for name in inputs:
            k = _first_missing(keys, name, steps, name in feedback, name in empty)
            if k is not None:
                raise CliError(f"--inputs {npz_path}: no value for input '{name}' at step {k} (keys '{name}' or "
                               f"'{name}@{k}')")
        if getattr(args, "assert_tol", None) is not None:
            _check_assert(args.assert_tol, keys, outputs, steps, npz_path)
        problem = _positions_problem(session, npz, keys, steps, feedback, "--steps")
        if problem is not None:
            raise CliError(problem)
        return _steps(args, src, npz, npz_path, session, keys, steps, feedback, empty, out_path, NpzWriter,
                      _float_casts)


def _steps(args: Any, src: Path, npz: Any, npz_path: Path, session: Any, keys: Keys, steps: int,
           feedback: dict[str, str], empty: dict[str, Any], out_path: Path | None, writer_cls: Any,
           float_casts: Any) -> int:
    from ..atomic import atomic_write

    inputs = list(session.input_names)
    loaded: dict[str, np.ndarray] = {}  # the every-step arrays, read once

    def value(key: str, every: bool) -> np.ndarray:
        if every:
            if key not in loaded:
                loaded[key] = npz.load(key)
            return loaded[key]
        return npz.load(key)

    written = 0
    k = 0
    tol = getattr(args, "assert_tol", None)
    failed: list[str] = []
    casted: set[str] = set()
    prev: dict[str, Any] = {}
    target = atomic_write(out_path) if out_path is not None else contextlib.nullcontext(None)
    try:
        with target as f:
            writer = writer_cls(f) if f is not None else None
            try:
                for k in range(steps):
                    feed: dict[str, Any] = {}
                    for name in inputs:
                        key = keys.per.get(k, {}).get(name)
                        if key is not None:
                            feed[name] = value(key, False)
                        elif name in keys.common:
                            feed[name] = value(keys.common[name], True)
                        else:
                            feed[name] = prev[feedback[name]] if k > 0 else empty[name]
                    feed = float_casts(feed, session, casted, args.allow_float_casts, npz_path)
                    try:
                        res = session.run(feed)
                    except NnefKvError as exc:
                        raise CliError(f"step {k}: {exc}") from exc
                    expected = {**keys.exp_common, **keys.exp_per.get(k, {})}
                    for name, arr in res.items():
                        a = np.asarray(arr)
                        line = f"step {k} {name}: {_stats(a)}"
                        if name in expected:
                            text, worst = _compare(a, value(expected[name], name in keys.exp_common))
                            line += text
                            if tol is not None and not worst <= tol:
                                failed.append(f"'{name}' at step {k} (max|diff| {worst:.3g})")
                        print(line)
                        if writer is not None:
                            writer.add(name if steps == 1 else f"{name}@{k}", a)
                            written += 1
                    sys.stdout.flush()
                    prev = {o: res[o] for o in feedback.values()}
            except BaseException:  # the temporary is dropped: its zip must not finalise later
                if writer is not None:
                    writer.discard()
                raise
            if writer is not None:
                writer.close()
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"nnef-kv run: interrupted at step {k} of {steps} ({k} done)"
              + (f"; nothing written to {args.output}" if out_path is not None else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    if out_path is not None:
        print(f"wrote {written} arrays to {args.output}")
    if failed:
        sys.stdout.flush()
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        print(f"nnef-kv run: --assert {tol:g}: {len(failed)} output(s) differ from --inputs {npz_path}: "
              f"{', '.join(failed[:3])}{more}", file=sys.stderr)
        return EXIT_MISMATCH
    return EXIT_OK
