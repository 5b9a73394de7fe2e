"""Small numba helpers shared by the kernels (this module imports numba: load it lazily).

* :func:`bits_to_f32`: reinterpret a uint32 as float32 (an LLVM bitcast, vectorisable).
* :func:`h2f`: the exact float32 value of a float16 given as its uint16 bits, every input included
  (subnormals, +-0, +-Inf, NaN with its payload: checked against NumPy's cast for all 65536 patterns
  in the tests); branch-free, so loops over it vectorise. It does not rely on subnormal f32
  arithmetic (subnormal halves are ``m * 2**-24``, a normal f32), so it is exact under FTZ/DAZ too.
* :func:`half_bits_to_f32`: the same with LLVM's ``fpext half -> float`` (one ``vcvtph2ps`` with F16C,
  4x faster in vector loops than :func:`h2f`); used when the host CPU has F16C (NaN payloads may come out
  quieted, every other value is bit-identical: checked in the tests).
* :func:`widen`: ``float32(x)`` for a float32 element, f16 -> f32 for a uint16 (f16 bits) element; the
  kernels take f16 arrays as uint16 views and f32 arrays as they are, one compiled version each.
* :func:`wide_vectors`: called first in a core, marks the LLVM function being compiled with
  ``"prefer-vector-width"="512"`` when the host has AVX-512 (:data:`WIDE`): LLVM's default on these CPUs
  is 256-bit vectors (a tuning for the first AVX-512 parts, whose clock dropped with 512-bit work), and
  the cores are bound by vector instruction throughput: 512-bit vectors make the KIVI cores 20-27%
  faster on the 2-core machine (measured). A hint only (same ISA, same results up to the lane count of
  the ``reassoc`` sums); not applied on Skylake-SP / Cascade Lake / Cooper Lake, or with
  ``NNEF_KV_NUMBA_WIDE=0`` at the first compilation (clear numba's cache, ``__pycache__/*.nbi|nbc``,
  after changing it). It goes through llvmlite's attribute printer (private API, its arguments passed
  through whatever they are): the function is printed once with the hint, and any failure puts numba's
  own attributes back, so a changed llvmlite costs the hint, never the kernel.
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = ["bits_to_f32", "h2f", "half_bits_to_f32", "widen", "wide_vectors", "JIT", "JIT_REASSOC",
           "as_f32_or_u16", "HAVE_F16C", "WIDE"]

#: options of every core: cached on disk, releases the GIL, IEEE arithmetic (no fastmath), NumPy's
#: error model (x / 0 gives Inf/NaN as in NumPy instead of raising)
JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
#: options of the cores whose loops are dot products (see kivi_attention's module docstring): only
#: LLVM's ``reassoc`` flag (sums may be reordered, i.e. vectorised into lanes); not ``nnan``/``ninf``
#: (NaN and Inf are kept), not ``contract`` (no FMA), not ``afn``/``arcp``.
JIT_REASSOC = dict(cache=True, nogil=True, fastmath={"reassoc"}, error_model="numpy")


@intrinsic
def bits_to_f32(typingctx, x):
    """uint32 -> float32 with the same bits."""
    if not (isinstance(x, types.Integer) and x.bitwidth == 32):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(x), codegen


@njit(**JIT)
def h2f(h16):
    """Exact float32 of the float16 whose bits are ``h16`` (uint16)."""
    h = np.uint32(h16)
    e = (h >> np.uint32(10)) & np.uint32(31)
    m = h & np.uint32(1023)
    neg = (h & np.uint32(0x8000)) != 0
    sign = np.uint32(0x80000000) if neg else np.uint32(0)
    normal = np.uint32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))
    special = np.uint32(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))  # Inf, NaN (payload kept)
    v = bits_to_f32(special if e == np.uint32(31) else normal)
    s = np.float32(np.int32(m)) * np.float32(5.9604644775390625e-08)  # subnormal: m * 2**-24, exact
    s = -s if neg else s
    return s if e == np.uint32(0) else v


@intrinsic
def half_bits_to_f32(typingctx, x):
    """uint16 (f16 bits) -> float32 by LLVM's fpext (exact)."""
    if not (isinstance(x, types.Integer) and x.bitwidth == 16):
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(x), codegen


def _host_has_f16c() -> bool:
    try:
        feats = llvm_binding.get_host_cpu_features()
        return bool(feats.get("f16c", False))
    except Exception:  # pragma: no cover - unknown host
        return False


#: the host CPU converts f16 in hardware (then widen uses fpext, else the integer h2f)
HAVE_F16C = _host_has_f16c()


_NARROW_CPUS = frozenset({"skylake-avx512", "cascadelake", "cooperlake", "knl", "knm"})


def _wide_wanted() -> bool:
    import os

    if os.environ.get("NNEF_KV_NUMBA_WIDE", "").strip() == "0":
        return False
    try:
        feats = llvm_binding.get_host_cpu_features()
        return bool(feats.get("avx512f", False)) and llvm_binding.get_host_cpu_name() not in _NARROW_CPUS
    except Exception:  # pragma: no cover - unknown host
        return False


#: the cores ask LLVM for 512-bit vectors (see :func:`wide_vectors`)
WIDE = _wide_wanted()
_WIDTH_ATTR = '"prefer-vector-width"="512"'
_wide_classes: dict[type, type] = {}


def _wide_attributes(old):
    """A copy of an llvmlite function-attribute set that also prints the vector-width hint."""
    base = type(old)
    cls = _wide_classes.get(base)
    if cls is None:
        class Wide(base):  # type: ignore[misc, valid-type]
            def _to_list(self, *args, **kwargs):  # whatever llvmlite's private signature: pass it through
                return list(super()._to_list(*args, **kwargs)) + [_WIDTH_ATTR]

            def __bool__(self) -> bool:  # printed even when no standard attribute is set
                return True
        cls = _wide_classes[base] = Wide
    new = cls()
    for a in old:
        new.add(a)
    new.alignstack = old.alignstack
    new.personality = old.personality
    return new


@intrinsic
def wide_vectors(typingctx):
    """No-op at run time; at compile time marks the calling function for 512-bit vectors (if WIDE)."""
    def codegen(context, builder, sig, args):
        if WIDE:
            fn = old = None
            try:
                fn = builder.function
                old = fn.attributes
                if not any(_WIDTH_ATTR == x for x in old._to_list(fn.ftype.return_type)):
                    fn.attributes = _wide_attributes(old)
                    str(fn)  # the IR still prints (numba prints it next): else the hint is taken back below
            except Exception:  # pragma: no cover - another llvmlite: keep numba's defaults
                if fn is not None and old is not None:
                    fn.attributes = old
        return context.get_dummy_value()
    return types.none(), codegen


def widen(x):  # pragma: no cover - replaced by the overload inside numba code
    """float32 value of one element of a float32 array or of a uint16 (f16 bits) array."""
    raise NotImplementedError("widen is only callable from numba code")


@overload(widen)
def _widen_overload(x):
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    if isinstance(x, types.Integer) and x.bitwidth == 16 and not x.signed:
        if HAVE_F16C:
            return lambda x: half_bits_to_f32(x)
        return lambda x: h2f(x)
    return None


def as_f32_or_u16(a: np.ndarray) -> np.ndarray:
    """What the cores take for a float array: float16 as its uint16 view, anything else as float32
    (a view when it already is)."""
    a = np.asarray(a)
    if a.dtype == np.float16:
        return a.view(np.uint16)
    return np.asarray(a, dtype=np.float32)
