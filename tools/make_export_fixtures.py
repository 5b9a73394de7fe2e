#!/usr/bin/env python3
"""Rebuild the decoder-export fixtures in tests/fixtures/exports/ with torch-to-nnef.

Developer tool only: no test imports it and CI never runs it (it needs torch).

Environment (a venv of its own, never the project's venv):

    python3 -m venv /work/t2n-venv
    /work/t2n-venv/bin/pip install torch==2.13.0        # the CPU wheel (torch-2.13.0+cpu)
    /work/t2n-venv/bin/pip install transformers==5.23.0 torch-to-nnef==0.24.12 \
        torch-to-nnef-llm==0.24.12 tract==0.23.9 numpy
    # transformers 5.24 breaks torch-to-nnef-llm 0.24.12.

torch-to-nnef checks its export by shelling out to the `tract` CLI, which it would download; offline
the check runs through `tract_cli_shim.py` (shared/tools/ beside the repository: it evaluates with
the `tract` Python package and tract's own tolerance table). This script copies that shim into a temp
dir as an executable `bin/tract` whose shebang is this venv's python, and passes it to the exporter as
`--tract-specific-path`.

Run (from the repository root):

    /work/t2n-venv/bin/python tools/make_export_fixtures.py [--shim ../shared/tools/tract_cli_shim.py]
        [--out tests/fixtures/exports] [--only NAME ...] [--keep-work DIR]

Determinism: the script re-executes itself with PYTHONHASHSEED=0 (torch-to-nnef names tensors in set
iteration order) and uses one torch thread. Models: `torch.manual_seed(0)` then
`AutoModelForCausalLM.from_config`; then, in `named_parameters()` order with
`torch.Generator().manual_seed(1)`, every norm weight gets `+= 0.1 N(0,1)` and every bias is set to
`0.05 N(0,1)` (so the exporter folds nothing away). This is the recipe of the shared exports (their
weights are reproduced exactly by it). Tokens: `np.random.default_rng(1234).integers(0, 256, 16)`,
the tokens of the shared `hf_ref.npz` files.

The exporter (`t2n_export_llm_to_tract`, its console entry point) runs in a child python seeded with
torch / numpy / random 0, so its test io and its check's inputs repeat too. Two rebuilds give
identical arrays in every npz and identical archive members except graph.nnef's `export_date`.
All fixtures take about a minute on one core.

Each fixture folder gets: model.nnef.tgz (as exported, recompressed; only the machine paths in the
`export_cmd` property replaced by `<path>`), config.json, tokenizer.json (the byte-level tokenizer
given to the exporter, identical to the shared one), t2n_tests/ (the exporter's own test io),
hf_ref.npz and export_info.json. tests/fixtures/exports/README.md describes them (hand-written: its
figures were measured with tract 0.23.9 and nnef_kv in the project venv).
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
N_PROMPT = 8
N_TOKENS = 16
TOKENS = np.random.default_rng(1234).integers(0, 256, N_TOKENS).astype(np.int64)

# Common tiny-decoder shape: 2 layers, hidden 64, 4 query heads of 16, 2 KV heads, vocab 256.
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

F16 = ["-dt", "f16"]
F32_ATTN = ["-f32-attn"]

# name -> (arch, mode, config kwargs, extra exporter args, notes)
FIXTURES = {
    "gemma2_default": dict(
        arch="gemma2",
        mode="default",
        config=dict(
            BASE,
            model_type="gemma2",
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=16,
            # Caps low enough to bend this tiny model's values (50 / 30 would leave tanh linear).
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            # Gemma 2's default window: wider than anything the graph accepts (S+P < 256). The
            # exporter's mask is causal only (no window), so a narrower window would make hf_ref and
            # the archive disagree; `window_probe` measures by how much for a window of 6.
            sliding_window=4096,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
        ),
        args=[],
        window_probe=6,
        softcap_probe=True,
    ),
    "qwen2_f16": dict(
        arch="qwen2",
        mode="f16",
        config=dict(
            {k: v for k, v in BASE.items() if k != "head_dim"},
            model_type="qwen2",
            hidden_act="silu",
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=28,
        ),
        args=F16,
    ),
    "llama_f16attn": dict(
        arch="llama",
        mode="f16+f32attn",
        config=dict(BASE, model_type="llama", hidden_act="silu", tie_word_embeddings=True),
        args=F16 + F32_ATTN,
    ),
    # sdpa traced but not reified: torch-to-nnef's scaled_dot_product_attention fragment (einsum for
    # q.kT and p.V). MHA: with GQA (2 KV heads) the trace bakes S = 1 into the query reshape and tract
    # refuses the archive ("64*S should be equal to 64"), as for the shared llama_sdpa.
    "llamamha_f16attn_sdpa": dict(
        arch="llama",
        mode="f16+f32attn+sdpa-trace",
        config=dict(BASE, model_type="llama", hidden_act="silu", tie_word_embeddings=True, num_key_value_heads=4),
        args=F16 + F32_ATTN + ["--transformers-attn-implementation", "sdpa"],
    ),
    "mistral_default": dict(
        arch="mistral",
        mode="default",
        config=dict(BASE, model_type="mistral", hidden_act="silu", tie_word_embeddings=False, sliding_window=6),
        args=[],
    ),
    "qwen3_default": dict(
        arch="qwen3",
        mode="default",
        config=dict(
            BASE,
            model_type="qwen3",
            hidden_act="silu",
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=28,
            attention_bias=False,
        ),
        args=[],
    ),
    "olmo2_default": dict(
        arch="olmo2",
        mode="default",
        config=dict(
            {k: v for k, v in BASE.items() if k != "head_dim"},
            model_type="olmo2",
            hidden_act="silu",
            tie_word_embeddings=False,
        ),
        args=[],
    ),
    "gptneox_default": dict(
        arch="gpt_neox",
        mode="default",
        config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            initializer_range=0.1,
            layer_norm_eps=1e-5,
            rotary_pct=0.5,
            use_parallel_residual=True,
            hidden_act="gelu",
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            tie_word_embeddings=False,
            model_type="gpt_neox",
            # GPT-NeoX has no such field; torch-to-nnef-llm 0.24.12 reads it to shape the KV cache
            # (AttributeError without it). transformers ignores it.
            num_key_value_heads=4,
        ),
        args=[],
    ),
}


# ---------------------------------------------------------------- tokenizer
def byte_level_tokenizer_json() -> str:
    """The shared fixtures' byte-level tokenizer.json (256 byte tokens, no merges), byte for byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            codes.append(256 + extra)
            extra += 1
    vocab = {chr(c): i for i, c in enumerate(codes)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    return tok.to_str(pretty=True)


# ---------------------------------------------------------------- model
def build_model(spec: dict):
    cfg_kwargs = dict(spec["config"])
    model_type = cfg_kwargs.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg_kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    norm_params = {
        f"{mname}.{pname}" if mname else pname
        for mname, mod in model.named_modules()
        if "norm" in type(mod).__name__.lower()
        for pname, _ in mod.named_parameters(recurse=False)
    }
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif name in norm_params and name.endswith("weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def hf_reference(model) -> dict:
    """Prompt call (8 tokens) then 8 teacher-forced one-token calls with a DynamicCache."""
    ids = torch.from_numpy(TOKENS)[None]
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        out = model(input_ids=ids[:, :N_PROMPT], past_key_values=cache, use_cache=True)
        logits = [out.logits[0, -1]]
        cache = out.past_key_values
        for i in range(N_PROMPT, N_TOKENS):
            out = model(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1])
        inc = torch.stack(logits).float().numpy()
        full = model(input_ids=ids, use_cache=False).logits[0].float().numpy()
    return {
        "logits": inc,
        "incremental_vs_full": float(np.abs(inc - full[N_PROMPT - 1 :]).max()),
    }


# ---------------------------------------------------------------- export
def make_shim(shim_src: Path, where: Path) -> Path:
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    dst = bin_dir / "tract"
    text = shim_src.read_text().split("\n", 1)
    body = text[1] if text[0].startswith("#!") else "\n".join(text)
    dst.write_text(f"#!{sys.executable}\n{body}")
    dst.chmod(0o755)
    return dst


def find_one(root: Path, name: str) -> Path:
    hits = sorted(root.rglob(name))
    if len(hits) != 1:
        raise RuntimeError(f"expected one {name} under {root}, found {hits}")
    return hits[0]


def rewrite_archive(src: Path, dst: Path, paths: list[str]) -> None:
    """Copy the exporter's tgz member by member, replacing machine paths in export_cmd by <path>."""
    with tarfile.open(src, "r:gz") as tin:
        members = [(m, tin.extractfile(m).read() if m.isfile() else None) for m in tin.getmembers()]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tout:
        for m, data in members:
            if m.name.endswith("graph.nnef"):
                text = data.decode()
                lines = []
                for line in text.split("\n"):
                    if '("export_cmd"' in line:
                        for p in sorted(paths, key=len, reverse=True):
                            line = line.replace(p, "<path>")
                    lines.append(line)
                data = "\n".join(lines).encode()
                m.size = len(data)
            tout.addfile(m, io.BytesIO(data) if data is not None else None)
    with open(dst, "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(buf.getvalue())


def graph_text(archive: Path) -> str:
    with tarfile.open(archive, "r:gz") as t:
        for m in t.getmembers():
            if m.name.endswith("graph.nnef"):
                return t.extractfile(m).read().decode()
    raise RuntimeError("no graph.nnef")


def graph_facts(text: str, spec: dict) -> dict:
    """What the archive's graph contains that matters for the fixture."""
    body = text[text.find("graph network") :]
    ops = re.findall(r"=\s*([a-z_][a-z0-9_]*)\s*[(<]", body)
    facts: dict = {"n_ops": len(ops), "tanh": ops.count("tanh")}
    # einsums may also sit in a fragment (the sdpa fragment): count over the whole file.
    einsums = [ln.strip() for ln in text.split("\n") if "tract_core_einsum(" in ln]
    facts["einsum"] = len(einsums)
    facts["einsum_lines"] = einsums[:4]
    facts["fragments"] = re.findall(r"^fragment ([A-Za-z0-9_]+)", text, re.M)
    facts["extensions"] = sorted(set(re.findall(r"^extension (.*);", text, re.M)))
    cfg = spec["config"]
    sw = cfg.get("sliding_window")
    if sw is not None:
        # A sliding-window mask needs the window size as a constant next to the position arithmetic.
        lines = [ln.strip() for ln in body.split("\n") if re.search(rf"[,( ]-?{sw}[,)\]]", ln)]
        facts["lines_with_window_constant"] = lines[:10]
        facts["mask_lines"] = [
            ln.strip() for ln in body.split("\n") if re.search(r"\b(qPos|kPos|future|attentionMask|gt0)\b", ln)
        ][:20]
    return facts


def check_io_summary(log: Path) -> dict:
    rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return {
        "n": len(rows),
        "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=None),
        "all_ok": bool(rows) and all(r["outliers"] == 0 for r in rows),
    }


def make_fixture(name: str, spec: dict, out_root: Path, shim: Path, work: Path) -> dict:
    print(f"=== {name}", flush=True)
    hf_dir = work / f"hf-src-{name}"
    exp_dir = work / f"export-{name}"
    for d in (hf_dir, exp_dir):
        shutil.rmtree(d, ignore_errors=True)
    model = build_model(spec)
    ref = hf_reference(model)
    extra_ref = {}
    probe = None
    if spec.get("window_probe"):
        narrow = dict(spec, config=dict(spec["config"], sliding_window=spec["window_probe"]))
        probe = float(np.abs(hf_reference(build_model(narrow))["logits"] - ref["logits"]).max())
    elif spec["config"].get("sliding_window") is not None:
        # Same weights, window wider than the context: what an export that ignores the window computes.
        nw = dict(spec, config=dict(spec["config"], sliding_window=spec["config"]["max_position_embeddings"]))
        ref_nw = hf_reference(build_model(nw))
        extra_ref["logits_no_window"] = ref_nw["logits"]
    hf_dir.mkdir(parents=True)
    model.save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_text(byte_level_tokenizer_json())
    # Without a tokenizer_class, AutoTokenizer picks the architecture's tokenizer class, which
    # rebuilds the tokenizer (Qwen2/GPT-NeoX add <|endoftext|> and a split regex) or fails (Gemma's
    # wants an <unk>). The plain fast tokenizer keeps the byte-level tokenizer.json as it is.
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")

    log = work / f"shim-{name}.jsonl"
    log.unlink(missing_ok=True)
    # The console script `t2n_export_llm_to_tract`, run in-process after seeding torch / numpy: its
    # test inputs (t2n_tests/export_*) and its check's inputs are drawn unseeded otherwise.
    cmd = [
        "t2n_export_llm_to_tract",
        "-e", str(exp_dir), "-d", str(hf_dir), "--tract-specific-path", str(shim),
        "--no-trust-remote-code", "-dwtac", *spec["args"],
    ]
    env = dict(os.environ, TRACT_SHIM_LOG=str(log), PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    runner = (
        "import sys, random, numpy, torch; random.seed(0); numpy.random.seed(0); torch.manual_seed(0);"
        " torch.set_num_threads(1); from torch_to_nnef_llm.cli import main; sys.argv = sys.argv[1:]; sys.exit(main())"
    )
    proc = subprocess.run([sys.executable, "-c", runner, *cmd], env=env, capture_output=True, text=True)
    (work / f"export-{name}.log").write_text(proc.stdout + "\n----- stderr\n" + proc.stderr)
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    last_error = (
        next((ln for ln in reversed(err_lines) if "Error" in ln or "ERROR" in ln), "") if proc.returncode else ""
    )
    if "Caused by" in last_error:  # tract's error chain, without the Python/Rust backtraces
        chain = last_error[last_error.find("TractError") : last_error.find("Stack backtrace")]
        last_error = " | ".join(x.strip() for x in chain.replace("\\n", "\n").split("\n") if x.strip())

    archive = find_one(exp_dir, "model.nnef.tgz")
    dst = out_root / name
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "t2n_tests").mkdir(parents=True)
    rewrite_archive(archive, dst / "model.nnef.tgz", [str(exp_dir), str(hf_dir), str(shim), str(shim.parent.parent)])
    shutil.copy(hf_dir / "config.json", dst / "config.json")
    # The byte-level tokenizer.json given to the exporter (for qwen2, transformers swaps in
    # Qwen2Tokenizer whatever tokenizer_config says, and the exporter's dump adds <|endoftext|> = 256).
    shutil.copy(hf_dir / "tokenizer.json", dst / "tokenizer.json")
    tok_dump = sorted(exp_dir.rglob("tokenizer.json"))
    dump_same = bool(tok_dump) and tok_dump[0].read_text() == byte_level_tokenizer_json()
    tests = sorted(p for p in exp_dir.rglob("*.npz"))
    for p in tests:
        shutil.copy(p, dst / "t2n_tests" / p.name)
    np.savez(
        dst / "hf_ref.npz",
        tokens=TOKENS,
        n_prompt=np.int64(N_PROMPT),
        logits=ref["logits"].astype(np.float32),
        **{k: v.astype(np.float32) for k, v in extra_ref.items()},
    )
    facts = graph_facts(graph_text(dst / "model.nnef.tgz"), spec)
    display = " ".join(
        "<export-dir>" if a == str(exp_dir) else f"<hf-src-{spec['arch']}>" if a == str(hf_dir)
        else "<tract-shim>" if a == str(shim) else a
        for a in ["t2n_export_llm_to_tract", *cmd[1:]]
    )
    info = {
        "name": name,
        "arch": spec["arch"],
        "mode": spec["mode"],
        "cmd": display,
        "rc": proc.returncode,
        "archive_bytes": archive.stat().st_size,
        "last_error_line": last_error,
        "t2n_check_io": check_io_summary(log),
        "hf_ref": {"attn": "eager", "incremental_vs_full": ref["incremental_vs_full"]},
        "exporter_tokenizer_dump_identical": dump_same,
        "graph": facts,
    }
    if extra_ref:
        info["hf_ref"]["logits_no_window"] = "same weights, sliding_window = max_position_embeddings"
        info["hf_ref"]["window_vs_no_window"] = float(np.abs(extra_ref["logits_no_window"] - ref["logits"]).max())
    if probe is not None:
        info["hf_ref"][f"sliding_window_{spec['window_probe']}_vs_hf_ref"] = probe
    if spec.get("softcap_probe"):
        # How much the caps bend this model: a softcap the runtime skipped would be off by this.
        flat = dict(spec, config=dict(spec["config"], attn_logit_softcapping=None, final_logit_softcapping=None))
        info["hf_ref"]["no_softcap_vs_hf_ref"] = float(
            np.abs(hf_reference(build_model(flat))["logits"] - ref["logits"]).max()
        )
        flat = dict(spec, config=dict(spec["config"], attn_logit_softcapping=None))
        info["hf_ref"]["no_attn_softcap_vs_hf_ref"] = float(
            np.abs(hf_reference(build_model(flat))["logits"] - ref["logits"]).max()
        )
    (dst / "export_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: info[k] for k in ("rc", "archive_bytes", "t2n_check_io", "last_error_line")}), flush=True)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shim", type=Path, default=REPO.parent / "shared" / "tools" / "tract_cli_shim.py")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "exports")
    ap.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    ap.add_argument("--keep-work", type=Path, default=None, help="keep HF dirs / exporter output here")
    args = ap.parse_args()
    names = args.only or list(FIXTURES)
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        ap.error(f"unknown fixtures {unknown}; known: {list(FIXTURES)}")
    if transformers.__version__ != "5.23.0":
        print(f"warning: transformers {transformers.__version__}, fixtures were made with 5.23.0", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    return make_all(names, FIXTURES, make_fixture, args, "t2n-fixtures-")


def make_all(names: list[str], fixtures: dict, make: Any, args: argparse.Namespace, prefix: str) -> int:
    """``make(name, spec, out, shim, work)`` for each fixture named, in a work dir (``--keep-work`` or a
    temporary one) holding the shim; every fixture is tried, the failed ones listed. The exit code."""
    tmp = None
    if args.keep_work is None:
        tmp = tempfile.TemporaryDirectory(prefix=prefix)
        work = Path(tmp.name)
    else:
        work = args.keep_work.resolve()
        work.mkdir(parents=True, exist_ok=True)
    shim = make_shim(args.shim.resolve(), work)
    failed = []
    for name in names:
        try:
            make(name, fixtures[name], args.out.resolve(), shim, work)
        except Exception as exc:  # keep going: report every fixture
            print(f"FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
    if tmp is not None:
        tmp.cleanup()
    print("failed:", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
