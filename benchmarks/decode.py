"""Decode throughput: nnef-kv vs tract on a LLaMA-style decoder archive built here.

The archive (deterministic random weights) is written as NNEF text + ``.dat`` tensors the way tract
writes a detected LLaMA: ``tract_core_rms_norm``, ``tract_transformers_apply_rope``,
``tract_transformers_dyn_kv_cache`` (the cache lives in op state), ``tract_transformers_sdpa``, a SwiGLU MLP
and weights as ``[1, out, in]`` variables used through ``matmul(..., transposeB = true)``.

Both engines prefill a prompt then decode greedily, one token per call; the script prints tokens/s of the
decode phase for nnef-kv (1 and 2 BLAS threads, via threadpoolctl) and tract (single-threaded, its
default), the ratios, and whether both produced the same tokens.

    python benchmarks/decode.py                  # 4 layers, hidden 512, 8 heads, 8 kv heads, vocab 8192,
                                                 # then the GQA variant (2 kv heads)
    python benchmarks/decode.py --quick          # tiny config, a smoke test

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

import numpy as np


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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def graph_text(c: Config) -> str:
    """NNEF text of the decoder (tract extension ops)."""
    D, H, NH, NKV = c.head_dim, c.hidden, c.heads, c.kv_heads
    L: list[str] = []
    a = L.append
    a("version 1.0;\n")
    a("extension tract_registry tract_core;")
    a("extension tract_registry tract_transformers;")
    a("extension tract_symbol S;")
    a("extension tract_symbol P;\n")
    a("graph decoder(input_ids) -> (logits)\n{")
    a("  input_ids = tract_core_external(shape = [1, S], datum_type = 'i64');")
    a(f"  embed = variable<scalar>(label = 'embed', shape = [{c.vocab}, {H}]);")
    a("  h_0 = tract_core_gather(embed, input_ids, axis = 0);")
    # rotary tables from the positions P .. P+S-1 (P is bound by the KV cache state)
    a("  pos = tract_core_range(P, P + S, 1);")
    a("  pos_f = tract_core_cast(pos, to = 'f32');")
    a("  pos_2 = unsqueeze(pos_f, axes = [1]);")
    a(f"  inv_freq = variable<scalar>(label = 'inv_freq', shape = [1, {D // 2}]);")
    a("  freqs = mul(pos_2, inv_freq);")
    a("  emb = concat([freqs, freqs], axis = 1);")
    a("  cos = unsqueeze(cos(emb), axes = [0, 1]);")
    a("  sin = unsqueeze(sin(emb), axes = [0, 1]);")
    scale = 1.0 / np.sqrt(D)
    for i in range(c.layers):
        h = f"h_{i}"
        p = f"l{i}_"

        def w(name: str, shape: list[int]) -> str:
            a(f"  {p}{name} = variable<scalar>(label = '{p}{name}', shape = {shape});")
            return f"{p}{name}"

        ln1 = w("ln1", [1, 1, H])
        a(f"  {p}n1r = tract_core_rms_norm({h}, axis = 2, eps = {c.eps});")
        a(f"  {p}n1 = mul({p}n1r, {ln1});")
        for proj, out in (("q", NH * D), ("k", NKV * D), ("v", NKV * D)):
            wt = w(f"w{proj}", [1, out, H])
            a(f"  {p}{proj}_lin = matmul({p}n1, {wt}, transposeA = false, transposeB = true);")
            heads = NH if proj == "q" else NKV
            a(f"  {p}{proj}_4 = reshape({p}{proj}_lin, shape = [{heads}, {D}], axis_start = 2, axis_count = 1);")
            a(f"  {p}{proj}_t = transpose({p}{proj}_4, axes = [0, 2, 1, 3]);")
        a(f"  {p}q_r = tract_transformers_apply_rope({p}q_t, cos, sin);")
        a(f"  {p}k_r = tract_transformers_apply_rope({p}k_t, cos, sin);")
        for kv, src in (("k", f"{p}k_r"), ("v", f"{p}v_t")):
            a(f"  {p}{kv}_c = tract_transformers_dyn_kv_cache({src}, name = '{p}{kv}', axis = 2, datum_type = 'f32', "
              f"past_sequence_shape = [1, {NKV}, P, {D}], input_sequence_shape = [1, {NKV}, S, {D}]);")
        a(f"  {p}att = tract_transformers_sdpa({p}q_r, {p}k_c, {p}v_c, scale = {scale:.9f}, datum_type = 'f32', "
          f"acc_datum_type = 'f32', is_causal = true);")
        a(f"  {p}att_t = transpose({p}att, axes = [0, 2, 1, 3]);")
        a(f"  {p}att_2 = reshape({p}att_t, shape = [{H}], axis_start = 2, axis_count = 2);")
        wo = w("wo", [1, H, NH * D])
        a(f"  {p}o = matmul({p}att_2, {wo}, transposeA = false, transposeB = true);")
        a(f"  {p}h1 = add({h}, {p}o);")
        ln2 = w("ln2", [1, 1, H])
        a(f"  {p}n2r = tract_core_rms_norm({p}h1, axis = 2, eps = {c.eps});")
        a(f"  {p}n2 = mul({p}n2r, {ln2});")
        wg, wu, wd = w("wg", [1, c.ffn, H]), w("wu", [1, c.ffn, H]), w("wd", [1, H, c.ffn])
        a(f"  {p}g = matmul({p}n2, {wg}, transposeA = false, transposeB = true);")
        a(f"  {p}u = matmul({p}n2, {wu}, transposeA = false, transposeB = true);")
        a(f"  {p}gu = mul(tract_core_silu({p}g), {p}u);")
        a(f"  {p}d = matmul({p}gu, {wd}, transposeA = false, transposeB = true);")
        a(f"  h_{i + 1} = add({p}h1, {p}d);")
    a(f"  lnf = variable<scalar>(label = 'lnf', shape = [1, 1, {H}]);")
    a(f"  last = slice(h_{c.layers}, axes = [1], begin = [S - 1], end = [S]);")
    a("  nf = mul(tract_core_rms_norm(last, axis = 2, eps = 1e-5), lnf);")
    a(f"  lm_head = variable<scalar>(label = 'lm_head', shape = [1, {c.vocab}, {H}]);")
    a("  logits = matmul(nf, lm_head, transposeA = false, transposeB = true);")
    a("}")
    return "\n".join(L) + "\n"


def weights(c: Config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    D, H = c.head_dim, c.hidden

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)

    t: dict[str, np.ndarray] = {
        "embed": rng.standard_normal((c.vocab, H), dtype=np.float32),
        "inv_freq": (1.0 / c.rope_theta ** (np.arange(0, D, 2, dtype=np.float32) / D)).reshape(1, -1).astype(np.float32),
        "lnf": (1 + 0.1 * rng.standard_normal((1, 1, H))).astype(np.float32),
        "lm_head": mat(1, c.vocab, H),
    }
    for i in range(c.layers):
        p = f"l{i}_"
        t[p + "ln1"] = (1 + 0.1 * rng.standard_normal((1, 1, H))).astype(np.float32)
        t[p + "ln2"] = (1 + 0.1 * rng.standard_normal((1, 1, H))).astype(np.float32)
        t[p + "wq"] = mat(1, c.heads * D, H)
        t[p + "wk"] = mat(1, c.kv_heads * D, H)
        t[p + "wv"] = mat(1, c.kv_heads * D, H)
        t[p + "wo"] = mat(1, H, c.heads * D)
        t[p + "wg"] = mat(1, c.ffn, H)
        t[p + "wu"] = mat(1, c.ffn, H)
        t[p + "wd"] = mat(1, H, c.ffn)
    return t


def write_archive(c: Config, folder: Path) -> Path:
    from nnef_kv import write_tensor

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "graph.nnef").write_text(graph_text(c))
    for label, arr in weights(c).items():
        write_tensor(folder / f"{label}.dat", arr)
    return folder


Result = tuple[list[int], float, float, float]  # tokens, prefill s, decode s (wall), decode s (process CPU)


def decode_nnef_kv(folder: Path, prompt: np.ndarray, steps: int) -> Result:
    import nnef_kv

    session = nnef_kv.load(folder).session()
    t0 = time.perf_counter()
    logits = session.run({"input_ids": prompt[None]})["logits"]
    t1, c1 = time.perf_counter(), time.process_time()
    tokens = [int(np.argmax(logits[0, -1]))]
    for _ in range(steps - 1):
        logits = session.run({"input_ids": np.array([[tokens[-1]]], np.int64)})["logits"]
        tokens.append(int(np.argmax(logits[0, -1])))
    t2, c2 = time.perf_counter(), time.process_time()
    return tokens, t1 - t0, t2 - t1, c2 - c1


def decode_tract(folder: Path, prompt: np.ndarray, steps: int) -> Result:
    import tract

    state = tract.nnef().with_tract_transformers().load(str(folder)).into_runnable().spawn_state()
    t0 = time.perf_counter()
    logits = state.run([prompt[None]])[0].to_numpy()
    t1, c1 = time.perf_counter(), time.process_time()
    tokens = [int(np.argmax(logits[0, -1]))]
    for _ in range(steps - 1):
        logits = state.run([np.array([[tokens[-1]]], np.int64)])[0].to_numpy()
        tokens.append(int(np.argmax(logits[0, -1])))
    t2, c2 = time.perf_counter(), time.process_time()
    return tokens, t1 - t0, t2 - t1, c2 - c1


def bench(c: Config, args: argparse.Namespace) -> dict[str, float]:
    """Run every engine on config ``c``; print and return tokens/s by engine."""
    from threadpoolctl import threadpool_limits

    print(f"\n== {c.layers} layers, hidden {c.hidden}, {c.heads} heads, {c.kv_heads} kv heads, ffn {c.ffn}, "
          f"vocab {c.vocab}; prompt {args.prompt}, {args.steps} tokens")
    rng = np.random.default_rng(42)
    prompt = rng.integers(0, c.vocab, args.prompt).astype(np.int64)
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="nnef-kv-bench-") as tmp:
        folder = write_archive(c, Path(tmp) / "decoder")
        tract_ok = not args.no_tract

        def keep(name: str, r: Result) -> None:
            if name not in results or r[2] < results[name][2]:
                results[name] = r

        # engines interleaved within each repetition: on a shared machine the load drifts, and the best of
        # the repetitions is reported for each engine
        for _ in range(args.repeat):
            for threads in (1, 2):
                with threadpool_limits(limits=threads, user_api="blas"):
                    keep(f"nnef-kv/{threads}", decode_nnef_kv(folder, prompt, args.steps))
            if tract_ok:
                try:
                    keep("tract", decode_tract(folder, prompt, args.steps))
                except Exception as exc:  # noqa: BLE001 - tract 0.23.9 fails some GQA decode paths
                    print(f"tract failed: {str(exc).splitlines()[0]}")
                    tract_ok = False
    decode_steps = args.steps - 1
    rates = {}
    for name, (tokens, prefill, decode, cpu) in results.items():
        rates[name] = decode_steps / decode
        print(f"{name:12s} prefill {args.prompt} tokens {prefill * 1e3:8.1f} ms | decode {rates[name]:8.1f} tokens/s"
              f" ({decode / decode_steps * 1e3:.2f} ms/token wall, {cpu / decode_steps * 1e3:.2f} ms/token CPU)")
    if "tract" in results:
        for threads in (1, 2):
            print(f"ratio nnef-kv ({threads} BLAS thread{'s' if threads > 1 else ''}) / tract: "
                  f"{rates[f'nnef-kv/{threads}'] / rates['tract']:.2f}x")
        cpu1 = results["nnef-kv/1"][3]
        print(f"CPU-time ratio, 1 thread (tract CPU / nnef-kv CPU; less sensitive to other load): "
              f"{results['tract'][3] / cpu1:.2f}x")
        same = sum(a == b for a, b in zip(results["nnef-kv/1"][0], results["tract"][0]))
        print(f"greedy tokens identical to tract: {same}/{len(results['tract'][0])}")
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
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine; the best is reported")
    ap.add_argument("--no-tract", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.ffn, args.vocab = 2, 64, 4, 128, 256
        args.kv_heads = min(args.kv_heads, 4)
        args.prompt, args.steps, args.repeat = 8, 8, 1
    from threadpoolctl import threadpool_info

    blas = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}" for i in threadpool_info()]
    print(f"BLAS: {', '.join(blas) or 'unknown'}")
    bench(Config(args.layers, args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab), args)
    if args.gqa_kv_heads and args.gqa_kv_heads != args.kv_heads:
        bench(Config(args.layers, args.hidden, args.heads, args.gqa_kv_heads, args.ffn, args.vocab), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
