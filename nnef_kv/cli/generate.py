"""``nnef-kv generate``: greedy decoding of an LLM archive, the prompt as text (``--chat``: in the model's chat
template) or ids, the tokens streamed out as they come; a summary line on stderr (tok/s, KV bytes)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .args import EXIT_INTERRUPTED, EXIT_OK, CliError, existing_path, int_at_least
from .measure import token_source
from .words import compiled as _compiled


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("generate", help="greedy decoding of an LLM archive (text or ids in, text or ids streamed out)",
                        description="Greedy decoding. The prompt is --prompt TEXT (tokenized with --tokenizer or the "
                                    "tokenizer.json found next to the archive; the output is streamed as text), "
                                    "--prompt-ids 1,2,3 or --ids FILE. Ctrl-C stops and prints the summary (exit 130).")
    sp.add_argument("archive")
    sp.add_argument("--prompt", help="prompt text")
    sp.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    sp.add_argument("--ids", help=".npy or text file of token ids")
    sp.add_argument("--tokenizer", help="tokenizer.json (or a folder holding one); default: found next to the archive")
    sp.add_argument("--max-new-tokens", type=int, default=16,
                    help="tokens to generate at most (default 16; generation also stops at the end-of-sequence token "
                         "of tokenizer_config.json)")
    sp.add_argument("--chat", action="store_true",
                    help="--prompt is a user message: apply the chat template of the tokenizer_config.json beside the "
                         "tokenizer (written by nnef-kv convert model.gguf)")


def cmd_generate(args: argparse.Namespace) -> int:
    from ..io.archive import load
    from ..text import decode_stream
    from ..validate.decode import InterpreterDecoder
    from ..validate.runner import max_positions, vocab_size

    n = int_at_least("--max-new-tokens", args.max_new_tokens, 1)
    src = existing_path(args.archive)
    chat = _chat_config(args, src) if getattr(args, "chat", False) else None
    if chat is not None:
        args.prompt = _chat_prompt(chat, args.prompt)
    source = token_source(args, src, default_text=False)
    if chat is None and source.tokenizer_path:
        from ..text import chat_config

        chat = chat_config(source.tokenizer_path)
    eos = _eos_id(chat, source.tokenizer)
    model = load(src)
    decoder = InterpreterDecoder(model)
    source.check_vocabulary(vocab_size(decoder.session, decoder.sig))
    top, bound = max_positions(decoder.session)
    if top is not None and len(source.ids) + n - 1 > top:
        raise CliError(f"{source.option}: {len(source.ids)} prompt tokens + --max-new-tokens {n} need "
                       f"{len(source.ids) + n - 1} positions, the model holds at most {top} ({bound})")
    for note in source.notes:
        print(f"note: {note}", file=sys.stderr)
    out = sys.stdout
    produced: list[int] = []
    text_of = decode_stream(source.tokenizer) if source.tokenizer is not None else None

    def show(tok: int) -> None:
        produced.append(tok)
        if text_of is not None:
            out.write(text_of(produced))
        else:
            out.write(("" if len(produced) == 1 else " ") + str(tok))
        out.flush()

    t0 = time.perf_counter()
    c0 = _compiled()
    stopped = None
    try:
        logits = decoder(np.asarray(source.ids, np.int64))
        for i in range(n):
            tok = int(np.argmax(logits))
            if tok == eos:
                stopped = "stopped at the end-of-sequence token"
                break
            show(tok)
            if i + 1 < n:
                logits = decoder(np.asarray([tok], np.int64))
    except KeyboardInterrupt:
        stopped = "interrupted"
    except BaseException:
        stopped = f"stopped at token {len(produced) + 1} by the error below"
        raise
    finally:
        if text_of is not None and produced:
            out.write(text_of(produced, final=True))
        out.write("\n")
        out.flush()
        compiled = _compiled() - c0  # kernels compiled on this machine's first run: not counted in tok/s
        dt = max(time.perf_counter() - t0 - compiled, 0.0)
        kv = decoder.kv_bytes().get("total", 0)
        kind = "explicit cache" if decoder.sig.explicit else "session cache"
        print(f"{len(produced)} tokens in {dt:.2f} s ({len(produced) / dt if dt else 0:.1f} tok/s)"
              + (f" + {compiled:.1f} s compiling kernels" if compiled >= 0.05 else "") + f", {kind}, "
              f"KV {kv:,} bytes at {len(source.ids) + max(len(produced) - 1, 0)} positions"
              + (f" ({stopped})" if stopped else ""), file=sys.stderr)
    return EXIT_INTERRUPTED if stopped == "interrupted" else EXIT_OK


def _chat_config(args: argparse.Namespace, src: Path) -> dict[str, Any]:
    """The ``tokenizer_config.json`` (chat template, BOS/EOS) beside the tokenizer ``generate --chat`` uses."""
    from ..text import chat_config, find_tokenizer

    if args.prompt is None:
        raise CliError("--chat: give the user's message with --prompt TEXT")
    tok = Path(args.tokenizer) if args.tokenizer else find_tokenizer(src)
    if tok is not None and tok.is_dir():
        tok = tok / "tokenizer.json"
    conf = chat_config(tok) if tok is not None else None
    if not conf or not conf.get("chat_template"):
        raise CliError(f"--chat: no chat template found (tokenizer_config.json with 'chat_template' beside "
                       f"{tok or 'the tokenizer'}; nnef-kv convert model.gguf writes it)")
    return conf


def _chat_prompt(conf: dict[str, Any], message: str) -> str:
    """``message`` as the user's turn of the model's chat template (Jinja, as transformers renders it)."""
    try:
        import jinja2
    except ImportError:  # pragma: no cover - a dependency of the package
        raise CliError("--chat needs the 'jinja2' package (pip install jinja2)") from None
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)

    def raise_exception(msg: str) -> None:
        raise CliError(f"--chat: the chat template refused the message ({msg})")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(conf["chat_template"]).render(
            messages=[{"role": "user", "content": message}], add_generation_prompt=True,
            bos_token=conf.get("bos_token") or "", eos_token=conf.get("eos_token") or "")
    except jinja2.TemplateError as exc:
        raise CliError(f"--chat: the chat template cannot be rendered ({' '.join(str(exc).split())[:160]})") from None


def _eos_id(conf: dict[str, Any] | None, tokenizer: Any) -> int | None:
    """The end-of-sequence id generation stops at: ``tokenizer_config.json``'s, else None (run to the count)."""
    if conf is None:
        return None
    if isinstance(conf.get("eos_token_id"), int):
        return conf["eos_token_id"]
    name = conf.get("eos_token")
    if isinstance(name, dict):
        name = name.get("content")
    return tokenizer.token_to_id(name) if isinstance(name, str) and tokenizer is not None else None
