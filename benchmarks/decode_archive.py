"""Decode throughput of any decoder archive: nnef-kv vs tract, paired (lockstep), BLAS on one thread.

    python benchmarks/decode_archive.py --archive PATH [--tract-archive PATH2]
    python benchmarks/decode_archive.py --form explicit|dyn|q4      # the built-in 21 M-param LLaMA

``--archive``: a folder / .tar / .tgz written by torch-to-nnef (explicit caches: ``in_cache_*`` inputs,
``out_cache_*`` outputs, fed back by the caller) or a stateful archive (``input_ids`` only: the caches
live in op state, e.g. ``tract_transformers_dyn_kv_cache`` or a KIVI archive from ``nnef-kv convert``),
f32, f16 or Q4_0 weights. tract runs ``--tract-archive`` when given (e.g. the f32 export a KIVI archive
was converted from: tract cannot run the KIVI op), else the same archive.

``--form``: the built-in decoder (:mod:`nnef_kv.models.t2n_llama`: 4 layers x 512, 8 heads, 8 kv heads,
ffn 1408, vocab 8192, untied, 21.2 M parameters, deterministic weights generated here), written in
torch-to-nnef's op spelling (``explicit``: caches as graph inputs/outputs, RMSNorm / RoPE / SiLU / the
GQA repeat as chains of small ops; ``q4``: the same with Q4_0 linear weights, as
``--compression-method min_max_q4_0`` writes them) or as tract writes a model after its transformer
detection (``dyn``: ``tract_core_rms_norm``, ``tract_transformers_apply_rope``,
``tract_transformers_dyn_kv_cache``, ``tract_transformers_sdpa``).

Method (the issue's): both engines in one process, fresh sessions each round, a ``--prompt``-token
prompt then ``--steps`` one-token calls, greedy, one token each in turn (order alternating), so every
nnef-kv token is paired with a tract token taken milliseconds apart. Printed: tokens/s of each, the
ratio of total decode times (``> 1``: nnef-kv faster) and the median of the per-token ratios. BLAS
runs on ``--blas`` threads (threadpoolctl); tract on its default (one thread). A warm-up round (not
timed) runs first: the first calls of a process (numba JIT or loading its on-disk cache, tract's
planning) are printed as "cold start" and kept out of the decode figures.

``--rss``: resident memory after loading, each engine in a fresh subprocess (``ru_maxrss`` and the
current RSS from ``/proc/self/statm``, after one prompt call so lazily built weights count).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------------------------
# the graph signature: the token input (integer) and the cache inputs (every other one, fed back from
# the outputs after the first, in order, as torch-to-nnef writes them); each engine reads its own
# ------------------------------------------------------------------------------------------------
class Signature:
    def __init__(self, where: Path, inputs: list[tuple[str, list[Any], Any]], n_outputs: int) -> None:
        self.inputs = [n for n, _, _ in inputs]
        self.token = next(n for n, _, dt in inputs if np.dtype(dt).kind in "iu")
        self.caches = [n for n in self.inputs if n != self.token]
        # symbolic dims (P, the past length) are 0 in the first call's empty caches
        self.empty = {n: np.zeros([d if isinstance(d, (int, np.integer)) else 0 for d in shape], dt)
                      for n, shape, dt in inputs if n != self.token}
        if len(self.caches) != n_outputs - 1:
            raise SystemExit(f"{where}: {len(self.caches)} cache inputs but {n_outputs - 1} outputs after the "
                             f"logits: not a torch-to-nnef decoder signature")


def _tract_signature(path: Path, m: Any) -> Signature:
    ins = []
    for i in range(m.input_count()):
        *dims, dt = str(m.input_fact(i)).split(",")
        shape = [int(d) if d.strip().isdigit() else "?" for d in dims]
        ins.append((m.input_name(i), shape, {"i64": np.int64, "i32": np.int32, "f16": np.float16}.get(dt, np.float32)))
    return Signature(path, ins, m.output_count())


class NnefKv:
    name = "nnef-kv"

    def __init__(self, path: Path, threads: int = 1) -> None:
        import nnef_kv
        from nnef_kv.interpreter.session import Session

        self.session = Session(nnef_kv.load(path), threads=threads)
        names = self.session.output_names
        self.logits_name, self.cache_out = names[0], names[1:]
        self.sig = sig = Signature(path, [(i.name, list(i.shape), i.dtype) for i in self.session.plan.inputs],
                                   len(names))
        self.cache: dict[str, np.ndarray] = dict(sig.empty)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        feed = dict(self.cache)
        feed[self.sig.token] = ids
        out = self.session.run(feed)
        self.cache = {i: out[o] for i, o in zip(self.sig.caches, self.cache_out)}
        return out[self.logits_name]


class Tract:
    name = "tract"

    def __init__(self, path: Path) -> None:
        import tract

        m = tract.nnef().with_tract_transformers().with_tract_extra().load(str(path))
        self.sig = sig = _tract_signature(path, m)
        self.state = m.into_runnable().spawn_state()
        self.cache = [sig.empty[n] for n in sig.caches]

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        feed = {self.sig.token: ids}
        feed.update(zip(self.sig.caches, self.cache))
        res = [t.to_numpy() for t in self.state.run([feed[n] for n in self.sig.inputs])]
        self.cache = res[1:]
        return res[0]


def _prompt(vocab: int, n: int) -> np.ndarray:
    return np.random.default_rng(42).integers(0, vocab, n).astype(np.int64)


def _decode(engines: list[Any], prompt: np.ndarray, steps: int, times: dict[str, list[float]],
            tokens: dict[str, list[int]]) -> None:
    """Prompt for each engine, then ``steps`` one-token calls each, one token each in turn, the order
    reversed every other token."""
    for e in engines:
        tokens[e.name] = [int(np.argmax(e(prompt[None])[0, -1]))]
    for i in range(steps):
        for e in (engines if i % 2 == 0 else engines[::-1]):
            t = time.perf_counter()
            logits = e(np.array([[tokens[e.name][-1]]], np.int64))
            times[e.name].append(time.perf_counter() - t)
            tokens[e.name].append(int(np.argmax(logits[0, -1])))


def lockstep(ours_path: Path, tract_path: Path, prompt_len: int, steps: int, rounds: int, blas: int,
             threads: int = 1) -> dict[str, Any]:
    from threadpoolctl import threadpool_limits

    out: dict[str, Any] = {"rounds": rounds, "steps": steps, "prompt": prompt_len, "blas": blas}
    with threadpool_limits(limits=blas, user_api="blas"):
        # cold start: the process's first session and call of each engine (numba JIT / cache load)
        t0 = time.perf_counter()
        ours = NnefKv(ours_path, threads)
        t1 = time.perf_counter()
        vocab = None
        logits = ours(_prompt(64, prompt_len)[None])
        t2 = time.perf_counter()
        vocab = int(logits.shape[-1])
        ours(np.array([[1]], np.int64))
        t3 = time.perf_counter()
        theirs = Tract(tract_path)
        t4 = time.perf_counter()
        theirs(_prompt(64, prompt_len)[None])
        t5 = time.perf_counter()
        out["cold"] = {"nnef-kv": {"load": t1 - t0, "first_call": t2 - t1, "second_call": t3 - t2},
                       "tract": {"load": t4 - t3, "first_call": t5 - t4}}
        prompt = _prompt(vocab, prompt_len)
        times: dict[str, list[float]] = {"nnef-kv": [], "tract": []}
        same = True
        for r in range(rounds + 1):  # round 0: warm-up, not counted
            eng = [NnefKv(ours_path, threads), Tract(tract_path)]
            t: dict[str, list[float]] = {"nnef-kv": [], "tract": []}
            toks: dict[str, list[int]] = {}
            _decode(eng if r % 2 == 0 else eng[::-1], prompt, steps, t, toks)
            if r:
                for k in times:
                    times[k] += t[k]
                same = same and toks["nnef-kv"] == toks["tract"]
            del eng
    a, b = np.array(times["nnef-kv"]), np.array(times["tract"])
    out.update(ours_tps=len(a) / a.sum(), tract_tps=len(b) / b.sum(), ratio=float(b.sum() / a.sum()),
               median_ratio=float(np.median(b / a)), faster=int((b > a).sum()), tokens=len(a), same=same)
    return out


def print_lockstep(label: str, r: dict[str, Any]) -> None:
    c = r["cold"]
    print(f"cold start (not in the figures): nnef-kv load {c['nnef-kv']['load']:.2f} s, first call "
          f"{c['nnef-kv']['first_call']:.2f} s (numba JIT or its cache, planning), second "
          f"{c['nnef-kv']['second_call'] * 1e3:.0f} ms; tract load {c['tract']['load']:.2f} s, first call "
          f"{c['tract']['first_call']:.2f} s")
    print(f"{label}: lockstep, BLAS on {r['blas']}, {r['rounds']} x ({r['prompt']}-token prompt + {r['steps']} steps): "
          f"nnef-kv {r['ours_tps']:.1f} tokens/s, tract {r['tract_tps']:.1f} tokens/s, "
          f"ratio {r['ratio']:.2f}x (median per-token {r['median_ratio']:.2f}x; nnef-kv faster on "
          f"{r['faster']}/{r['tokens']} tokens); same greedy tokens: {r['same']}", flush=True)


# ------------------------------------------------------------------------------------------------
# RSS after load, each engine in a fresh subprocess
# ------------------------------------------------------------------------------------------------
def _memory() -> dict[str, int]:
    """This process's resident set now (VmRSS; anonymous and file-backed parts) and at its peak (VmHWM), bytes."""
    names = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in names:
            got[names[key]] = int(val.split()[0]) * 1024
    return got


def _rss_child(engine: str, path: str, prompt_len: int) -> None:
    from threadpoolctl import threadpool_limits

    got = {}
    with threadpool_limits(limits=1, user_api="blas"):
        e = NnefKv(Path(path)) if engine == "nnef-kv" else Tract(Path(path))
        got["load"] = _memory()
        tok = int(np.argmax(e(_prompt(64, prompt_len)[None])[0, -1]))
        e(np.array([[tok]], np.int64))
        got["run"] = _memory()
    print(json.dumps(got))


def _rss_baseline() -> None:
    """The same imports, no model: what the interpreter, NumPy, tract's library and numba take alone."""
    import tract  # noqa: F401
    import nnef_kv  # noqa: F401
    from nnef_kv.interpreter.session import Session  # noqa: F401
    from threadpoolctl import threadpool_limits  # noqa: F401

    print(json.dumps(_memory()))


def rss(ours: Path, theirs: Path, prompt_len: int) -> dict[str, dict[str, int]]:
    res = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for engine, path in (("nnef-kv", ours), ("tract", theirs), ("imports only", None)):
        args = [sys.executable, __file__, "--_rss-child", engine, str(path), str(prompt_len)]
        if path is None:
            args = [sys.executable, __file__, "--_rss-baseline"]
        got = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
        res[engine] = json.loads(got.stdout.strip().splitlines()[-1])
    return res


def print_rss(r: dict[str, Any]) -> None:
    mb = 1 / 2 ** 20
    ours, theirs = r["nnef-kv"], r["tract"]
    for stage, what in (("load", "after load (session / runnable made)"),
                        ("run", "after the prompt and one decode call")):
        a, b = ours[stage], theirs[stage]
        print(f"RSS {what}: nnef-kv {a['rss'] * mb:.1f} MiB (anon {a['anon'] * mb:.1f}, file {a['file'] * mb:.1f}), "
              f"tract {b['rss'] * mb:.1f} MiB (anon {b['anon'] * mb:.1f}, file {b['file'] * mb:.1f}): "
              f"ratio {a['rss'] / b['rss']:.2f}x", flush=True)
    base = r["imports only"]
    print(f"(a fresh process each; the imports alone, both libraries and no model: {base['rss'] * mb:.1f} MiB; "
          f"numba's share is the difference between nnef-kv's two lines when its kernels run)")


# ------------------------------------------------------------------------------------------------
def profile(path: Path, prompt_len: int, steps: int) -> None:
    """Where nnef-kv's decode time goes: every plan step timed as it runs (BLAS on one thread), summed
    by op over ``steps`` one-token calls after the prompt."""
    import collections

    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        eng = NnefKv(path)
        plan = eng.session.plan
        spent: dict[str, float] = collections.defaultdict(float)
        calls: collections.Counter[str] = collections.Counter()
        program = plan.program

        def timed(st: Any, op: str) -> Any:
            def step(v: list, states: list) -> None:
                t = time.perf_counter()
                st(v, states)
                spent[op] += time.perf_counter() - t
                calls[op] += 1
            return step

        plan.program = [(timed(st, node.op), dead) for (st, dead), node in zip(program, plan.step_nodes)]
        try:
            tok = int(np.argmax(eng(_prompt(64, prompt_len)[None])[0, -1]))
            spent.clear()
            calls.clear()
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = int(np.argmax(eng(np.array([[tok]], np.int64))[0, -1]))
            total = (time.perf_counter() - t0) / steps
        finally:
            plan.program = program
    print(f"== profile of {path}: {len(program)} steps a call; {plan.info}")
    print(f"{'op':40s} {'ms/token':>9s} {'calls':>6s} {'us/call':>8s}")
    for op, t in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{op:40s} {t / steps * 1e3:9.3f} {calls[op] // steps:6d} {t / calls[op] * 1e6:8.1f}")
    inside = sum(spent.values()) / steps
    print(f"per token {total * 1e3:.3f} ms: steps {inside * 1e3:.3f} ms, outside the steps (binding the inputs, "
          f"the cache hand-over, argmax, timers) {(total - inside) * 1e3:.3f} ms")


def _built_in(form: str, folder: Path, kv_heads: int) -> Path:
    from nnef_kv.models.t2n_llama import T2nConfig, write_t2n_decoder

    return write_t2n_decoder(T2nConfig(kv_heads=kv_heads, form=form), folder / form)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archive", type=Path, help="decoder archive nnef-kv runs")
    ap.add_argument("--tract-archive", type=Path, help="archive tract runs (default: --archive)")
    ap.add_argument("--form", choices=("explicit", "dyn", "q4"), help="the built-in decoder in this form")
    ap.add_argument("--kv-heads", type=int, default=8, help="with --form")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blas", type=int, default=1, help="BLAS threads for nnef-kv (tract: its default, one)")
    ap.add_argument("--threads", type=int, default=1, help="Session(threads=...) for nnef-kv")
    ap.add_argument("--rss", action="store_true", help="also RSS after load, each engine in a fresh process")
    ap.add_argument("--rss-only", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only print where nnef-kv's decode time goes, op by op")
    ap.add_argument("--_rss-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_rss-baseline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._rss_child:
        _rss_child(args._rss_child[0], args._rss_child[1], int(args._rss_child[2]))
        return 0
    if args._rss_baseline:
        _rss_baseline()
        return 0
    if (args.archive is None) == (args.form is None):
        ap.error("give one of --archive PATH or --form explicit|dyn|q4")
    from nnef_kv.kernels import numba_available

    print(f"numba kernels: {'on' if numba_available() else 'off (NumPy references)'}; load average "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    with tempfile.TemporaryDirectory(prefix="nnef-kv-bench-") as tmp:
        if args.form:
            t0 = time.perf_counter()
            ours = theirs = _built_in(args.form, Path(tmp), args.kv_heads)
            print(f"built-in decoder, form {args.form}, {args.kv_heads} kv heads: written in "
                  f"{time.perf_counter() - t0:.1f} s to {ours}")
            label = f"--form {args.form}"
        else:
            ours = args.archive
            theirs = args.tract_archive or args.archive
            label = f"{ours}" + (f" vs tract on {theirs}" if theirs != ours else "")
        if args.profile:
            profile(ours, args.prompt, args.steps)
            return 0
        if not args.rss_only:
            print_lockstep(label, lockstep(ours, theirs, args.prompt, args.steps, args.rounds, args.blas, args.threads))
        if args.rss or args.rss_only:
            print_rss(rss(ours, theirs, args.prompt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
