"""Bytes <-> tensors and archives.

- ``dat``: the ``.dat`` tensor codec (:func:`~nnef_kv.io.dat.read_tensor`, :func:`~nnef_kv.io.dat.write_tensor`,
  :class:`~nnef_kv.io.dat.DatInfo` for bit-exact rewrites);
- ``blockquant``: tract's Q4_0 / Q8_1 block-quantized tensors (:class:`~nnef_kv.io.blockquant.BlockQuantTensor`);
- ``container``: folders, tar and tgz files as safe, bounded lists of members, and reproducible writers;
- ``archive``: the :class:`~nnef_kv.io.archive.Model` and :func:`~nnef_kv.io.archive.load` /
  :func:`~nnef_kv.io.archive.save`.
"""
