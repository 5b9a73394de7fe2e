"""Teacher forcing at prefill speed: one stepwise call of N tokens vs N one-token calls.

The decoder of ``benchmarks/decode.py`` (4 layers, hidden 512, 8 heads, vocab 8192; tract's stateful
dyn-cache form) converted by ``nnef-kv convert`` to a 4-bit KIVI cache (groups 32, residual 32). After a
prompt, the next ``--tokens`` tokens (default 256) are fed two ways, from the same state:

* ``stepwise``: one ``Session.run(..., stepwise=True)`` call (every weight product once for all tokens;
  each token answered as a one-token call would have been);
* ``one-token``: ``--tokens`` calls of one token each (what ``validate`` would do without stepwise runs).

Both run in the same process, alternating which goes first, ``--rounds`` times (paired figures: the
ratio of each round, then the median); BLAS pinned to ``--blas-threads`` (default 1). The script also
checks that both give the same figures: the logits of every position (max |diff| relative to the
largest logit, argmax agreement), the KIVI states afterwards, and the mean KL against the f32 model that
``validate`` would report from each. (The KV op's stepwise run is exact given its inputs; a C-row weight
product rounds differently from a 1-row one, BLAS gemm vs gemv, ~6e-7 relative, which can move a value
lying on a code boundary to the next code: the code bytes differing are printed.)

    python benchmarks/validate_speed.py            # the figure quoted in the README
    python benchmarks/validate_speed.py --quick    # a small model, a smoke test
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode as bench_decode  # noqa: E402  (benchmarks/decode.py: the decoder archive)

import nnef_kv  # noqa: E402
from nnef_kv.converters import convert  # noqa: E402


def _session_after_prompt(model, prompt: np.ndarray):
    s = model.session()
    s.run({"input_ids": prompt[None]})
    return s


def run(args: argparse.Namespace) -> dict[str, float]:
    cfg = bench_decode.Config() if not args.quick else bench_decode.Config(layers=2, hidden=64, heads=4, kv_heads=2,
                                                                           ffn=128, vocab=256)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab, args.prompt + args.tokens).astype(np.int64)
    prompt, rest = ids[:args.prompt], ids[args.prompt:]
    with tempfile.TemporaryDirectory() as tmp:
        folder = bench_decode.write_archive(cfg, Path(tmp))
        f32 = nnef_kv.load(folder)
        model, _ = convert(f32, scheme="kivi", bits=args.bits)
    ref = f32.session()  # the f32 cache is chunk-invariant: its stepwise logits are the reference's
    ref.run({"input_ids": prompt[None]})
    ref_logits = np.asarray(ref.run({"input_ids": rest[None]}, stepwise=True)["outputs"]).reshape(-1, cfg.vocab)
    print(f"decoder: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads / {cfg.kv_heads} kv heads, vocab "
          f"{cfg.vocab}; KIVI {args.bits}-bit (groups 32, residual 32); prompt {args.prompt}, then {args.tokens} "
          f"teacher-forced tokens; BLAS threads {args.blas_threads}")
    base = _session_after_prompt(model, prompt)
    saved = [st.state_tensors() for st in base.states]

    def fresh():
        s = model.session()
        for st, t in zip(s.states, saved):
            st.load_state_tensors(t)
        return s

    def stepwise():
        s = fresh()
        t0 = time.perf_counter()
        out = s.run({"input_ids": rest[None]}, stepwise=True)["outputs"]
        return time.perf_counter() - t0, np.asarray(out).reshape(-1, cfg.vocab), s

    def one_token():
        s = fresh()
        t0 = time.perf_counter()
        rows = [np.asarray(s.run({"input_ids": rest[None, i:i + 1]})["outputs"]).reshape(-1) for i in range(len(rest))]
        return time.perf_counter() - t0, np.stack(rows), s

    stepwise()  # warm-up: plans built, caches warm
    ratios, ts, to = [], [], []
    a = b = sa = sb = None
    for r in range(args.rounds):
        order = (stepwise, one_token) if r % 2 == 0 else (one_token, stepwise)
        res = {fn.__name__: fn() for fn in order}
        t_s, a, sa = res["stepwise"]
        t_o, b, sb = res["one_token"]
        ts.append(t_s)
        to.append(t_o)
        ratios.append(t_o / t_s)
        print(
            f"  round {r + 1}: stepwise {t_s * 1000:8.1f} ms, one-token calls {t_o * 1000:8.1f} ms: {t_o / t_s:6.2f}x"
        )
    rel = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    agree = float(np.mean(np.argmax(a, -1) == np.argmax(b, -1)))
    state_rel = 0.0
    codes_diff = 0
    codes_total = 0
    for x, y in zip(sa.states, sb.states):
        tx, ty = x.state_tensors(), y.state_tensors()
        for k in tx:
            if tx[k].dtype.kind == "f" and tx[k].size:
                state_rel = max(state_rel, float(np.max(np.abs(tx[k] - ty[k])) / (np.max(np.abs(ty[k])) or 1)))
            elif tx[k].dtype == np.uint8:
                codes_diff += int(np.count_nonzero(tx[k] != ty[k]))
                codes_total += tx[k].size
    from nnef_kv.validate.metrics import kl_divergence

    kl_s, kl_o = float(np.mean(kl_divergence(ref_logits, a))), float(np.mean(kl_divergence(ref_logits, b)))
    med = float(np.median(ratios))
    print(f"stepwise vs one-token calls, paired median over {args.rounds} rounds: {med:.2f}x faster "
          f"(median {np.median(ts) * 1000:.1f} ms vs {np.median(to) * 1000:.1f} ms for {args.tokens} tokens)")
    print(f"same figures: logits max |diff| {rel:.2e} of the largest logit over {len(b)} positions, argmax agreement "
          f"{agree:.3f}; KIVI state float tensors max rel diff {state_rel:.2e}, code bytes differing "
          f"{codes_diff} of {codes_total}")
    print(f"the figure validate reports, mean KL(p_f32 || p) over the {len(b)} tokens: {kl_s:.6g} stepwise, {kl_o:.6g} "
          f"one-token calls (relative difference {abs(kl_s - kl_o) / max(kl_o, 1e-30):.1e})")
    return {"ratio": med, "logits_rel": rel, "argmax": agree, "kl_stepwise": kl_s, "kl_one_token": kl_o}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        run(args)
        return 0
    with threadpool_limits(limits=args.blas_threads, user_api="blas"):
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
