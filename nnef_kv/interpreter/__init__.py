"""Graph -> plan -> session: runs NNEF graphs with NumPy kernels (see ``registry``)."""
