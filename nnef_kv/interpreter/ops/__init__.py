"""Kernels, one module per family (:mod:`nnef_kv.interpreter.catalog` imports them all)."""
