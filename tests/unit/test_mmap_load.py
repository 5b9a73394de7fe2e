"""One copy of the weights (issue 26.2): a .tar or a folder is memory-mapped and loading reads no tensor byte;
planning copies the products' weights into huge pages and gives the file pages back (with
``NNEF_KV_HUGE_PAGES=0`` it reads nothing either), a .tgz member is inflated into one buffer, a tied
embedding is one array in the plan, released pages leave the process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import nnef_kv
from nnef_kv.tensors import hugepages
from nnef_kv.tensors.pages import _mapping_of, release_pages

MIB = 1 << 20

# a graph reading two 24 MiB weights: y = x @ a^T, z = w @ b^T (two inputs: two products)
TEXT = """version 1.0;
graph g(x, w) -> (y, z)
{
  x = external<scalar>(shape = [1, 1024]);
  w = external<scalar>(shape = [1, 1024]);
  a = variable<scalar>(label = 'a', shape = [6144, 1024]);
  b = variable<scalar>(label = 'b', shape = [6144, 1024]);
  y = linear(x, a, 0.0);
  z = matmul(w, b, transposeA = false, transposeB = true);
}
"""
# the same weights read by one input: the planner fuses them into one [1024, 12288] product (a new array)
FUSED = TEXT.replace("z = matmul(w, b", "z = matmul(x, b")


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal((6144, 1024)).astype(np.float32) for k in "ab"}
    model = nnef_kv.Model.from_text(TEXT, tensors)
    root = tmp_path_factory.mktemp("mmap")
    out = {}
    for name in ("m.tar", "m"):
        out[name] = str(nnef_kv.save(model, root / name))
    out["fused.tar"] = str(nnef_kv.save(nnef_kv.Model.from_text(FUSED, tensors), root / "fused.tar"))
    return out


PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import nnef_kv
    from nnef_kv.interpreter.session import Session

    def rss():
        got = {}
        for line in open("/proc/self/status"):
            if line.startswith(("RssFile", "RssAnon", "VmHWM")):
                k, v = line.split(":")
                got[k] = int(v.split()[0]) * 1024
        try:
            for line in open("/proc/self/smaps_rollup"):
                if line.startswith("AnonHugePages"):
                    got["AnonHugePages"] = int(line.split(":")[1].split()[0]) * 1024
        except OSError:
            got["AnonHugePages"] = 0
        return got

    # the code a load and a run map (the archive readers with gzip's libraries, the parser, numba, LLVM,
    # the few-row product's compiled cache) loaded before measuring: the figures below are tensor bytes
    import nnef_kv.io.container
    nnef_kv.parse("version 1.0; graph g(x) -> (x) { x = external<scalar>(shape = [1]); }")
    from nnef_kv.kernels.gemv import rows_by_t
    rows_by_t(np.ones((1, 4), np.float32), np.ones((2, 4), np.float32), np.ones((1, 2), np.float32), 0, 2)
    r = {"start": rss()}
    model = nnef_kv.load(sys.argv[1])
    r["loaded"] = rss()
    s = Session(model, threads=1)
    r["planned"] = rss()
    ones = np.ones((1, 1024), np.float32)
    out = s.run({k: ones for k in s.input_names})
    r["ran"] = rss()
    r["y0"] = float(out["y"][0, 0])
    r["a0"] = float(model.tensors["a"][0].astype(np.float64).sum())
    print(json.dumps(r))
""")


def _probe(path: str, huge_pages: bool = True) -> dict:
    env = {**os.environ, hugepages.ENV: "1" if huge_pages else "0"}
    done = subprocess.run([sys.executable, "-c", PROBE, path], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("name", ["m.tar", "m"])
def test_no_tensor_byte_is_read_until_used(archives: dict[str, str], name: str) -> None:
    # NNEF_KV_HUGE_PAGES=0: the plan reads the archive's own arrays
    r = _probe(archives[name], huge_pages=False)
    grown = {k: r[k]["RssFile"] + r[k]["RssAnon"] - r["start"]["RssFile"] - r["start"]["RssAnon"]
             for k in ("loaded", "planned", "ran")}
    # 48 MiB of weights: loading and planning touch none of them (a few pages of headers at most)
    assert grown["loaded"] < 2 * MIB, grown
    assert grown["planned"] < 4 * MIB, grown
    # the run reads both weights once, through the mapping (file pages, no anonymous copy)
    assert r["ran"]["RssFile"] - r["start"]["RssFile"] > 44 * MIB, r
    assert r["ran"]["RssAnon"] - r["start"]["RssAnon"] < 16 * MIB, r
    assert np.isclose(r["y0"], r["a0"], rtol=1e-4)


def _thp_enabled() -> bool:
    try:
        return "[never]" not in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("name", ["m.tar", "m"])
def test_loading_reads_nothing_and_planning_moves_the_weights_to_huge_pages(archives: dict[str, str],
                                                                            name: str) -> None:
    r = _probe(archives[name])
    grown = r["loaded"]["RssFile"] + r["loaded"]["RssAnon"] - r["start"]["RssFile"] - r["start"]["RssAnon"]
    assert grown < 2 * MIB, r  # the load reads no tensor byte
    # planning copies the two 24 MiB weights (each alone: two inputs) into anonymous memory and gives the
    # file pages it read back: one copy held
    anon = r["planned"]["RssAnon"] - r["start"]["RssAnon"]
    assert 44 * MIB < anon < 56 * MIB, r
    assert r["planned"]["RssFile"] - r["start"]["RssFile"] < 4 * MIB, r
    if _thp_enabled():
        assert r["planned"]["AnonHugePages"] - r["start"]["AnonHugePages"] >= 40 * MIB, r
    # running reads the copies only: no file page comes back
    assert r["ran"]["RssFile"] - r["start"]["RssFile"] < 4 * MIB, r
    assert r["ran"]["RssAnon"] - r["planned"]["RssAnon"] < 8 * MIB, r
    assert np.isclose(r["y0"], r["a0"], rtol=1e-4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_fused_projection_is_the_one_copy(archives: dict[str, str]) -> None:
    r = _probe(archives["fused.tar"])
    # planning copies both weights side by side (48 MiB, anonymous) and drops the file pages it read
    anon = r["planned"]["RssAnon"] - r["start"]["RssAnon"]
    assert 44 * MIB < anon < 56 * MIB, r
    assert r["planned"]["RssFile"] - r["start"]["RssFile"] < 4 * MIB, r
    # running reads the fused copy only
    assert r["ran"]["RssFile"] - r["start"]["RssFile"] < 4 * MIB, r
    assert np.isclose(r["y0"], r["a0"], rtol=1e-4)


@pytest.mark.parametrize("name", ["m.tar", "m"])
def test_loaded_arrays_are_views_of_the_file_mapping(archives: dict[str, str], name: str) -> None:
    model = nnef_kv.load(archives[name])
    for t in model.tensors.values():
        assert _mapping_of(t.base) is not None and not t.flags.writeable


def test_release_pages_drops_touched_pages_and_values_stay(archives: dict[str, str]) -> None:
    model = nnef_kv.load(archives["m.tar"])
    a = model.tensors["a"]
    before = float(a.astype(np.float64).sum())
    released = release_pages(a.T)
    assert 23 * MIB < released <= a.nbytes  # whole pages inside the 24 MiB array
    assert float(a.astype(np.float64).sum()) == before  # read again from the file
    assert release_pages(np.ones(1 << 20, np.float32)) == 0  # not a mapping: nothing
    assert release_pages(a[:, ::2]) == 0  # not contiguous: nothing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_tgz_member_is_not_held_twice(tmp_path) -> None:
    big = np.zeros((12 * 1024, 1024), np.float32)  # one 48 MiB member (zeros: fast to compress)
    text = TEXT.replace("6144", "12288")
    path = nnef_kv.save(nnef_kv.Model.from_text(text, {"a": big, "b": np.zeros((12288, 1024), np.float32)}),
                        tmp_path / "m.tgz")
    code = textwrap.dedent("""
        import sys, nnef_kv
        def hwm():
            return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
        import numpy  # noqa
        before = hwm()
        m = nnef_kv.load(sys.argv[1])
        print(hwm() - before, sum(t.nbytes for t in m.tensors.values()))
    """)
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    peak, held = map(int, done.stdout.split())
    assert held == 96 * MIB
    # every member in its own buffer of its size: the peak is the members plus read-ahead, not one more copy of
    # the largest (joining read() chunks made it 144 MiB)
    assert peak < held + 24 * MIB, (peak, held)


def test_tied_embedding_is_one_array_in_the_plan() -> None:
    from nnef_kv.interpreter.plan import get_plan
    from nnef_kv.interpreter.session import Session
    from nnef_kv.models import DecoderConfig, build_decoder

    cfg = DecoderConfig(vocab=512, hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, mlp=128,
                        tied_embeddings=True)
    model = build_decoder(cfg)
    emb = model.tensors["model.embed_tokens.weight"]
    assert "lm_head.weight" not in model.tensors
    plan = get_plan(model)
    big = [a for a in plan.base if isinstance(a, np.ndarray) and a.size == emb.size]
    assert big, "the plan holds no array of the embedding's size"
    assert all(np.shares_memory(a, emb) for a in big)  # the gather's and the LM head's are the embedding
    # and the plan's logits are the embedding's product
    s = Session(model, threads=1)
    sig_inputs = {i.name: np.zeros([1 if isinstance(d, str) else d for d in i.shape], i.dtype)
                  for i in s.plan.inputs}
    sig_inputs["input_ids"] = np.array([[3]], np.int64)
    out = s.run(sig_inputs)
    logits = np.asarray(out[s.output_names[0]]).reshape(-1, cfg.vocab)
    assert logits.shape[-1] == cfg.vocab and np.all(np.isfinite(logits))


def test_unchanged_tensors_are_copied_not_re_encoded(archives: dict[str, str], tmp_path) -> None:
    from nnef_kv.io.archive import model_members

    model = nnef_kv.load(archives["m.tar"])
    members = model_members(model, "m.tar")
    for label, t in model.tensors.items():
        header, *payload = members[label + ".dat"]
        assert len(payload) == 1 and np.shares_memory(np.frombuffer(payload[0], np.uint8), t)  # the mapping itself
    out = nnef_kv.save(model, tmp_path / "again.tar")
    again = nnef_kv.load(out)
    for label, t in model.tensors.items():
        assert again.tensor_info[label] == model.tensor_info[label]
        np.testing.assert_array_equal(again.tensors[label], t)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("out", ["copy.tar", "copy", "copy.tgz"])
def test_saving_a_loaded_model_gives_the_input_pages_back(archives: dict[str, str], tmp_path, out: str) -> None:
    """``save`` of a memory-mapped model (what ``convert`` and validate's round trip do) reads every tensor; each
    member's pages of the input file are given back once written, so the process does not end up holding the
    whole input (48 MiB here) as file-backed memory. The copy is the same model."""
    code = textwrap.dedent("""
        import json, sys, nnef_kv
        def rss_file():
            return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssFile")][0]
        m = nnef_kv.load(sys.argv[1])
        before = rss_file()
        nnef_kv.save(m, sys.argv[2])
        print(json.dumps({"grew": rss_file() - before}))
    """)
    target = tmp_path / out
    got = subprocess.run([sys.executable, "-c", code, archives["m.tar"], str(target)], check=True,
                         capture_output=True, text=True)
    grew = json.loads(got.stdout)["grew"]
    assert grew < 8 * MIB, grew  # without the release: about 48 MiB, both tensors resident
    a, b = nnef_kv.load(archives["m.tar"]), nnef_kv.load(target)
    assert all(np.array_equal(a.tensors[k], b.tensors[k]) for k in "ab")
