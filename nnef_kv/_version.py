"""The version of nnef-kv (one place: the package, the command line and the build read it)."""

__version__ = "0.1.0"
