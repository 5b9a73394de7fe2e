"""Sessions: run a planned model, own the state of its stateful nodes (KV caches).

``Session(model)`` plans the model once (the plan is cached on the model object) and creates one state
object per stateful node with ``primitive.state_factory(**attrs)``. ``run`` checks every input first, so a
refused run leaves the state untouched, and a run failing later puts every state back as it was (a run is
all-or-nothing for state). Two sessions of one model share the plan, never state.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from typing import Any, Mapping

import numpy as np

from ..atomic import atomic_write
from ..errors import GraphError, InputError, NnefKvError, StateError, clip
from .graph import Node
from .graph import slots_of as _slots_of
from .plan import Plan, bind_inputs, execute, get_plan
from .plan.parallel import BLAS, THREADS_ENV, check_threads, run_threads
from .plan.steps import symbolic_attrs as _symbolic_attrs
from ..core.registry import NO_CHECKPOINT, KvState

STATE_FORMAT = "nnef-kv-session-state"
STATE_MANIFEST = "state.json"


def _join(parts: list[Any], lens: list[int], what: str) -> Any:
    """The values of consecutive chunks of a stepwise run (chunk ``i`` brought ``lens[i]`` tokens, two
    lengths at least differ): concatenated along the one axis whose length is each chunk's token count
    (a per-token value), else the last one (an accumulated value, e.g. an explicit cache)."""
    arrays = [np.asarray(p) for p in parts]
    shapes = [a.shape for a in arrays]
    if len({len(sh) for sh in shapes}) != 1:
        return parts[-1]
    rank = len(shapes[0])
    cand = [ax for ax in range(rank)
            if all(sh[ax] == n for sh, n in zip(shapes, lens))
            and all(sh[:ax] + sh[ax + 1:] == shapes[0][:ax] + shapes[0][ax + 1:] for sh in shapes)]
    if not cand:
        return parts[-1]
    if len(cand) > 1:
        raise InputError(f"stepwise: {what} has several axes of the chunk's token count {shapes}: cannot join")
    return np.concatenate(arrays, axis=cand[0])


class Session:
    """Runs a model; holds one state per stateful node.

    ``outputs = session.run({"input": x})`` returns a dict by output name in the graph's output order.
    """

    def __init__(self, model: Any, state: str | os.PathLike | None = None, threads: int | None = None, *,
                 prepare_weights: bool = True) -> None:
        """``threads = 2``: large products by constant weights run as two column halves, one on a helper
        thread (:mod:`nnef_kv.interpreter.plan.parallel`); ``threads = 1``: everything on the calling thread;
        None (the default): the usable CPUs, at most 2. Whatever the value, BLAS itself runs on one thread
        while the session runs (its own threads collapse on a loaded machine; see the thread policy there).
        ``prepare_weights=False``: a throwaway session on a plan of its own that leaves the weights as the
        archive holds them (nothing transposed, joined or dequantized for it; slower products): what
        :func:`~nnef_kv.interpreter.check.check_model` runs."""
        self.threads = check_threads(threads)
        #: left at the default: a run goes on one thread while other processes hold the CPUs (plan/parallel.py)
        self.auto_threads = threads is None and not os.environ.get(THREADS_ENV)
        self.model = model
        self.plan = get_plan(model, prepare_weights=prepare_weights)
        self.states: list[KvState] = []
        self._stale: str | None = None  # set when a failed run could not be rolled back (see _rollback)
        for _, node in self.plan.stateful:
            factory = node.prim.state_factory
            assert factory is not None
            try:
                self.states.append(factory(**_symbolic_attrs(node.attrs)))
            except NnefKvError:
                raise
            except Exception as exc:
                raise GraphError(f"{node.location}: cannot create the state of {node.op} '{node.name}': {exc}") from exc
        if state is not None:
            self.load_state(state)

    # -- running -------------------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        return self.plan.input_names

    @property
    def output_names(self) -> list[str]:
        return self.plan.output_names

    def run(self, inputs: dict[str, Any], capture: Any = None, *, stepwise: bool = False,
            capture_map: Any = None, token_symbol: str | None = None) -> Any:
        """Run the graph once on ``inputs`` (by input name); returns outputs by name, in graph order.

        ``capture``: intermediate tensors to return too, each named by an identifier of the graph body
        (its first assignment; else a node name, e.g. ``"t.inner"`` inside an expanded fragment or
        ``"x#1"`` for a later one) or given as a node of ``plan.step_nodes`` (its first output, keyed by
        the node's name: exact for tools that pick nodes by op). Then the result is
        ``(outputs, {name: array})``; the arrays are the run's own values (not copies: do not write into
        them). An unknown name is an InputError raised before anything runs. Captured values are kept
        alive; the normal path (no ``capture``) is unchanged. ``capture_map``: a function applied to each
        captured value as soon as it is computed (e.g. ``lambda a: a[..., -1:, :].copy()``); its result is
        returned instead and the value itself is freed as usual (bounded memory for long runs).

        ``stepwise=True``: the run's ``C`` new tokens (along the token symbol of the integer input, e.g.
        ``S`` of ``input_ids [1, S]``) are answered exactly as ``C`` one-token runs would have been, and the
        same state is left behind, while each weight product runs once for the ``C`` tokens. Stateful
        nodes run their ``stepwise`` form (the KIVI op vectorised, tract's fused ops token by token
        inside the op, exact f32 caches as usual); a slice keeping only the last token passes all of
        them through, so an output a one-token run gives for its token (the logits of torch-to-nnef
        exports) comes out for every token, along that axis; an accumulated output (an explicit
        ``out_cache_*``) comes out as after the last token. A state that needs it (tract's quantized
        dyn cache) cuts the run into chunks at its block boundaries, each run as one call.
        ``token_symbol``: the symbol counting the tokens (default: :meth:`token_inputs` finds it).

        A kernel failing raises ``file:line:col: node 'name' (op): message`` (GraphError, or the
        kernel's own nnef-kv error type)."""
        plan = self.plan
        if not isinstance(inputs, Mapping):
            from ..errors import ArgumentError, describe, names as _names

            raise ArgumentError(f"session.run: inputs must be a dict of input name -> array (the graph's inputs: "
                                f"{_names(plan.input_names)}), got {describe(inputs)}")
        names: list[str] = []
        slots: list[int] = []
        if capture is not None:
            wanted = [capture] if isinstance(capture, (str, Node)) else list(capture)
            names = [w.name if isinstance(w, Node) else str(w) for w in wanted]
            slots = self._capture_slots(wanted)
            if plan.elided.intersection(slots):  # a fused producer's value: run the unfused plan
                plan = plan.unfused()
        if stepwise:
            outs, caps = self._run_stepwise(plan, inputs, slots, capture_map, token_symbol)
        elif capture is None and not self.states:  # the decode path of stateless graphs: nothing else to do
            v = bind_inputs(plan, inputs)
            with BLAS:
                execute(plan, v, self.states, threads=run_threads(self.threads, self.auto_threads))
            return {name: v[slot] for name, slot in plan.outputs}
        else:
            v = bind_inputs(plan, inputs, self._state_symbols() if self.states else None)
            outs, caps = self._execute(plan, v, slots, capture_map)
        return outs if capture is None else (outs, dict(zip(names, caps)))

    def _execute(self, plan: Plan, v: list, slots: list[int], capture_map: Any, checkpoint: bool = True
                 ) -> tuple[dict[str, Any], list[Any]]:
        """Execute ``plan`` on the bound values ``v``; returns (outputs, captured values in ``slots`` order).
        ``checkpoint``: all-or-nothing for the states (else the caller holds the checkpoint)."""
        keep: frozenset[int] = frozenset()
        taps = None
        got: dict[int, Any] = {}
        if slots:
            if capture_map is None:
                keep = frozenset(slots)
            else:
                taps = {s: (lambda x, s=s: got.__setitem__(s, capture_map(x))) for s in set(slots)}
        marks = self._checkpoint() if (checkpoint and self.states) else None
        try:
            with BLAS:
                execute(plan, v, self.states, keep, run_threads(self.threads, self.auto_threads), taps)
        except BaseException as exc:
            if marks is not None:
                self._rollback(marks, exc)
            raise
        outs = {name: v[slot] for name, slot in plan.outputs}
        return outs, [v[s] if capture_map is None else got[s] for s in slots]

    # -- stepwise runs -------------------------------------------------------------------------
    def token_inputs(self, token_symbol: str | None = None) -> tuple[str, dict[str, int]]:
        """``(symbol, {input name: axis})``: the symbol counting a run's new tokens and the inputs carrying it:
        ``token_symbol`` when given, else the one symbolic dim of the integer inputs (``S`` of ``input_ids
        [1, S]``), else, with no integer input carrying one, the one symbol every input with a symbolic dim
        shares (``S`` of an attention op's ``q``, ``k``, ``v`` ``[1, H, S, D]``)."""
        dims = {spec.name: {d for d in spec.shape if isinstance(d, str)} for spec in self.plan.inputs}
        if token_symbol is not None:
            every = set().union(*dims.values()) if dims else set()
            if token_symbol not in every:
                raise InputError(f"stepwise: token_symbol={token_symbol!r} is no symbolic dim of the inputs "
                                 f"({', '.join(sorted(every)) or 'they have none'})")
            syms = {token_symbol}
        else:
            syms = {d for spec in self.plan.inputs if np.dtype(spec.dtype).kind in "iu" for d in dims[spec.name]}
            if not syms:
                carried = [d for d in dims.values() if d]
                syms = set.intersection(*carried) if carried else set()
                what = "the inputs share"
            else:
                what = "the integer inputs have"
            if len(syms) != 1:
                found = "no symbolic dim" if not syms else "the symbolic dims " + ", ".join(sorted(syms))
                raise InputError(f"stepwise: cannot tell which symbol counts the tokens: {what} {found}; name it "
                                 f"(token_symbol=...)")
        sym = syms.pop()
        axes = {spec.name: spec.shape.index(sym) for spec in self.plan.inputs if sym in spec.shape}
        return sym, axes

    def _run_stepwise(self, plan: Plan, inputs: dict[str, Any], slots: list[int], capture_map: Any,
                      token_symbol: str | None = None) -> tuple[dict[str, Any], list[Any]]:
        sym, axes = self.token_inputs(token_symbol)
        for (_, node), st in zip(self.plan.stateful, self.states):
            if not st.has_stepwise():
                raise InputError(f"{node.location}: stepwise: {node.op} '{node.name}' has no stepwise run")
        tslot = plan.graph.symbols[sym]
        splan = plan.stepwise(tslot)
        v = bind_inputs(splan, inputs, self._state_symbols() if self.states else None)
        c = int(v[tslot])
        cuts = sorted({int(i) for st in self.states for i in st.stepwise_splits(c) if 0 < int(i) < c})
        if not cuts:
            return self._execute(splan, v, slots, capture_map)
        other = [spec.name for spec in plan.inputs
                 if spec.name not in axes and any(not isinstance(d, (int, np.integer)) for d in spec.shape)]
        if other:
            raise InputError(f"stepwise: the run must be cut into chunks (a state needs it) but input "
                             f"'{other[0]}' does not carry the tokens ({sym}) and cannot be cut")
        bounds = [0, *cuts, c]
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        if len(set(lens)) == 1 and lens[-1] > 1:  # unequal lengths tell a token axis from the others
            bounds.insert(-1, c - 1)
            lens = [b - a for a, b in zip(bounds, bounds[1:])]
        marks = self._checkpoint()
        results: list[tuple[dict[str, Any], list[Any]]] = []
        try:
            for a, b in zip(bounds, bounds[1:]):
                sub = {}
                for name, x in inputs.items():
                    if name in axes:
                        x = np.asarray(x)
                        sub[name] = x[(slice(None),) * axes[name] + (slice(a, b),)]
                    else:
                        sub[name] = x
                vv = bind_inputs(splan, sub, self._state_symbols())
                results.append(self._execute(splan, vv, slots, capture_map, checkpoint=False))
        except BaseException as exc:
            self._rollback(marks, exc)
            raise
        outs = {name: _join([r[0][name] for r in results], lens, f"output '{name}'") for name, _ in plan.outputs}
        caps = [_join([r[1][i] for r in results], lens, "a captured value") for i in range(len(slots))]
        return outs, caps

    # -- all-or-nothing runs -------------------------------------------------------------------
    def _checkpoint(self) -> list[Any]:
        """Before a run: every state's ``checkpoint()`` (O(1) for every KV state and scan). A state that
        cannot take one cheaply answers :data:`~.registry.NO_CHECKPOINT` (a copy could cost O(cache) every
        run): a failed run then marks the session stale instead (see :meth:`_rollback`)."""
        if self._stale is not None:
            raise StateError(self._stale)
        return [s.checkpoint() for s in self.states]

    def _rollback(self, marks: list[Any], cause: BaseException) -> None:
        """A run failed: put every state that can be rolled back as :meth:`_checkpoint` found it. If some
        state cannot be (it took no checkpoint), the session refuses further runs until :meth:`reset` or
        :meth:`load_state`, rather than continue from a state the failed run may have advanced."""
        stale = []
        for (_, node), s, mark in zip(self.plan.stateful, self.states, marks):
            if mark is NO_CHECKPOINT:
                stale.append(f"'{node.name}' ({node.op})")
                continue
            try:
                s.rollback(mark)
            except Exception as exc:  # noqa: BLE001 - reported with the node, the run's own error as cause
                raise StateError(f"{node.location}: node '{node.name}' ({node.op}): the run failed ({cause}) and "
                                 f"its state could not be restored: {exc}") from cause
        if stale:
            self._stale = (f"a previous run failed ({type(cause).__name__}: {cause}) after the state of "
                           f"{', '.join(stale)} may have changed; call session.reset() or session.load_state(...)")

    def _capture_slots(self, wanted: list[Any]) -> list[int]:
        out = []
        for n in wanted:
            if isinstance(n, Node):
                if not n.outputs:
                    raise InputError(f"capture: node '{n.name}' has no output")
                out.append(_slots_of(n.outputs[0])[0])
                continue
            slot = self.plan.slot_of(str(n))
            if slot is None:
                raise InputError(f"capture: no tensor named '{n}' in the graph (an identifier of its body or a "
                                 f"node name)")
            out.append(slot)
        return out

    __call__ = run

    def _state_symbols(self) -> dict[str, tuple[int, str]]:
        """Symbols bound by the states (a KV cache binds ``P`` to its current length)."""
        out: dict[str, tuple[int, str]] = {}
        for (_, node), s in zip(self.plan.stateful, self.states):
            for sym, n in s.symbol_bindings().items():
                if sym in out and out[sym][0] != n:
                    raise StateError(f"symbol {sym} is {out[sym][0]} in {out[sym][1]} but {n} in '{node.name}'")
                out.setdefault(sym, (int(n), f"state of '{node.name}'"))
        return out

    def reset(self) -> None:
        """Forget everything the stateful nodes accumulated (a new sequence)."""
        for s in self.states:
            s.reset()
        self._stale = None

    # -- KV accounting -------------------------------------------------------------------------
    def kv_cache_bytes(self) -> dict[str, int]:
        """Bytes held by all stateful nodes, summed key by key, plus ``total`` = codes+params+full_precision."""
        out: dict[str, int] = {"codes": 0, "params": 0, "full_precision": 0}
        for s in self.states:
            for k, n in s.nbytes().items():
                out[k] = out.get(k, 0) + int(n)
        out["total"] = out["codes"] + out["params"] + out["full_precision"]
        return out

    # -- state persistence ---------------------------------------------------------------------
    def save_state(self, path: str | os.PathLike) -> None:
        """Write every state's tensors as ``.dat`` files in a tar archive, with a manifest naming the model."""
        from ..tensors.dat import write_tensor
        from ..targets import path_arg

        path = path_arg(path, "session.save_state", "the path of the state file to write")
        manifest: dict[str, Any] = {"format": STATE_FORMAT, "version": 1, "model": self.plan.fingerprint,
                                    "nodes": []}
        members: list[tuple[str, bytes]] = []
        for (k, node), s in zip(self.plan.stateful, self.states):
            tensors = s.state_tensors()
            entry = {"index": k, "name": node.name, "op": node.op, "tensors": {}}
            for tname, arr in tensors.items():
                member = f"state/{k}/{tname}.dat"
                buf = io.BytesIO()
                write_tensor(buf, np.ascontiguousarray(arr))
                members.append((member, buf.getvalue()))
                entry["tensors"][tname] = member
            manifest["nodes"].append(entry)
        members.insert(0, (STATE_MANIFEST, json.dumps(manifest, indent=1).encode()))
        with atomic_write(path) as f:
            with tarfile.open(fileobj=f, mode="w") as tar:
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    info.mode = 0o644
                    tar.addfile(info, io.BytesIO(data))

    def load_state(self, path: str | os.PathLike) -> None:
        """Restore states written by :meth:`save_state`; a state of another model -> StateError."""
        from ..tensors.dat import read_tensor
        from ..targets import kind_of, path_arg, resolve

        path = path_arg(path, "session.load_state", "the path of a state file written by save_state")
        kind = kind_of(resolve(path))
        if kind != "file":
            raise StateError(f"{path}: {'no such file' if kind == 'absent' else 'is a ' + kind}: not a saved session "
                             f"state")
        try:
            with tarfile.open(path, mode="r") as tar:
                files: dict[str, bytes] = {}
                for m in tar.getmembers():
                    if not m.isfile():
                        continue
                    fh = tar.extractfile(m)
                    if fh is not None:
                        files[m.name] = fh.read()
        except tarfile.TarError:
            raise StateError(f"{path}: not a saved session state (not a tar archive)") from None
        except OSError as exc:
            raise StateError(f"{path}: not a saved session state: {clip(' '.join(str(exc).split()), 120)}") from None
        if STATE_MANIFEST not in files:
            raise StateError(f"{path}: no {STATE_MANIFEST} (not a saved session state)")
        try:
            manifest = json.loads(files[STATE_MANIFEST])
        except ValueError as exc:
            raise StateError(f"{path}: damaged manifest: {exc}") from None
        if manifest.get("format") != STATE_FORMAT:
            raise StateError(f"{path}: not a saved session state (format {manifest.get('format')!r})")
        if manifest.get("model") != self.plan.fingerprint:
            raise StateError(f"{path}: the state was saved from another model")
        entries = manifest.get("nodes", [])
        if len(entries) != len(self.states):
            raise StateError(f"{path}: {len(entries)} stateful nodes saved, the model has {len(self.states)}")
        loaded: list[dict[str, np.ndarray]] = []
        for (k, node), entry in zip(self.plan.stateful, entries):
            if entry.get("name") != node.name or entry.get("op") != node.op:
                raise StateError(f"{path}: saved node {entry.get('name')!r} does not match '{node.name}'")
            tensors = {}
            for tname, member in entry.get("tensors", {}).items():
                if member not in files:
                    raise StateError(f"{path}: missing {member}")
                try:
                    tensors[tname] = read_tensor(io.BytesIO(files[member]))
                except NnefKvError as exc:
                    raise StateError(f"{path}: {member}: {exc}") from None
            loaded.append(tensors)
        for s, tensors in zip(self.states, loaded):
            try:
                s.load_state_tensors(tensors)
            except StateError:
                raise
            except Exception as exc:
                raise StateError(f"{path}: cannot restore state: {exc}") from exc
        self._stale = None
