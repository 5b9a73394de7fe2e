"""Real-size rows against tract (issue 26): memory and load, decode on one and two threads (quiet and loaded
machine), writing and converting archives, and the products by transposed weights.

The model is the package's built-in decoder (``nnef_kv/models/llama.py``) at the SmolLM2-135M shape:
``DecoderConfig(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, mlp=1536,
rope_theta=1e5, cache="explicit")`` (random weights N(0, 1/hidden), f32, 651 MB), written as a ``.tar``
in a temporary folder. tract 0.23.9 runs the same archive (``nnef_kv.tract_driver``). Every row is
printed with the ``uptime`` load average: other processes share this machine.

* ``--rows memory``: each engine in a fresh process: load time, then RSS (anonymous + file-backed) after
  load and after the prompt and one decode call.
* ``--rows decode``: nnef-kv and tract decoding side by side, one token each in turn (order alternating,
  as ``benchmarks/decode.py --lockstep``), nnef-kv at ``Session(threads=1)``, ``threads=2`` and the
  default (which steps back to one thread while other processes hold the second CPU), with BLAS left
  at its own default (all cores): the session holds it at one thread itself.
  Then the same with another process spinning on a core (``--no-loaded`` skips that).
* ``--rows write``: ``nnef_kv.save`` of the loaded model as a folder, a ``.tar`` and a ``.tgz`` (the
  compressor :func:`nnef_kv.io.container.gzip_writer` picks), and ``convert`` to KIVI-4 into a ``.tgz``;
  zlib's levels timed on ``--gzip-mib`` MiB of the archive (the rate is per MiB: at 7 MiB/s a whole
  archive takes minutes).
* ``--rows products``: GB/s of ``x @ W.T`` on BLAS (the transposed view, a contiguous ``[in, out]``
  copy) and on the numba few-row kernel (NumPy arrays, huge pages, huge pages on two threads), the
  weights read from memory.
* ``--rows tools``: ``inspect``, ``convert`` to KIVI-4, ``validate`` of it against the archive and
  ``compare --jobs 2`` / ``--jobs 1``, each command's processes sampled every 50 ms: the peak of their summed
  PSS (shared pages counted once in all) and of the largest process's RSS (``tools/pss_peak.py``).

    python benchmarks/scale.py                      # every row (about 4-6 minutes on the 2-core VM)
    python benchmarks/scale.py --rows decode --steps 24
    python benchmarks/scale.py --layers 4           # a quick smoke run of the same shape, fewer layers
    python benchmarks/scale.py --weights q4_0       # the linear weights as Q4_0 blocks
    python benchmarks/scale.py --shape llama1b --weights q4_0 --rows memory,decode --no-loaded
                                                    # Llama-3.2-1B's shape (tied embedding), Q4_0 linears
    python benchmarks/scale.py --shape smollm2-360m --rows write
                                                    # SmolLM2-360M's shape: 1.45 GB of f32 weights
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from decode import _last, _NnefKvCalls, _tract_calls  # noqa: E402  (this script's folder is on sys.path)

MIB = 1 << 20


def smollm2_config(layers: int = 30, weights: str = "f32") -> Any:
    from nnef_kv.models import DecoderConfig

    return DecoderConfig(vocab=49152, hidden=576, layers=layers, heads=9, kv_heads=3, head_dim=64, mlp=1536,
                         rope_theta=1e5, cache="explicit", init_std=576 ** -0.5, weights=weights, name="smollm2")


def smollm2_360m_config(layers: int = 32, weights: str = "f32") -> Any:
    """SmolLM2-360M's shape: hidden 960, 32 layers, 15 / 5 heads x 64, ffn 2560, vocab 49152, tied embedding
    (1.45 GB of f32 weights, the issue's conversion case)."""
    from nnef_kv.models import DecoderConfig

    return DecoderConfig(vocab=49152, hidden=960, layers=layers, heads=15, kv_heads=5, head_dim=64, mlp=2560,
                         rope_theta=1e5, cache="explicit", init_std=960 ** -0.5, weights=weights,
                         tied_embeddings=True, name="smollm2_360m")


def llama1b_config(layers: int = 16, weights: str = "f32") -> Any:
    """Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 / 8 heads x 64, ffn 8192, vocab 128256, tied embedding
    (with ``--weights q4_0`` the linear weights are Q4_0 blocks, the tied embedding and LM head one f32 array)."""
    from nnef_kv.models import DecoderConfig

    return DecoderConfig(vocab=128256, hidden=2048, layers=layers, heads=32, kv_heads=8, head_dim=64, mlp=8192,
                         rope_theta=5e5, cache="explicit", init_std=2048 ** -0.5, weights=weights,
                         tied_embeddings=True, name="llama1b")


SHAPES = {"smollm2": (smollm2_config, 30, "SmolLM2-135M"), "smollm2-360m": (smollm2_360m_config, 32, "SmolLM2-360M"),
          "llama1b": (llama1b_config, 16, "Llama-3.2-1B")}


def uptime() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------------------------------------ memory
CHILD = """
import json, sys, time
import numpy as np
sys.path[:0] = {paths!r}
from decode import _last, _NnefKvCalls, _tract_calls
def mem():
    got = {{}}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon", "RssFile", "VmHWM")):
            k, v = line.split(":")
            got[k] = int(v.split()[0]) / 1024
    return got
engine, folder, prompt = sys.argv[1], sys.argv[2], np.array(json.loads(sys.argv[3]), np.int64)
import pickle
base = mem()
t = time.perf_counter()
if engine == "nnef-kv":
    import nnef_kv
    from nnef_kv.interpreter.session import Session
    calls = _NnefKvCalls(Session(nnef_kv.load(folder)))
    first, step = calls.first, calls.step
else:
    sig = pickle.loads(bytes.fromhex(sys.argv[4]))
    first, step = _tract_calls(folder, sig)
load = time.perf_counter() - t
after_load = mem()
step(int(np.argmax(_last(first(prompt)))))
print(json.dumps({{"load_s": load, "base": base, "load": after_load, "run": mem()}}))
"""


def memory_rows(folder: Path, prompt: np.ndarray, sig: Any) -> None:
    import pickle

    code = CHILD.format(paths=[str(HERE), str(HERE.parent)])
    got = {}
    for engine in ("nnef-kv", "tract"):
        done = subprocess.run([sys.executable, "-c", code, engine, str(folder), json.dumps(prompt.tolist()),
                               pickle.dumps(sig).hex()], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"memory: the {engine} process failed: {done.stderr.strip().splitlines()[-1:]}")
        got[engine] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n## memory and load ({uptime()})")
    print("| engine | load s | RSS after load MiB (anon + file) | after prompt + 1 step MiB (anon + file) | peak MiB |")
    print("|---|---|---|---|---|")
    for engine, r in got.items():
        cells = [f"{r[k]['RssAnon'] + r[k]['RssFile']:.0f} ({r[k]['RssAnon']:.0f} + {r[k]['RssFile']:.0f})"
                 for k in ("load", "run")]
        print(f"| {engine} | {r['load_s']:.2f} | {cells[0]} | {cells[1]} | {r['run']['VmHWM']:.0f} |")
    ours, theirs = got["nnef-kv"], got["tract"]
    tot = {e: got[e]["run"]["RssAnon"] + got[e]["run"]["RssFile"] for e in got}
    print(f"nnef-kv / tract: load time {ours['load_s'] / theirs['load_s']:.2f}x, RSS after a step "
          f"{tot['nnef-kv'] / tot['tract']:.2f}x")


# ------------------------------------------------------------------------------------------------ decode
class _Timed:
    def __init__(self, first: Any, step: Any) -> None:
        self._first, self._step, self.times, self.tokens = first, step, [], []

    def first(self, prompt: np.ndarray) -> None:
        self.tokens = [int(np.argmax(_last(self._first(prompt))))]

    def step(self) -> None:
        t = time.perf_counter()
        logits = self._step(self.tokens[-1])
        self.times.append(time.perf_counter() - t)
        self.tokens.append(int(np.argmax(_last(logits))))


def decode_rows(model: Any, folder: Path, prompt: np.ndarray, steps: int, loaded: bool) -> None:
    """Every setting and tract in one lockstep: each token, every engine takes one call, the order rotated
    each token, so all of them see the same moments of a shared machine (load moves by 2x in a minute)."""
    from nnef_kv.interpreter.plan import parallel
    from nnef_kv.interpreter.session import Session

    sig = _NnefKvCalls(Session(model, threads=1)).sig
    tract_first, tract_step = _tract_calls(folder, sig)
    settings = [("threads=1", 1), ("threads=2", 2), (f"default ({parallel.default_threads()})", None)]
    for spin in ([False, True] if loaded else [False]):
        spinner = None
        if spin:  # another process on a core: what other users of a shared machine do
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1.0)
        try:
            print(f"\n## decode, {steps - 1} tokens after a {len(prompt)}-token prompt, every setting and tract in "
                  f"one lockstep ({'one process spinning beside' if spin else 'no extra load'}; {uptime()})")
            engines = {label: _Timed(*_calls_of(Session(model, threads=threads))) for label, threads in settings}
            engines["tract"] = _Timed(tract_first, tract_step)
            order = list(engines.values())
            for e in order:
                e.first(prompt)
            one_thread_runs = 0
            for i in range(steps - 1):
                for e in order[i % len(order):] + order[:i % len(order)]:
                    e.step()
                one_thread_runs += not parallel.LOAD.free()
            tract = float(np.median(engines["tract"].times))
            print("| nnef-kv | ms/token (median) | tract ms/token | tok/s ratio vs tract | vs threads=1 | "
                  "same tokens as tract |")
            print("|---|---|---|---|---|---|")
            one = float(np.median(engines["threads=1"].times))
            for label, _ in settings:
                e = engines[label]
                a = float(np.median(e.times))
                print(f"| {label} | {a * 1e3:.1f} | {tract * 1e3:.1f} | {tract / a:.2f}x | {one / a:.2f}x | "
                      f"{e.tokens == engines['tract'].tokens} |", flush=True)
            sp = parallel.SPLITTER
            print(f"(the default's load watch: {parallel.LOAD.others:.2f} CPUs of other work beside this process at "
                  f"the end; one thread on {one_thread_runs} of {steps - 1} tokens. Splitter so far: {sp.split} "
                  f"split, {sp.taken_back} taken back, {sp.paused} paused)")
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()


def _calls_of(session: Any) -> tuple[Any, Any]:
    calls = _NnefKvCalls(session)
    return calls.first, calls.step


# ------------------------------------------------------------------------------------------------ write
def write_rows(model: Any, folder: Path, tmp: Path, gzip_mib: int, convert: bool) -> None:
    import shutil

    import nnef_kv
    from nnef_kv.io import container

    try:
        import isal  # noqa: F401
        fast = f"isal level {container.ISAL_LEVEL}"
    except ImportError:
        fast = f"zlib level {container.ZLIB_LEVEL} (isal not installed)"
    size = folder.stat().st_size
    print(f"\n## writing ({size / MIB:.0f} MiB of .tar; {uptime()})")
    print("| output | seconds | MiB/s | size / .tar | nnef_kv.load s |")
    print("|---|---|---|---|---|")
    for name, what in (("out", "folder"), ("out.tar", ".tar"), ("out.tgz", f".tgz, {fast}")):
        t = time.perf_counter()
        nnef_kv.save(model, tmp / name)
        dt = time.perf_counter() - t
        p = tmp / name
        n = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        t = time.perf_counter()
        nnef_kv.load(p)
        loaded = time.perf_counter() - t
        print(f"| {what} | {dt:.2f} | {size / MIB / dt:.0f} | {n / size:.4f} | {loaded:.2f} |", flush=True)
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    with open(folder, "rb") as f:
        f.seek(min(size // 4, max(0, size - gzip_mib * MIB)))
        sample = f.read(gzip_mib * MIB)
    for level in (1, 6, 9):
        t = time.perf_counter()
        c = zlib.compress(sample, level)
        dt = time.perf_counter() - t
        print(f"| zlib level {level}, {len(sample) >> 20} MiB sample | {dt:.2f} | {len(sample) / MIB / dt:.1f} | "
              f"{len(c) / len(sample):.4f} | |", flush=True)
    try:
        from isal import isal_zlib

        for level in (1, 2):
            t = time.perf_counter()
            c = isal_zlib.compress(sample, level)
            dt = time.perf_counter() - t
            print(f"| isal level {level}, {len(sample) >> 20} MiB sample | {dt:.2f} | {len(sample) / MIB / dt:.1f} | "
                  f"{len(c) / len(sample):.4f} | |", flush=True)
    except ImportError:
        pass
    if convert:
        from nnef_kv.converters import convert as run_convert

        t = time.perf_counter()
        converted, _ = run_convert(nnef_kv.load(folder), scheme="kivi", bits=4)
        t1 = time.perf_counter()
        nnef_kv.save(converted, tmp / "kivi.tgz")
        t2 = time.perf_counter()
        print(f"convert to KIVI-4 .tgz: {t2 - t:.2f} s ({t1 - t:.2f} s load + passes, {t2 - t1:.2f} s saving; "
              f"{(tmp / 'kivi.tgz').stat().st_size / size:.4f} of the .tar)")


# ------------------------------------------------------------------------------------------------ products
def product_rows() -> None:
    """GB/s of weight read by ``x @ W.T`` for the weights' ``[out, in]`` layout, the weights cycled through
    about 600 MB so that every call reads them from memory (as a decode step does), one thread: BLAS on
    the transposed view (what the plan gives BLAS), BLAS on a contiguous ``[in, out]`` copy, the numba
    few-row kernel (``nnef_kv.kernels.gemv.rows_by_t``, up to its ``MAX_ROWS``) on NumPy arrays and on the
    same weights in huge pages (``nnef_kv.tensors.hugepages``, as a plan holds them); then that last one
    split across two threads (the session's ``ColumnSplitter``)."""
    from threadpoolctl import threadpool_limits

    from nnef_kv.interpreter.plan.parallel import ColumnSplitter
    from nnef_kv.kernels import gemv
    from nnef_kv.tensors import hugepages

    rng = np.random.default_rng(0)
    splitter = ColumnSplitter()

    def best(f: Any, ws: list, reps: int = 3) -> float:
        f(ws[0])
        t_best = 1e9
        for _ in range(reps):
            t = time.perf_counter()
            for w in ws:
                f(w)
            t_best = min(t_best, time.perf_counter() - t)
        return sum(w.nbytes for w in ws) / t_best / 1e9

    def split(a: np.ndarray, w: np.ndarray) -> None:
        splitter._skip = 0  # measure the split itself, not the back-off
        splitter.rows_by_t(a, w)

    print(f"\n## products by a [out, in] weight, GB/s of weight read, weights cycled through ~600 MB ({uptime()})")
    print("| rows x in x out | BLAS on W.T (view) | BLAS on a [in, out] copy | numba | numba, huge pages | "
          "huge pages / BLAS view | huge pages, two threads |")
    print("|---|---|---|---|---|---|---|")
    with threadpool_limits(1, "blas"):
        for m, k, n in [(1, 576, 1536), (1, 1536, 576), (1, 576, 1728), (1, 576, 49152), (2, 576, 1536),
                        (4, 576, 1536), (8, 576, 1536), (64, 576, 1536), (512, 576, 1536)]:
            count = max(1, int(600e6 / (n * k * 4)))
            ws = [rng.standard_normal((n, k), np.float32) for _ in range(count)]
            a = rng.standard_normal((m, k), np.float32)
            out = np.empty((m, n), np.float32)
            view = best(lambda w: np.matmul(a, w.T, out=out), ws)
            copies = [np.ascontiguousarray(w.T) for w in ws]
            copy = best(lambda bt: np.matmul(a, bt, out=out), copies)
            del copies
            if m <= gemv.MAX_ROWS:
                nb = best(lambda w: gemv.rows_by_t(a, w, out, 0, n), ws)
                huge = []
                for w in ws:
                    h = hugepages.empty(w.shape, w.dtype)
                    h[...] = w
                    huge.append(h)
                nbh = best(lambda w: gemv.rows_by_t(a, w, out, 0, n), huge)
                two = best(lambda w: split(a, w), huge) if m == 1 else float("nan")
                del huge
                cells = f"{nb:.1f} | {nbh:.1f} | {nbh / view:.2f}x | {two:.1f}"
            else:
                cells = "(BLAS above MAX_ROWS) | | | "
            print(f"| {m} x {k} x {n} | {view:.1f} | {copy:.1f} | {cells} |", flush=True)
    splitter.close()


# ------------------------------------------------------------------------------------------------ tools
def tool_rows(folder: Path, tmp: Path, context: int, eval_tokens: int) -> None:
    """``inspect``, ``validate`` (KIVI-4 against the f32 archive) and ``compare --jobs 2`` / ``--jobs 1`` on
    the archive, each in its own processes: wall time, the peak over 50 ms samples of the processes' summed
    PSS (a page shared by k processes counts 1/k in each: what they hold together) and the largest single
    process's RSS (``tools/pss_peak.py``)."""
    sys.path.insert(0, str(HERE.parent / "tools"))
    from pss_peak import PeakSampler

    ids = tmp / "ids.txt"
    ids.write_text("\n".join(str(int(i)) for i in np.random.default_rng(7).integers(0, 49152, 4 * (context + 64))))
    kivi = tmp / "kivi4.tar"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    nk = [sys.executable, "-m", "nnef_kv"]
    measure = ["--ids", str(ids), "--context", str(context), "--eval-tokens", str(eval_tokens), "--windows", "1"]
    cmds = [("inspect", nk + ["inspect", str(folder)]),
            ("convert -> KIVI-4 .tar",
             nk + ["convert", str(folder), "-o", str(kivi), "--scheme", "kivi", "--bits", "4"]),
            ("validate KIVI-4 --reference f32 --no-parity",
             nk + ["validate", str(kivi), "--reference", str(folder), "--no-parity"] + measure),
            ("compare kivi:4,q8_0 --jobs 2 --no-tract", nk + ["compare", str(folder), "--schemes", "kivi:4,q8_0",
                                                            "--no-tract", "--jobs", "2"] + measure),
            ("compare kivi:4,q8_0 --jobs 1 --no-tract", nk + ["compare", str(folder), "--schemes", "kivi:4,q8_0",
                                                            "--no-tract", "--jobs", "1"] + measure)]
    size = folder.stat().st_size
    print(f"\n## commands ({size / MIB:.0f} MiB of f32 weights; context {context}, {eval_tokens} predictions; "
          f"{uptime()})")
    print("| command | wall s | peak PSS, all processes, MiB | largest process RSS MiB | PSS / weights |")
    print("|---|---|---|---|---|")
    for name, cmd in cmds:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with PeakSampler(proc.pid) as s:
            _, err = proc.communicate()
        if proc.returncode not in (0, 1):  # validate's exit 1: a check failed (random weights), still measured
            raise SystemExit(f"{name}: exit {proc.returncode}: {err.strip().splitlines()[-1:]}")
        p = s.peak
        print(f"| {name} | {time.perf_counter() - t:.1f} | {p['pss'] / MIB:.0f} ({p['n']} processes) | "
              f"{p['max_rss'] / MIB:.0f} | {p['pss'] / size:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="memory,decode,write,products,tools", help="which rows, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="tools rows: validate's and compare's context")
    ap.add_argument("--eval-tokens", type=int, default=32, help="tools rows: predictions measured")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2",
                    help="the model's shape: SmolLM2-135M (default) or Llama-3.2-1B (tied embedding)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's, 30 / 16)")
    ap.add_argument("--weights", choices=["f32", "q4_0"], default="f32",
                    help="the linear weights as f32 or as Q4_0 blocks (the embedding stays f32)")
    ap.add_argument("--steps", type=int, default=17, help="decode calls per setting (the first is the prompt)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    ap.add_argument("--no-loaded", action="store_true", help="skip the decode rows with a spinning process")
    ap.add_argument("--gzip-mib", type=int, default=32, help="MiB of the archive each zlib level compresses")
    ap.add_argument("--no-convert", action="store_true", help="skip the convert row")
    args = ap.parse_args()
    rows = set(args.rows.split(","))

    import nnef_kv
    from nnef_kv.interpreter.session import Session
    from nnef_kv.models import build_decoder

    make, layers, title = SHAPES[args.shape]
    args.layers = layers if args.layers is None else args.layers
    cfg = make(args.layers, args.weights)
    print(f"# benchmarks/scale.py: {title} shape, {args.layers} layers, {args.weights}, explicit caches; "
          f"{os.cpu_count()} CPUs; {uptime()}")
    with tempfile.TemporaryDirectory(prefix="nnef-kv-scale-") as tmp_name:
        tmp = Path(tmp_name)
        t = time.perf_counter()
        folder = nnef_kv.save(build_decoder(cfg), tmp / f"{args.shape}.tar")
        print(f"built and saved {folder.name}: {folder.stat().st_size / MIB:.0f} MiB in "
              f"{time.perf_counter() - t:.1f} s")
        prompt = np.random.default_rng(42).integers(0, cfg.vocab, args.prompt).astype(np.int64)
        model = nnef_kv.load(folder)
        if "memory" in rows:
            memory_rows(folder, prompt, _NnefKvCalls(Session(model, threads=1)).sig)
        if "decode" in rows:
            decode_rows(model, folder, prompt, args.steps, not args.no_loaded)
        if "write" in rows:
            write_rows(model, folder, tmp, args.gzip_mib, not args.no_convert)
        if "products" in rows:
            product_rows()
        if "tools" in rows:
            tool_rows(folder, tmp, args.context, args.eval_tokens)
    print(f"\ndone; {uptime()}")


if __name__ == "__main__":
    main()
