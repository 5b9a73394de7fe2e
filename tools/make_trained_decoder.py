"""A small *trained* LLaMA decoder for KV-scheme comparisons: ``tests/fixtures/trained_llama/``.

The shared fixture decoders are random-init with head_dim 16 (llama.cpp's cache types need whole
blocks of 32 along head_dim, and a random model's predictions are nearly flat). This one is trained,
byte-level (vocab 256, token id = byte), with head_dim 32, so every scheme runs on it and its
predictions, attention sinks and key outlier channels come from training.

Two steps (torch only for the first):

    /work/hf-venv/bin/python tools/make_trained_decoder.py train OUT.npz   # transformers LlamaForCausalLM
    python tools/make_trained_decoder.py build OUT.npz tests/fixtures/trained_llama
    python tools/make_trained_decoder.py tokenizer tests/fixtures/trained_llama*   # tokenizer.json only

``--layers N`` (before the step; default 4) trains and builds the same model with N layers
(``--layers 8`` builds a model named ``trained_llama8``); ``--seq N --batch N
--steps N`` (``train`` only; defaults 256, 16, 1200) train on N-byte windows, N a step, N steps (a model
trained on windows of other than 256 bytes is named ``..._seqN``).

``train``: ``LlamaForCausalLM`` (4 layers, hidden 128, 4 query heads / 2 KV heads of 32, MLP 256,
RoPE theta 10000, RMSNorm eps 1e-5, untied), ``torch.manual_seed(0)``, one torch thread, AdamW
(lr 3e-3, cosine to 3e-4, weight decay 0.01, 1200 steps of 16 x 256 bytes) on the texts of
``/usr/share/common-licenses`` (Debian 12; each distinct file once) and ``/usr/share/doc/git/RelNotes``
(English prose and lists); the sample text shipped with nnef-kv (the Declaration of Independence) is
held out. ``build``: the weights into :func:`nnef_kv.models.build_decoder_text` (same labels, same
rotate-half RoPE as HF's LLaMA), written with :func:`nnef_kv.save`, with the byte-level tokenizer and
the config; the script checks nnef-kv's logits against the PyTorch ones saved by ``train`` and writes the
PyTorch reference (the 512 held-out bytes, their last-position logits) as ``reference.npz``
(``tests/e2e/test_trained_fixtures.py`` checks the archive against it). ``tokenizer DIR...``: rewrites only
``DIR/tokenizer.json``.

The tokenizer (:func:`byte_id_tokenizer`) maps byte ``b`` to id ``b``, the ids the model was trained on
(``np.frombuffer(text, np.uint8)``): a byte-level BPE without merges whose vocabulary gives the
byte-level character of byte ``b`` the id ``b``. It is not :func:`nnef_kv.text.byte_level_tokenizer`,
which lists the bytes in GPT-2's vocabulary order ('A' -> 32, ' ' -> 220: the order of the shared
fixture exports' vocabulary); the fixtures shipped with that one until issue 21, and every text fed to
them was scrambled (reference perplexity 320-884 on the sample text, worse than uniform over 256 ids).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 4, 128, 4, 2, 32, 256, 256
SEQ, BATCH, STEPS, LR = 256, 16, 1200, 3e-3


OPTIONS = ("--layers", "--seq", "--batch", "--steps")


def _opt(name: str, default: int) -> int:
    """``NAME N`` of the command line (one of :data:`OPTIONS`), else ``default``."""
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def _layers() -> int:
    """``--layers N`` of the command line (default :data:`LAYERS`)."""
    return _opt("--layers", LAYERS)


def _train_shape() -> tuple[int, int, int]:
    """``--seq``, ``--batch``, ``--steps`` of the command line (defaults :data:`SEQ`, :data:`BATCH`, :data:`STEPS`)."""
    return _opt("--seq", SEQ), _opt("--batch", BATCH), _opt("--steps", STEPS)


def corpus() -> bytes:
    seen, parts = set(), []
    files = sorted(Path("/usr/share/common-licenses").iterdir())
    files += sorted(Path("/usr/share/doc/git/RelNotes").glob("*.txt"))
    for p in files:
        if not p.is_file():
            continue
        data = p.resolve().read_bytes()
        h = hashlib.sha256(data).hexdigest()
        if h in seen:
            continue
        seen.add(h)
        parts.append(data)
    return b"\n\n".join(parts)


def train(out: str) -> None:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = torch.tensor(np.frombuffer(corpus(), np.uint8).astype(np.int64))
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=_layers(),
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    seq, batch, steps = _train_shape()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=LR / 10)
    gen = torch.Generator().manual_seed(1)
    model.train()
    for step in range(steps):
        idx = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[i:i + seq] for i in idx])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    model.eval()
    sample = Path(__file__).resolve().parents[1] / "nnef_kv" / "samples" / "texts" / "declaration_of_independence.txt"
    held = torch.tensor(np.frombuffer(sample.read_bytes()[:512], np.uint8).astype(np.int64))[None]
    with torch.no_grad():
        ref = model(input_ids=held).logits[0].numpy()
        nll = torch.nn.functional.cross_entropy(torch.tensor(ref[:-1]), held[0, 1:]).item()
    print(f"held-out (sample text, 512 bytes) nll {nll:.3f} nats/byte")
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    inv = model.model.rotary_emb.inv_freq.detach().numpy().astype(np.float32)
    np.savez(out, **weights, **{"model.rotary_emb.inv_freq": inv, "_ref_ids": held[0].numpy(),
                                "_ref_logits": ref, "_heldout_nll": np.float64(nll),
                                "_train": np.array([seq, batch, steps])})


def byte_id_tokenizer():
    """A ``tokenizers.Tokenizer`` whose id of each byte is the byte: ``encode(text).ids`` is
    ``list(text.encode("utf-8"))`` and ``decode`` gives the text back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # the byte-level pre-tokenizer turns each byte into one printable character (GPT-2's map): bytes
    # '!'..'~', 0xa1..0xac and 0xae..0xff are their own character, the other 68 chr(256 + n) in byte order
    chars = pre_tokenizers.ByteLevel.alphabet()
    own = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    char_of, n = {}, 0
    for b in range(256):
        if b in own:
            char_of[b] = chr(b)
        else:
            char_of[b] = chr(256 + n)
            n += 1
    assert set(char_of.values()) == set(chars), "the byte-level alphabet is not GPT-2's"
    tok = Tokenizer(models.BPE(vocab={char_of[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    probe = bytes(range(256)).decode("latin-1") + " We hold these truths \u00e9\u2014"
    assert tok.encode(probe).ids == list(probe.encode("utf-8")), "the tokenizer does not give id = byte"
    return tok


def write_tokenizer(out_dir: str | Path) -> Path:
    """``out_dir/tokenizer.json``: :func:`byte_id_tokenizer`."""
    p = Path(out_dir) / "tokenizer.json"
    p.write_text(byte_id_tokenizer().to_str())
    return p


def build(npz: str, out_dir: str) -> None:
    import numpy as np

    import nnef_kv
    from nnef_kv.io.archive import Model
    from nnef_kv.models import DecoderConfig, build_decoder_text

    z = np.load(npz)
    n = _layers()
    seq, batch, steps = (int(x) for x in z["_train"]) if "_train" in z.files else (SEQ, BATCH, STEPS)
    name = "trained_llama" + (f"{n}" if n != LAYERS else "") + (f"_seq{seq}" if seq != SEQ else "")
    cfg = DecoderConfig(vocab=VOCAB, hidden=HIDDEN, layers=n, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                        mlp=MLP, name=name)
    weights = {k: z[k] for k in z.files if not k.startswith("_")}
    model = Model.from_text(build_decoder_text(cfg), weights, source=None)
    ids = z["_ref_ids"]
    sess = model.session()
    from nnef_kv.models import empty_cache

    out = sess.run(dict(empty_cache(cfg), input_ids=ids[None].astype(np.int64)))
    got = np.asarray(out["outputs"]).reshape(-1, VOCAB)
    err = float(np.abs(got[-1] - z["_ref_logits"][-1]).max())
    print(f"nnef-kv vs PyTorch, last-position logits: max |diff| {err:.2e}")
    assert err < 1e-3, err
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    nnef_kv.save(model, d / "model.nnef.tgz")
    write_tokenizer(d)
    np.savez(d / "reference.npz", ids=ids.astype(np.uint8), last_logits=z["_ref_logits"][-1].astype(np.float32))
    (d / "config.json").write_text(json.dumps({**cfg.to_dict(), "heldout_nll_nats_per_byte": float(z["_heldout_nll"]),
                                               "train": {"steps": steps, "batch": batch, "seq": seq, "lr": LR}},
                                              indent=1) + "\n")
    print(f"wrote {d}")


if __name__ == "__main__":
    args = [a for i, a in enumerate(sys.argv[1:], 1) if a not in OPTIONS and sys.argv[i - 1] not in OPTIONS]
    if args[0] == "train":
        train(args[1])
    elif args[0] == "tokenizer":
        for a in args[1:]:
            print(f"wrote {write_tokenizer(a)}")
    else:
        build(args[1], args[2])
