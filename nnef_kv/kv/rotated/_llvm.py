"""LLVM IR helpers of the intrinsics of :mod:`nnef_kv.kv.rotated._tables_jit` and
:mod:`nnef_kv.kv.rotated._vperm_jit` (llvmlite builders; no numba import)."""
from __future__ import annotations

from llvmlite import ir

_F32 = ir.FloatType()
_V4 = ir.VectorType(_F32, 4)
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)
_V16B = ir.VectorType(ir.IntType(8), 16)


def _c64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _data(context, builder, ty, val):
    """(data pointer, stride of axis 0 in bytes) of an array argument."""
    a = context.make_array(ty)(context, builder, val)
    return a.data, builder.extract_value(a.strides, 0)


def _byte(builder, ptr, stride, j):
    p = builder.gep(builder.bitcast(ptr, ir.IntType(8).as_pointer()), [builder.mul(j, stride)])
    return builder.zext(builder.load(p), _I64)


def _loop(builder, count, phis, body_fn, name):
    """``for i in range(count)`` with loop-carried values ``phis`` (initial LLVM values); ``body_fn(i, vals)``
    returns the next values; returns the final ones."""
    entry = builder.block
    check = builder.append_basic_block(f"{name}.check")
    body = builder.append_basic_block(f"{name}.body")
    done = builder.append_basic_block(f"{name}.done")
    builder.branch(check)
    builder.position_at_end(check)
    i = builder.phi(_I64)
    i.add_incoming(_c64(0), entry)
    ps = []
    for v in phis:
        p = builder.phi(v.type)
        p.add_incoming(v, entry)
        ps.append(p)
    builder.cbranch(builder.icmp_signed("<", i, count), body, done)
    builder.position_at_end(body)
    nxt = body_fn(i, ps)
    end = builder.block
    i.add_incoming(builder.add(i, _c64(1)), end)
    for p, v in zip(ps, nxt):
        p.add_incoming(v, end)
    builder.branch(check)
    builder.position_at_end(done)
    return ps
