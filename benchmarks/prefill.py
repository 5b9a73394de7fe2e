"""Prefill: nnef-kv vs tract on the same SmolLM2-135M-shaped archive (issue 26 points 3 and 5).

The archive is the package's built-in decoder (``nnef_kv/models/llama.py``, deterministic random weights)
in SmolLM2-135M's shape: ``DecoderConfig(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3,
head_dim=64, mlp=1536, rope_theta=1e5)``, f32, in one of the forms ``--form`` names (``explicit``:
torch-to-nnef's explicit-cache export, attention as matmul/softmax/matmul with an in-graph mask, the
default; ``dyn``: the same spelling with session caches and ``tract_transformers_sdpa`` plus a mask;
``tract``: the form tract writes, a causal ``tract_transformers_sdpa``).

**Time** (default): one prompt of ``--tokens`` tokens (512) prefilled from empty caches, by nnef-kv with
``Session(threads=1)`` and ``Session(threads=2)`` (the session holds BLAS at one thread and splits large
products itself, see ``nnef_kv/interpreter/plan/parallel.py``) and by tract 0.23.9 with its defaults
(``nnef_kv/tract_driver.py`` sets no thread count), side by side in one process: ``--rounds`` rounds,
each engine once a round, the order rotating. Printed per engine: best and median wall time, median CPU
time of the process (``time.process_time``: on a shared machine the CPU figures move less than the wall
ones), tract's time over the engine's (> 1: nnef-kv faster), and whether the last position's logits agree.
The load average (``os.getloadavg``) is printed before and after: others share this machine.

**Memory** (``--memory N``): the peak resident memory (``VmHWM``) of an ``N``-token prefill, each engine
in a fresh process, beside its RSS after loading.

**Profile** (``--profile``): the functions taking the most CPU time in one nnef-kv prefill (cProfile, timed
with ``time.process_time``), ``threads=1``.

    python benchmarks/prefill.py                      # 512 tokens, explicit form, 3 rounds
    python benchmarks/prefill.py --form tract         # tract's own form (causal sdpa)
    python benchmarks/prefill.py --memory 8192        # peak RSS of an 8192-token prefill, each engine
    python benchmarks/prefill.py --memory 8192 --engines nnef-kv   # nnef-kv only
    python benchmarks/prefill.py --profile            # where nnef-kv's prefill time goes
    python benchmarks/prefill.py --quick              # 4 layers, 128 tokens: a smoke test

``--keep DIR`` writes the archive there (and reuses it on the next run) instead of a temporary folder.

Measured on the 2-core VM while other sessions loaded it heavily (load average 8-17), 2026-12-02, after
the blocked attention of ``nnef_kv/kv/blocked.py`` (512 tokens; median wall / median CPU seconds;
tract's time over nnef-kv's in CPU time):

====================  ======================  ======================  ===============  =================
form (command)        nnef-kv threads=1       nnef-kv threads=2       tract 0.23.9     tract/nnef-kv cpu
====================  ======================  ======================  ===============  =================
explicit (default)    5.47 / 1.71             6.25 / 1.69             9.29 / 2.42      1.41 / 1.43
``--form tract``      5.57 / 1.74             8.89 / 1.53             9.52 / 3.00      1.73 / 1.97
``--form dyn``        6.15 / 1.63             7.19 / 1.75             9.91 / 2.66      1.64 / 1.52
====================  ======================  ======================  ===============  =================

Wall times at that load mostly measure the scheduler (tract's 9.3 s wall is 2.4 s of CPU); the CPU ratios
are the figures to read. Logits agree with tract's to <= 1.1e-4 relative, same argmax, in every row.
``--memory 8192 --engines nnef-kv`` (explicit form): RSS after load 345 MiB, peak during the 8192-token
prefill 1729 MiB (934 s wall at load 11-17); without the blocks one attention's scores alone would be
9 x 8192 x 8192 x 4 B = 2.25 GiB (not run). tract's 8192-token peak was not measured (the machine was
too loaded for a second run of that length).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

FORMS = {"explicit": dict(cache="explicit"), "dyn": dict(cache="dyn"), "tract": dict(cache="dyn", spelling="tract")}


def config(form: str, layers: int = 30) -> Any:
    from nnef_kv.models import DecoderConfig

    return DecoderConfig(vocab=49152, hidden=576, layers=layers, heads=9, kv_heads=3, head_dim=64, mlp=1536,
                         rope_theta=1e5, max_positions=1 << 15, name="decoder", **FORMS[form])


def archive(cfg: Any, folder: Path) -> Path:
    """The decoder of ``cfg`` saved as a folder (reused when ``folder/graph.nnef`` is there)."""
    import nnef_kv
    from nnef_kv.models import build_decoder

    if not (folder / "graph.nnef").is_file():
        nnef_kv.save(build_decoder(cfg), folder)
    return folder


def feed_for(names: list[str], cfg: Any, ids: np.ndarray) -> list[np.ndarray]:
    """Inputs by position: the token ids, empty explicit caches."""
    empty = np.zeros((1, cfg.kv_heads, 0, cfg.head_dim), np.float32)
    return [ids if n == "input_ids" else empty for n in names]


def prompt(tokens: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(42).integers(0, vocab, (1, tokens)).astype(np.int64)


class NnefKv:
    def __init__(self, folder: Path, cfg: Any, threads: int) -> None:
        import nnef_kv
        from nnef_kv.interpreter.session import Session

        self.name = f"nnef-kv threads={threads}"
        self.session = Session(nnef_kv.load(folder), threads=threads)
        self.names = [i.name for i in self.session.plan.inputs]
        self.cfg = cfg

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        self.session.reset()
        out = self.session.run(dict(zip(self.names, feed_for(self.names, self.cfg, ids))))
        return np.asarray(out["outputs"]).reshape(-1)[-self.cfg.vocab:]


class Tract:
    def __init__(self, folder: Path, cfg: Any) -> None:
        from nnef_kv import tract_driver

        self.name = "tract 0.23.9"
        self.state = tract_driver.Stateful(folder)
        self.cfg = cfg

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        self.state.reset()
        out = self.state.run_first(feed_for(self.state.input_names, self.cfg, ids))
        return np.asarray(out).reshape(-1)[-self.cfg.vocab:]


def load_text() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def timed(engines: list[Any], ids: np.ndarray, rounds: int) -> None:
    times: dict[str, list[tuple[float, float]]] = {e.name: [] for e in engines}
    logits: dict[str, np.ndarray] = {}
    for e in engines:  # once untimed: first-call costs (numba, buffers, tract's plan for this length)
        logits[e.name] = e(ids)
    for r in range(rounds):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for e in order:
            c0, w0 = time.process_time(), time.perf_counter()
            logits[e.name] = e(ids)
            times[e.name].append((time.perf_counter() - w0, time.process_time() - c0))
        print(f"  round {r + 1}: " + ", ".join(f"{n} {t[-1][0]:.2f} s" for n, t in times.items()), flush=True)
    tract = engines[-1].name
    tw = statistics.median(w for w, _ in times[tract])
    tc = statistics.median(c for _, c in times[tract])
    ref = logits[tract]
    print(f"\n{'engine':24} {'best s':>8} {'median s':>9} {'cpu s':>7} {'tract/it wall':>14} {'tract/it cpu':>13}"
          f"  logits vs tract")
    for e in engines:
        ws = [w for w, _ in times[e.name]]
        cs = [c for _, c in times[e.name]]
        w, c = statistics.median(ws), statistics.median(cs)
        diff = float(np.max(np.abs(logits[e.name] - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
        same = int(np.argmax(logits[e.name])) == int(np.argmax(ref))
        print(f"{e.name:24} {min(ws):8.3f} {w:9.3f} {c:7.3f} {tw / w:14.2f} {tc / c:13.2f}  "
              f"max rel diff {diff:.1e}, same argmax {same}")


def profile(folder: Path, cfg: Any, ids: np.ndarray, top: int = 20) -> None:
    import cProfile
    import pstats

    e = NnefKv(folder, cfg, 1)
    e(ids)
    pr = cProfile.Profile(time.process_time)  # CPU time: less moved by the other tenants than wall time
    pr.enable()
    e(ids)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def memory_child(engine: str, folder: str, form: str, layers: int, tokens: int) -> None:
    cfg = config(form, layers)
    ids = prompt(tokens, cfg.vocab)
    e: Callable[[np.ndarray], np.ndarray] = NnefKv(Path(folder), cfg, 1) if engine == "nnef-kv" else \
        Tract(Path(folder), cfg)
    after_load = _status("VmRSS")
    t = time.perf_counter()
    e(ids)
    print(after_load, _status("VmHWM"), time.perf_counter() - t)


def memory(folder: Path, args: argparse.Namespace) -> None:
    print(f"peak RSS of a {args.memory}-token prefill, each engine in a fresh process ({load_text()})")
    for engine in args.engines.split(","):
        got = subprocess.run([sys.executable, __file__, "--_memory-child", engine, str(folder), args.form,
                              str(args.layers), str(args.memory)], capture_output=True, text=True)
        if got.returncode:
            print(f"  {engine}: failed ({got.returncode}): {got.stderr.strip().splitlines()[-1:]}")
            continue
        load, peak, secs = got.stdout.split()
        print(f"  {engine:8} RSS after load {int(load) / 2**20:8.0f} MiB, peak during the prefill "
              f"{int(peak) / 2**20:8.0f} MiB ({float(secs):.1f} s)")
    print(f"  after: {load_text()}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--form", choices=sorted(FORMS), default="explicit")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", type=int, default=0, metavar="N", help="peak RSS of an N-token prefill instead")
    ap.add_argument("--engines", default="nnef-kv,tract", help="--memory: the engines measured (default: both)")
    ap.add_argument("--profile", action="store_true", help="cProfile of one nnef-kv prefill instead")
    ap.add_argument("--quick", action="store_true", help="4 layers, 128 tokens, 2 rounds")
    ap.add_argument("--keep", type=Path, help="write (and reuse) the archive in this folder")
    ap.add_argument("--_memory-child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._memory_child:
        engine, folder, form, layers, tokens = args._memory_child
        return memory_child(engine, folder, form, int(layers), int(tokens))
    if args.quick:
        args.layers, args.tokens, args.rounds = 4, 128, 2
    cfg = config(args.form, args.layers)
    with tempfile.TemporaryDirectory(prefix="nnef-kv-prefill-") as tmp:
        folder = archive(cfg, args.keep or Path(tmp) / "decoder")
        print(f"SmolLM2-135M shape, {args.layers} layers, f32, {args.form} form: {folder}")
        if args.memory:
            return memory(folder, args)
        ids = prompt(args.tokens, cfg.vocab)
        if args.profile:
            return profile(folder, cfg, ids)
        print(f"prefill of {args.tokens} tokens; before: {load_text()}")
        t = time.perf_counter()
        engines = [NnefKv(folder, cfg, 1), NnefKv(folder, cfg, 2), Tract(folder, cfg)]
        print(f"  loaded the three engines in {time.perf_counter() - t:.1f} s", flush=True)
        timed(engines, ids, args.rounds)
        print(f"after: {load_text()}")


if __name__ == "__main__":
    main()
