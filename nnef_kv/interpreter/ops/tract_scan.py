"""The loop of tract's ``tract_core_scan``, for the graph builder to drive.

``tract_core_scan`` cannot be a plain kernel: its ``body`` names a document fragment, and its tensors
sit inside arrays of tuples (``scan = [("x", x, 0, 1)]``). The graph builder resolves those (building the
body fragment into a callable sub-graph) and hands them to :class:`ScanLoop`, which does what tract's
``OptScan`` does (``sonos/tract`` ``core/src/ops/scan/optimized.rs``, ``nnef/src/ops/core/scan.rs``):

* iterations = ``ceil(len(scan input along axis) / |chunk|)`` (the first scan input decides);
* each iteration the body gets, by parameter name: a chunk of every scan input (``chunk < 0`` walks
  backwards from the end, each chunk reversed), every full input whole, and every state: the
  initializer on the first iteration, then the body result named in the state tuple;
* outputs, in the order of the ``output`` tuples: ``"full"`` concatenates the body result along its
  axis (backwards when ``chunk < 0``), ``"last"`` is the result of the final iteration;
* the hidden state persists across runs of the session unless ``reset_every_turn`` (tract's pulse
  semantics); ``skip`` iterations (counted across runs) produce nothing.

``ScanLoop`` is a :class:`~nnef_kv.core.registry.KvState` (the session's state interface), so a session can
keep, reset, save and reload it like any stateful node. It is *not* registered as a primitive.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from ...errors import GraphError, StateError
from ...core.registry import KvState

Body = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class ScanSpec:
    """The static part of a ``tract_core_scan`` invocation.

    scan: ``(body parameter, axis, chunk)`` per scanned input; full: body parameters given whole;
    state: ``(body parameter, body result that feeds it next iteration)``;
    outputs: ``(body result, "full" | "last", axis, chunk)`` in the op's output order.
    """

    scan: tuple[tuple[str, int, int], ...]
    full: tuple[str, ...] = ()
    state: tuple[tuple[str, str], ...] = ()
    outputs: tuple[tuple[str, str, int, int], ...] = ()
    skip: int = 0
    reset_every_turn: bool = False
    name: str = "tract_core_scan"

    def __post_init__(self) -> None:
        if not self.scan:
            raise GraphError(f"{self.name}: at least one scanned input is needed")
        for result, kind, _axis, chunk in self.outputs:
            if kind not in ("full", "last"):
                raise GraphError(f"{self.name}: output {result!r} must be 'full' or 'last', got {kind!r}")
            if kind == "full" and chunk == 0:
                raise GraphError(f"{self.name}: output {result!r} has chunk 0")
        for param, _axis, chunk in self.scan:
            if chunk == 0:
                raise GraphError(f"{self.name}: scanned input {param!r} has chunk 0")


def _slice_chunk(x: np.ndarray, axis: int, i: int, chunk: int) -> np.ndarray:
    n = x.shape[axis]
    c = abs(chunk)
    moved = np.moveaxis(x, axis, 0)
    out = np.zeros((c,) + moved.shape[1:], dtype=x.dtype)  # a short last chunk is zero-padded
    if chunk < 0:
        for j in range(c):
            src = n - 1 - (i * c + j)
            if src >= 0:
                out[c - 1 - j] = moved[src]
    else:
        part = moved[i * c : min((i + 1) * c, n)]
        out[: part.shape[0]] = part
    return np.moveaxis(out, 0, axis)


class ScanLoop(KvState):
    """One ``tract_core_scan`` node: ``loop(scan_inputs, full_inputs, state_inits)`` -> outputs tuple."""

    def __init__(self, spec: ScanSpec, body: Body) -> None:
        self.spec = spec
        self.body = body
        self.hidden: dict[str, np.ndarray] | None = None
        self.position = 0

    def __call__(
        self,
        scan_inputs: Sequence[np.ndarray],
        full_inputs: Sequence[np.ndarray] = (),
        state_inits: Sequence[np.ndarray] = (),
    ) -> tuple[np.ndarray, ...]:
        sp = self.spec
        if len(scan_inputs) != len(sp.scan) or len(full_inputs) != len(sp.full) or len(state_inits) != len(sp.state):
            raise GraphError(f"{sp.name}: got {len(scan_inputs)}/{len(full_inputs)}/{len(state_inits)} scan/full/state "
                             f"tensors, the invocation declares {len(sp.scan)}/{len(sp.full)}/{len(sp.state)}")
        scans = [np.asarray(a) for a in scan_inputs]
        fulls = {name: np.asarray(a) for name, a in zip(sp.full, full_inputs)}
        _, axis0, chunk0 = sp.scan[0]
        iters = -(-scans[0].shape[axis0] // abs(chunk0))
        if sp.reset_every_turn or self.hidden is None:
            self.hidden = {param: np.asarray(a).copy() for (param, _), a in zip(sp.state, state_inits)}
        pieces: dict[int, list[tuple[int, np.ndarray]]] = {k: [] for k in range(len(sp.outputs))}
        last: dict[int, np.ndarray] = {}
        for i in range(iters):
            self.position += 1
            if self.position <= sp.skip:
                continue
            feed = dict(fulls)
            feed.update(self.hidden)
            for (param, axis, chunk), x in zip(sp.scan, scans):
                feed[param] = _slice_chunk(x, axis, i, chunk)
            try:
                res = self.body(feed)
            except GraphError:
                raise
            except Exception as exc:  # a kernel failing inside the body: say where
                raise GraphError(f"{sp.name}: body failed at iteration {i}: {exc}") from exc
            for param, result in sp.state:
                if result not in res:
                    raise GraphError(f"{sp.name}: the body has no result {result!r} for state {param!r}")
                self.hidden[param] = np.asarray(res[result])
            for k, (result, kind, _axis, _chunk) in enumerate(sp.outputs):
                if result not in res:
                    raise GraphError(f"{sp.name}: the body has no result {result!r}")
                if kind == "full":
                    pieces[k].append((i, np.asarray(res[result])))
                elif i == iters - 1:
                    last[k] = np.asarray(res[result])
        outs: list[np.ndarray] = []
        for k, (result, kind, axis, chunk) in enumerate(sp.outputs):
            if kind == "last":
                if k not in last:
                    raise GraphError(f"{sp.name}: no iteration ran, output {result!r} has no value")
                outs.append(last[k])
                continue
            if not pieces[k]:
                raise GraphError(f"{sp.name}: no iteration ran, output {result!r} has no value")
            sample = pieces[k][0][1]
            step = sample.shape[axis]
            shape = list(sample.shape)
            shape[axis] = step * iters
            full = np.zeros(shape, dtype=sample.dtype)
            mv = np.moveaxis(full, axis, 0)
            for i, v in pieces[k]:
                vv = np.moveaxis(v, axis, 0)
                off = (shape[axis] - 1 - i * step) if chunk < 0 else i * step
                count = min(step, shape[axis] - off)
                mv[off : off + count] = vv[:count]
            outs.append(full)
        return tuple(outs)

    # KvState interface -----------------------------------------------------------------
    def reset(self) -> None:
        self.hidden = None
        self.position = 0

    def checkpoint(self) -> tuple[dict[str, np.ndarray] | None, int]:
        """Token for :meth:`rollback`, O(number of state tensors): a run replaces the hidden tensors, never
        writes into them."""
        return (None if self.hidden is None else dict(self.hidden)), self.position

    def rollback(self, token: tuple[dict[str, np.ndarray] | None, int]) -> None:
        hidden, self.position = token
        self.hidden = None if hidden is None else dict(hidden)

    def state_tensors(self) -> dict[str, np.ndarray]:
        if self.hidden is None:
            return {}
        out = {f"state:{k}": v.copy() for k, v in self.hidden.items()}
        out["position"] = np.asarray(self.position, dtype=np.int64)
        return out

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        if not tensors:
            self.reset()
            return
        want = {f"state:{p}" for p, _ in self.spec.state} | {"position"}
        if set(tensors) != want:
            raise StateError(f"{self.spec.name}: expected saved states {sorted(want)}, got {sorted(tensors)}")
        self.hidden = {k[len("state:"):]: np.asarray(v).copy() for k, v in tensors.items() if k.startswith("state:")}
        self.position = int(np.asarray(tensors["position"]))

    def nbytes(self) -> dict[str, int]:
        held = 0 if self.hidden is None else sum(int(v.nbytes) for v in self.hidden.values())
        return {"codes": 0, "params": 0, "full_precision": held}
