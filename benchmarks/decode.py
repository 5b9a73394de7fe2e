"""Decode throughput: nnef-kv vs tract on a LLaMA-style decoder archive built here (or one given).

The archive (deterministic random weights) is the package's built-in decoder, ``nnef_kv/models/llama.py``,
written in one of three forms (``--form``):

* ``tract`` (default): the form tract writes for a detected LLaMA (``DecoderConfig(cache="dyn",
  spelling="tract")``): ``tract_core_rms_norm``, ``tract_transformers_apply_rope``,
  ``tract_transformers_dyn_kv_cache`` (the cache lives in op state), a causal ``tract_transformers_sdpa``,
  a SwiGLU MLP through ``tract_core_silu`` and weights as ``[1, out, in]`` variables used through
  ``matmul(..., transposeB = true)``;
* ``dyn``: torch-to-nnef's op spelling (chains of small ops) with the same session-held dyn caches and
  sdpa (``cache="dyn"``);
* ``explicit``: torch-to-nnef's explicit-cache export (``cache="explicit"``): the caches go in and out
  of every call as arrays;
* ``q4``: the same explicit export with its linear weights as Q4_0 blocks (``weights="q4_0"``), as
  ``--compression-method min_max_q4_0`` writes it.

``--archive PATH`` times an existing decoder archive instead (explicit or session caches: the signature
``nnef_kv.validate.decode.detect_signature`` recognises; the model sizes printed are then the flags', not
the archive's). ``--tract-archive PATH``: tract runs that archive instead of the same one (a KIVI archive
made by ``nnef-kv convert`` against tract on the f32 export it was converted from: tract has no KIVI op).

Cold start: before the lockstep rounds each engine decodes a few tokens once (not timed into the
figures); the time of that first session's load, prompt and first decode call (numba compiling or loading
its on-disk cache for the kernels the archive uses, tract's planning) is printed apart. ``--rss``: the
resident memory of each engine, each in a fresh process (after load, then after the prompt and one decode
call), with its anonymous / file-backed parts.

Both engines prefill a prompt then decode greedily, one token per call; the script prints tokens/s of the
decode phase for nnef-kv (1 and 2 BLAS threads, via threadpoolctl; and ``nnef-kv/2s``: BLAS on one thread,
the session splitting its large products across two threads itself, ``Session(model, threads=2)``) and
tract (single-threaded, its default; driven by ``nnef_kv.tract_driver``), the ratios, and whether both
produced the same tokens. On a shared machine: the engines are
interleaved, each figure is the best of ``--repeat`` runs, and CPU-time ratios are printed beside the
wall-time ones; the load average before and after is printed too.

Best-of-N figures of separate runs reward whichever engine happened to run in a quiet moment (on the
2-core VM this was written on, the same engine's decode time varies by up to 1.6x from one minute to the
next: other tenants share the memory bandwidth the weight products live on). The ``lockstep`` figures are
the paired measurement: nnef-kv and tract decode side by side in one process, one token each in turn
(order alternating), so every nnef-kv token is compared with a tract token taken a few milliseconds
apart; ``--lockstep N`` sequences, BLAS on one then two threads.

    python benchmarks/decode.py                  # 4 layers, hidden 512, 8 heads, 8 kv heads, vocab 8192,
                                                 # then the GQA variant (2 kv heads)
    python benchmarks/decode.py --quick          # tiny config, a smoke test
    python benchmarks/decode.py --form explicit  # torch-to-nnef's explicit-cache form of the same model
    python benchmarks/decode.py --archive model.nnef.tgz --gqa-kv-heads 0

On machines that set OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (see the environment notes), unset both for the
benchmark command only: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/decode.py``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: --form -> the built-in decoder's (cache, spelling, weights)
FORMS = {"tract": ("dyn", "tract", "f32"), "dyn": ("dyn", "torch-to-nnef", "f32"),
         "explicit": ("explicit", "torch-to-nnef", "f32"), "q4": ("explicit", "torch-to-nnef", "q4_0")}


@dataclass
class Config:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 8
    ffn: int = 1408
    vocab: int = 8192
    rope_theta: float = 10000.0
    eps: float = 1e-5
    form: str = "tract"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def decoder(self) -> Any:
        """The ``nnef_kv.models.DecoderConfig`` of this benchmark model (weights N(0, 1/hidden))."""
        from nnef_kv.models import DecoderConfig

        cache, spelling, weights = FORMS[self.form]
        return DecoderConfig(vocab=self.vocab, hidden=self.hidden, layers=self.layers, heads=self.heads,
                             kv_heads=self.kv_heads, head_dim=self.head_dim, mlp=self.ffn, rope_theta=self.rope_theta,
                             eps=self.eps, seed=self.seed, init_std=float(self.hidden) ** -0.5, cache=cache,
                             spelling=spelling, weights=weights, name="decoder")


def write_archive(c: Config, folder: Path) -> Path:
    """The decoder of ``c`` built by ``nnef_kv/models/llama.py``, saved as a folder (graph.nnef + .dat)."""
    import nnef_kv
    from nnef_kv.models import build_decoder

    return nnef_kv.save(build_decoder(c.decoder()), folder)


def _folder(c: Config, args: argparse.Namespace, tmp: str) -> Path:
    """``--archive`` as given, else the built-in decoder of ``c`` written into ``tmp``."""
    if getattr(args, "archive", None):
        return Path(args.archive)
    return write_archive(c, Path(tmp) / "decoder")


def _prompt(c: Config, args: argparse.Namespace, folder: Path) -> np.ndarray:
    """The prompt's token ids (seeded), below the model's vocabulary (an ``--archive``'s read from its logits)."""
    vocab = c.vocab
    if getattr(args, "archive", None):
        vocab = int(_last(_NnefKvCalls(_session(folder)).first(np.zeros(1, np.int64))).shape[-1])
    return np.random.default_rng(42).integers(0, vocab, args.prompt).astype(np.int64)


def _model_text(c: Config, args: argparse.Namespace, ffn: bool = False) -> str:
    """What is timed, for the headers."""
    if getattr(args, "archive", None):
        return f"archive {args.archive}"
    return (f"{c.layers} layers, hidden {c.hidden}, {c.heads} heads, {c.kv_heads} kv heads"
            + (f", ffn {c.ffn}, vocab {c.vocab}" if ffn else "") + f" ({c.form} form)")


def _last(logits: Any) -> np.ndarray:
    """The last position's row of a logits output (``[1, S, V]``, ``[1, V]``...)."""
    a = np.asarray(logits)
    return a.reshape(-1, a.shape[-1])[-1]


class _NnefKvCalls:
    """An nnef-kv session driven with its archive's decode signature: ``first(prompt)`` (fresh caches),
    ``step(token)``; explicit caches fed back from the previous call, session caches left to the session."""

    def __init__(self, session: Any) -> None:
        from nnef_kv.validate.decode import detect_signature

        self.session = session
        self.sig = detect_signature(session.plan)
        self.ids, self.logits = self.sig.ids_input, self.sig.logits_output
        self.cache: dict[str, np.ndarray] = {}

    def feed(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {**self.cache, self.ids: ids} if self.sig.explicit else {self.ids: ids}

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        out = self.session.run(self.feed(ids))
        if self.sig.explicit:
            self.cache = {i: out[o] for i, o in self.sig.cache_outputs.items()}
        return out[self.logits]

    def first(self, prompt: np.ndarray) -> np.ndarray:
        self.cache = self.sig.empty_caches()
        return self(prompt[None])

    def step(self, token: int) -> np.ndarray:
        return self(np.array([[token]], np.int64))


def _tract_calls(folder: Path, sig: Any) -> tuple[Any, Any]:
    """tract (a fresh state) driven like ``_NnefKvCalls``: ``(first(prompt), step(token))`` -> logits."""
    from nnef_kv import tract_driver

    if not sig.explicit:  # the caches live in tract's state; the logits are the only/first output
        state = tract_driver.Stateful(folder)
        return (lambda p: state.run_first([p[None]]), lambda t: state.run_first([np.array([[t]], np.int64)]))
    dec = tract_driver.Decoder(folder, sig)

    def first(p: np.ndarray) -> np.ndarray:
        dec.reset()
        return dec(p[None])[sig.logits_output]

    return first, lambda t: dec.step(t)[sig.logits_output]


@dataclass
class Result:
    """One prefill + decode run of one engine. Decode times cover ``steps - 1`` single-token calls."""

    tokens: list[int]
    prefill: float  # s, wall
    wall: float  # s, decode, wall clock
    thread_cpu: float  # s, decode, CPU time of the calling thread (time.thread_time)
    process_cpu: float  # s, decode, CPU time of the whole process, BLAS workers included (time.process_time)
    median_token: float  # s, median wall time of one decode call (robust to bursts of load)


def _timed_decode(first: Any, step: Any, steps: int) -> Result:
    """``first()`` runs the prompt and returns its logits; ``step(token)`` one decode call."""
    t0 = time.perf_counter()
    logits = first()
    t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
    tokens = [int(np.argmax(_last(logits)))]
    walls = []
    for _ in range(steps - 1):
        ts = time.perf_counter()
        logits = step(tokens[-1])
        walls.append(time.perf_counter() - ts)
        tokens.append(int(np.argmax(_last(logits))))
    t2, c2, p2 = time.perf_counter(), time.thread_time(), time.process_time()
    return Result(tokens, t1 - t0, t2 - t1, c2 - c1, p2 - p1, float(np.median(walls)) if walls else 0.0)


def decode_nnef_kv(folder: Path, prompt: np.ndarray, steps: int, threads: int = 1) -> Result:
    """``threads = 2``: the session splits its large products across two threads itself (BLAS on one)."""
    import nnef_kv
    from nnef_kv.interpreter.session import Session

    calls = _NnefKvCalls(Session(nnef_kv.load(folder), threads=threads))
    return _timed_decode(lambda: calls.first(prompt), calls.step, steps)


def decode_tract(folder: Path, prompt: np.ndarray, steps: int, sig: Any) -> Result:
    first, step = _tract_calls(folder, sig)
    return _timed_decode(lambda: first(prompt), step, steps)


class _Engine:
    """One engine's session for a lockstep run: ``first()`` runs the prompt, ``step()`` one decode call."""

    def __init__(self, name: str, first: Any, step: Any) -> None:
        self.name, self._first, self._step = name, first, step
        self.tokens: list[int] = []
        self.times: list[float] = []

    def first(self) -> None:
        self.tokens = [int(np.argmax(_last(self._first())))]

    def step(self) -> None:
        t = time.perf_counter()
        logits = self._step(self.tokens[-1])
        self.times.append(time.perf_counter() - t)
        self.tokens.append(int(np.argmax(_last(logits))))


def _alternate(engines: list[_Engine], steps: int) -> None:
    """Prompt for each engine, then ``steps - 1`` decode calls each, one token each in turn, the order
    reversed every other token."""
    for e in engines:
        e.first()
    for i in range(steps - 1):
        for e in (engines if i % 2 == 0 else engines[::-1]):
            e.step()


def cold_start(folder: Path, tract_folder: Path, prompt: np.ndarray, steps: int) -> dict[str, float]:
    """The first session of each engine and its whole first sequence (load, prompt, first decode call, the
    ``steps - 1`` decode calls: seconds), untimed in the figures. In a fresh process nnef-kv's hold numba's
    first compilation or on-disk cache load of the kernels the model uses (a KIVI cache calls them once a
    group is quantized, tokens after the prompt); the slowest decode call of the sequence is printed."""
    from threadpoolctl import threadpool_limits

    got: dict[str, float] = {}
    tract_sig = _NnefKvCalls(_session(tract_folder)).sig
    with threadpool_limits(limits=1, user_api="blas"):
        for name in ("nnef-kv", "tract"):
            t0 = time.perf_counter()
            if name == "nnef-kv":
                calls = _NnefKvCalls(_session(folder))
                first, step = calls.first, calls.step
            else:
                first, step = _tract_calls(tract_folder, tract_sig)
            t1 = time.perf_counter()
            tok = int(np.argmax(_last(first(prompt))))
            t2 = time.perf_counter()
            slowest = 0.0
            for i in range(steps - 1):
                ts = time.perf_counter()
                tok = int(np.argmax(_last(step(tok))))
                slowest = max(slowest, time.perf_counter() - ts)
                if i == 0:
                    got[f"{name} first step"] = time.perf_counter() - ts
            t3 = time.perf_counter()
            got.update({f"{name} load": t1 - t0, f"{name} prompt": t2 - t1, f"{name} sequence": t3 - t0,
                        f"{name} slowest step": slowest})
    return got


def lockstep(folder: Path, prompt: np.ndarray, steps: int, blas_threads: int, rounds: int,
             tract_folder: Path | None = None) -> dict[str, Any]:
    """nnef-kv (BLAS on ``blas_threads``) and tract (on ``tract_folder``, default the same archive)
    decoding side by side, one token each in turn (the order alternates), so both see the same moments of
    a shared machine: a paired measurement. Returns per engine its total decode time over ``rounds``
    sequences, and the per-token time ratios."""
    from threadpoolctl import threadpool_limits

    totals = {"nnef-kv": 0.0, "tract": 0.0}
    ratios: list[float] = []
    same = True
    tract_folder = tract_folder or folder
    tract_sig = _NnefKvCalls(_session(tract_folder)).sig
    with threadpool_limits(limits=blas_threads, user_api="blas"):
        for _ in range(rounds):
            calls = _NnefKvCalls(_session(folder))
            first, step = _tract_calls(tract_folder, tract_sig)
            ours = _Engine("nnef-kv", lambda: calls.first(prompt), calls.step)
            theirs = _Engine("tract", lambda: first(prompt), step)
            _alternate([ours, theirs], steps)
            totals["nnef-kv"] += sum(ours.times)
            totals["tract"] += sum(theirs.times)
            ratios += [b / a for a, b in zip(ours.times, theirs.times)]
            same = same and ours.tokens == theirs.tokens
    return {"totals": totals, "ratios": ratios, "same": same, "tokens": rounds * (steps - 1)}


def _session(folder: Path, plain: bool = False, threads: int | None = None) -> Any:
    """An nnef-kv session (``threads``: the session's, None its default); ``plain``: its plan built without op
    fusion and kernel specialisation."""
    import nnef_kv
    from nnef_kv.interpreter.plan import build_plan
    from nnef_kv.interpreter.session import Session, get_plan

    model = nnef_kv.load(folder)
    if plain:
        plan = build_plan(get_plan(model).graph, fuse_ops=False, specialize_kernels=False)
        object.__setattr__(model, "_nnef_kv_plan", (model.document, plan))
    return Session(model, threads=threads)


def profile(c: Config, args: argparse.Namespace) -> None:
    """Where a decode step's time goes: every plan step timed as it runs (BLAS on one thread), summed by
    op over the decode, and the same steps replayed 200 times each on the last token's values (warm
    caches). The timers add about 0.3 us a step."""
    import collections

    from threadpoolctl import threadpool_limits

    from nnef_kv.interpreter.plan import bind_inputs

    with tempfile.TemporaryDirectory(prefix="nnef-kv-bench-") as tmp, threadpool_limits(limits=1, user_api="blas"):
        folder = _folder(c, args, tmp)
        prompt = _prompt(c, args, folder)
        session = _session(folder, plain=args.plain)
        decode = _NnefKvCalls(session)
        plan = session.plan
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
            tok = int(np.argmax(_last(decode.first(prompt))))
            spent.clear()
            calls.clear()
            n = args.steps - 1
            t0 = time.perf_counter()
            for _ in range(n):
                tok = int(np.argmax(_last(decode.step(tok))))
            total = (time.perf_counter() - t0) / n
        finally:
            plan.program = program
        v = bind_inputs(plan, decode.feed(np.array([[tok]], np.int64)), session._state_symbols())
        warm: dict[str, float] = collections.defaultdict(float)
        for (st, _), node in zip(program, plan.step_nodes):
            if node.prim.stateful:  # appends to a cache: run once, not timed
                st(v, session.states)
                continue
            t = time.perf_counter()
            for _ in range(200):
                st(v, session.states)
            warm[node.op] += (time.perf_counter() - t) / 200
    print(f"\n== profile ({'plain plan' if args.plain else 'planned'}): {_model_text(c, args)}; "
          f"{len(program)} steps; {plan.info}")
    print(f"{'op':34s} {'in run ms/token':>16s} {'calls':>6s} {'us/call':>8s} {'warm us/call':>13s}")
    for op, t in sorted(spent.items(), key=lambda kv: -kv[1]):
        k = calls[op] // n
        print(f"{op:34s} {t / n * 1e3:16.3f} {k:6d} {t / calls[op] * 1e6:8.1f} "
              f"{warm.get(op, 0.0) / max(k, 1) * 1e6 if op in warm else float('nan'):13.1f}")
    inside = sum(spent.values()) / n
    print(f"per token {total * 1e3:.3f} ms: steps {inside * 1e3:.3f} ms, outside the steps (session.run, argmax, "
          f"timers) {(total - inside) * 1e3:.3f} ms")


def plan_pair(c: Config, args: argparse.Namespace) -> None:
    """The planner's own gain, paired: the planned session and a plain one (no op fusion, no kernel
    specialisation; same constant folding, weight layout and projection fusion) decoding side by side."""
    from threadpoolctl import threadpool_limits

    totals = {"planned": 0.0, "plain": 0.0}
    with tempfile.TemporaryDirectory(prefix="nnef-kv-bench-") as tmp, threadpool_limits(limits=1, user_api="blas"):
        folder = _folder(c, args, tmp)
        prompt = _prompt(c, args, folder)
        for _ in range(max(args.lockstep, 1)):
            engines = []
            for plain in (False, True):
                calls = _NnefKvCalls(_session(folder, plain=plain))
                engines.append(_Engine("plain" if plain else "planned", lambda calls=calls: calls.first(prompt),
                                       calls.step))
            _alternate(engines, args.steps)
            for e in engines:
                totals[e.name] += sum(e.times)
            assert engines[0].tokens == engines[1].tokens, "planned and plain plans decoded different tokens"
    print(f"\n== planner gain, paired: {_model_text(c, args)}: plain plan "
          f"{totals['plain'] / (max(args.lockstep, 1) * (args.steps - 1)) * 1e3:.3f} ms/token, planned "
          f"{totals['planned'] / (max(args.lockstep, 1) * (args.steps - 1)) * 1e3:.3f} ms/token: "
          f"{totals['plain'] / totals['planned']:.3f}x (same tokens)")


def kernel_pair(c: Config, args: argparse.Namespace) -> None:
    """The decode-step kernels' gain, paired: one session decoding greedily, its one-token calls alternately
    with the attention, RMS norm and RoPE kernels (nnef_kv/kernels/attend.py, rowwise.py) and with the NumPy
    calls they stand for (the order swapped every pair), at one and at two threads; medians of the calls."""
    import os

    from threadpoolctl import threadpool_limits

    from nnef_kv.interpreter.plan import attention as plan_attention
    from nnef_kv.kernels import numba_available, rowwise

    if not numba_available():
        print("numba is not there (or NNEF_KV_NO_NUMBA=1): nothing to compare")
        return

    def kernels(on: bool) -> None:
        plan_attention.DECODE_KERNEL[0] = on
        for k in (rowwise.rms_rows, rowwise.rope_half):
            if on:
                k.__dict__.pop("hot", None)
            else:
                k.hot = lambda: None  # type: ignore[method-assign]

    with tempfile.TemporaryDirectory(prefix="nnef-kv-bench-") as tmp, threadpool_limits(limits=1, user_api="blas"):
        folder = _folder(c, args, tmp)
        prompt = _prompt(c, args, folder)
        print(f"\n== decode kernels' gain, paired: {_model_text(c, args)}; load average "
              f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for threads in (1, 2):
            calls = _NnefKvCalls(_session(folder, threads=threads))
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(max(args.lockstep, 1)):
                logits = calls.first(prompt)
                for i in range(args.steps - 1):
                    for on in ((True, False) if i % 2 else (False, True)):
                        kernels(on)
                        t0 = time.perf_counter()
                        logits = calls.step(int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1])))
                        times[on].append(time.perf_counter() - t0)
            kernels(True)
            on, off = (float(np.median(times[k])) * 1e3 for k in (True, False))
            print(f"threads={threads}: kernels {on:.2f} ms/token, NumPy calls {off:.2f} ms/token: {off / on:.3f}x "
                  f"({len(times[True])} calls each)")


def _memory() -> dict[str, int]:
    """This process's resident set now (VmRSS) with its anonymous and file-backed parts, bytes."""
    names = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in names:
            got[names[key]] = int(val.split()[0]) * 1024
    return got


def _rss_child(engine: str, folder: str, prompt: list[int], sig_file: str) -> None:
    """In a fresh process: one engine's memory after load, then after the prompt and one decode call (tract
    gets its archive's decode signature from the parent: nothing of nnef-kv's is loaded in its process)."""
    import json
    import pickle

    from threadpoolctl import threadpool_limits

    ids = np.asarray(prompt, np.int64)
    with threadpool_limits(limits=1, user_api="blas"):
        if engine == "nnef-kv":
            calls = _NnefKvCalls(_session(Path(folder)))
            first, step = calls.first, calls.step
        else:
            with open(sig_file, "rb") as f:
                sig = pickle.load(f)
            first, step = _tract_calls(Path(folder), sig)
        got = {"load": _memory()}
        step(int(np.argmax(_last(first(ids)))))
        got["run"] = _memory()
    print(json.dumps(got))


def rss(folder: Path, tract_folder: Path, prompt: np.ndarray, tract_sig: Any) -> dict[str, Any]:
    import json
    import os
    import pickle
    import subprocess

    import nnef_kv

    root = str(Path(nnef_kv.__file__).resolve().parents[1])  # the children run the nnef_kv this process runs
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = {}
    sig_file = Path(tempfile.mkdtemp(prefix="nnef-kv-rss-")) / "sig.pickle"
    sig_file.write_bytes(pickle.dumps(tract_sig))
    for engine, path in (("nnef-kv", folder), ("tract", tract_folder)):
        got = subprocess.run([sys.executable, __file__, "--_rss-child", engine, str(path),
                              ",".join(str(int(t)) for t in prompt), str(sig_file)],
                             capture_output=True, text=True, env=env)
        if got.returncode:
            raise SystemExit(f"--rss: the {engine} process failed: {got.stderr.strip().splitlines()[-1:]}")
        out[engine] = json.loads(got.stdout.strip().splitlines()[-1])
    return out


def print_rss(r: dict[str, Any]) -> None:
    mb = 1 / 2 ** 20
    ours, theirs = r["nnef-kv"], r["tract"]
    for stage, what in (("load", "after load"), ("run", "after the prompt and one decode call")):
        a, b = ours[stage], theirs[stage]
        print(f"RSS {what} (a fresh process each): nnef-kv {a['rss'] * mb:.1f} MiB (anon {a['anon'] * mb:.1f}, "
              f"file {a['file'] * mb:.1f}), tract {b['rss'] * mb:.1f} MiB (anon {b['anon'] * mb:.1f}, file "
              f"{b['file'] * mb:.1f}): ratio {a['rss'] / b['rss']:.2f}x")


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def bench(c: Config, args: argparse.Namespace) -> dict[str, float]:
    """Run every engine on config ``c``; print and return decode tokens/s (best wall time) by engine.

    Robust on a shared machine: the engines are interleaved within each repetition (their order rotates),
    each figure is the best of the repetitions, and CPU times (of the calling thread, and of the process
    with its BLAS workers) are reported beside wall time: other processes slow the wall clock of a run
    much more than its CPU time."""
    from threadpoolctl import threadpool_limits

    print(f"\n== {_model_text(c, args, ffn=True)}; prompt {args.prompt}, {args.steps} tokens; best of {args.repeat}, "
          f"engines interleaved")
    best: dict[str, dict[str, float]] = {}
    tokens: dict[str, list[int]] = {}
    print(f"load average before: {_loadavg()}")
    with tempfile.TemporaryDirectory(prefix="nnef-kv-bench-") as tmp:
        folder = _folder(c, args, tmp)
        prompt = _prompt(c, args, folder)
        tract_ok = not args.no_tract
        tract_folder = Path(args.tract_archive) if getattr(args, "tract_archive", None) else folder
        sig = _NnefKvCalls(_session(tract_folder)).sig
        if tract_ok:
            cold = cold_start(folder, tract_folder, prompt, args.steps)
            print("cold start (not in the figures below): "
                  + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in cold.items()))

        def nnef(blas_threads: int, threads: int = 1) -> Any:
            def run() -> Result:
                with threadpool_limits(limits=blas_threads, user_api="blas"):
                    return decode_nnef_kv(folder, prompt, args.steps, threads)
            return run

        engines: list[tuple[str, Any]] = [("nnef-kv/1", nnef(1)), ("nnef-kv/2", nnef(2)), ("nnef-kv/2s", nnef(1, 2))]
        if tract_ok:
            engines.append(("tract", lambda: decode_tract(tract_folder, prompt, args.steps, sig)))
        for rep in range(args.repeat):
            k = rep % len(engines)
            for name, run in engines[k:] + engines[:k]:
                if name == "tract" and not tract_ok:
                    continue
                time.sleep(args.settle)  # let BLAS workers of the previous run stop spinning (process CPU)
                try:
                    r = run()
                except Exception as exc:  # noqa: BLE001 - tract 0.23.9 fails some GQA decode paths
                    if name != "tract":
                        raise
                    print(f"tract failed: {str(exc).splitlines()[0]}")
                    tract_ok = False
                    continue
                b = best.setdefault(name, {})
                for key in ("prefill", "wall", "thread_cpu", "process_cpu", "median_token"):
                    b[key] = min(b.get(key, float("inf")), getattr(r, key))
                tokens.setdefault(name, r.tokens)
        locked: dict[int, Any] = {}
        for blas in ((1, 2) if tract_ok and args.lockstep else ()):
            try:
                locked[blas] = lockstep(folder, prompt, args.steps, blas, args.lockstep, tract_folder)
            except Exception as exc:  # noqa: BLE001 - tract 0.23.9 fails some GQA decode paths
                print(f"lockstep: tract failed: {str(exc).splitlines()[0]}")
                break
        if getattr(args, "rss", False):
            print_rss(rss(folder, tract_folder, prompt, sig))
    print(f"load average after:  {_loadavg()}")
    n = args.steps - 1
    rates = {}
    for name, b in best.items():
        rates[name] = n / b["wall"]
        print(f"{name:10s} prefill {b['prefill'] * 1e3:7.1f} ms | decode {rates[name]:7.1f} tokens/s | per token: "
              f"{b['wall'] / n * 1e3:.2f} ms wall (median token {b['median_token'] * 1e3:.2f}), "
              f"{b['thread_cpu'] / n * 1e3:.2f} ms thread CPU, {b['process_cpu'] / n * 1e3:.2f} ms process CPU")
    if "tract" in best:
        t = best["tract"]
        labels = {"nnef-kv/1": "1 BLAS thread", "nnef-kv/2": "2 BLAS threads",
                  "nnef-kv/2s": "2 threads: split products, BLAS on 1"}
        for name, label in labels.items():
            e = best[name]
            print(f"ratio nnef-kv ({label}) / tract: "
                  f"wall {t['wall'] / e['wall']:.2f}x (median token {t['median_token'] / e['median_token']:.2f}x) | "
                  f"CPU time {t['process_cpu'] / e['process_cpu']:.2f}x")
        print("(ratios are tract time / nnef-kv time, > 1 means nnef-kv is faster; CPU time is the process's, "
              "BLAS workers included, each figure the best of the runs)")
        same = sum(a == b for a, b in zip(tokens["nnef-kv/1"], tokens["tract"]))
        print(f"greedy tokens identical to tract: {same}/{len(tokens['tract'])}")
    if locked:
        print(f"lockstep (paired): nnef-kv and tract decode side by side, one token each in turn, "
              f"{args.lockstep} sequences of {args.steps} tokens")
        for blas, r in locked.items():
            t, n = r["totals"], r["tokens"]
            ratio = t["tract"] / t["nnef-kv"]
            faster = sum(x > 1 for x in r["ratios"])
            print(f"  BLAS on {blas}: nnef-kv {n / t['nnef-kv']:7.1f} tokens/s, tract {n / t['tract']:7.1f} tokens/s, "
                  f"ratio {ratio:.2f}x (median per-token ratio {float(np.median(r['ratios'])):.2f}x; "
                  f"nnef-kv faster on {faster}/{len(r['ratios'])} tokens); same tokens: {r['same']}")
            rates[f"lockstep/{blas}"] = ratio
    return rates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--gqa-kv-heads", type=int, default=2, help="kv heads of the GQA variant (0: skip it)")
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5, help="runs per engine, interleaved; the best is reported")
    ap.add_argument("--settle", type=float, default=0.3,
                    help="seconds of rest before each run (OpenBLAS workers spin ~0.1 s after their last job)")
    ap.add_argument("--no-tract", action="store_true")
    ap.add_argument("--lockstep", type=int, default=3,
                    help="sequences decoded by nnef-kv and tract side by side, token by token (0: skip)")
    ap.add_argument("--form", choices=sorted(FORMS), default="tract",
                    help="the built-in decoder's archive form (nnef_kv/models/llama.py): tract = tract's own stateful "
                         "form (dyn_kv_cache + causal sdpa, fused rms_norm/rope/silu), dyn = torch-to-nnef's op "
                         "spelling with the same dyn caches, explicit = torch-to-nnef's explicit-cache export")
    ap.add_argument("--archive", metavar="PATH",
                    help="time this decoder archive (folder, .tar, .tgz; explicit or session caches) instead of the "
                         "built-in one; the size flags and --gqa-kv-heads are then ignored")
    ap.add_argument("--tract-archive", metavar="PATH",
                    help="with --archive: tract runs this archive (e.g. the f32 export a KIVI archive was made from)")
    ap.add_argument("--rss", action="store_true",
                    help="also the resident memory of each engine, each in a fresh process (after load, after running)")
    ap.add_argument("--_rss-child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--profile", action="store_true",
                    help="only print where nnef-kv's decode time goes, op by op (default config, BLAS on 1 thread)")
    ap.add_argument("--plain", action="store_true", help="with --profile: the plan without fusion/specialisation")
    ap.add_argument("--plan-gain", action="store_true",
                    help="only measure the planner's gain: planned vs plain plan decoding side by side")
    ap.add_argument("--kernel-gain", action="store_true",
                    help="only measure the decode-step kernels' gain (attention, RMS norm, RoPE): calls alternately "
                         "with and without them, at one and two threads")
    args = ap.parse_args(argv)
    if args._rss_child:
        _rss_child(args._rss_child[0], args._rss_child[1], [int(t) for t in args._rss_child[2].split(",")],
                   args._rss_child[3])
        return 0
    if args.tract_archive and not args.archive:
        ap.error("--tract-archive goes with --archive")
    if args.quick:
        args.layers, args.hidden, args.heads, args.ffn, args.vocab = 2, 64, 4, 128, 256
        args.kv_heads = min(args.kv_heads, 4)
        args.prompt, args.steps, args.repeat, args.settle = 8, 8, 1, 0.0
    from threadpoolctl import threadpool_info

    import os

    blas = [f"{i.get('internal_api')} {i.get('version')} kernel {i.get('architecture')} "
            f"({i.get('num_threads')} threads available)" for i in threadpool_info()]
    print(f"BLAS: {', '.join(blas) or 'unknown'}")
    forced = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    if forced:
        print(f"note: {forced} is set: OpenBLAS runs that kernel (slower on a recent CPU); for the benchmark "
              f"command only: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/decode.py")
    config = Config(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab, form=args.form)
    if args.profile or args.plan_gain or args.kernel_gain:
        (profile if args.profile else plan_pair if args.plan_gain else kernel_pair)(config, args)
        return 0
    bench(config, args)
    if args.gqa_kv_heads and args.gqa_kv_heads != args.kv_heads and not args.archive:
        bench(Config(args.layers, args.hidden, args.heads, args.gqa_kv_heads, args.ffn, args.vocab, form=args.form),
              args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
