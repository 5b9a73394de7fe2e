"""``convert --auto-bits``'s units: layers cut into groups, a unit's levels expanded to per-layer settings,
the bytes of each unit at each level, and the exact multiple-choice knapsack over them
(:mod:`.autobits` runs the search)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..errors import InputError

__all__ = ["AUTO_GROUPS", "GRID", "knapsack", "layer_groups"]

GRID = 4000
AUTO_GROUPS = 8  # default --layer-groups: consecutive layers share a unit past this many layers


def knapsack(costs: list[list[float]], sizes: list[list[float]], limit: float, grid: int = GRID) -> list[int] | None:
    """For each unit ``u`` a level ``i`` minimising ``sum sizes[u][i]`` with ``sum costs[u][i] <= limit``
    (costs >= 0, rounded up to ``limit / grid`` steps: never optimistic). None when nothing fits."""
    if limit < 0:
        return None
    step = limit / grid if limit > 0 else 1.0
    inf = math.inf
    best = [0.0] + [inf] * grid  # best[j]: fewest bytes with total cost exactly j steps
    picks: list[list[int]] = []
    for cu, su in zip(costs, sizes):
        new = [inf] * (grid + 1)
        arg = [-1] * (grid + 1)
        for i, (c, s) in enumerate(zip(cu, su)):
            k = 0 if c <= 0 else (math.ceil(c / step - 1e-9) if limit > 0 else grid + 1)
            if k > grid:
                continue
            for j in range(grid + 1 - k):
                if best[j] + s < new[j + k]:
                    new[j + k] = best[j] + s
                    arg[j + k] = i * (grid + 1) + j
        best = new
        picks.append(arg)
    j = min(range(grid + 1), key=lambda x: best[x])
    if best[j] == inf:
        return None
    out = []
    for arg in reversed(picks):
        i, j = divmod(arg[j], grid + 1)
        out.append(i)
    return out[::-1]


def _as_groups(groups: int | list[range]) -> list[range]:
    return [range(i, i + 1) for i in range(groups)] if isinstance(groups, int) else list(groups)


def layer_groups(layers: int, count: int | None) -> list[range]:
    """``layers`` consecutive layers cut into ``count`` groups as equal as possible, the larger ones first
    (None: :data:`AUTO_GROUPS` groups at most; one layer a group on a shallower model)."""
    n = min(layers, AUTO_GROUPS if count is None else count)
    size, extra = divmod(layers, n)
    out, first = [], 0
    for g in range(n):
        last = first + size + (1 if g < extra else 0)
        out.append(range(first, last))
        first = last
    return out


def _units(groups: int | list[range], split: bool) -> list[tuple[int, int]]:
    return [(g, side) for g in range(len(_as_groups(groups))) for side in ((0, 1) if split else (0,))]


def _setting(levels: dict[tuple[int, int], Any], groups: int | list[range], split: bool) -> list[tuple[Any, Any]]:
    """The per-layer setting (keys, values) of per-unit levels: every layer of a group at its group's levels."""
    return [(levels[(g, 0)], levels[(g, 1)] if split else levels[(g, 0)])
            for g, rng in enumerate(_as_groups(groups)) for _ in rng]


def _levels(setting: list[tuple[Any, Any]], groups: int | list[range], split: bool) -> dict[tuple[int, int], Any]:
    """The per-unit levels of a per-layer setting (a group's first layer speaks for it)."""
    out = {}
    for g, rng in enumerate(_as_groups(groups)):
        k, v = setting[rng.start]
        out[(g, 0)] = k
        if split:
            out[(g, 1)] = v
    return out


def span(rng: range) -> str:
    """A group's layers as the reports print them: ``3`` or ``0-4``."""
    return str(rng.start) if len(rng) == 1 else f"{rng.start}-{rng.stop - 1}"


def _group_name(groups: list[range], g: int) -> str:
    return f"{'layer' if len(groups[g]) == 1 else 'layers'} {span(groups[g])}"


def _unit_bytes(uniform: dict[tuple[Any, Any], Any], ladder: Sequence[Any], layers: int,
                split: bool, groups: int | list[range] | None = None) -> dict[tuple[int, int, Any], float]:
    """Bytes of each unit at each level, from the KV ops' byte counts of the uniform runs (a group's: the
    sum of its layers')."""
    out: dict[tuple[int, int, Any], float] = {}
    for lv in ladder:
        cand = uniform[(lv, lv)]
        ops = [o for o in cand.figures().get("kv_ops", []) if o["op"] != "tract_transformers_dyn_kv_cache"]
        if not ops:
            raise InputError(f"--auto-bits: the uniform run at {lv} failed: {cand.row.reason if cand.row else '?'}")
        if len(ops) == layers:  # one fused op a layer: keys and values halves
            per = [(o["bytes"] / 2, o["bytes"] / 2) for o in ops]
        else:  # one cache op per layer and role, in graph order; the role from the node's name
            per = []
            for i in range(layers):
                a, b = ops[2 * i], ops[2 * i + 1]
                if "value" in a["node"] and "value" not in b["node"]:
                    a, b = b, a
                per.append((a["bytes"], b["bytes"]))
        for g, rng in enumerate(_as_groups(layers if groups is None else groups)):
            k, v = sum(per[i][0] for i in rng), sum(per[i][1] for i in rng)
            if split:
                out[(g, 0, lv)], out[(g, 1, lv)] = k, v
            else:
                out[(g, 0, lv)] = k + v
    return out
