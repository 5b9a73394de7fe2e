"""Peak memory of one long prefill of SmolLM2-135M (or any GGUF) in nnef-kv: one call, WikiText tokens.

    python benchmarks/long_prefill.py --tokens 4096 [--gguf PATH] [--chunk N]

Prints the prefill time, the peak RSS of the process (``ru_maxrss``: the import's weights included) and the
RSS after the import, so the prefill's own share is their difference. Run each length in its own process
(the peak is per process).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    import numpy as np
    from tokenizers import Tokenizer

    from nnef_kv.converters.frontends.gguf import gguf_import
    from nnef_kv.models.pretrained import smollm2_gguf
    from nnef_kv.text import WIKITEXT
    from nnef_kv.validate.decode import InterpreterDecoder

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--chunk", type=int, default=None, help="prefill in calls of N tokens (default: one call)")
    a = ap.parse_args()
    imp = gguf_import(a.gguf or smollm2_gguf())
    tok = Tokenizer.from_str(imp.beside["tokenizer.json"].decode())
    ids = tok.encode(WIKITEXT.read_text(encoding="utf-8")).ids[: a.tokens]
    dec = InterpreterDecoder(imp.model)
    after_load = rss_mib()
    t0 = time.perf_counter()
    logits, _ = dec.prefill(ids, chunk=a.chunk)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"prefill {len(ids)} tokens{f' in chunks of {a.chunk}' if a.chunk else ' in one call'}: {dt:.1f} s; "
          f"RSS after import {after_load:.0f} MiB, peak {peak:.0f} MiB (prefill's share {peak - after_load:.0f} MiB); "
          f"KV {dec.kv_bytes().get('total', 0):,} bytes; argmax {int(np.argmax(logits))}; load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
