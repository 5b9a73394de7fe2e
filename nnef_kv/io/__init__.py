"""Bytes <-> tensors and archives: ``.dat`` codec (``dat``), folder/tar/tgz containers (``archive``)."""
