"""The op contract, the floor every op family and KV state builds on.

- ``registry``: an op's registration (its NNEF signature, kernel or :class:`~nnef_kv.core.registry.KvState`
  class, and the facts tools ask of it), :data:`~nnef_kv.core.registry.PRIMITIVES`;
- ``params``: the values an op's parameters take; ``dtypes``: NNEF/tract datum types as NumPy dtypes;
- ``coerce``: operands brought to the types a kernel takes.

The interpreter (:mod:`nnef_kv.interpreter`) loads the op families and runs them; the KV states
(:mod:`nnef_kv.kv`) implement the contract; neither is imported here.
"""
