"""``convert --auto-bits``: the knapsack against brute force, the measured refinement on a synthetic model,
the whole command on the trained fixture decoder (archive and report written, the choice within the
target, never more bytes than the best uniform setting, its figures reproduced by validating the written
archive), and refusals."""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from nnef_kv.cli import main
from nnef_kv.validate.autobits import (LADDERS, AutoBitsResult, Candidate, _levels, _next_levels, _refine, _refine_all,
                                      _setting, _unit_bytes, _units, knapsack, layer_groups, pick_ladder)

ROOT = Path(__file__).resolve().parents[2]
TRAINED = ROOT / "tests" / "fixtures" / "trained_llama" / "model.nnef.tgz"


@pytest.mark.parametrize("seed", range(12))
def test_knapsack_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    units, levels = int(rng.integers(1, 5)), int(rng.integers(2, 5))
    sizes = [sorted(rng.uniform(1, 10, levels).tolist()) for _ in range(units)]  # cheaper levels first
    costs = [sorted(rng.uniform(0, 1, levels).tolist(), reverse=True) for _ in range(units)]
    for c in costs:
        c[-1] = 0.0
    limit = float(rng.uniform(0, units * 0.6))
    got = knapsack(costs, sizes, limit)
    best = None
    for pick in itertools.product(range(levels), repeat=units):
        if sum(costs[u][i] for u, i in enumerate(pick)) <= limit:
            s = sum(sizes[u][i] for u, i in enumerate(pick))
            best = s if best is None else min(best, s)
    assert got is not None and best is not None
    assert sum(costs[u][i] for u, i in enumerate(got)) <= limit + 1e-12  # never optimistic
    # the grid rounds costs up: the optimum of a slightly smaller limit is never missed by more
    tight = min(sum(sizes[u][i] for u, i in enumerate(p)) for p in itertools.product(range(levels), repeat=units)
                if sum(costs[u][i] for u, i in enumerate(p)) <= limit * (1 - 2 * units / 4000))
    assert best <= sum(sizes[u][i] for u, i in enumerate(got)) <= tight + 1e-9


def test_knapsack_nothing_fits():
    assert knapsack([[1.0, 0.5]], [[1.0, 2.0]], 0.1) is None
    assert knapsack([[1.0, 0.0]], [[1.0, 2.0]], 0.0) == [1]


def test_auto_bits_on_the_trained_decoder_checks_its_choice_on_held_out_text(tmp_path, capsys):
    """The whole command on the trained fixture, with few tokens (16 a window, 2 windows: one chosen on, one
    held out): the search's choice meets the target on the text it was chosen on (its interval's upper
    bound) and fails on the held-out window; it is reported (REJECTED, the held-out interval), not returned:
    no archive written, exit 1, the report written to --report-dir."""
    out = tmp_path / "auto.nnef.tgz"
    rd = tmp_path / "rep"
    rc = main(["convert", str(TRAINED), "-o", str(out), "--scheme", "tract-cache", "--auto-bits", "--max-kl", "0.004",
               "--context", "160", "--eval-tokens", "16", "--windows", "2", "--jobs", "2", "--report-dir", str(rd)])
    printed = capsys.readouterr().out
    assert rc == 1, printed
    assert not out.exists() and sorted(p.name for p in rd.iterdir()) == ["report.json", "report.md"]
    rep = json.loads((rd / "report.json").read_text())
    assert rep["scheme"] == "tract-cache" and rep["layers"] == 4 and rep["split"] and rep["chosen"] is None
    assert len(rep["uniform"]) == 4 and len(rep["sensitivity"]) == 8  # 2 x 2 uniform pairs; 4 layers x K, V x 4 bits
    st = rep["window_starts"]
    assert len(st["search"]) == len(st["decide"]) == len(st["held-out"]) == 1 and st["search"] != st["held-out"]
    bad, held = rep["rejected"], rep["held_out_chosen"]
    assert bad is not None and held["layer_bits"] == bad["layer_bits"] and held["predictions"] == 16
    assert bad["kl_mean_ci95"][1] <= rep["target"] < held["kl_mean_ci95"][1]  # met where chosen, not held out
    bu = rep["best_uniform"]
    assert bu is not None and bu["kl_mean_ci95"][1] <= 0.004 and rep["held_out_best_uniform"] is not None
    assert "REJECTED: --layer-bits" in printed and "held-out text, the choice" in printed
    assert "the choice failed on the held-out text (above): nothing written" in printed


class _CiRow:
    status = "measured"
    reason = ""

    def __init__(self, kl: float, half: float, kv_bytes: float) -> None:
        self.per_context = [{"kl_mean": kl, "kl_mean_ci95": [max(kl - half, 0.0), kl + half], "kv_bytes": kv_bytes}]


def _decide_case(table: dict):
    """An AutoBitsResult after a search (one-width ladder 2, 4, 8, one layer), each candidate measured by
    ``table[(stage, level)] = (kl, half width)``; bytes = the level."""
    from nnef_kv.validate.autobits import _decide

    def cand(label, lv, stage="search"):
        c = Candidate(label, [(lv, lv)])
        kl, half = table[(stage, lv)]
        c.row = _CiRow(kl, half, float(lv))
        return c

    uniform = [cand(f"uniform {lv}", lv) for lv in (2, 4, 8)]
    res = AutoBitsResult("hf", {}, 1.0, 1.0, 64, 8, 1, False, (2, 4, 8), uniform, {}, [], None, None)
    within = [c for c in uniform if c.within(1.0)]
    res.chosen = min(within, key=lambda c: c.kv_bytes) if within else None
    calls = []

    def run(cands, stage="search"):
        calls.append((stage, [c.setting[0][0] for c in cands]))
        for c in cands:
            kl, half = table[(stage, c.setting[0][0])]
            c.row = _CiRow(kl, half, float(c.setting[0][0]))

    _decide(res, run, uniform, 1.0)
    return res, calls


def test_undecided_candidates_get_more_tokens_and_the_choice_is_held_out():
    """Level 2's interval holds the target (0.8 +- 0.5 around 1.0): measured again on more tokens, where it is
    within (0.8 +- 0.1); then the choice and the best uniform are measured on the held-out text and hold."""
    table = {("search", 2): (0.8, 0.5), ("search", 4): (0.5, 0.2), ("search", 8): (0.1, 0.05),
             ("decide", 2): (0.8, 0.1), ("decide", 4): (0.5, 0.1), ("decide", 8): (0.1, 0.02),
             ("held-out", 2): (0.85, 0.1), ("held-out", 4): (0.5, 0.1), ("held-out", 8): (0.1, 0.02)}
    res, calls = _decide_case(table)
    assert calls[0] == ("decide", [4, 2, 8]) and calls[1][0] == "held-out" and calls[1][1] == [2]
    assert res.chosen is not None and res.chosen.setting == [(2, 2)] and res.rejected is None
    assert res.held(res.chosen).within(1.0) and res.best_uniform.setting == [(2, 2)]


def test_a_choice_failing_on_held_out_text_is_rejected_not_returned():
    table = {("search", 2): (2.0, 0.5), ("search", 4): (0.5, 0.2), ("search", 8): (0.1, 0.05),
             ("decide", 2): (2.0, 0.1), ("decide", 4): (0.6, 0.2), ("decide", 8): (0.1, 0.02),
             ("held-out", 4): (0.95, 0.2), ("held-out", 8): (0.1, 0.02)}
    res, calls = _decide_case(table)
    assert res.chosen is None and res.rejected is not None and res.rejected.setting == [(4, 4)]
    assert not res.held(res.rejected).within(1.0)
    note = next(n for n in res.notes if "fails on the held-out text" in n)
    assert "its mean is within the target but the interval is too wide to tell" in note
    from nnef_kv.validate.autobits_report import render_json, render_text

    assert "REJECTED: --layer-bits 4" in render_text(res)
    d = json.loads(render_json(res))
    assert d["chosen"] is None and d["rejected"]["layer_bits"] == [[4, 4]]


def test_a_mean_within_the_budget_is_not_enough():
    """Level 4 measures 0.9 but its interval reaches 1.2 on every text: never accepted; level 8 is."""
    table = {("search", 2): (3.0, 0.5), ("search", 4): (0.9, 0.3), ("search", 8): (0.1, 0.05),
             ("decide", 2): (3.0, 0.5), ("decide", 4): (0.9, 0.3), ("decide", 8): (0.1, 0.02),
             ("held-out", 8): (0.1, 0.02)}
    res, _ = _decide_case(table)
    assert res.chosen.setting == [(8, 8)] and res.best_uniform.setting == [(8, 8)]


@pytest.mark.parametrize("args,msg", [
    (["--auto-bits"], "--auto-bits: give the budget, --max-kl X"),
    (["--auto-bits", "--max-kl", "0"], "--max-kl 0.0: a mean KL budget > 0"),
    (["--auto-bits", "--max-kl", "0.1", "--scheme", "tract"], "scheme tract has no bit width to choose"),
    (["--auto-bits", "--max-kl", "0.1", "--layer-bits", "4,4,4,4"], "--layer-bits and --auto-bits: give one"),
    (["--auto-bits", "--max-kl", "0.1", "--context", "100,200"], "--auto-bits chooses for one context"),
    (["--max-kl", "0.1"], "--max-kl: only with --auto-bits"),
    (["--auto-bits", "--max-kl", "0.1", "--jobs", "1", "--ray", "auto"], "--jobs and --ray: give one"),
    (["--auto-bits", "--max-kl", "0.1", "--ladder", "3,7"], "--ladder 3,7: 7 is not a level of scheme kivi"),
    (["--auto-bits", "--max-kl", "0.1", "--ladder", "4,4"], "--ladder 4,4: two levels at least"),
    (["--auto-bits", "--max-kl", "0.1", "--layer-groups", "0"], "--layer-groups"),
    (["--ladder", "2,4"], "--ladder: only with --auto-bits"),
])
def test_auto_bits_refusals_write_nothing(tmp_path, capsys, args, msg):
    out = tmp_path / "never.nnef.tgz"
    rc = main(["convert", str(TRAINED), "-o", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and err.count("\n") == 1, err
    assert not out.exists() and not list(tmp_path.iterdir())


class _Row:
    status = "measured"

    def __init__(self, kl: float, kv_bytes: float) -> None:
        self.per_context = [{"kl_mean": kl, "kv_bytes": kv_bytes}]


def _additive(true: dict):
    """A synthetic one-width model (keys and values at one level a layer, levels counted as bytes): a
    setting's KL is the sum of its layers' ``true`` costs."""
    def measure(c):
        c.row = _Row(sum(true[(layer, 0, k)] for layer, (k, _) in enumerate(c.setting)),
                     float(sum(k for k, _ in c.setting)))
    return measure


@pytest.mark.parametrize("pessimism", [1.0, 2.0, 4.0])
def test_refinement_spends_the_kl_the_first_order_model_leaves(pessimism):
    """A synthetic 3-layer model whose measured KL adds the units' true costs, given a sensitivity table
    ``pessimism`` times the truth: from the all-precise setting, the refinement lowers units one step at a
    time on measurements, never keeps a setting above the target, and ends where no single step fits."""
    ladder, layers, split, target = (2, 3, 4), 3, True, 1.0
    units = _units(layers, split)
    true = {(u[0], u[1], lv): 0.1 * (u[0] + 1) * (4 - lv) ** 2 for u in units for lv in ladder}
    ubytes = {(u[0], u[1], lv): float(lv) for u in units for lv in ladder}
    dkl = {k: pessimism * v for k, v in true.items()}

    def measure(c):
        levels = [lv for k, v in c.setting for lv in (k, v)]
        c.row = _Row(sum(true[(u[0], u[1], lv)] for u, lv in zip(units, levels)), float(sum(levels)))

    start = Candidate("start", _setting({u: 4 for u in units}, layers, split))
    measure(start)
    res = AutoBitsResult("kivi", {}, target, target, 64, 8, layers, split, ladder, [start], dkl, [], start, None)
    _refine(res, lambda cands: [measure(c) for c in cands], dkl, ubytes, units, ladder, layers, split, target,
            {tuple(start.setting)})
    assert res.rounds, "nothing refined"
    best = min([c for c in res.rounds if c.kl <= target], key=lambda c: c.kv_bytes)
    assert best.kv_bytes < start.kv_bytes and best.kl <= target
    if pessimism == 1.0 and len(res.rounds) < 16:  # an exact table, rounds left: no single step down fits
        levels = dict(zip(units, [x for k, v in best.setting for x in (k, v)]))
        for u in units:
            i = ladder.index(levels[u])
            if i:
                assert true[(u[0], u[1], ladder[i - 1])] - true[(u[0], u[1], levels[u])] > target - best.kl


def test_refinement_exchanges_when_no_step_down_fits():
    """Two units on a ladder whose top step is dear (4, 5, 8 bytes, as q4/q5/q8): from (4, 8), lowering
    the second unit alone breaks the target and the first is at the bottom, so only an exchange (the
    first up, the second down: 2 bytes fewer, a lower KL) makes progress; after it a plain step down fits."""
    ladder, layers, split, target = (4, 5, 8), 2, False, 0.55
    units = _units(layers, split)
    true = {(0, 0, 4): 0.5, (0, 0, 5): 0.1, (0, 0, 8): 0.0, (1, 0, 4): 0.2, (1, 0, 5): 0.1, (1, 0, 8): 0.0}
    ubytes = {(u[0], u[1], lv): float(lv) for u in units for lv in ladder}

    measure = _additive(true)

    start = Candidate("start", _setting({(0, 0): 4, (1, 0): 8}, layers, split))
    measure(start)
    assert start.kl == 0.5 and start.kv_bytes == 12
    res = AutoBitsResult("hf", {}, target, target, 64, 8, layers, split, ladder, [start], true, [], start, None)
    _refine(res, lambda cands: [measure(c) for c in cands], true, ubytes, units, ladder, layers, split, target,
            {tuple(start.setting)})
    assert any("one unit down and one up" in c.label for c in res.rounds)
    best = min([c for c in res.rounds if c.kl <= target], key=lambda c: (c.kv_bytes, c.kl))
    assert [k for k, _ in best.setting] == [5, 4] and best.kv_bytes == 9 and best.kl <= target


def test_ggml_ladder_holds_iq4_nl_beside_q4_0():
    """llama.cpp's iq4_nl takes q4_0's bytes (18 a block of 32) with another codebook: both are rungs, the
    cheapest pair, so that a unit can take either."""
    from nnef_kv.kv.ggml import BLOCK_BYTES

    lad = LADDERS["ggml"]
    assert "iq4_nl" in lad and [BLOCK_BYTES[t] for t in lad] == sorted(BLOCK_BYTES[t] for t in lad)


def test_next_levels_offer_every_kind_of_the_nearest_size():
    ladder = ("q4_0", "iq4_nl", "q4_1", "q8_0")
    size = {"q4_0": 18.0, "iq4_nl": 18.0, "q4_1": 20.0, "q8_0": 34.0}
    ubytes = {(0, s, lv): b for s in (0, 1) for lv, b in size.items()}
    assert _next_levels((0, 1), "q4_1", ubytes, ladder, -1) == ["q4_0", "iq4_nl"]
    assert _next_levels((0, 1), "q4_0", ubytes, ladder, -1) == []
    assert _next_levels((0, 1), "iq4_nl", ubytes, ladder, +1) == ["q4_1"]
    assert _next_levels((0, 1), "q8_0", ubytes, ladder, +1) == []


def test_refinement_steps_down_to_the_better_of_two_same_size_levels():
    """Values better at q4_0 than at iq4_nl (same bytes): from q4_1 the step down that fits the target is to
    q4_0, though iq4_nl is the ladder's next rung (the step to it breaks the target)."""
    ladder, layers, split, target = ("q4_0", "iq4_nl", "q4_1", "q8_0"), 1, True, 0.3
    units = _units(layers, split)
    size = {"q4_0": 18.0, "iq4_nl": 18.0, "q4_1": 20.0, "q8_0": 34.0}
    true = {(0, 0, "q4_0"): 0.5, (0, 0, "iq4_nl"): 0.4, (0, 0, "q4_1"): 0.3, (0, 0, "q8_0"): 0.0,
            (0, 1, "q4_0"): 0.1, (0, 1, "iq4_nl"): 0.35, (0, 1, "q4_1"): 0.05, (0, 1, "q8_0"): 0.0}
    ubytes = {(0, s, lv): b for s in (0, 1) for lv, b in size.items()}

    def measure(c):
        (k, v), = c.setting
        c.row = _Row(true[(0, 0, k)] + true[(0, 1, v)], size[k] + size[v])

    start = Candidate("start", [("q8_0", "q4_1")])
    measure(start)
    res = AutoBitsResult("ggml", {}, target, target, 64, 8, layers, split, ladder, [start], true, [], start, None)
    _refine(res, lambda cands: [measure(c) for c in cands], true, ubytes, units, ladder, layers, split, target,
            {tuple(start.setting)})
    best = min([c for c in res.rounds + [start] if c.kl <= target], key=lambda c: (c.kv_bytes, c.kl))
    assert best.setting == [("q8_0", "q4_0")] and best.kl <= target


def test_refinement_also_descends_from_the_uniform_setting():
    """When a round's setting is the cheapest within the target, step 6 first descends from the cheapest
    uniform setting within it (its first candidates are one step from that setting, not from the round's);
    when the uniform setting is itself the cheapest, only the usual refinement runs (from it)."""
    ladder, layers, split, target = (4, 5, 8), 2, False, 0.5
    units = _units(layers, split)
    true = {(0, 0, 4): 0.3, (0, 0, 5): 0.04, (0, 0, 8): 0.0, (1, 0, 4): 0.15, (1, 0, 5): 0.02, (1, 0, 8): 0.0}
    ubytes = {(u[0], u[1], lv): float(lv) for u in units for lv in ladder}

    measure = _additive(true)

    for round_levels, descends in (((4, 5), True), ((8, 8), False)):
        uniform = Candidate("uniform 5", _setting({(0, 0): 5, (1, 0): 5}, layers, split))
        found = Candidate("round 1", _setting({(0, 0): round_levels[0], (1, 0): round_levels[1]}, layers, split))
        for c in (uniform, found):
            measure(c)
        res = AutoBitsResult("hf", {}, target, target, 64, 8, layers, split, ladder, [uniform], true, [found],
                             uniform, None)
        before = len(res.rounds)
        _refine_all(res, lambda cands: [measure(c) for c in cands], true, ubytes, units, ladder, layers, split,
                    target, {tuple(uniform.setting), tuple(found.setting)})
        new = res.rounds[before:]
        labelled = [c for c in new if c.label.startswith("descent from the uniform setting")]
        assert bool(labelled) == descends
        first = new[0]
        origin = uniform if descends else (found if found.kv_bytes < uniform.kv_bytes else uniform)
        steps = sum(abs(ladder.index(a[0]) - ladder.index(b[0])) for a, b in zip(first.setting, origin.setting))
        assert steps == 1 and first.kv_bytes < origin.kv_bytes
        best = min([c for c in res.rounds + res.uniform if c.kl <= target], key=lambda c: (c.kv_bytes, c.kl))
        assert best.kv_bytes <= min(uniform.kv_bytes, found.kv_bytes if found.kl <= target else math.inf)


def test_layer_groups_cut_consecutive_layers_evenly():
    assert layer_groups(30, 6) == [range(i, i + 5) for i in range(0, 30, 5)]
    assert [len(g) for g in layer_groups(30, None)] == [4, 4, 4, 4, 4, 4, 3, 3]  # 8 at most by default
    assert layer_groups(4, None) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert layer_groups(3, 10) == [range(0, 1), range(1, 2), range(2, 3)]  # never more groups than layers
    for n, k in itertools.product(range(1, 20), range(1, 9)):
        gs = layer_groups(n, k)
        assert [i for g in gs for i in g] == list(range(n)) and max(map(len, gs)) - min(map(len, gs)) <= 1


def test_grouped_units_expand_to_every_layer_and_sum_their_bytes():
    """A unit of a group sets all its layers; its bytes are its layers' sum, read back per group."""
    groups = layer_groups(5, 2)  # layers 0-2, 3-4
    units = _units(groups, True)
    assert units == [(0, 0), (0, 1), (1, 0), (1, 1)]
    setting = _setting({(0, 0): 2, (0, 1): 4, (1, 0): 8, (1, 1): 3}, groups, True)
    assert setting == [(2, 4)] * 3 + [(8, 3)] * 2
    assert _levels(setting, groups, True) == {(0, 0): 2, (0, 1): 4, (1, 0): 8, (1, 1): 3}

    class _Ops:
        def __init__(self, per_layer):
            self.per_context = [{"kv_ops": [o for k, v in per_layer for o in
                                            ({"op": "x", "node": "key", "bytes": k}, {"op": "x", "node": "value",
                                                                                      "bytes": v})]}]
            self.status, self.reason = "measured", ""

    uniform = {(lv, lv): Candidate(f"uniform {lv}", [(lv, lv)] * 5, _Ops([(lv * (i + 1), lv) for i in range(5)]))
               for lv in (2, 4)}
    ub = _unit_bytes(uniform, (2, 4), 5, True, groups)
    assert ub[(0, 0, 2)] == 2 * (1 + 2 + 3) and ub[(1, 0, 4)] == 4 * (4 + 5) and ub[(1, 1, 2)] == 2 * 2


def test_ladder_is_a_subset_in_the_schemes_order():
    assert pick_ladder("kivi", LADDERS["kivi"], ["8", "3", "4"]) == (3, 4, 8)
    assert pick_ladder("ggml", LADDERS["ggml"], ["Q8_0", "q4_0"]) == ("q4_0", "q8_0")


def test_when_the_search_window_was_easy_the_choice_climbs_on_more_tokens():
    """Two layers (one width each), the search window 1.5x easier than the text: uniform 4 (8 bytes) is
    within the target 0.5 on the search window and fails on more tokens; the settings the search measured
    between it and uniform 8 are measured again, predicted by the ratio of the two stages, and the
    cheapest that holds there, per-layer 2/8 (10 bytes), is chosen and held out."""
    from nnef_kv.validate.autobits import _decide

    cost = {2: 0.3, 4: 0.2, 8: 0.0}

    def kl_of(setting, stage):
        return sum(cost[k] for k, _ in setting) * (1.0 if stage == "search" else 1.5)

    def cand(label, levels, stage="search"):
        c = Candidate(label, [(lv, lv) for lv in levels])
        c.row = _CiRow(kl_of(c.setting, stage), 0.02, float(sum(levels)))
        return c

    uniform = [cand(f"uniform {lv}", (lv, lv)) for lv in (2, 4, 8)]
    rounds = [cand("round 1", (2, 8)), cand("round 2", (4, 8))]
    res = AutoBitsResult("hf", {}, 0.5, 0.5, 64, 8, 2, False, (2, 4, 8), uniform, {}, rounds, None, None)
    res.chosen = uniform[1]  # the search's choice: uniform 4, within on the search window
    calls = []

    def run(cands, stage="search"):
        calls.append((stage, [tuple(k for k, _ in c.setting) for c in cands]))
        for c in cands:
            c.row = _CiRow(kl_of(c.setting, stage), 0.02, float(sum(k for k, _ in c.setting)))

    _decide(res, run, uniform + rounds, 0.5)
    assert calls[0] == ("decide", [(4, 4), (8, 8)])  # the choice and the uniform settings: 4 fails there
    assert calls[1] == ("decide", [(2, 8), (4, 8)])  # the climb: predicted 0.47 and 0.32 by the ratio 1.48
    assert "ratio 1.48" in res.decided[2].label
    assert res.chosen.setting == [(2, 2), (8, 8)] and res.chosen.kv_bytes == 10 and res.rejected is None
    assert calls[2][0] == "held-out" and res.held(res.chosen).within(0.5)
