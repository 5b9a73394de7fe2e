"""A tensor's bytes, the floor below the op contract and the archives.

- ``dat``: the ``.dat`` tensor codec (:func:`~nnef_kv.tensors.dat.read_tensor`,
  :func:`~nnef_kv.tensors.dat.write_tensor`, :class:`~nnef_kv.tensors.dat.DatInfo` for bit-exact rewrites);
- ``blockquant``: tract's Q4_0 / Q8_1 block-quantized tensors
  (:class:`~nnef_kv.tensors.blockquant.BlockQuantTensor`);
- ``pages``: the resident pages of a memory-mapped tensor given back (:func:`~nnef_kv.tensors.pages.release_pages`).
"""
