"""Print what tests/unit/test_kv_kivi.py::test_prefill_is_exact_and_decode_no_worse_on_minilm asserts: a 512-token
one-call KIVI prefill against exact attention, then 256 decode steps, beside the former semantics (a call
ingesting its tokens before it attends).

    python tools/kivi_prefill_figures.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_kv_kivi as T  # noqa: E402
from conftest import FIXTURES  # noqa: E402
from nnef_kv.kv import KiviSdpa  # noqa: E402
from nnef_kv.kv.tract_fused import softmax_attention  # noqa: E402


def rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def main() -> None:
    z = np.load(FIXTURES / "activations" / "minilm_qkv_apache2_128tok.npz")
    scale = float(z["scale"])
    q, k, v = (np.concatenate([z[f"layer{i}_{x}"] for i in range(6)], axis=1)[None] for x in "qkv")
    n0 = 512
    for bits in (8, 4, 2):
        ops = {name: KiviSdpa(scale=scale, bits=bits, key_group=32, value_group=32, residual=32)
               for name in ("new", "old")}
        calls = {"new": lambda op, *qkv: op(*qkv), "old": T._old_semantics_call}
        head = (q[:, :, :n0], k[:, :, :n0], v[:, :, :n0])
        exact = softmax_attention(*head, scale, T._causal(n0, n0))
        prefill = {name: rel(calls[name](ops[name], *head), exact) for name in ops}
        err = {name: [0.0, 0.0] for name in ops}
        for t in range(n0, q.shape[2]):
            sl = slice(t, t + 1)
            ref = softmax_attention(q[:, :, sl], k[:, :, :t + 1], v[:, :, :t + 1], scale).astype(np.float64)
            for name, op in ops.items():
                out = calls[name](op, q[:, :, sl], k[:, :, sl], v[:, :, sl])
                err[name][0] += float(np.sum((out.astype(np.float64) - ref) ** 2))
                err[name][1] += float(np.sum(ref ** 2))
        dec = {name: float(np.sqrt(a / b)) for name, (a, b) in err.items()}
        print(f"{bits}-bit: prefill rel L2 vs exact {prefill['new']:.2e} (old semantics {prefill['old']:.2%}); "
              f"{q.shape[2] - n0} decode steps after it: {dec['new']:.2%} (old {dec['old']:.2%})")


if __name__ == "__main__":
    main()
