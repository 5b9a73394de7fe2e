"""Archives: a model's files in and out (the floor above the interpreter, as tract-nnef is above tract-core).

- ``container``: folders, tar and tgz files as safe, bounded lists of members, and reproducible writers;
- ``archive``: the :class:`~nnef_kv.io.archive.Model` (the one model type: what the interpreter plans and
  runs, ``model.session()``) and :func:`~nnef_kv.io.archive.load` / :func:`~nnef_kv.io.archive.save`;
- ``npz``, ``sniff``: NumPy input files, and naming what a file is when it is not what was expected.

A tensor's own bytes (the ``.dat`` codec, block-quantized tensors) are a floor lower, :mod:`nnef_kv.tensors`.
"""
