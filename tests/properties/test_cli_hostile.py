"""The command line under a hostile or careless user (issue 13): one table of cases per subcommand.

Each case runs ``nnef_kv.cli.main(argv)`` in a world of good, bad and special files (tests/cli_world.py: tiny
decoders with a 16-position bound, junk, hostile ``.npz`` files, a FIFO, symbolic links, a character device made
with ``os.mknod`` when running as root) and checks: the exit code; for a refusal, exactly one line on stderr, no
traceback, no "internal error", the words expected (naming the path, option, node or key) and at most 300
characters beyond the paths it names; and nothing changed at or near the targets (no temporary left, special
files, links and the precious folder untouched, the inputs byte-identical, the other targets unchanged).
``fuzz/cli_table.py`` prints docs/hardening.md's table from these same cases."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from cli_world import NO_CHAR_DEVICE, World, run_cli, snapshot, without_paths

MAX_MESSAGE = 300


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    rc: int
    needle: str  # in the error line (rc 2), else in stdout + stderr
    what: str = ""  # for the table: what the careless or hostile user did
    changed: frozenset[str] = frozenset()  # targets under out/ this case may change (it succeeds)
    root: bool = False  # needs the character device
    check: Callable[[World, str, str], None] | None = field(default=None, compare=False)


def C(id: str, argv: str, rc: int, needle: str, what: str = "", changed: tuple[str, ...] = (), root: bool = False,
      check: Callable[[World, str, str], None] | None = None) -> Case:
    return Case(id, tuple(argv.split()), rc, needle, what, frozenset(changed), root, check)


def _is_npz(name: str) -> Callable[[World, str, str], None]:
    def check(w: World, out: str, err: str) -> None:
        with np.load(w.out / name) as z:
            assert z.files, z.files

    return check


def _says(err: str, words: str) -> None:
    assert words in err, err


def _once(text: str, words: str) -> None:
    assert text.count(words) == 1, text


def _link_kept(link: str, target: str) -> Callable[[World, str, str], None]:
    def check(w: World, out: str, err: str) -> None:
        import nnef_kv

        assert (w.out / link).is_symlink() and os.readlink(w.out / link) == target
        nnef_kv.load(w.out / target)

    return check


INSPECT = [
    C("missing", "inspect {in}/absent.tgz", 2, "absent.tgz: no such file", "a path that does not exist"),
    C("junk", "inspect {in}/junk.tgz", 2, "junk.tgz: not an NNEF model archive: a text file", "text named .tgz"),
    C("empty", "inspect {in}/empty", 2, "empty: not an NNEF model archive: an empty file", "an empty file"),
    C("onnx", "inspect {in}/m.onnx", 2, "m.onnx: an .onnx file; inspect reads NNEF models", "an .onnx file"),
    C("dat", "inspect {in}/w.dat", 2, "w.dat: not an NNEF model archive: an NNEF tensor file (.dat)", "a .dat file"),
    C("npz", "inspect {in}/io.npz", 2, "io.npz: not an NNEF model archive: a NumPy .npz archive", "an .npz file"),
    C("fifo", "inspect {in}/fifo", 2, "fifo: is a FIFO (named pipe); nnef-kv reads regular files", "a FIFO"),
    C("chr", "inspect {in}/chr", 2, "chr: is a character device", "a character device", root=True),
    C("undefined", "inspect {in}/undef", 2, "undef/graph.nnef:4:12: undefined identifier 'zz'",
      "a graph using an undefined identifier"),
    C("add-2-3", "inspect {in}/badadd", 2, "badadd/graph.nnef:5:7: node 'y' (add): ValueError: operands could not be "
      "broadcast together with shapes (2,) (3,)", "`add` of [2] and [3]"),
    C("string-operand", "inspect {in}/strop", 2, "strop/graph.nnef:4:3: node 'y': cannot use 'hello' as a tensor",
      "a string operand"),
    C("bad-reshape", "inspect {in}/badreshape", 2, "badreshape/graph.nnef:4:7: node 'y' (reshape): reshape [2, 3] -> "
      "[4, 2]", "a reshape that cannot be"),
    C("unknown-op", "inspect {in}/unknownop", 2, "unknownop/graph.nnef:4:7: unknown operation 'frobnicate'",
      "an unknown op"),
    C("hub-cache", "inspect {in}/hub/snapshots/0123abc", 0, "check: graph built, one run on zeros",
      "a Hugging Face hub cache snapshot (files linked to ../../blobs)"),
    C("link-fifo", "inspect {in}/link_to_fifo", 2, "link_to_fifo: member 'w.dat' is a symbolic link to not a regular "
      "file", "a model folder linking a file to a FIFO"),
    C("link-dir", "inspect {in}/link_to_dir", 2, "link_to_dir: member 'w.dat' is a symbolic link to a folder",
      "a model folder linking a file to a folder"),
    C("link-dangling", "inspect {in}/link_dangling", 2, "link_dangling: member 'w.dat' is a symbolic link that does "
      "not resolve", "a model folder with a dangling link"),
    C("export-folder", "inspect {in}/export", 2, "export: no graph.nnef in the folder; it holds the archive "
      "model.nnef.tgz: pass that ({in}/export/model.nnef.tgz)", "an export folder holding model.nnef.tgz"),
    C("huge-external", "inspect {in}/hugeext", 2, "hugeext/graph.nnef:3:7: input 'x' declares float32 [100000, "
      "100000, 100000]: the check run's zeros would take 4000000000000000 bytes, over max_tensor_bytes",
      "external(shape = [100000, 100000, 100000])"),
    C("no-check", "inspect {in}/badadd --no-check", 0, "operations: 3 invocations", "--no-check: text summary only"),
    C("ok", "inspect {in}/f32.nnef.tar", 0, "check: graph built, one run on zeros of the declared inputs (S=1, P=1): "
      "ok", "a good archive"),
    C("max-members", "--max-members 3 inspect {in}/f32.nnef.tar", 2, "max_members=3", "--max-members 3"),
]

CONVERT = [
    C("zip", "convert {in}/f32.nnef.tar -o {out}/ok.zip", 2, "ok.zip: cannot write a model as '.zip': name a .tar, "
      ".tgz or .tar.gz file, or a folder", "-o ok.zip"),
    C("nnef", "convert {in}/f32.nnef.tar -o {out}/ok.nnef", 2, "ok.nnef: cannot write a model as '.nnef'",
      "-o ok.nnef"),
    C("onnx-out", "convert {in}/f32.nnef.tar -o {out}/x.onnx", 2, "x.onnx: cannot write a model as '.onnx'",
      "-o x.onnx"),
    C("non-model-folder", "convert {in}/f32.nnef.tar -o {out}/precious", 2, "precious: a folder that is not a model "
      "(no graph.nnef) and not empty: refusing to replace it", "-o an existing folder of other files"),
    C("file-as-folder", "convert {in}/f32.nnef.tar -o {out}/existing.tgz/m", 2, "existing.tgz is a file, not a folder",
      "-o below a regular file"),
    C("fifo-out", "convert {in}/f32.nnef.tar -o {out}/fifo", 2, "fifo: is a FIFO (named pipe); a model folder must be",
      "-o a FIFO"),
    C("link-to-fifo", "convert {in}/f32.nnef.tar -o {out}/link_fifo.tgz", 2, "link_fifo.tgz: is a FIFO (named pipe) "
      "(the symbolic link points to", "-o a symbolic link to a FIFO"),
    C("chr-out", "convert {in}/f32.nnef.tar -o {out}/chr", 2, "chr: is a character device", "-o a character device",
      root=True),
    C("loop", "convert {in}/f32.nnef.tar -o {out}/loop.npz", 2, "loop.npz: a symbolic link that does not resolve",
      "-o a symbolic link loop"),
    C("own-input", "convert {in}/f32.nnef.tar -o {in}/f32.nnef.tar", 2, "the output would overwrite the input",
      "-o the input itself"),
    C("input-via-link", "convert {in}/link_f32.tar -o {in}/f32.nnef.tar", 2, "would overwrite the input",
      "-o the input, read through a link"),
    C("model-folder", "convert {in}/f32.nnef.tar -o {out}/model", 0, "converted 1 attention block(s) of",
      "-o an existing model folder",
      changed=("model", "model/graph.nnef")),
    C("through-link", "convert {in}/f32.nnef.tar -o {out}/link_file.tgz", 0, "converted 1 attention block(s) of",
      "-o a link to a regular file",
      changed=("existing.tgz",), check=_link_kept("link_file.tgz", "existing.tgz")),
    C("tract-bits-4", "convert {in}/f32.nnef.tar -o {out}/t.tgz --scheme tract --bits 4", 2,
      "option bits=4: scheme tract stores 8-bit codes", "--scheme tract --bits 4"),
    C("tract-key-group", "convert {in}/f32.nnef.tar -o {out}/t.tgz --scheme tract --key-group 16", 2,
      "option key_group=16: scheme tract does not take it", "--scheme tract --key-group 16"),
    C("tract-cache-residual", "convert {in}/f32.nnef.tar -o {out}/t.tgz --scheme tract-cache --residual 8", 2,
      "option residual=8: scheme tract-cache does not take it", "--scheme tract-cache --residual 8"),
    C("huge-sinks", "convert {in}/f32.nnef.tar -o {out}/t.tgz --sinks 100000000000000000000", 2,
      "option sinks=100000000000000000000: too large: the op holds it as a 64-bit integer", "--sinks 10^20"),
    C("huge-key-group", "convert {in}/f32.nnef.tar -o {out}/t.tgz --key-group 99999999999999999999999", 2,
      "option key_group=99999999999999999999999: too large", "--key-group 10^23"),
    C("one-bit", "convert {in}/f32.nnef.tar -o {out}/t.tgz --bits 1", 0, "with scheme kivi, 1 bit ->",
      "--bits 1: said as 1 bit", changed=("t.tgz",)),
    C("never-quantized", "convert {in}/f32.nnef.tar -o {out}/t.tgz --residual 100", 0,
      "note: never quantized: the op quantizes once it holds 132 tokens", "--residual past the model's positions",
      changed=("t.tgz",)),
    C("ggml-head-dim", "convert {in}/f32.nnef.tar -o {out}/t.tgz --scheme ggml", 2, "scheme ggml: the converted "
      "graph cannot run (node 'layer0_attn_output' (nnef_kv_ggml_sdpa): head_dim D = 8 is not a "
      "multiple of 32", "--scheme ggml on a model whose head_dim is 8"),
    C("hf-group-7", "convert {in}/f32.nnef.tar -o {out}/t.tgz --scheme hf --group-size 7", 2, "scheme hf: the "
      "converted graph cannot run (node 'layer0_attn_output' (nnef_kv_hf_quantized_sdpa): quanto cannot group a "
      "[1, 1, 1, 8] tensor along axis 0: group_size 7 must divide 8", "--scheme hf --group-size 7"),
    C("bits-text", "convert {in}/f32.nnef.tar -o {out}/t.tgz --bits four", 2, "--bits: invalid int value: 'four'",
      "--bits four"),
    C("dat-in", "convert {in}/w.dat -o {out}/t.tgz", 2, "w.dat: an NNEF tensor file (.dat)", "a .dat as input"),
    C("fifo-in", "convert {in}/fifo -o {out}/t.tgz", 2, "fifo: is a FIFO", "a FIFO as input"),
]

RUN = [
    C("empty", "run {in}/f32.nnef.tar --inputs {in}/empty.npz", 2, "--inputs {in}/empty.npz: an empty file, not an "
      ".npz archive", "--inputs an empty file"),
    C("truncated", "run {in}/f32.nnef.tar --inputs {in}/trunc.npz", 2, "trunc.npz: a truncated or damaged .npz",
      "--inputs a truncated .npz"),
    C("text", "run {in}/f32.nnef.tar --inputs {in}/text.npz", 2, "text.npz: not an .npz archive (no zip signature",
      "--inputs a text file"),
    C("npy", "run {in}/f32.nnef.tar --inputs {in}/arr.npy", 2, "arr.npy: a .npy array, not an .npz archive",
      "--inputs a .npy"),
    C("pickled", "run {in}/f32.nnef.tar --inputs {in}/obj.npz", 2, "obj.npz: key 'x' holds Python objects (pickled "
      "data: nnef-kv never unpickles a file)", "--inputs holding pickled objects"),
    C("strings", "run {in}/f32.nnef.tar --inputs {in}/strexp.npz", 2, "strexp.npz: key 'outputs' holds strings",
      "an expected-value key holding strings"),
    C("huge-header", "run {in}/f32.nnef.tar --inputs {in}/huge.npz", 2, "huge.npz: key 'input_ids' declares float32 "
      "[1125899906842624, 1], 4503599627370496 bytes, over max_tensor_bytes", "a header-only npz claiming 4 PiB"),
    C("bomb", "--max-tensor-bytes 1000000 run {in}/f32.nnef.tar --inputs {in}/bomb.npz", 2,
      "bomb.npz: key 'input_ids' declares int64 [4194304], 33554432 bytes, over max_tensor_bytes=1000000",
      "a 33 kB npz inflating to 32 MiB, --max-tensor-bytes 1000000"),
    C("fifo-in", "run {in}/f32.nnef.tar --inputs {in}/fifo", 2, "--inputs {in}/fifo: is a FIFO", "--inputs a FIFO"),
    C("chr-in", "run {in}/f32.nnef.tar --inputs {in}/chr", 2, "--inputs {in}/chr: is a character device",
      "--inputs a character device (as /dev/null is)", root=True),
    C("unknown-key", "run {in}/f32.nnef.tar --inputs {in}/badkey.npz", 2, "key 'bogus' names no graph input or output",
      "an npz key naming nothing"),
    C("bad-step", "run {in}/f32.nnef.tar --inputs {in}/badstep.npz", 2, "key 'input_ids@x': the step after '@'",
      "an npz key NAME@x"),
    C("missing-input", "run {in}/f32.nnef.tar --inputs {in}/x.npz", 2, "key 'x' names no graph input",
      "inputs of another graph"),
    C("fifo-out", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/fifo", 2, "fifo: is a "
      "FIFO (named pipe); nnef-kv writes the output only to a regular file", "-o a FIFO"),
    C("link-fifo-out", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/link_fifo.npz", 2,
      "link_fifo.npz: is a FIFO (named pipe) (the symbolic link points to", "-o a link to a FIFO"),
    C("chr-out", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/chr", 2, "chr: is a character device",
      "-o a character device (as /dev/full is)", root=True),
    C("folder-out", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/precious", 2, "precious: is a folder; the "
      "output is a file", "-o an existing folder"),
    C("suffix", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/o.txt", 2, "-o {out}/o.txt: the output is written "
      "as .npz", "-o o.txt"),
    C("parent-file", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/file_parent/o.npz", 2,
      "file_parent is a file, not a folder", "-o below a regular file"),
    C("own-input", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {in}/io.npz", 2, "would overwrite the input",
      "-o the --inputs file"),
    C("through-link", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/link_file.npz", 0, "wrote 3 arrays",
      "-o a link to a regular file: written through", changed=("existing.npz",), check=_is_npz("existing.npz")),
    C("dangling-link", "run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/dangling.npz", 0, "wrote 3 arrays",
      "-o a dangling link: its target is created", changed=("nowhere.npz",), check=_is_npz("nowhere.npz")),
    C("steps-0", "run {in}/f32.nnef.tar --inputs {in}/io.npz --steps 0", 2, "--steps 0: must be an integer >= 1",
      "--steps 0"),
    C("steps-huge", "run {in}/f32.nnef.tar --inputs {in}/io.npz --steps 99999999999999999999", 2,
      "--steps 99999999999999999999: too large", "--steps 10^20"),
    C("past-bound", "run {in}/dyn.nnef.tar --inputs {in}/ids1.npz --steps 40", 2, "--steps 40: step 15 needs 16 "
      "positions (15 cached + 1 new), the model holds at most 15 (tract_assert S+P < 16); at most 15 steps fit",
      "--steps past the model's positions"),
    C("steps-streamed", "run {in}/dyn.nnef.tar --inputs {in}/ids1.npz --steps 3 -o {out}/s.npz", 0,
      "step 2 outputs: float32 [1, 1, 256]", "three steps, -o streamed", changed=("s.npz",), check=_is_npz("s.npz")),
    C("assert-mismatch", "run {in}/f32.nnef.tar --inputs {in}/expect_bad.npz --assert", 1, "--assert 0.0001: 1 "
      "output(s) differ from --inputs {in}/expect_bad.npz: 'outputs' at step 0 (max|diff| 100)",
      "--assert with expected outputs off by 100"),
    C("assert-tol", "run {in}/f32.nnef.tar --inputs {in}/expect_bad.npz --assert 101", 0, "max|diff| vs npz 100",
      "--assert 101: a difference of 100 within it"),
    C("assert-ok", "run {in}/f32.nnef.tar --inputs {in}/expect_ok.npz --assert", 0, "max|diff| vs npz 0",
      "--assert with the outputs as computed"),
    C("assert-nothing", "run {in}/f32.nnef.tar --inputs {in}/io.npz --assert", 2, "--assert: --inputs {in}/io.npz "
      "holds no expected output", "--assert on an npz of inputs only"),
    C("assert-nan", "run {in}/f32.nnef.tar --inputs {in}/expect_ok.npz --assert nan", 2, "--assert nan: the "
      "tolerance must be a finite number >= 0", "--assert nan"),
    C("inf-counted", "run {in}/plain.nnef.tar --inputs {in}/x.npz", 0, "step 0 y: float32 [1, 4] min 0 max 1 "
      "mean 0.333333 NaN 0 Inf 1", "inputs holding inf and NaN: both counted"),
]

GENERATE = [
    C("huge-id", "generate {in}/f32.nnef.tar --prompt-ids 99999999999999999999999", 2,
      "--prompt-ids: token id 99999999999999999999999 is too large", "--prompt-ids 10^23"),
    C("outside-vocab", "generate {in}/f32.nnef.tar --prompt-ids 1,300", 2, "--prompt-ids: token id 300 at position 1 "
      "is outside the model's vocabulary of 256 ids", "an id outside the vocabulary"),
    C("t2n-vocab", "generate {in}/t2n.nnef.tgz --prompt-ids 1,300", 2, "--prompt-ids: token id 300 at position 1 is "
      "outside the model's vocabulary of 256 ids", "an id outside the vocabulary of a torch-to-nnef export"),
    C("ids-file-vocab", "generate {in}/f32.nnef.tar --ids {in}/bigid.txt", 2, "--ids {in}/bigid.txt: token id 300 at "
      "position 2 is outside the model's vocabulary", "--ids FILE with an id outside the vocabulary"),
    C("past-bound", "generate {in}/f32.nnef.tar --prompt-ids 1,2 --max-new-tokens 30", 2, "--prompt-ids: 2 prompt "
      "tokens + --max-new-tokens 30 need 31 positions, the model holds at most 15 (tract_assert S+P < 16)",
      "prompt + new tokens past the model's positions"),
    C("unicode-digit", "generate {in}/f32.nnef.tar --prompt-ids ١٢", 2, "--prompt-ids: '١٢' is not an integer token id",
      "--prompt-ids in Arabic-Indic digits"),
    C("new-0", "generate {in}/f32.nnef.tar --prompt-ids 1 --max-new-tokens 0", 2, "--max-new-tokens 0: must be an "
      "integer >= 1", "--max-new-tokens 0"),
    C("ids-fifo", "generate {in}/f32.nnef.tar --ids {in}/fifo", 2, "--ids {in}/fifo: is a FIFO", "--ids a FIFO"),
    C("tokenizer-fifo", "generate {in}/f32.nnef.tar --prompt hi --tokenizer {in}/fifo", 2,
      "--tokenizer {in}/fifo: is a FIFO", "--tokenizer a FIFO"),
    C("not-decoder", "generate {in}/plain.nnef.tar --prompt-ids 1", 2, "no integer input to take token ids",
      "a graph that is not a decoder"),
    C("ok", "generate {in}/f32.nnef.tar --prompt-ids 1,2 --max-new-tokens 3", 0, "3 tokens in", "a good prompt"),
]

VALIDATE = [
    C("report-dir-file", "validate {in}/f32.nnef.tar --report-dir {out}/existing.npz", 2,
      "existing.npz: is a file; --report-dir must be a folder", "--report-dir a regular file"),
    C("report-dir-fifo", "validate {in}/f32.nnef.tar --report-dir {out}/fifo", 2, "fifo: is a FIFO (named pipe); "
      "--report-dir must be a folder", "--report-dir a FIFO"),
    C("report-below-file", "validate {in}/f32.nnef.tar --report-dir {out}/file_parent/r", 2,
      "file_parent is a file, not a folder", "--report-dir below a regular file"),
    C("report-json-fifo", "validate {in}/f32.nnef.tar --report-dir {out}/rdir", 2, "rdir/report.json: is a FIFO",
      "--report-dir whose report.json is a FIFO"),
    C("max-kl-nan", "validate {in}/f32.nnef.tar --max-kl nan", 2, "--max-kl nan: not a number", "--max-kl nan"),
    C("context-0", "validate {in}/f32.nnef.tar --context 0", 2, "--context", "--context 0"),
    C("context-huge", "validate {in}/f32.nnef.tar --context 99999999999999999999999", 2, "--context "
      "99999999999999999999999: too large", "--context 10^23"),
    C("context-past-bound", "validate {in}/f32.nnef.tar --ids {in}/ids.txt --context 5000", 2,
      "it holds at most 15 (tract_assert S+P < 16)", "--context past the model's positions"),
    C("text-fifo", "validate {in}/f32.nnef.tar --text {in}/fifo", 2, "--text {in}/fifo: is a FIFO", "--text a FIFO"),
    C("eval-0", "validate {in}/f32.nnef.tar --eval-tokens 0", 2, "--eval-tokens 0: must be an integer >= 1",
      "--eval-tokens 0"),
    C("undefined", "validate {in}/undef --ids {in}/ids.txt", 2, "undef/graph.nnef:4:12: undefined identifier 'zz'",
      "a graph using an undefined identifier"),
    C("tokenizer-316", "validate {in}/t2n.nnef.tgz --tokenizer {in}/tok316.json --prompt hi<x5>there --no-parity", 2,
      "--prompt: token id 261 at position 2 is outside the model's vocabulary of 256 ids", "a 316-id tokenizer for a "
      "256-row embedding (torch-to-nnef export)", check=lambda w, out, err: _says(err, "tok316.json has 316 ids")),
    C("sdpa-export", "validate {in}/sdpa_gqa.nnef.tgz --ids {in}/ids.txt --no-parity", 2, "torch-to-nnef "
      "--reify-sdpa-operator with grouped-query attention bakes the traced S = 1 into this reshape",
      "a torch-to-nnef --reify-sdpa-operator GQA export (S = 1 baked in)"),
    C("junk-reference", "validate {in}/f32.nnef.tar --reference {in}/junk.tgz --ids {in}/ids.txt", 2,
      "junk.tgz: not an NNEF model archive: a text file", "--reference junk"),
]

DEMO = [
    C("report-dir-file", "demo --report-dir {out}/existing.npz", 2, "existing.npz: is a file; --report-dir must be",
      "--report-dir a regular file"),
    C("save-dir-fifo", "demo --save-dir {out}/fifo", 2, "fifo: is a FIFO (named pipe); --save-dir must be a folder",
      "--save-dir a FIFO"),
    C("bits-9", "demo --bits 4,9", 2, "--bits 9: scheme kivi takes 1..8 bits", "--bits 9"),
    C("vocab-small", "demo --vocab 128", 2, "--vocab 128: must be an integer >= 256", "--vocab 128"),
    C("vocab-huge", "demo --vocab 99999999999", 2, "--vocab 99999999999 x --hidden 64: one weight of the demo decoder "
      "would take 25599999999744 bytes, over max_tensor_bytes", "--vocab 10^11"),
    C("layers-huge", "demo --layers 1000000", 2, "--layers 1000000: the demo decoder's weights would take about",
      "--layers 10^6"),
    C("hidden-huge", "demo --hidden 99999999999999999999999", 2, "--hidden 99999999999999999999999: too large",
      "--hidden 10^23"),
    C("key-group-huge", "demo --key-group 99999999999999999999999", 2, "--key-group 99999999999999999999999: too "
      "large", "--key-group 10^23"),
    C("context-0", "demo --context 0", 2, "--context 0", "--context 0"),
    C("residual-huge", "demo --residual 100000 --bits 4 --context 16 --eval-tokens 2 --no-tract --layers 1 --hidden 16 "
      "--mlp 16", 0, "* nothing was quantized: context 16 fits in the full-precision window (residual 100000",
      "--residual 100000: rows with nothing quantized", check=lambda w, out, err: _says(out, "kivi *")),
    C("bits-twice", "demo --bits 4,4 --context 16 --eval-tokens 2 --no-tract --layers 1 --hidden 16 --mlp 16", 0,
      "kivi", "--bits 4,4", check=lambda w, out, err: _once(out, "\nkivi")),
]

COMPARE = [
    C("report-dir-fifo", "compare {in}/f32.nnef.tar --report-dir {out}/fifo", 2, "fifo: is a FIFO (named pipe); "
      "--report-dir must be a folder", "--report-dir a FIFO"),
    C("report-json-fifo", "compare {in}/f32.nnef.tar --report-dir {out}/rdir", 2, "rdir/report.json: is a FIFO",
      "--report-dir whose report.json is a FIFO"),
    C("archive-fifo", "compare {in}/fifo", 2, "fifo: is a FIFO (named pipe); nnef-kv reads regular files",
      "the archive a FIFO"),
    C("context-huge", "compare {in}/f32.nnef.tar --context 99999999999999999999999", 2,
      "--context 99999999999999999999999: too large", "--context 10^23"),
    C("context-text", "compare {in}/f32.nnef.tar --context ١", 2, "--context '١': a number of tokens is expected",
      "--context in Arabic-Indic digits"),
    C("jobs-0", "compare {in}/f32.nnef.tar --jobs 0", 2, "--jobs 0: must be an integer >= 1", "--jobs 0"),
    C("unknown-scheme", "compare {in}/f32.nnef.tar --schemes nope", 2, "--schemes 'nope': unknown scheme 'nope'",
      "--schemes nope"),
    C("short-text", "compare {in}/f32.nnef.tar --schemes kivi:8 --context 8 --eval-tokens 2 --no-tract --jobs 1 --ids "
      "{in}/ids.txt", 2, "--context 8: with --eval-tokens 2", "a context the 3-token text cannot hold"),
    C("auto-bits-no-budget", "convert {in}/f32.nnef.tar -o {out}/t.tgz --auto-bits", 2, "--auto-bits: give the "
      "budget, --max-kl X", "convert --auto-bits without --max-kl"),
    C("auto-bits-nan", "convert {in}/f32.nnef.tar -o {out}/t.tgz --auto-bits --max-kl nan", 2, "--max-kl nan: not a "
      "number", "convert --auto-bits --max-kl nan"),
    C("auto-bits-zip", "convert {in}/f32.nnef.tar -o {out}/ok.zip --auto-bits --max-kl 0.1", 2,
      "ok.zip: cannot write a model as '.zip'", "convert --auto-bits -o ok.zip"),
    C("auto-bits-report-fifo", "convert {in}/f32.nnef.tar -o {out}/t.tgz --auto-bits --max-kl 0.1 --report-dir "
      "{out}/rdir", 2, "rdir/report.json: is a FIFO", "convert --auto-bits --report-dir whose report.json is a FIFO"),
    C("budget-alone", "convert {in}/f32.nnef.tar -o {out}/t.tgz --max-kl 0.1", 2, "--max-kl: only with --auto-bits",
      "convert --max-kl without --auto-bits"),
]

GLOBAL = [
    C("version", "--version", 0, "nnef-kv 0.1.0", "--version"),
    C("limit-0", "--max-tensor-bytes 0 inspect {in}/f32.nnef.tar", 2, "--max-tensor-bytes 0: must be an integer >= 1",
      "--max-tensor-bytes 0"),
    C("no-command", "", 2, "the following arguments are required: COMMAND", "no command"),
    C("huge-int-text", "demo --seed " + "9" * 5000, 2, "--seed: invalid int value", "a 5000-digit --seed"),
]

TABLES = {"inspect": INSPECT, "convert": CONVERT, "run": RUN, "generate": GENERATE, "validate": VALIDATE,
          "demo": DEMO, "compare": COMPARE, "global": GLOBAL}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World.make(tmp_path_factory.mktemp("hostile-cli"))


def check_case(world: World, case: Case, rc: int, out: str, err: str, before: dict[str, str]) -> None:
    subs = world.subs()
    needle = case.needle.format(**subs)
    assert rc == case.rc, (rc, out[-500:], err[-500:])
    assert "Traceback" not in err and "internal error" not in err, err
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, lines
        assert needle in lines[0], lines[0]
        assert len(without_paths(lines[0], world)) <= MAX_MESSAGE, lines[0]
    else:
        assert needle in out + err, (out[-800:], err[-800:])
    assert world.damage() == []
    after = snapshot(world.out)
    moved = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    allowed = set(case.changed) | {k for k in moved if any(k.startswith(c + "/") for c in case.changed)}
    assert moved <= allowed, sorted(moved - allowed)
    if case.check is not None:
        case.check(world, out, err)


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{t}-{c.id}") for t, cases in TABLES.items() for c in cases])
def test_cli_case(world: World, case: Case) -> None:
    if case.root and not world.has_char:
        pytest.skip(NO_CHAR_DEVICE)
    world.reset_out()
    before = snapshot(world.out)
    subs = world.subs()
    rc, out, err = run_cli([a.format(**subs) for a in case.argv])
    check_case(world, case, rc, out, err, before)


def test_every_subcommand_has_a_table() -> None:
    from nnef_kv.cli import COMMANDS

    assert set(COMMANDS) <= set(TABLES)


# ------------------------------------------------------------------------------------------------ item 5
@pytest.mark.parametrize("argv,target", [
    ("run {in}/f32.nnef.tar --inputs {in}/io.npz -o {out}/precious", "precious"),
    ("convert {in}/f32.nnef.tar -o {out}/precious", "precious"),
    ("convert {in}/f32.nnef.tar -o {out}/ok.zip", "ok.zip"),
    ("validate {in}/f32.nnef.tar --report-dir {out}/rdir", "rdir/report.json"),
    ("demo --report-dir {out}/existing.npz", "existing.npz"),
])
def test_targets_are_checked_before_any_work(world, monkeypatch, argv, target) -> None:
    """A refused target is refused before any model is read or built (so a long decode never starts)."""
    import nnef_kv.converters.frontends as fe
    import nnef_kv.io.archive as archive
    import nnef_kv.validate.demo as demo

    def no_work(*a, **k):
        raise AssertionError("work started before the target was checked")

    for mod, name in ((archive, "load"), (fe, "load"), (demo, "run_demo")):
        monkeypatch.setattr(mod, name, no_work)
    world.reset_out()
    rc, out, err = run_cli([a.format(**world.subs()) for a in argv.split()])
    assert rc == 2 and "work started" not in err and target in err and ".tmp" not in err, err
    assert world.damage() == []


def _as_nobody():
    """A context running the process as uid/gid 65534 (effective ids only, restored after): root can write in a
    read-only folder, nobody cannot. Not root: a no-op (the folder's mode then suffices)."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        if os.geteuid() != 0:
            yield
            return
        os.setegid(65534)
        os.seteuid(65534)
        try:
            yield
        finally:
            os.seteuid(0)
            os.setegid(0)

    return cm()


@pytest.mark.parametrize("argv", [
    "run {ro}/m.tar --inputs {ro}/io.npz -o {ro}/out.npz",
    "convert {ro}/m.tar -o {ro}/out.tgz",
    "validate {ro}/m.tar --ids {ro}/ids.txt --report-dir {ro}/report",
])
def test_read_only_folder_refused_before_work_naming_the_path(world, tmp_path_factory, monkeypatch, argv) -> None:
    import shutil
    import tempfile

    import nnef_kv.converters.frontends as fe
    import nnef_kv.io.archive as archive

    ro = Path(tempfile.mkdtemp(prefix="nnef-kv-ro-"))  # outside pytest's 0700 folder, so nobody can reach it
    try:
        shutil.copy(world.ins / "f32.nnef.tar", ro / "m.tar")
        shutil.copy(world.ins / "io.npz", ro / "io.npz")
        shutil.copy(world.ins / "ids.txt", ro / "ids.txt")
        os.chmod(ro, 0o555)
        run_cli(["inspect", "--no-check", str(ro / "m.tar")])  # every module imported before dropping privileges
        calls = []
        monkeypatch.setattr(archive, "load", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(
            AssertionError("work started")))
        monkeypatch.setattr(fe, "load", archive.load)
        with _as_nobody():
            rc, out, err = run_cli([a.format(ro=ro) for a in argv.split()])
        assert rc == 2 and not calls, err
        line = err.strip()
        assert "cannot write in" in line and "Permission denied" in line and ".tmp" not in line, line
        assert sorted(os.listdir(ro)) == ["ids.txt", "io.npz", "m.tar"]
    finally:
        os.chmod(ro, 0o755)
        shutil.rmtree(ro)


# ------------------------------------------------------------------------------------------------ item 4
def test_every_writer_honours_the_umask(world, tmp_path) -> None:
    import stat

    import nnef_kv
    from nnef_kv.validate import ValidateOptions, ValidationReport, write_report

    old = os.umask(0o027)
    try:
        assert run_cli(["run", str(world.ins / "f32.nnef.tar"), "--inputs", str(world.ins / "io.npz"), "-o",
                        str(tmp_path / "run.npz")])[0] == 0
        assert run_cli(["convert", str(world.ins / "f32.nnef.tar"), "-o", str(tmp_path / "c.tgz")])[0] == 0
        assert run_cli(["convert", str(world.ins / "f32.nnef.tar"), "-o", str(tmp_path / "cdir")])[0] == 0
        m = nnef_kv.load(world.ins / "dyn.nnef.tar")
        s = m.session()
        s.run({"input_ids": np.array([[1, 2]], np.int64)})
        s.save_state(tmp_path / "state.tar")
        nnef_kv.write_tensor(tmp_path / "w.dat", np.zeros(3, np.float32))
        write_report(ValidationReport(archive="a", reference=None, options=ValidateOptions(eval_tokens=4)),
                     tmp_path / "rep")
    finally:
        os.umask(old)
    files = ["run.npz", "c.tgz", "cdir/graph.nnef", "state.tar", "w.dat", "rep/report.json", "rep/report.md",
             "rep/report.png"]
    modes = {f: stat.S_IMODE((tmp_path / f).stat().st_mode) for f in files}
    assert modes == dict.fromkeys(files, 0o640), modes  # 0666 less the umask, as convert always did
    assert stat.S_IMODE((tmp_path / "cdir").stat().st_mode) == 0o750


# ------------------------------------------------------------------------------------------------ item 6
def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_temporaries_of_a_killed_writer_are_swept_by_the_next_write(world, tmp_path) -> None:
    """A writer SIGKILLed mid-write leaves .NAME.nnef-kv-HOST-PID-X.tmp; the next write of NAME removes it (its
    pid is dead), and leaves alone a temporary whose writer is alive."""
    import signal
    import subprocess
    import sys

    from nnef_kv.targets import HOST, temp_prefix

    target = tmp_path / "out.npz"
    code = ("import sys, time\nfrom nnef_kv.atomic import atomic_write\n"
            "with atomic_write(sys.argv[1]) as f:\n    f.write(b'x' * 100000); f.flush(); print('ready', flush=True)\n"
            "    time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline().strip() == b"ready"
        left = [n for n in os.listdir(tmp_path) if n.startswith(f".out.npz.nnef-kv-{HOST}-{p.pid}-")]
        assert len(left) == 1, os.listdir(tmp_path)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    assert (tmp_path / left[0]).stat().st_size == 100000  # what a killed writer leaves: up to the whole output
    alive = tmp_path / (temp_prefix("out.npz").replace(f"-{os.getpid()}-", f"-{os.getppid()}-") + "live.tmp")
    alive.write_bytes(b"a live writer's")
    rc, out, err = run_cli(["run", str(world.ins / "f32.nnef.tar"), "--inputs", str(world.ins / "io.npz"), "-o",
                            str(target)])
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted(["out.npz", alive.name])  # the dead one swept, the live one kept
    # a dead writer's folder temporary (a model folder being written) goes too, through convert
    dead = tmp_path / f".m.nnef-kv-{HOST}-{_dead_pid()}-abcd1234.tmp"
    dead.mkdir()
    (dead / "w.dat").write_bytes(b"partial")
    assert run_cli(["convert", str(world.ins / "f32.nnef.tar"), "-o", str(tmp_path / "m")])[0] == 0
    assert not dead.exists() and (tmp_path / "m" / "graph.nnef").is_file()


# ------------------------------------------------------------------------------------------------ items 13, 14
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a half-written zip left to finalise
def test_run_streams_each_step_and_ctrl_c_writes_nothing(world, tmp_path, monkeypatch, capsys) -> None:
    from nnef_kv.cli import main
    from nnef_kv.interpreter.session import Session

    real = Session.run
    calls = {"n": 0}

    def run(self, inputs, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            out = capsys.readouterr().out  # the two finished steps are already printed
            assert out.count("step 0 ") == 1 and out.count("step 1 ") == 1 and "step 2" not in out, out
            raise KeyboardInterrupt
        return real(self, inputs, *a, **k)

    monkeypatch.setattr(Session, "run", run)
    target = tmp_path / "o.npz"
    assert main(["run", str(world.ins / "dyn.nnef.tar"), "--inputs", str(world.ins / "ids1.npz"), "--steps", "10",
                 "-o", str(target)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"nnef-kv run: interrupted at step 2 of 10 (2 done); nothing written to {target}"
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a half-written zip left to finalise
def test_run_step_error_names_the_step_after_the_lines_of_the_others(world, tmp_path, monkeypatch, capsys) -> None:
    import nnef_kv
    from nnef_kv.cli import main
    from nnef_kv.interpreter.session import Session

    real = Session.run

    def run(self, inputs, *a, **k):
        if self.states and self.states[0].symbol_bindings().get("P") == 2:
            raise nnef_kv.GraphError("graph.nnef:9:9: node 'n' (op): injected")
        return real(self, inputs, *a, **k)

    monkeypatch.setattr(Session, "run", run)
    assert main(["run", str(world.ins / "dyn.nnef.tar"), "--inputs", str(world.ins / "ids1.npz"), "--steps", "5",
                 "-o", str(tmp_path / "o.npz")]) == 2
    cap = capsys.readouterr()
    assert cap.out.count("outputs:") == 2 and cap.out.endswith("\n")
    assert cap.err.strip() == "nnef-kv run: error: step 2: graph.nnef:9:9: node 'n' (op): injected"
    assert os.listdir(tmp_path) == []


def test_run_keeps_no_step_outputs_in_memory(tmp_path) -> None:
    """100 steps of a 256 kB output: without -o only the current step is held, with -o they go to the file."""
    import tracemalloc

    import nnef_kv

    text = "version 1.0;\ngraph g(x) -> (y) {\n  x = external<scalar>(shape = [256, 256]);\n  y = relu(x);\n}\n"
    nnef_kv.save(nnef_kv.Model.from_text(text), tmp_path / "m.tar")
    np.savez(tmp_path / "x.npz", x=np.ones((256, 256), np.float32))
    for extra in ([], ["-o", str(tmp_path / "o.npz")]):
        tracemalloc.start()
        rc, out, err = run_cli(["run", str(tmp_path / "m.tar"), "--inputs", str(tmp_path / "x.npz"), "--steps", "100",
                                *extra])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert rc == 0 and out.count("\n") == 100 + bool(extra), err
        assert peak < 8 << 20, peak  # holding the 100 outputs would be 25 MiB
    with np.load(tmp_path / "o.npz") as z:
        assert len(z.files) == 100 and z["y@99"].shape == (256, 256)


def test_generate_stopped_by_an_error_ends_the_line_and_summarises(world, monkeypatch, capsys) -> None:
    import nnef_kv
    from nnef_kv.cli import main
    from nnef_kv.validate.decode import InterpreterDecoder

    real = InterpreterDecoder.__call__
    calls = {"n": 0}

    def fail_on_fourth(self, ids):
        calls["n"] += 1
        if calls["n"] == 4:
            raise nnef_kv.GraphError("graph.nnef:1:1: node 'g' (tract_core_gather): injected")
        return real(self, ids)

    monkeypatch.setattr(InterpreterDecoder, "__call__", fail_on_fourth)
    assert main(["generate", str(world.ins / "f32.nnef.tar"), "--prompt-ids", "1,2", "--max-new-tokens", "8"]) == 2
    cap = capsys.readouterr()
    assert cap.out.endswith("\n") and len(cap.out.split()) == 3  # the prefill's token and two more
    err = cap.err.strip().splitlines()
    assert err[0].startswith("3 tokens in ") and err[0].endswith("(stopped at token 4 by the error below)")
    assert err[1] == "nnef-kv generate: error: graph.nnef:1:1: node 'g' (tract_core_gather): injected"


def test_closed_stdout_stops_quietly(world, monkeypatch) -> None:
    import io
    import sys

    from nnef_kv.cli import EXIT_PIPE_CLOSED, main

    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", Closed())
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["inspect", str(world.ins / "f32.nnef.tar")]) == EXIT_PIPE_CLOSED == 141
    assert err.getvalue() == ""


# ------------------------------------------------------------------------------------------------ item 16
def test_every_option_has_help_and_shows_its_default() -> None:
    import argparse

    from nnef_kv.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        for action in sp._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            if action.default not in (None, False) and action.default is not argparse.SUPPRESS:
                text = sp.format_help()
                assert str(action.default) in text, f"{name} {action.option_strings[0]}: default not shown"
    conv = " ".join(sub.choices["convert"].format_help().split())
    for flag, default in (("--bits", "4 (kivi), 8 (tract), 4 (tract-cache)"), ("--key-group", "32 (kivi)"),
                          ("--value-group", "32 (kivi)")):
        after = conv.split(f"{flag} N ", 1)[1]
        assert f"default {default}" in after.split(" --", 1)[0], (flag, after[:300])


def test_the_hardening_table_has_a_row_per_case() -> None:
    """docs/hardening.md's table comes from these cases (``python fuzz/cli_table.py``): a case added here shows
    there."""
    from conftest import REPO

    readme = (REPO / "docs" / "hardening.md").read_text()
    for table, cases in TABLES.items():
        for c in cases:
            assert f"| {table} | {(c.what or c.id).replace('`', chr(39))} |" in readme, (table, c.id)
