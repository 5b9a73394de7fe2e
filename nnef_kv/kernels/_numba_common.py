"""Small numba helpers shared by the kernels (this module imports numba: load it lazily).

* :func:`bits_to_f32`: reinterpret a uint32 as float32 (an LLVM bitcast, vectorisable).
* :func:`h2f`: the exact float32 value of a float16 given as its uint16 bits, every input included
  (subnormals, +-0, +-Inf, NaN with its payload: checked against NumPy's cast for all 65536 patterns
  in the tests); branch-free, so loops over it vectorise. It does not rely on subnormal f32
  arithmetic (subnormal halves are ``m * 2**-24``, a normal f32), so it is exact under FTZ/DAZ too.
* :func:`half_bits_to_f32`: the same with LLVM's ``fpext half -> float`` (one ``vcvtph2ps`` with F16C,
  faster in vector loops than :func:`h2f`); used when the host CPU has F16C (NaN payloads may come out
  quieted, every other value is bit-identical: checked in the tests).
* :func:`widen`: ``float32(x)`` for a float32 element, f16 -> f32 for a uint16 (f16 bits) element; the
  kernels take f16 arrays as uint16 views and f32 arrays as they are, one compiled version each.
* :func:`fetch_add`: atomically add 1 to ``a[0]`` (an int64 array) and return its previous value (an LLVM
  ``atomicrmw add``, sequentially consistent): threads running one nogil core claim work items from a
  shared counter without going back to Python (and the GIL) between items.
* :func:`void_pointer`: an integer address as a ``void *``, for :func:`numba.carray` (a strided array's memory
  seen as one contiguous run, so that loops over its rows vectorise: :mod:`nnef_kv.kernels.attend`).
* :func:`exp_nonpositive`: ``exp(x)`` of a float32 ``x <= 0`` (a softmax numerator, the row max already
  subtracted), branch-free so that a loop over it vectorises: NumPy's ``exp`` is a call numba cannot
  make without the GIL, and LLVM's ``expf`` stays one scalar libm call an element. Within 1 ulp of
  the exact value for ``-87 <= x <= 0`` (checked against float64 in the tests), exactly 1 at 0, 0 below -87 (where the
  true value is under 1.7e-38), NaN for NaN.
* :func:`wide_vectors`: called first in a core, marks the LLVM function being compiled with
  ``"prefer-vector-width"="512"`` when the host has AVX-512 (:data:`WIDE`): LLVM's default on these CPUs
  is 256-bit vectors (a tuning for the first AVX-512 parts, whose clock dropped with 512-bit work), and
  the cores are bound by vector instruction throughput: 512-bit vectors make the KIVI cores faster
  (docs/benchmarks.md, "Where the code's thresholds come from"). A hint only (same ISA, same results up to
  the lane count of the ``reassoc`` sums); not applied on Skylake-SP / Cascade Lake / Cooper Lake, or with
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

__all__ = ["bits_to_f32", "fetch_add", "void_pointer", "exp_nonpositive", "h2f", "half_bits_to_f32", "widen",
           "wide_vectors", "JIT", "JIT_REASSOC", "as_f32_or_u16", "HAVE_F16C", "WIDE"]

#: options of every core: cached on disk, releases the GIL, IEEE arithmetic (no fastmath), NumPy's
#: error model (x / 0 gives Inf/NaN as in NumPy instead of raising)
JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
#: options of the cores whose loops are dot products (see nnef_kv.kv.kivi.kernels's module docstring): only
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
def fetch_add(typingctx, a):
    """``old = a[0]; a[0] += 1; return old`` as one atomic operation (``a``: a C-contiguous int64 array)."""
    if not (isinstance(a, types.Array) and a.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        one = context.get_constant(types.int64, 1)
        return builder.atomic_rmw("add", arr.data, one, "seq_cst")
    return types.int64(a), codegen


@intrinsic
def void_pointer(typingctx, address):
    """An integer address as a ``void *`` (for :func:`numba.carray`)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return types.voidptr(address), codegen


# exp(x) = 2**n * exp(r), n = round(x / ln 2), r = x - n ln 2 in two parts (n * _LN2_HI is exact: _LN2_HI
# has 9 significant bits, |n| <= 126); exp(r) on |r| <= ln(2) / 2 by the classic single-precision
# polynomial 1 + r + r**2 P(r) (Cephes' expf coefficients, a minimax fit of that range)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_ROUND = np.float32(12582912.0)  # 1.5 * 2**23: (t + _ROUND) - _ROUND rounds t to an integer, |t| < 2**22
_EXP_P = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                        1.6666665459e-1, 5.0000001201e-1))
_EXP_FLOOR = np.float32(-87.0)


@njit(inline="always", fastmath=False, error_model="numpy")
def exp_nonpositive(x):
    """exp of a float32 ``x <= 0`` (NaN in, NaN out; -Inf and anything below -87 give 0)."""
    xc = _EXP_FLOOR if x < _EXP_FLOOR else x  # NaN stays NaN (the comparison is false)
    f = (xc * _LOG2E + _ROUND) - _ROUND
    r = (xc - f * _LN2_HI) - f * _LN2_LO
    p0, p1, p2, p3, p4, p5 = _EXP_P
    y = (((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5) * (r * r) + r + np.float32(1.0)
    n = np.int32(f) if f == f else np.int32(0)  # f is in [-126, 0]; NaN gives n = 0 (y is NaN anyway)
    scale = bits_to_f32(np.uint32((n + np.int32(127)) << np.int32(23)))
    out = y * scale
    return np.float32(0.0) if x < _EXP_FLOOR else out


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
