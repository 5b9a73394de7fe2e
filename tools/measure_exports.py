"""Print, per torch-to-nnef export, what tests/e2e/test_exports.py asserts: the distance of nnef-kv's and tract's
decodes to the export's hf_ref.npz logits and to its t2n_tests, then for each scheme the greedy agreement
with the f32 archive over the 9 calls (and, for tract's ops, the parity with tract).

    python tools/measure_exports.py
"""
import glob
from pathlib import Path

import numpy as np

import nnef_kv
from nnef_kv.converters import convert
from nnef_kv.validate.decode import InterpreterDecoder, TractDecoder

REPO = Path(__file__).resolve().parents[1]
SCHEMES = (("kivi", 8), ("kivi", 4), ("tract", 8), ("tract-cache", 8), ("tract-cache", 4))


def decode(dec, tokens, n):
    """Logits of a prefill of ``n`` tokens, then of one-token calls."""
    dec.reset()
    out = [dec(np.asarray(tokens[:n]))]
    out += [dec(np.asarray([t])) for t in tokens[n:]]
    return np.stack(out)


def t2n_distance(model, folder: str) -> float:
    s, worst = model.session(), 0.0
    for f in sorted(glob.glob(folder + "t2n_tests/*_inputs.npz")):
        zi, zo = np.load(f), np.load(f.replace("_inputs", "_outputs"))
        out = s.run({spec.name: zi[spec.name].astype(spec.dtype) for spec in s.plan.inputs})
        s.reset()
        worst = max([worst] + [float(np.max(np.abs(np.asarray(out[k], np.float64) - zo[k]))) for k in zo.files])
    return worst


def main() -> None:
    dirs = sorted(glob.glob(str(REPO.parent / "shared/fixtures/exports/*") + "/"))
    dirs += sorted(glob.glob(str(REPO / "tests/fixtures/exports/*") + "/"))
    for d in dirs:
        name = Path(d).name
        if name == "llama_sdpa":  # refused: torch-to-nnef's reify-sdpa GQA bug (docs/converters.md)
            continue
        h = np.load(d + "hf_ref.npz")
        tok, n = [int(t) for t in h["tokens"]], int(h["n_prompt"])
        want = h["logits_no_window"] if "logits_no_window" in h.files else h["logits"]
        ref = nnef_kv.load(d + "model.nnef.tgz")
        dec = InterpreterDecoder(ref)
        ours = decode(dec, tok, n)
        theirs = decode(TractDecoder(d + "model.nnef.tgz", dec.sig), tok, n)
        line = (f"{name:24s} hf: ours {np.abs(ours - want).max():.2e} tract {np.abs(theirs - want).max():.2e} "
                f"ours-tract {np.abs(ours - theirs).max():.2e} max|l| {np.abs(want).max():.2f} "
                f"t2n {t2n_distance(ref, d):.2e} |")
        for scheme, bits in SCHEMES:
            try:
                m, _ = convert(ref, scheme=scheme, bits=bits, residual=4, key_group=4, value_group=16)
            except nnef_kv.NnefKvError:
                line += f" {scheme}{bits}: refused |"
                continue
            cd = InterpreterDecoder(m)
            lg = decode(cd, tok, n)
            line += f" {scheme}{bits}: {int(np.sum(np.argmax(lg, -1) == np.argmax(ours, -1)))}/9"
            if scheme != "kivi":
                line += f" parity {np.abs(decode(TractDecoder(m, cd.sig), tok, n) - lg).max():.1e}"
            line += " |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
