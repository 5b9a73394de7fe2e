"""Driving tract (Sonos' inference engine; the ``tract`` Python package, 0.23.9), the oracle.

The one module that loads archives into tract and runs them: validation's tract parity
(:class:`nnef_kv.validate.decode.TractDecoder`), the benchmarks and the tests go through it.

tract is an optional dependency (``pip install 'nnef-kv[tract]'``): it is imported inside the functions;
without it they raise :class:`TractMissing` (one line), and :func:`available` says whether it is there.

What the module knows about tract 0.23.9:

* an archive is read by ``tract.nnef()`` plus ``with_<x>()`` / ``without_<x>()`` calls; the default here
  is ``with_tract_transformers()`` (the KV-cache and attention ops) and nothing else;
* tract renames graph outputs: outputs are returned **by position**, in the graph's declared order,
  never matched by name;
* tract ignores attributes it does not know: that tract loads a graph does not mean it read all of it;
* a model is prepared by ``into_runnable()`` only: no symbol is concretised, no transform applied, tract's
  own (single) thread;
* a stateful op (``tract_transformers_dyn_kv_cache``, ...) keeps its state in a spawned state, which
  :class:`Stateful` keeps across calls (``reset()`` spawns a fresh one);
* inputs are NumPy arrays given by position; tract copies non-contiguous ones itself (a 0-d array stays
  0-d, which ``np.ascontiguousarray`` would not do).
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .errors import InputError, NnefKvError

__all__ = ["TractMissing", "available", "framework", "load", "load_text", "runnable", "run", "Stateful",
           "Decoder", "DEFAULT_EXTENSIONS"]

#: what ``tract.nnef()`` is extended with unless told otherwise
DEFAULT_EXTENSIONS: tuple[str, ...] = ("tract_transformers",)


class TractMissing(NnefKvError, ImportError):
    """The tract Python package is not installed."""


def available() -> bool:
    """Whether the ``tract`` package can be imported (without importing it)."""
    return importlib.util.find_spec("tract") is not None


def _tract() -> Any:
    try:
        import tract  # optional dependency
    except ImportError:
        raise TractMissing("this needs the tract Python package, which is not installed "
                           "(pip install 'nnef-kv[tract]', tract==0.23.9)") from None
    return tract


def _chain(spec: str) -> list[str]:
    """``"tract.nnef().with_onnx().without_tract_core()"`` (a loader as the conformance manifest writes it)
    -> ``["with_onnx", "without_tract_core"]``."""
    calls = [c.strip().removesuffix("()") for c in spec.strip().split(".")]
    if calls[:2] != ["tract", "nnef"] or not all(c.startswith(("with_", "without_")) for c in calls[2:]):
        raise InputError(f"not a tract NNEF loader: {spec!r} (expected 'tract.nnef().with_x()...')")
    return calls[2:]


def framework(extensions: Iterable[str] | str = DEFAULT_EXTENSIONS, without: Iterable[str] = ()) -> Any:
    """``tract.nnef()`` with ``with_<name>()`` for each of ``extensions`` (``tract_transformers``, ``onnx``,
    ``tract_extra``, ``pulse``, ``extended_identifier_syntax``) then ``without_<name>()`` for each of
    ``without`` (``tract_core``). ``extensions`` may instead be a loader chain as a string,
    ``"tract.nnef().with_onnx()"`` (its calls made in order); ``()`` gives plain ``tract.nnef()``."""
    calls = _chain(extensions) if isinstance(extensions, str) else [f"with_{n}" for n in extensions]
    calls += [f"without_{n}" for n in without]
    nnef = _tract().nnef()
    for call in calls:
        method = getattr(nnef, call, None)
        if method is None:
            raise InputError(f"tract.nnef() has no {call}()")
        nnef = method()
    return nnef


def load(source: Any, extensions: Iterable[str] | str = DEFAULT_EXTENSIONS, *, nnef: Any = None) -> Any:
    """A tract model (``tract.Model``) of ``source``: an archive path (folder, ``.tar``, ``.tgz``) or an
    in-memory nnef-kv model (written to a temporary ``.nnef.tar`` first, which tract reads whole at load).
    ``nnef``: a framework object from :func:`framework` to use instead of ``extensions``."""
    loader = nnef if nnef is not None else framework(extensions)
    if isinstance(source, (str, os.PathLike)):
        return loader.load(str(source))
    from .io.archive import save

    with tempfile.TemporaryDirectory(prefix="nnef_kv_tract_") as tmp:
        path = Path(tmp) / "model.nnef.tar"
        save(source, path)
        return loader.load(str(path))


def load_text(text: str, extensions: Iterable[str] | str = DEFAULT_EXTENSIONS) -> Any:
    """A tract model of a graph given as NNEF text (no tensors), written to a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="nnef_kv_tract_") as tmp:
        (Path(tmp) / "graph.nnef").write_text(text)
        return framework(extensions).load(tmp)


def runnable(source: Any, extensions: Iterable[str] | str = DEFAULT_EXTENSIONS) -> Any:
    """``load(source).into_runnable()``; ``source`` may also be a tract model already loaded."""
    model = source if _is_tract_model(source) else load(source, extensions)
    return model.into_runnable()


def _is_tract_model(obj: Any) -> bool:
    return type(obj).__module__.startswith("tract") and hasattr(obj, "into_runnable")


def _arrays(inputs: Sequence[Any]) -> list[np.ndarray]:
    return [a if isinstance(a, np.ndarray) else np.asarray(a) for a in inputs]


def run(source: Any, inputs: Sequence[Any], extensions: Iterable[str] | str = DEFAULT_EXTENSIONS) -> list[np.ndarray]:
    """One call of a freshly loaded model (or of a tract runnable/model given as ``source``): its outputs
    by position, as NumPy arrays."""
    if hasattr(source, "spawn_state"):  # already a runnable
        r = source
    else:
        r = runnable(source, extensions)
    return [t.to_numpy() for t in r.run(_arrays(inputs))]


class Stateful:
    """A tract model with one state kept across calls (stateful ops keep their caches in it).

    ``input_names`` / ``output_names`` are tract's (outputs renamed by tract: use positions)."""

    def __init__(self, source: Any, extensions: Iterable[str] | str = DEFAULT_EXTENSIONS) -> None:
        model = source if _is_tract_model(source) else load(source, extensions)
        self.input_names = [model.input_name(i) for i in range(model.input_count())]
        self.output_names = [model.output_name(i) for i in range(model.output_count())]
        self.runnable = model.into_runnable()
        self.reset()

    def reset(self) -> None:
        """A fresh state: every stateful op starts empty again."""
        self.state = self.runnable.spawn_state()

    def run(self, inputs: Sequence[Any]) -> list[np.ndarray]:
        """One call, inputs and outputs by position."""
        return [t.to_numpy() for t in self.state.run(_arrays(inputs))]

    def run_first(self, inputs: Sequence[Any]) -> np.ndarray:
        """One call; only the first output is read back (the others stay in tract)."""
        return self.state.run(_arrays(inputs))[0].to_numpy()

    __call__ = run


class Decoder:
    """A decoder archive driven call by call with the feeding convention of a decode signature ``sig``
    (:class:`nnef_kv.validate.decode.DecodeSignature`: ``input_names``, ``output_names``, ``ids_input``,
    ``explicit``, ``cache_outputs``, ``empty_caches()``): token ids go to the ids input, explicit caches are
    fed back from the previous call's outputs, session caches stay in tract's state. Outputs are matched
    with the signature's output names by position."""

    def __init__(self, source: Any, sig: Any, extensions: Iterable[str] | str = DEFAULT_EXTENSIONS) -> None:
        self.stateful = Stateful(source, extensions)
        self.sig = sig
        if len(self.stateful.input_names) != len(sig.input_names):
            where = source if isinstance(source, (str, os.PathLike)) else "<model>"
            raise InputError(f"{where}: tract sees {len(self.stateful.input_names)} inputs, the graph declares "
                             f"{len(sig.input_names)}")
        self.reset()

    @property
    def tract_inputs(self) -> list[str]:
        return self.stateful.input_names

    def reset(self) -> None:
        """Start a new sequence: fresh tract state, empty explicit caches."""
        self.stateful.reset()
        self.cache = self.sig.empty_caches()

    def __call__(self, ids: Any) -> dict[str, np.ndarray]:
        """Feed token ids ``[S]`` or ``[1, S]`` (one call): every output by the signature's names."""
        feed = dict(self.cache)
        feed[self.sig.ids_input] = np.asarray(ids, np.int64).reshape(1, -1)
        out = dict(zip(self.sig.output_names, self.stateful.run([feed[n] for n in self.sig.input_names])))
        if self.sig.explicit:
            self.cache = {i: out[o] for i, o in self.sig.cache_outputs.items()}
        return out

    def step(self, token: int) -> dict[str, np.ndarray]:
        """One token."""
        return self(np.array([[int(token)]], np.int64))
