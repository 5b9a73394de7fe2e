#!/usr/bin/env python3
"""Sliding-window exports for tests/fixtures/exports/ (issue 25): torch-to-nnef exports whose masks keep the window.

Developer tool only (it needs torch; no test imports it). Environment and shim: as
``tools/make_export_fixtures.py`` (whose model recipe, shim and archive rewriting this reuses).

Stock torch-to-nnef-llm 0.24.12 hands every decoder one plain causal mask (its base handler's
``build_causal_mask_with_past``), so Mistral, Qwen2 and Gemma 2/3 exports run without their window; only its
GPT-OSS handler builds the ``{"full_attention", "sliding_attention"}`` mapping (``gptoss_window`` uses it). This tool
registers handlers of the same form for ``mistral``, ``qwen2``, ``gemma2`` and ``gemma3_text`` in the exporter's
process before its CLI runs (:func:`register_window_handlers`): models with ``layer_types`` get the mapping,
Mistral (every layer slides, no ``layer_types``) the windowed mask itself. The masks are built from positions
(arange comparisons), so the graph is right for any (S, P).

Each fixture: window 16, 2 layers, 4 query heads and 2 KV heads of 32, vocab 256; ``hf_ref.npz`` holds ``tokens``
[112] (``np.random.default_rng(2025)``), ``n_prompt`` = 8, ``logits`` [105, 256] (the eager HF model with its
``DynamicCache``, sliding layers and all: the 8-token prompt call then 104 one-token calls), and
``logits_windowless`` (same weights and calls, window wider than the context: what an export that lost its window
computes).

Run (from the repository root):

    /work/t2n-venv/bin/python tools/make_window_exports.py [--only NAME ...] [--keep-work DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_export_fixtures as base  # noqa: E402  (re-executes with PYTHONHASHSEED=0)

np, torch, transformers = base.np, base.torch, base.transformers

WINDOW = 16
N_PROMPT = 8
N_TOKENS = 112
TOKENS = np.random.default_rng(2025).integers(0, 256, N_TOKENS).astype(np.int64)

#: heads of 32 (ggml's blocks hold 32 values along head_dim): 4 query heads, 2 KV heads
WIDE = dict(base.BASE, head_dim=32)

FIXTURES = {
    "mistral_window": dict(
        arch="mistral", mode="default, window in the mask",
        config=dict(WIDE, model_type="mistral", hidden_act="silu", tie_word_embeddings=False,
                    sliding_window=WINDOW)),
    "qwen2_window": dict(  # layer 0 full, layer 1 sliding (layers >= max_window_layers slide)
        arch="qwen2", mode="default, window in the mask",
        config=dict({k: v for k, v in base.BASE.items() if k != "head_dim"}, hidden_size=128, model_type="qwen2",
                    hidden_act="silu",
                    tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2_window": dict(
        arch="gemma2", mode="default, window in the mask",
        config=dict(WIDE, model_type="gemma2", hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)),
    "gemma3_window": dict(
        arch="gemma3_text", mode="default, window in the mask",
        config=dict(WIDE, model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
                    query_pre_attn_scalar=32, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
                    rope_parameters={"full_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                                     "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}})),
    # GPT-OSS: its own handler (torch-to-nnef-llm) encodes the windows; learned sinks (a per-head logit
    # appended to the scores) and routed experts (tract_moe_ffn), 4 experts, 2 per token
    "gptoss_window": dict(
        arch="gpt_oss", mode="default, window in the mask, sinks, moe", sinks=1.0,
        config=dict(WIDE, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                    attention_bias=True)),
}


# ---------------------------------------------------------------- the exporter's handlers
def register_window_handlers() -> None:
    """Handlers that hand the model its sliding-window masks (run in the exporter's process)."""
    from torch_to_nnef_llm.models.handlers.default import DefaultArchitectureHandler
    from torch_to_nnef_llm.models.handlers.gpt_oss import GptOssArchitectureHandler
    from torch_to_nnef_llm.models.handlers.registry import register_handler

    class WindowHandler(DefaultArchitectureHandler):
        ARCH_NAMES = ("mistral", "qwen2", "gemma2", "gemma3_text")

        def build_forward_inputs(self, *, inputs, wrapper):
            ctx = super().build_forward_inputs(inputs=inputs, wrapper=wrapper)
            if not getattr(wrapper, "force_causal_mask", False):
                return ctx
            config = wrapper.model.config
            window = int(getattr(config, "sliding_window", 0) or 0)
            layer_types = tuple(getattr(config, "layer_types", ()) or ())
            if window <= 0 or (layer_types and "sliding_attention" not in layer_types):
                return ctx
            masks = GptOssArchitectureHandler._build_mask_mapping(
                seq_length=inputs[0].shape[1], past_length=inputs[1].shape[2], sliding_window=window,
                device=inputs[0].device)
            ctx.model_inputs["attention_mask"] = masks if layer_types else masks["sliding_attention"]
            return ctx

    register_handler(WindowHandler)


# ---------------------------------------------------------------- reference
def hf_reference(model) -> np.ndarray:
    ids = torch.from_numpy(TOKENS)[None]
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        out = model(input_ids=ids[:, :N_PROMPT], past_key_values=cache, use_cache=True)
        logits = [out.logits[0, -1]]
        for i in range(N_PROMPT, N_TOKENS):
            out = model(input_ids=ids[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[0, -1])
    return torch.stack(logits).float().numpy()


def make_fixture(name: str, spec: dict, out_root: Path, shim: Path, work: Path) -> dict:
    print(f"=== {name}", flush=True)
    hf_dir, exp_dir = work / f"hf-src-{name}", work / f"export-{name}"
    for d in (hf_dir, exp_dir):
        shutil.rmtree(d, ignore_errors=True)
    model = base.build_model(spec)
    if spec.get("sinks"):  # HF initialises them to 0: make each head's sink logit matter
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(spec["sinks"] * torch.randn(layer.self_attn.sinks.shape, generator=gen))
    ref = hf_reference(model)
    wide = dict(spec, config=dict(spec["config"], sliding_window=spec["config"]["max_position_embeddings"]))
    no_window = hf_reference(base.build_model(wide))
    hf_dir.mkdir(parents=True)
    model.save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_text(base.byte_level_tokenizer_json())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")
    cmd = ["t2n_export_llm_to_tract", "-e", str(exp_dir), "-d", str(hf_dir), "--tract-specific-path", str(shim),
           "--no-trust-remote-code", "-dwtac"]
    log = work / f"shim-{name}.jsonl"
    log.unlink(missing_ok=True)
    env = dict(os.environ, TRACT_SHIM_LOG=str(log), PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    runner = (
        "import sys, random, numpy, torch; random.seed(0); numpy.random.seed(0); torch.manual_seed(0);"
        f" torch.set_num_threads(1); sys.path.insert(0, {str(Path(__file__).resolve().parent)!r});"
        " import make_window_exports as w; w.register_window_handlers();"
        " from torch_to_nnef_llm.cli import main; sys.argv = sys.argv[1:]; sys.exit(main())"
    )
    proc = subprocess.run([sys.executable, "-c", runner, *cmd], env=env, capture_output=True, text=True)
    (work / f"export-{name}.log").write_text(proc.stdout + "\n----- stderr\n" + proc.stderr)
    archive = base.find_one(exp_dir, "model.nnef.tgz")
    dst = out_root / name
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    base.rewrite_archive(archive, dst / "model.nnef.tgz", [str(exp_dir), str(hf_dir), str(shim),
                                                           str(shim.parent.parent)])
    shutil.copy(hf_dir / "config.json", dst / "config.json")
    shutil.copy(hf_dir / "tokenizer.json", dst / "tokenizer.json")
    (dst / "t2n_tests").mkdir()
    for p in sorted(exp_dir.rglob("*.npz")):  # the exporter's own test io, as make_export_fixtures.py keeps it
        shutil.copy(p, dst / "t2n_tests" / p.name)
    np.savez(dst / "hf_ref.npz", tokens=TOKENS, n_prompt=np.int64(N_PROMPT), logits=ref.astype(np.float32),
             logits_windowless=no_window.astype(np.float32))
    past = slice(WINDOW, None)
    info = {"name": name, "arch": spec["arch"], "mode": spec["mode"], "window": WINDOW, "rc": proc.returncode,
            "cmd": "t2n_export_llm_to_tract -e <export-dir> -d <hf-src> --tract-specific-path <tract-shim> "
                   "--no-trust-remote-code -dwtac (window handlers registered first: tools/make_window_exports.py)",
            "archive_bytes": (dst / "model.nnef.tgz").stat().st_size, "t2n_check_io": base.check_io_summary(log),
            "hf_ref": {"attn": "eager", "calls": int(ref.shape[0]),
                       "window_vs_no_window_past_the_window": float(np.abs(ref - no_window)[past].max())}}
    (dst / "export_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: info[k] for k in ("rc", "archive_bytes", "t2n_check_io", "hf_ref")}), flush=True)
    if proc.returncode:
        raise RuntimeError(f"exporter exited {proc.returncode}: see {work / f'export-{name}.log'}")
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shim", type=Path, default=base.REPO.parent / "shared" / "tools" / "tract_cli_shim.py")
    ap.add_argument("--out", type=Path, default=base.REPO / "tests" / "fixtures" / "exports")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--keep-work", type=Path, default=None)
    args = ap.parse_args()
    names = args.only or list(FIXTURES)
    return base.make_all(names, FIXTURES, make_fixture, args, "t2n-window-")

if __name__ == "__main__":
    sys.exit(main())
