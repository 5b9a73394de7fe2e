"""The nnef-kv command line: every command's happy path and every error path (in-process through
``nnef_kv.cli.main``, once through ``python -m nnef_kv`` in a subprocess)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnef_kv
from nnef_kv.cli import main
from nnef_kv.models import DecoderConfig, build_decoder, build_decoder_weights, empty_cache
from nnef_kv.models.reference import reference_logits

from conftest import HAVE_TRACT, REPO, requires_tract

CFG = DecoderConfig(vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64, seed=21)


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    f32 = d / "f32.nnef.tar"
    nnef_kv.save(build_decoder(CFG), f32)
    dyn = d / "dyn.nnef.tar"
    nnef_kv.save(build_decoder(DecoderConfig(**{**CFG.to_dict(), "cache": "dyn"})), dyn)
    plain = d / "plain.nnef.tar"  # a graph with no attention at all
    nnef_kv.save(nnef_kv.Model.from_text(
        "version 1.0;\ngraph g(x) -> (y) {\n  x = external<scalar>(shape = [1, 4]);\n  y = relu(x);\n}\n"), plain)
    junk = d / "junk.nnef.tgz"
    junk.write_bytes(b"this is not a tar archive at all\n" * 10)
    from nnef_kv.text import byte_level_tokenizer

    byte_level_tokenizer().save(str(d / "tokenizer.json"))  # found next to the archives
    return {"f32": f32, "dyn": dyn, "plain": plain, "junk": junk, "dir": d}


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err, f"expected one error line, got {err!r}"
    assert "Traceback" not in err
    return err


# -- inspect ---------------------------------------------------------------------------------------
def test_inspect(archives, capsys) -> None:
    assert main(["inspect", str(archives["f32"])]) == 0
    out = capsys.readouterr().out
    assert "in_cache_key_0" in out and "outputs" in out


# -- convert ---------------------------------------------------------------------------------------
def test_convert_then_inspect_shows_the_kv_op(archives, tmp_path, capsys) -> None:
    out = tmp_path / "k4.nnef.tar"
    assert main(["convert", str(archives["f32"]), "-o", str(out), "--bits", "4", "--key-group", "16",
                 "--value-group", "16", "--residual", "16"]) == 0
    assert out.is_file()
    text = nnef_kv.dump(nnef_kv.load(out).document)
    assert text.count("nnef_kv_kivi_sdpa(") == CFG.layers and "bits = 4" in text
    assert "->" in capsys.readouterr().out


@pytest.mark.parametrize("opts,needle", [
    (["--bits", "99"], "bits"),
    (["--bits", "0"], "bits"),
    (["--scheme", "tract-cache", "--bits", "3"], "bits"),
    (["--key-group", "0"], "key_group"),
    (["--value-group", "-4"], "value_group"),
    (["--residual", "-1"], "residual"),
    (["--sinks", "-2"], "sinks"),
    (["--scheme", "magic"], "scheme"),
    (["--bits", "four"], "bits"),
])
def test_convert_bad_options_refused_before_work(archives, tmp_path, capsys, opts, needle) -> None:
    out = tmp_path / "out.nnef.tar"
    assert main(["convert", str(archives["f32"]), "-o", str(out), *opts]) == 2
    assert needle in _err_line(capsys)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("which,needle", [("missing", "no such file"), ("junk", "junk"), ("plain", "attention"),
                                          ("onnx", "onnx")])
def test_convert_failures_leave_no_output(archives, tmp_path, capsys, which, needle) -> None:
    if which == "missing":
        src = archives["dir"] / "nope.nnef.tgz"
    elif which == "onnx":
        src = archives["dir"] / "broken.onnx"
        src.write_bytes(b"\x08\x07 definitely not protobuf \xff\xff")
    else:
        src = archives[which]
    out = tmp_path / "out.nnef.tgz"
    assert main(["convert", str(src), "-o", str(out)]) == 2
    assert needle in _err_line(capsys).lower()
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_to_overwrite_its_input(archives, capsys) -> None:
    before = archives["f32"].read_bytes()
    assert main(["convert", str(archives["f32"]), "-o", str(archives["f32"])]) == 2
    assert "overwrite" in _err_line(capsys)
    assert archives["f32"].read_bytes() == before


def test_debug_shows_the_exception(archives, tmp_path, capsys) -> None:
    """--debug prints the traceback and still exits 2 (issue 13 item 10: it used to re-raise, exit status 1)."""
    for argv in (["--debug", "convert", str(archives["plain"]), "-o", str(tmp_path / "o.tar")],
                 ["convert", str(archives["plain"]), "-o", str(tmp_path / "o.tar"), "--debug"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "nnef_kv.errors.ConversionError" in err
        assert err.rstrip().splitlines()[-1].startswith("nnef-kv convert: error: ")
    assert not (tmp_path / "o.tar").exists()


# -- run -------------------------------------------------------------------------------------------
def test_run_multi_step_with_cache_feedback(archives, tmp_path, capsys) -> None:
    ids = np.array([[3, 1, 4, 1, 5]], np.int64)
    npz = tmp_path / "io.npz"
    np.savez(npz, **{"input_ids@0": ids[:, :3], "input_ids@1": ids[:, 3:4], "input_ids@2": ids[:, 4:5]})
    out = tmp_path / "out.npz"
    assert main(["run", str(archives["f32"]), "--inputs", str(npz), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"step 2 outputs: float32 [1, 1, {CFG.vocab}]" in text and "NaN 0" in text
    with np.load(out) as z:
        assert z["out_cache_key_1@2"].shape == (1, CFG.kv_heads, 5, CFG.head_dim)
        want = reference_logits(CFG, build_decoder_weights(CFG), ids[0])
        for k in range(3):
            np.testing.assert_allclose(z[f"outputs@{k}"][0, -1], want[2 + k], atol=2e-5)


def test_run_single_step_compares_with_expected_outputs(archives, tmp_path, capsys) -> None:
    feed = dict(empty_cache(CFG), input_ids=np.array([[7, 8]], np.int64))
    expected = build_decoder(CFG).session().run(feed)["outputs"]
    npz = tmp_path / "io.npz"
    np.savez(npz, outputs=expected, **feed)
    out = tmp_path / "o.npz"
    assert main(["run", str(archives["f32"]), "--inputs", str(npz), "-o", str(out)]) == 0
    assert "max|diff| vs npz 0" in capsys.readouterr().out
    with np.load(out) as z:
        assert "outputs" in z.files and "outputs@0" not in z.files


@pytest.mark.parametrize("case", ["unknown key", "bad step", "missing input", "not npz", "steps 0"])
def test_run_errors(archives, tmp_path, capsys, case) -> None:
    npz = tmp_path / "io.npz"
    args = []
    if case == "unknown key":
        np.savez(npz, input_ids=np.zeros((1, 2), np.int64), bogus=np.zeros(2))
    elif case == "bad step":
        np.savez(npz, **{"input_ids@x": np.zeros((1, 2), np.int64)})
    elif case == "missing input":
        np.savez(npz, in_cache_key_0=np.zeros((1, 2, 0, 8), np.float32))
    elif case == "not npz":
        npz.write_text("hello")
    else:
        np.savez(npz, input_ids=np.zeros((1, 2), np.int64))
        args = ["--steps", "0"]
    out = tmp_path / "out.npz"
    assert main(["run", str(archives["f32"]), "--inputs", str(npz), "-o", str(out), *args]) == 2
    _err_line(capsys)
    assert not out.exists()


# -- generate --------------------------------------------------------------------------------------
def test_generate_greedy_matches_reference_on_both_cache_layouts(archives, capsys) -> None:
    prompt = [5, 9, 2, 33]
    ids = list(prompt)
    for _ in range(6):  # greedy with the independent NumPy forward
        ids.append(int(np.argmax(reference_logits(CFG, build_decoder_weights(CFG), np.array(ids))[-1])))
    want = " ".join(str(i) for i in ids[len(prompt):])
    for which in ("f32", "dyn"):
        assert main(["generate", str(archives[which]), "--prompt-ids", "5,9,2,33", "--max-new-tokens", "6"]) == 0
        cap = capsys.readouterr()
        assert cap.out.strip() == want
        assert ("explicit cache" if which == "f32" else "session cache") in cap.err


def test_generate_prompt_streams_text(archives, capsys) -> None:
    from nnef_kv.text import byte_level_tokenizer

    tok = byte_level_tokenizer()
    ids = tok.encode("We hold these truths").ids
    for _ in range(8):
        ids.append(int(np.argmax(reference_logits(CFG, build_decoder_weights(CFG), np.array(ids))[-1])))
    want = tok.decode(ids[len(tok.encode("We hold these truths").ids):])
    assert main(["generate", str(archives["f32"]), "--prompt", "We hold these truths", "--max-new-tokens", "8"]) == 0
    cap = capsys.readouterr()
    assert cap.out == want + "\n"
    err = cap.err.strip().splitlines()
    assert "tokenizer found next to the archive" in err[0] and err[-1].startswith("8 tokens in ")


def test_generate_interrupted_ends_the_line_and_summarises(archives, capsys, monkeypatch) -> None:
    from nnef_kv.validate.decode import InterpreterDecoder

    real = InterpreterDecoder.__call__
    calls = {"n": 0}

    def stop_after_three(self, ids):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(self, ids)

    monkeypatch.setattr(InterpreterDecoder, "__call__", stop_after_three)
    assert main(["generate", str(archives["f32"]), "--prompt-ids", "1,2", "--max-new-tokens", "50"]) == 130
    cap = capsys.readouterr()
    assert cap.out.endswith("\n") and len(cap.out.split()) == 3
    assert cap.err.strip().startswith("3 tokens in ") and "(interrupted)" in cap.err


@pytest.mark.parametrize("opts,match", [
    (["--prompt-ids", "1,x"], "not an integer"), (["--prompt-ids", "-3"], "negative"),
    (["--prompt-ids", ","], "no token"), (["--prompt-ids", "1", "--max-new-tokens", "0"], ">= 1"),
    (["--prompt-ids", "99999999999999999999999"], "too large"),
    (["--prompt-ids", "1,300"], "token id 300 at position 1 is outside the model's vocabulary of 256"),
    (["--prompt-ids", "1", "--max-new-tokens", "5000"], "the model holds at most 4095"),
    (["--prompt", ""], "the prompt is empty"), ([], "give the prompt"),
    (["--prompt", "x", "--tokenizer", "{missing}"], "no such file"),
])
def test_generate_bad_options(archives, capsys, opts, match, tmp_path) -> None:
    opts = [o.format(missing=tmp_path / "nope.json") for o in opts]
    assert main(["generate", str(archives["f32"]), *opts]) == 2
    assert match in _err_line(capsys)


def test_generate_on_a_non_decoder(archives, capsys) -> None:
    assert main(["generate", str(archives["plain"]), "--prompt-ids", "1"]) == 2
    assert "token ids" in _err_line(capsys)


# -- validate --------------------------------------------------------------------------------------
def _kivi(archives, tmp_path, bits: int) -> Path:
    out = tmp_path / f"k{bits}.nnef.tar"
    assert main(["convert", str(archives["f32"]), "-o", str(out), "--bits", str(bits), "--key-group", "16",
                 "--value-group", "8", "--residual", "16"]) == 0
    # as exporters leave it
    (tmp_path / "tokenizer.json").write_bytes((archives["dir"] / "tokenizer.json").read_bytes())
    return out


def test_validate_good_archive_passes_and_writes_reports(archives, tmp_path, capsys) -> None:
    k8 = _kivi(archives, tmp_path, 8)
    rd = tmp_path / "report"
    assert main(["validate", str(k8), "--reference", str(archives["f32"]), "--report-dir", str(rd),
                 "--context", "100,300", "--eval-tokens", "24", "--max-attention-deviation", "0.1",
                 "--min-token-agreement", "0.8", "--max-kl", "0.01", "--max-ppl-ratio", "1.1"]) == 0
    out = capsys.readouterr().out
    assert "\nPASS\nreport: " in out and "[ok] round trip" in out and "Mean KLD" in out
    assert "no --text given: the sample text shipped with nnef-kv" in out
    data = json.loads((rd / "report.json").read_text())
    assert data["verdict"] == "pass" and [c["context"] for c in data["contexts"]] == [100, 300]
    assert 0 < data["contexts"][0]["attention_deviation"]["max"] <= 0.1
    assert (rd / "report.md").read_text().startswith("# nnef-kv validation")
    assert (rd / "report.png").stat().st_size > 1000


def test_validate_without_thresholds_is_measured_never_pass(archives, tmp_path, capsys) -> None:
    k4 = _kivi(archives, tmp_path, 4)
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, " * 40)
    assert main(["validate", str(k4), "--reference", str(archives["f32"]), "--text", str(text),
                 "--eval-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("MEASURED") and "PASS" not in out
    assert "context 256 (default" in out


def test_validate_within_the_window_exits_1(archives, tmp_path, capsys) -> None:
    k4 = _kivi(archives, tmp_path, 4)
    assert main(["validate", str(k4), "--reference", str(archives["f32"]), "--context", "20",
                 "--eval-tokens", "8"]) == 1
    out = capsys.readouterr().out
    assert ("nothing was quantized: context 20 fits in the full-precision window (residual 16 + key_group 16); "
            "use --context >= 256") in out
    assert out.rstrip().endswith("FAIL")


def test_validate_impossible_threshold_exits_1(archives, tmp_path, capsys) -> None:
    k2 = _kivi(archives, tmp_path, 2)
    rd = tmp_path / "r"
    assert main(["validate", str(k2), "--reference", str(archives["f32"]), "--context", "128", "--eval-tokens", "16",
                 "--max-attention-deviation", "0.000001", "--report-dir", str(rd)]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert json.loads((rd / "report.json").read_text())["verdict"] == "fail"


def test_validate_refuses_another_model_as_reference(archives, tmp_path, capsys) -> None:
    k4 = _kivi(archives, tmp_path, 4)
    other = tmp_path / "other.nnef.tar"
    nnef_kv.save(build_decoder(DecoderConfig(**{**CFG.to_dict(), "seed": 22})), other)
    assert main(["validate", str(k4), "--reference", str(other), "--context", "64", "--eval-tokens", "8"]) == 2
    assert "not the same model as the archive" in _err_line(capsys)
    assert main(["validate", str(k4), "--reference", str(k4), "--context", "64", "--eval-tokens", "8"]) == 2
    assert "holds a quantized KV cache itself" in _err_line(capsys)


def test_validate_non_decoder_is_refused(archives, tmp_path, capsys) -> None:
    assert main(["validate", str(archives["plain"]), "--ids", str(_ids_file(tmp_path, [1, 2, 3] * 200)),
                 "--report-dir", str(tmp_path / "r")]) == 2
    assert "not a decoder nnef-kv can drive" in _err_line(capsys)
    assert not (tmp_path / "r").exists()


def _ids_file(tmp_path, ids) -> Path:
    p = tmp_path / "ids.txt"
    p.write_text(" ".join(map(str, ids)))
    return p


@pytest.mark.parametrize("opts,match", [
    (["--max-kl", "-1"], "--max-kl -1.0: must be >= 0"), (["--min-token-agreement", "1.5"], "in [0, 1]"),
    (["--eval-tokens", "0"], "--eval-tokens 0: must be an integer >= 1"),
    (["--max-attention-deviation", "nan"], "--max-attention-deviation nan: not a number"),
    (["--max-ppl-ratio", "nan"], "not a number"), (["--context", "0"], "a context is a number of tokens >= 1"),
    (["--context", "x"], "a context is a number of tokens"), (["--chunk", "0"], "--chunk 0"),
    (["--reference", "/nonexistent/ref.tgz"], "no such file"),
    (["--context", "5000"], "it holds at most 4095 (tract_assert S+P < 4096)"),
    (["--text", "{empty}"], "the text is empty"), (["--text", "{short}", "--context", "100"], "the text has 12"),
    (["--text", "{latin1}"], "not UTF-8 text (byte 0xe9 at offset 1)"),
    (["--text", "{short}", "--tokenizer", "{notok}"], "a JSON file but not a Hugging Face tokenizer"),
    (["--text", "{short}", "--tokenizer", "{short}"], "not a readable tokenizer JSON file"),
    (["--ids", "{bigid}"], "--ids {bigid}: token id 300 at position 3 is outside the model's vocabulary of 256"),
    (["--ids", "{badid}"], "is not an integer token id"),
    (["--text", "{short}", "--ids", "{bigid}"], "give exactly one of --text, --prompt or --ids"),
])
def test_validate_bad_input_writes_nothing(archives, tmp_path, capsys, opts, match) -> None:
    files = {"empty": "  \n", "short": "Hello, world", "notok": '{"a": 1}', "bigid": "1 2 3 300 4", "badid": "1 2 x"}
    subs = {}
    for k, v in files.items():
        (tmp_path / k).write_text(v)
        subs[k] = str(tmp_path / k)
    (tmp_path / "latin1").write_bytes("é".encode("latin-1").join([b"a", b"b"]))
    subs["latin1"] = str(tmp_path / "latin1")
    rd = tmp_path / "r"
    opts = [o.format(**subs) for o in opts]
    assert main(["validate", str(archives["f32"]), "--report-dir", str(rd), *opts]) == 2
    assert match.format(**subs) in _err_line(capsys)
    assert not rd.exists()


@requires_tract
def test_validate_tract_parity_on_f32(archives, capsys) -> None:
    assert main(["validate", str(archives["f32"]), "--context", "64", "--eval-tokens", "8"]) == 1  # nothing quantized
    out = capsys.readouterr().out
    assert "[ok] tract parity" in out and "no quantized KV cache" in out


# -- demo --------------------------------------------------------------------------------------------
def test_demo_table(capsys, tmp_path) -> None:
    assert main(["demo", "--builtin", "--context", "128,300", "--eval-tokens", "16", "--report-dir",
                 str(tmp_path / "reports")]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    header = next(i for i, ln in enumerate(lines) if ln.startswith("model"))
    rows = [ln.split() for ln in lines[header + 2: header + 12]]
    assert [r[0] for r in rows] == ["f32"] * 2 + ["kivi"] * 6 + ["tract"] * 2
    bits = [r[2] if r[0] == "f32" else r[1] for r in rows]
    assert bits == ["32", "32", "8", "8", "4", "4", "2", "2", "8", "8"]
    ctx = [int(r[3] if r[0] == "f32" else r[2]) for r in rows]
    assert ctx == [128, 300] * 5
    kv = {(b, c): int((r[7] if r[0] == "f32" else r[6]).replace(",", "")) for r, b, c in zip(rows, bits, ctx)}
    assert kv[("32", 300)] > kv[("8", 300)] > kv[("4", 300)] > kv[("2", 300)]
    quantized = [int(r[3]) for r in rows[2:8] if r[0] == "kivi"]
    assert all(q > 0 for q in quantized)  # past the window: the quantized cache is what is measured
    assert {p.name for p in (tmp_path / "reports").iterdir()} == {"f32", "kivi8", "kivi4", "kivi2", "tract8"}
    assert all(" ".join(r[-3:]) == "n/a (nnef-kv op)" for r in rows[2:8])  # tract cannot load the KIVI op: said so
    if HAVE_TRACT:
        assert rows[0][-2] == "ok"  # the f32 reference agrees with tract


def test_demo_session_cache_variant(capsys) -> None:
    assert main(["demo", "--builtin", "--cache", "dyn", "--context", "128", "--eval-tokens", "16", "--bits", "4",
                 "--no-tract",
                 "--key-group", "8", "--value-group", "8", "--residual", "8", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "cache dyn" in out
    row = next(ln.split() for ln in out.splitlines() if ln.startswith("kivi"))
    assert float(row[7]) < 1.0 and 0.0 < float(row[8])  # fewer KV bytes than f32, some deviation


@pytest.mark.parametrize("opts", [["--bits", "4,9"], ["--vocab", "128"], ["--context", "0"]])
def test_demo_bad_options(capsys, opts) -> None:
    assert main(["demo", *opts]) == 2
    _err_line(capsys)


@pytest.mark.slow
def test_demo_default_runs_under_a_minute(capsys) -> None:
    import time

    t0 = time.perf_counter()
    assert main(["demo", "--builtin"]) == 0
    assert time.perf_counter() - t0 < 60
    assert "kivi" in capsys.readouterr().out


def test_run_session_cache_archive_keeps_state_across_steps(archives, tmp_path, capsys) -> None:
    npz = tmp_path / "io.npz"
    np.savez(npz, **{"input_ids@0": np.array([[3, 1, 4]], np.int64), "input_ids@1": np.array([[1]], np.int64)})
    out = tmp_path / "o.npz"
    assert main(["run", str(archives["dyn"]), "--inputs", str(npz), "-o", str(out)]) == 0
    want = reference_logits(CFG, build_decoder_weights(CFG), np.array([3, 1, 4, 1]))
    with np.load(out) as z:
        assert sorted(z.files) == ["outputs@0", "outputs@1"]
        np.testing.assert_allclose(z["outputs@1"][0, -1], want[-1], atol=2e-5)


# -- progress ----------------------------------------------------------------------------------------
def test_progress_bar_silent_off_terminal_and_forced_on(monkeypatch, capsys) -> None:
    from nnef_kv.progress import progress_bar, progress_enabled

    monkeypatch.delenv("NNEF_KV_PROGRESS", raising=False)
    assert not progress_enabled()  # pytest's stderr is not a terminal
    with progress_bar("x", total=3) as advance:
        advance()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("NNEF_KV_PROGRESS", "1")
    assert progress_enabled()
    with progress_bar("forced", total=2) as advance:
        advance(2)
    monkeypatch.setenv("NNEF_KV_PROGRESS", "0")
    assert not progress_enabled()


# -- missing files, every command ------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["inspect", "{missing}"],
    ["convert", "{missing}", "-o", "{out}"],
    ["run", "{missing}", "--inputs", "{missing}", "-o", "{out}"],
    ["run", "{f32}", "--inputs", "{missing}", "-o", "{out}"],
    ["generate", "{missing}", "--prompt-ids", "1,2"],
    ["validate", "{missing}", "--report-dir", "{out}"],
    ["validate", "{f32}", "--reference", "{missing}", "--report-dir", "{out}"],
    ["validate", "{f32}", "--text", "{missing}", "--report-dir", "{out}"],
])
def test_missing_files(archives, tmp_path, capsys, argv) -> None:
    out = tmp_path / "out"
    subs = {"missing": str(tmp_path / "absent.nnef.tgz"), "out": str(out), "f32": str(archives["f32"])}
    assert main([a.format(**subs) for a in argv]) == 2
    assert "no such file" in _err_line(capsys)
    assert not out.exists()


def test_validate_report_dir_is_a_file(archives, tmp_path, capsys) -> None:
    f = tmp_path / "taken"
    f.write_text("x")
    assert main(["validate", str(archives["f32"]), "--report-dir", str(f), "--context", "64"]) == 2
    assert "report-dir" in _err_line(capsys)
    assert f.read_text() == "x"


# -- subprocess ----------------------------------------------------------------------------------------
def test_subprocess_error_is_one_line(tmp_path) -> None:
    out = tmp_path / "o.nnef.tar"
    p = subprocess.run([sys.executable, "-m", "nnef_kv", "convert", str(tmp_path / "missing.tgz"), "-o", str(out),
                        "--bits", "4"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "no such file" in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == "" and not out.exists()
    p = subprocess.run([sys.executable, "-m", "nnef_kv", "convert", str(tmp_path / "missing.tgz"), "-o", str(out),
                        "--bits", "99"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 2 and "bits" in p.stderr and not out.exists()


@pytest.mark.parametrize("flag", [False, True])
def test_run_f16_archive_on_its_f32_test_io(flag, capsys) -> None:
    from conftest import SHARED

    d = SHARED / "fixtures" / "exports" / "llama_f16"
    if not d.is_dir():
        pytest.skip(f"{d} not found")
    io = d / "t2n_tests" / "prompt_inputs.npz"
    argv = ["run", str(d / "model.nnef.tgz"), "--inputs", str(io)] + (["--allow-float-casts"] if flag else [])
    if not flag:
        assert main(argv) == 2
        assert "is float32, the graph declares float16 (--allow-float-casts casts float inputs" in _err_line(capsys)
        return
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert cap.err.count("note: --allow-float-casts") == 4 and "step 0 outputs: float16 [1, 1, 256]" in cap.out
