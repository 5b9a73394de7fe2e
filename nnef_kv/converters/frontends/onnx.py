"""ONNX decoder -> NNEF (through Khronos nnef-tools) with the sequence lengths kept symbolic.

nnef-tools converts static graphs only: it refuses inputs with symbolic dims and any tensor whose
shape depends on ``Shape`` ops ("Input graph contains tensors with dynamic shape", and
``--fold-constants`` needs ``onnxsim``). A decoder with a KV cache has two symbolic lengths, the
tokens of this call ``S`` and the cached tokens ``P``, and usually builds its causal mask from them.
The front end therefore:

1. names the symbolic dims: axis 1 of the integer token input is ``S``, axis 2 of the rank-4 past
   inputs (``past_key_values.*``, ``*cache*``) is ``P``; other symbolic dims (batch) become 1;
2. finds the tensors computed from shapes only (``Shape``/``Size`` outputs and what is computed
   from them and constants) where they enter the data path, evaluates them with onnxruntime at a
   few ``(S, P)`` and accepts an additive causal mask (0 where key ``j <= P + i``, a large negative
   value elsewhere, shape ``[.., S, P + S]``) or this call's positions ``arange(P, P + S)``; any
   other such tensor moves the cut one node towards the ``Shape`` ops (a positional embedding
   ``Gather(wpe, positions)`` is cut at ``positions``), and reaching a ``Shape`` op is an error;
3. cuts those tensors off (they become inputs), fixes ``S`` and ``P`` to sentinel sizes that occur
   nowhere else in the model, and runs ``python -m nnef_tools.convert --input-format onnx
   --output-format nnef --keep-io-names``;
4. reads the result, turns the sentinel sizes back into ``S``, ``P``, ``P + S`` (declared
   ``extension tract_symbol``), and rebuilds each cut mask and positions tensor inside the graph
   from ``P`` and ``S`` (``tract_core_range``, ``gt``, as torch-to-nnef writes it), so the graph's
   inputs are the tokens and the past caches only; Khronos ``gather`` becomes ``tract_core_gather``
   (same parameters; tract 0.23.9 has no ``gather``).

The result is an f32 NNEF model that runs any ``(S, P)`` step with the cache fed explicitly; the
converter passes then turn it into a quantized-KV archive.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError
from ...grammar import ast as A
from ..graph_edit import invocation
from ..masks import pattern
from .base import FrontEnd

SHAPE_OPS = ("Shape", "Size")
#: Khronos stdlib ops nnef-tools writes that tract 0.23.9 lacks, and tract's op with the same
#: parameters (so the converted archives also load in tract).
TRACT_NAMES = {"gather": "tract_core_gather"}
SENTINELS = ((37, 41), (43, 53), (59, 67), (71, 79), (83, 89), (97, 101))
MASK_PROBES = ((3, 0), (1, 4), (2, 5), (4, 3))


@dataclass
class OnnxImport:
    """What :func:`onnx_to_nnef` did."""

    source: str
    seq_symbol: str = "S"
    past_symbol: str = "P"
    token_input: str | None = None
    past_inputs: list[str] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # ONNX name -> NNEF name (inputs/outputs)
    masks: dict[str, float] = field(default_factory=dict)  # cut tensor -> fill value of masked entries
    mask_ranks: dict[str, int] = field(default_factory=dict)  # cut tensor -> its rank
    positions: list[str] = field(default_factory=list)  # cut tensors holding arange(P, P + S)
    sentinels: tuple[int, int] = (0, 0)
    fixed_dims: list[str] = field(default_factory=list)  # other symbolic dims fixed to 1
    nnef_tools_log: str = ""


def nnef_name(name: str) -> str:
    """The identifier nnef-tools writes for an ONNX tensor name (``past_key_values.0.key`` ->
    ``past_key_values_0_key``)."""
    s = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return s if s and not s[0].isdigit() else f"_{s}"


def _dims(vi: Any) -> list[Any]:
    out: list[Any] = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        else:
            out.append(d.dim_param or None)
    return out


def _tainted(graph: Any) -> tuple[set[str], list[str]]:
    """Tensors computed from shapes only (``Shape``/``Size`` outputs and what is computed from them
    and constants), and the boundary ones read by the data path or the outputs."""
    const = {t.name for t in graph.initializer}
    tainted: set[str] = set()
    node_tainted: list[bool] = []
    for n in graph.node:  # ONNX nodes are topologically sorted
        ins = [i for i in n.input if i]
        if not ins and n.op_type == "Constant":
            const.update(n.output)
            node_tainted.append(False)
            continue
        t = n.op_type in SHAPE_OPS or (any(i in tainted for i in ins) and all(i in tainted or i in const for i in ins))
        node_tainted.append(t)
        if t:
            tainted.update(o for o in n.output if o)
    boundary: list[str] = []
    for n, t in zip(graph.node, node_tainted):
        if t:
            continue
        for i in n.input:
            if i in tainted and i not in boundary:
                boundary.append(i)
    for o in graph.output:
        if o.name in tainted and o.name not in boundary:
            boundary.append(o.name)
    return tainted, boundary


def _feeds(
    model: Any, roles: dict[str, tuple[str, int]], s: int, p: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    import onnx

    feeds = {}
    for vi in model.graph.input:
        dims = [1 if isinstance(d, str) or d is None else d for d in _dims(vi)]
        if vi.name in roles:
            role, axis = roles[vi.name]
            dims[axis] = s if role == "S" else p
        et = vi.type.tensor_type.elem_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(et)
        if np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, 2, size=dims).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def _classify(model: Any, boundary: list[str], roles: dict[str, tuple[str, int]], where: str,
              ranks: dict[str, int], failed: dict[str, str]) -> tuple[dict[str, float], list[str]]:
    """Evaluate the boundary tensors with onnxruntime at a few ``(S, P)``; each must be an additive
    causal mask ``[1.., S, P + S]`` or the positions of this call ``arange(P, P + S)`` as ``[1.., S]``.
    Returns (mask -> fill value, position tensors); the others go to ``failed`` with a reason."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    for b in boundary:
        if b not in known:
            probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(b))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    kinds: dict[str, str] = {}
    fills: dict[str, float] = {}
    for s, p in MASK_PROBES:
        res = sess.run(boundary, _feeds(model, roles, s, p, rng))
        for b, val in zip(boundary, res):
            v = np.asarray(val)
            ranks[b] = v.ndim
            t = p + s
            kind = None
            if v.ndim >= 2 and v.shape[-2:] == (s, t) and all(d == 1 for d in v.shape[:-2]) \
                    and np.issubdtype(v.dtype, np.floating):
                m = v.reshape(s, t)
                future = np.arange(t)[None, :] > (p + np.arange(s))[:, None]
                read = pattern(m, s, p)[0]  # the converter's own reading of a mask (converters/masks.py)
                if read == "causal" or (read == "full" and not future.any()):
                    kind = "mask"
                    if future.any():
                        fills.setdefault(b, float(m[future].max()))
            if kind is None and v.ndim >= 1 and v.shape[-1] == s and all(d == 1 for d in v.shape[:-1]) \
                    and np.issubdtype(v.dtype, np.integer) and np.array_equal(v.reshape(s), np.arange(p, p + s)):
                kind = "positions"
            if kind is None or kinds.setdefault(b, kind) != kind:
                kinds[b] = ""
                failed.setdefault(b, f"at S={s}, P={p} it has shape {list(v.shape)}, dtype {v.dtype}")
    masks = {b: fills.get(b, -1e9) for b, k in kinds.items() if k == "mask"}
    return masks, [b for b, k in kinds.items() if k == "positions"]


def _find_cut(model: Any, roles: dict[str, tuple[str, int]], where: str, ranks: dict[str, int],
              ) -> tuple[set[str], list[str], dict[str, float], list[str]]:
    """The shape-derived tensors to cut and rebuild: start from where they meet the data path and
    move the cut towards the ``Shape`` ops until every cut tensor is a mask or positions."""
    tainted, boundary = _tainted(model.graph)
    producer = {o: n for n in model.graph.node for o in n.output}
    for _ in range(64):
        if not boundary:
            return tainted, [], {}, []
        failed: dict[str, str] = {}
        masks, positions = _classify(model, boundary, roles, where, ranks, failed)
        if not failed:
            return tainted, boundary, masks, positions
        new: list[str] = [b for b in boundary if b not in failed]
        for b in failed:
            node = producer.get(b)
            ins = [i for i in (node.input if node is not None else ()) if i in tainted]
            if node is None or node.op_type in SHAPE_OPS or not ins:
                raise ConversionError(
                    f"{where}: ONNX tensor '{b}' is computed from tensor shapes (Shape/Size) and is neither an "
                    f"additive causal mask nor the positions arange(P, P + S) ({failed[b]}); nnef-tools converts "
                    "static graphs only, so the front end rebuilds those two and nothing else")
            tainted.difference_update(node.output)
            new += [i for i in ins if i not in new]
        boundary = new
    raise ConversionError(f"{where}: could not isolate the shape computations of the model")


def _pick_sentinels(model: Any) -> tuple[int, int]:
    from onnx import numpy_helper

    used: set[int] = set()
    for vi in list(model.graph.input) + list(model.graph.output):
        used.update(d for d in _dims(vi) if isinstance(d, int))
    for init in model.graph.initializer:
        used.update(int(d) for d in init.dims)
        if init.data_type in (6, 7) and np.prod(init.dims or [1]) <= 64:  # int32/int64 shape-like values
            used.update(int(x) for x in np.asarray(numpy_helper.to_array(init)).ravel())
    for s0, p0 in SENTINELS:
        if not {s0, p0, s0 + p0} & used:
            return s0, p0
    raise ConversionError("no free sentinel sizes for S and P (every candidate occurs in the model)")


def _cut_model(model: Any, tainted: set[str], boundary: list[str], roles: dict[str, tuple[str, int]],
               s0: int, p0: int, fixed: list[str], ranks: dict[str, int], positions: list[str]) -> Any:
    import onnx
    from onnx import helper

    g = model.graph
    nodes = [n for n in g.node if not (set(n.output) & tainted)]
    used = {i for n in nodes for i in n.input} | {o.name for o in g.output}
    inputs = []
    for vi in g.input:
        dims = _dims(vi)
        for i, d in enumerate(dims):
            if vi.name in roles and roles[vi.name][1] == i:
                dims[i] = s0 if roles[vi.name][0] == "S" else p0
            elif not isinstance(d, int):
                dims[i] = 1
                fixed.append(f"{vi.name}[{i}]={d}")
        inputs.append(helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type, dims))
    for b in boundary:
        if b in positions:
            lead = [1] * max(ranks.get(b, 1) - 1, 0)
            inputs.append(helper.make_tensor_value_info(b, onnx.TensorProto.INT64, [*lead, s0]))
        else:
            lead = [1] * max(ranks.get(b, 2) - 2, 0)
            inputs.append(helper.make_tensor_value_info(b, onnx.TensorProto.FLOAT, [*lead, s0, s0 + p0]))
    outputs = [helper.make_tensor_value_info(o.name, o.type.tensor_type.elem_type, None) for o in g.output]
    inits = [t for t in g.initializer if t.name in used]
    graph = helper.make_graph(nodes, g.name or "network", inputs, outputs, inits)
    cut = helper.make_model(graph, opset_imports=list(model.opset_import))
    cut.ir_version = model.ir_version
    return cut


def _mask_statements(name: str, fill: float, rank: int, p: str, s: str) -> list[A.Assignment]:
    """``name`` = the additive causal mask ``[1.., S, P + S]`` built from the symbols."""
    def a(lhs: str, rhs: Any) -> A.Assignment:
        return A.Assignment(A.Identifier(lhs), rhs)

    fill = float(max(fill, float(np.finfo(np.float32).min)))
    pre = f"{name}_causal"
    stmts = [
        a(f"{pre}_past", A.Identifier(p)),
        a(f"{pre}_total", A.BinaryExpr("+", A.Identifier(p), A.Identifier(s))),
        a(f"{pre}_qpos", invocation("tract_core_range", A.Identifier(f"{pre}_past"), A.Identifier(f"{pre}_total"), 1)),
        a(f"{pre}_kpos", invocation("tract_core_range", 0, A.Identifier(f"{pre}_total"), 1)),
        a(f"{pre}_qcol", invocation("unsqueeze", A.Identifier(f"{pre}_qpos"), axes=[1])),
        a(f"{pre}_krow", invocation("unsqueeze", A.Identifier(f"{pre}_kpos"), axes=[0])),
        a(f"{pre}_future", invocation("gt", A.Identifier(f"{pre}_krow"), A.Identifier(f"{pre}_qcol"))),
        a(f"{pre}_futuref", invocation("tract_core_cast", A.Identifier(f"{pre}_future"), to="f32")),
    ]
    last = f"{pre}_futuref"
    if rank > 2:
        stmts.append(a(f"{pre}_2d", invocation("mul", A.Identifier(last), fill)))
        stmts.append(a(name, invocation("unsqueeze", A.Identifier(f"{pre}_2d"), axes=list(range(rank - 2)))))
    else:
        stmts.append(a(name, invocation("mul", A.Identifier(last), fill)))
    return stmts


def _positions_statements(name: str, rank: int, p: str, s: str) -> list[A.Assignment]:
    """``name`` = ``arange(P, P + S)`` with ``rank - 1`` leading unit axes."""
    pre = f"{name}_pos"
    stmts = [
        A.Assignment(A.Identifier(f"{pre}_past"), A.Identifier(p)),
        A.Assignment(A.Identifier(f"{pre}_total"), A.BinaryExpr("+", A.Identifier(p), A.Identifier(s))),
    ]
    rng = invocation("tract_core_range", A.Identifier(f"{pre}_past"), A.Identifier(f"{pre}_total"), 1)
    if rank > 1:
        stmts.append(A.Assignment(A.Identifier(f"{pre}_range"), rng))
        stmts.append(A.Assignment(A.Identifier(name), invocation("unsqueeze", A.Identifier(f"{pre}_range"),
                                                                 axes=list(range(rank - 1)))))
    else:
        stmts.append(A.Assignment(A.Identifier(name), rng))
    return stmts


def _substitute(e: Any, table: dict[int, A.Expr]) -> Any:
    """Integer literals found in ``table`` replaced by symbol expressions."""
    return A.map_leaves(e, lambda lit: table.get(lit.value, lit), (A.IntegerLiteral,))


def onnx_to_nnef(source: str | os.PathLike | Any, work_dir: str | os.PathLike | None = None,
                 ) -> tuple[Any, OnnxImport]:
    """Convert an ONNX decoder (path or ``onnx.ModelProto``) to an NNEF :class:`~nnef_kv.Model`.

    Returns the model (f32, explicit cache inputs/outputs, symbols ``S``/``P``) and an
    :class:`OnnxImport` describing the names and choices. ``work_dir`` keeps the intermediate
    files (cut ONNX model, nnef-tools output) for inspection; by default a temporary folder is used.
    """
    import onnx

    from ...io.archive import load

    if isinstance(source, (str, os.PathLike)):
        where = os.fspath(source)
        if not os.path.exists(where):
            raise ConversionError(f"{where}: no such file")
        try:
            model = onnx.load_model(where)
        except Exception as exc:  # protobuf errors
            raise ConversionError(f"{where}: not an ONNX model: {exc}") from None
    else:
        model, where = source, "<onnx model>"
    info = OnnxImport(source=where)
    g = model.graph
    init_names = {t.name for t in g.initializer}
    roles: dict[str, tuple[str, int]] = {}
    for vi in g.input:
        if vi.name in init_names:
            continue
        dims = _dims(vi)
        et = vi.type.tensor_type.elem_type
        if et in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and len(dims) == 2 and info.token_input is None:
            info.token_input = vi.name
            roles[vi.name] = ("S", 1)
        elif len(dims) == 4 and et == onnx.TensorProto.FLOAT and re.search(r"past|cache", vi.name, re.I):
            info.past_inputs.append(vi.name)
            roles[vi.name] = ("P", 2)
    if info.token_input is None:
        raise ConversionError(f"{where}: no token input (an int64 [batch, sequence] graph input) found")
    for vi in g.input:
        if vi.name in init_names or vi.name in roles:
            continue
        dims = _dims(vi)
        if any(not isinstance(d, int) for d in dims):
            raise ConversionError(
                f"{where}: graph input '{vi.name}' {dims} has symbolic dims and is neither the tokens nor a past "
                "cache; inputs such as attention_mask/position_ids are not supported (the converted graph "
                "derives the causal mask and positions from the cache length)")
    tainted, boundary, info.masks, info.positions = _find_cut(model, roles, where, info.mask_ranks)
    s0, p0 = _pick_sentinels(model)
    info.sentinels = (s0, p0)
    cut = _cut_model(model, tainted, boundary, roles, s0, p0, info.fixed_dims, info.mask_ranks, info.positions)

    tmp = None
    if work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="nnef_kv_onnx_")
        work = Path(tmp.name)
    else:
        work = Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
    try:
        cut_path, out_path = work / "cut.onnx", work / "nnef"
        onnx.save(cut, str(cut_path))
        cmd = [sys.executable, "-m", "nnef_tools.convert", "--input-format", "onnx", "--output-format", "nnef",
               "--input-model", str(cut_path), "--output-model", str(out_path), "--keep-io-names"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        info.nnef_tools_log = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0 or not (out_path / "graph.nnef").exists():
            tail = " | ".join(info.nnef_tools_log.splitlines()[-4:])
            raise ConversionError(f"{where}: nnef-tools could not convert the model: {tail}")
        nnef_model = load(out_path)
    finally:
        if tmp is not None:
            tmp.cleanup()
    _despecialize(nnef_model, info, s0, p0, where)
    nnef_model.source = f"{where} (via nnef-tools)"
    return nnef_model, info


def _despecialize(model: Any, info: OnnxImport, s0: int, p0: int, where: str) -> None:
    """Sentinel sizes back to symbols; cut masks rebuilt from the symbols."""
    from dataclasses import replace

    doc: A.Document = model.document
    g = doc.graph
    assert g is not None
    sym_s, sym_p = info.seq_symbol, info.past_symbol
    table: dict[int, A.Expr] = {s0: A.Identifier(sym_s), p0: A.Identifier(sym_p),
                                s0 + p0: A.BinaryExpr("+", A.Identifier(sym_p), A.Identifier(sym_s))}
    onnx_names = [info.token_input or ""] + info.past_inputs + list(info.masks) + info.positions
    info.names = {n: nnef_name(n) for n in onnx_names}
    masks = {nnef_name(b): fill for b, fill in info.masks.items()}
    positions = {nnef_name(b): info.mask_ranks.get(b, 1) for b in info.positions}
    body: list[A.Assignment] = []
    for st in g.body:
        lhs = st.lhs.name if isinstance(st.lhs, A.Identifier) else None
        rhs = st.rhs
        if lhs in masks:
            shape = rhs.named().get("shape") if isinstance(rhs, A.Invocation) else None
            rank = len(shape.items) if isinstance(shape, A.ArrayExpr) else 2
            body.extend(_mask_statements(lhs, masks[lhs], rank, sym_p, sym_s))
            continue
        if lhs in positions:
            body.extend(_positions_statements(lhs, positions[lhs], sym_p, sym_s))
            continue
        if isinstance(rhs, A.Invocation) and rhs.name == "variable":
            body.append(st)
            continue
        rhs = _substitute(rhs, table)
        if isinstance(rhs, A.Invocation) and rhs.name in TRACT_NAMES:
            rhs = replace(rhs, name=TRACT_NAMES[rhs.name])
        body.append(replace(st, rhs=rhs))
    cut = set(masks) | set(positions)
    inputs = tuple(n for n in g.inputs if n not in cut)
    missing = [
        n for n in cut if n in g.inputs and n not in {b.lhs.name for b in body if isinstance(b.lhs, A.Identifier)}
    ]
    if missing:
        raise ConversionError(f"{where}: cut mask(s) {missing} not found in nnef-tools' output")
    exts = list(doc.extensions)
    for name, arg in (("tract_registry", "tract_core"), ("tract_symbol", sym_s), ("tract_symbol", sym_p)):
        if not any(e.name == name and e.argument.strip() == arg for e in exts):
            exts.append(A.Extension(name, arg))
    version = doc.version or "1.0"
    model.document = replace(doc, version=version, extensions=tuple(exts),
                             graph=replace(g, inputs=inputs, body=tuple(body)))
    model.text = None


def load(path: Path) -> Any:
    """The NNEF model of the ONNX decoder at ``path`` (:func:`onnx_to_nnef`)."""
    import importlib.util

    missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConversionError(f"{path}: reading ONNX needs the {' and '.join(missing)} package(s) (and nnef-tools): "
                              "pip install -e '.[dev]'")
    return onnx_to_nnef(path)[0]


FRONTEND = FrontEnd(name="onnx", kinds="an .onnx file", load=load, suffixes=(".onnx",))
