"""Attention of a KIVI variant (keys and values of different widths, or per-token keys): the quantized part
dequantized once per call (:meth:`~.kivi.KiviSdpa._dequantized_quant`, side-table values back at their
exact values), then exact softmax attention in f32 over ``[sinks | quantized | window and the call's
tokens]`` -- the same readings as the packed-code path of :mod:`.attend`, which assumes one codec
and per-channel keys. Stepwise runs use :meth:`~.attend.KiviAttention._attend_stepwise`, which
already reads dequantized codes."""
from __future__ import annotations

import numpy as np

from ..common import causal_keep, softmax_numerators
from .parts import View, as32, finite_part

__all__ = ["KiviDequantizedAttention"]


class KiviDequantizedAttention:
    """A mixin of :class:`~.kivi.KiviSdpa` (its state, codes and params)."""

    def _attend_dequantized(self, q: np.ndarray, sq: int, view: View) -> np.ndarray:
        """q ``[n, M, D]`` f32 (rotated; ``M = group * Sq``, row ``r`` is query ``r % Sq``) over ``view``
        (read before the call ingests its tokens); returns ``[n, M, D]``."""
        c = self.cfg
        n, m, d = q.shape
        tq = view.tq
        kq, vq = self._dequantized_quant() if tq else (np.zeros((n, 0, d), np.float32),) * 2
        k = np.concatenate([as32(view.sink_k), kq[:, :tq], as32(view.res_k)], axis=1)
        v = np.concatenate([as32(view.sink_v), vq[:, :tq], as32(view.res_v)], axis=1)
        total = k.shape[1]
        s = np.matmul(q * np.float32(c.scale), k.swapaxes(-1, -2))  # [n, M, T]
        self._softcap(s)
        keep = causal_keep(total, m, sq, c.is_causal, c.window)  # [M, T] or None
        s2, keep2 = self._sink_column(s, keep, self._sink_rows(0, n, np.arange(m), sq))
        p = softmax_numerators(s2, keep2)
        ls = p.sum(axis=-1, keepdims=True)
        p = p[:, :, :total]
        vf, bad = finite_part(v, 0)  # masked positions contribute nothing, not even 0 * NaN
        out = np.matmul(p, vf)
        if bad is not None:
            h, col, ch, val = bad
            seen = np.ones((m, col.size), bool) if keep is None else keep[:, col]
            contrib = np.where(seen.T, p[h, :, col] * val[:, None], np.float32(0))  # [cnt, M]
            np.add.at(np.swapaxes(out, 1, 2), (h, ch), contrib)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.divide(out, ls, out=out)
