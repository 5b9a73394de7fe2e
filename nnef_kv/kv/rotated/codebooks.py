"""Lloyd-Max codebooks and random rotations of the rotated-codebook KV scheme (``nnef_kv_rotated_sdpa``).

A key or value vector ``x`` of a head (``D`` values) is rotated, ``u = x Pi / |x|``, and each coordinate of
``u`` is coded against a fixed scalar codebook. After a random rotation a coordinate of a unit vector in
``D`` dimensions follows the marginal of the uniform distribution on the sphere,

    f(u) ~ (1 - u^2) ** ((D - 3) / 2)  on [-1, 1]    (variance 1 / D; a Beta((D-1)/2, (D-1)/2) on (u+1)/2),

which tends to a Gaussian of variance ``1 / D``. :func:`codebook` is the Lloyd-Max quantizer of that exact
marginal (``D >= 3``), computed here by Lloyd's iterations on a fine grid (not a table copied from
anywhere); ``D = 2`` uses the same grid (the arcsine density, integrable at the ends) and ``D = 1``
(a coordinate is +-1) the evenly spaced levels of ``[-1, 1]``. :func:`gaussian_codebook` is the same
computation for a unit Gaussian, the check against the published Lloyd-Max MSEs (0.3634, 0.1175,
0.03454, 0.009497 at 1-4 bits; ``tests/unit/test_kv_rotated.py``).

:func:`rotation` is the op's rotation: ``D`` a power of two, a Sylvester Hadamard matrix with random
signs on its rows, ``diag(s) H / sqrt(D)`` (``s`` = +-1 from ``numpy.random.default_rng(seed)``); any
other ``D``, a random orthogonal matrix (QR of a Gaussian matrix from the same generator, signs fixed so
that it is unique). Both are exactly orthogonal up to f32 rounding; ``x_rot = x @ rotation(D, seed)``.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["codebook", "boundaries", "gaussian_codebook", "lloyd_max", "rotation", "codebook_mse",
           "MAX_BITS", "GRID"]

MAX_BITS = 4
GRID = 400_001  # grid points of the Lloyd iterations
_ITERS = 50_000
_TOL = 1e-12


def lloyd_max(x: np.ndarray, w: np.ndarray, levels: int, symmetric: bool = True) -> tuple[np.ndarray, float]:
    """Lloyd-Max quantizer of the discrete distribution ``(x sorted ascending, weights w)``: the ``levels``
    reconstruction points and the MSE. Starts from the quantiles of the distribution and alternates
    nearest-point cells (boundaries at midpoints) and cell centroids until the points move less than
    ``1e-12`` (``symmetric``: each step averaged with its mirror image, for a density symmetric about 0)."""
    w = w / w.sum()
    cw = np.concatenate([[0.0], np.cumsum(w)])
    cwx = np.concatenate([[0.0], np.cumsum(w * x)])
    cwx2 = np.concatenate([[0.0], np.cumsum(w * x * x)])
    c = np.interp((np.arange(levels) + 0.5) / levels, cw[1:], x)
    # the cumulative sums read at a boundary by linear interpolation between grid points: the cells move
    # continuously with the points (snapping them to grid points stalls the iterations short of the optimum)
    xe = np.concatenate([[x[0] - (x[1] - x[0])], x])
    for _ in range(_ITERS):
        b = (c[1:] + c[:-1]) / 2
        fw = np.concatenate([[0.0], np.interp(b, xe, cw), [1.0]])
        fx = np.concatenate([[0.0], np.interp(b, xe, cwx), [cwx[-1]]])
        mass = np.diff(fw)
        new = np.where(mass > 0, np.diff(fx) / np.where(mass > 0, mass, 1), c)
        if symmetric:
            new = (new - new[::-1]) / 2
        done = np.max(np.abs(new - c)) < _TOL
        c = new
        if done:
            break
    b = (c[1:] + c[:-1]) / 2
    f = [np.concatenate([[0.0], np.interp(b, xe, cum), [cum[-1]]]) for cum in (cw, cwx, cwx2)]
    m0, m1, m2 = (np.diff(v) for v in f)  # per cell: sum of w (x - c_i)^2 = m2 - 2 c m1 + c^2 m0
    return c, float(np.sum(m2 - 2 * c * m1 + c * c * m0))


def _check_bits(bits: int) -> int:
    bits = int(bits)
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"rotated codebooks exist for 1..{MAX_BITS} bits, got {bits}")
    return bits


@lru_cache(maxsize=None)
def _gaussian(bits: int) -> tuple[np.ndarray, float]:
    x = np.linspace(-9.0, 9.0, GRID)
    return lloyd_max(x, np.exp(-0.5 * x * x), 1 << bits)


def gaussian_codebook(bits: int) -> tuple[np.ndarray, float]:
    """The Lloyd-Max codebook of a unit Gaussian at ``bits`` bits and its MSE (float64)."""
    c, mse = _gaussian(_check_bits(bits))
    return c.copy(), mse


@lru_cache(maxsize=None)
def _sphere(bits: int, d: int) -> tuple[np.ndarray, float]:
    """Codebook of the coordinate of a unit vector in ``d`` dims, in the scaled variable ``y = sqrt(d) u``
    (unit variance), and its MSE in ``y``."""
    levels = 1 << bits
    if d == 1:
        c = np.linspace(-1.0, 1.0, levels)
        return c, 0.0
    half = np.sqrt(d)
    lim = min(half, 12.0)
    step = 2 * lim / GRID
    y = -lim + step * (np.arange(GRID) + 0.5)  # midpoints: the D = 2 density is infinite at +-1
    with np.errstate(divide="ignore"):
        logf = 0.5 * (d - 3) * np.log1p(-(y * y) / d)
    return lloyd_max(y, np.exp(logf - logf.max()), levels)


def codebook(bits: int, d: int) -> np.ndarray:
    """The ``2**bits`` reconstruction points (ascending, float32) of one coordinate of a rotated unit vector
    of ``d`` dimensions (the exact marginal; see the module docstring)."""
    bits, d = _check_bits(bits), int(d)
    if d < 1:
        raise ValueError(f"head_dim must be >= 1, got {d}")
    c, _ = _sphere(bits, d)
    return (c if d == 1 else c / np.sqrt(d)).astype(np.float32)


def codebook_mse(bits: int, d: int) -> float:
    """The MSE of :func:`codebook` per coordinate of a unit vector, times ``d`` (the distortion of a unit
    Gaussian coordinate's scale: tends to :func:`gaussian_codebook`'s MSE as ``d`` grows)."""
    _, mse = _sphere(_check_bits(bits), int(d))
    return mse


def boundaries(cb: np.ndarray) -> np.ndarray:
    """The decision boundaries of a codebook (midpoints of neighbouring points): code = searchsorted."""
    cb = np.asarray(cb, np.float32)
    return ((cb[1:] + cb[:-1]) / np.float32(2)).astype(np.float32)


@lru_cache(maxsize=64)
def _rotation(d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if d & (d - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        signs = rng.choice(np.array([-1.0, 1.0]), size=d)
        m = signs[:, None] * h / np.sqrt(d)
    else:
        qm, r = np.linalg.qr(rng.standard_normal((d, d)))
        m = qm * np.sign(np.diag(r))
    out = m.astype(np.float32)
    out.setflags(write=False)
    return out


def rotation(d: int, seed: int = 0) -> np.ndarray:
    """The op's orthogonal ``[d, d]`` f32 rotation (read-only): ``x_rot = x @ R``, ``x = x_rot @ R.T``."""
    if int(d) < 1:
        raise ValueError(f"head_dim must be >= 1, got {d}")
    return _rotation(int(d), int(seed))
