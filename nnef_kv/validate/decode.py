"""Driving an LLM archive token by token, with nnef-kv's interpreter or with tract.

Two archive layouts are recognised from the graph's inputs:

* **explicit cache** (torch-to-nnef exports): an integer ``input_ids [1, S]`` input plus float cache
  inputs (``in_cache_*``, ``past*``); each call returns logits then the grown caches, which the caller
  feeds back (``out_cache_X`` -> ``in_cache_X``, else by position). The first call gets empty caches
  (the cache's sequence symbol bound to 0);
* **session cache** (fused or ``*_kv_cache`` ops): ``input_ids`` is the only input; the cache lives in
  the session (interpreter) or in the spawned state (tract).

A decode run is: one call with the whole prompt, then ``steps`` calls of one token each. The logits of
the last position of each call are kept, so call ``i`` predicts token ``n_prompt + i``. Tokens are
either given (teacher forcing) or chosen greedily (argmax).
"""
from __future__ import annotations

import os

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import tract_driver
from ..errors import InputError, NnefKvError
from .capture import attention_step_indices, run_capturing

__all__ = ["DecodeSignature", "detect_signature", "InterpreterDecoder", "TractDecoder", "DecodeTrace", "run_decode",
           "tract_available"]

_CACHE_WORDS = ("cache", "past", "key", "value", "present")


@dataclass
class DecodeSignature:
    """How to feed an LLM graph: which input takes the ids, which are caches and where they come back."""

    ids_input: str
    logits_output: str
    input_names: list[str]
    output_names: list[str]
    cache_inputs: list[str] = field(default_factory=list)
    cache_outputs: dict[str, str] = field(default_factory=dict)  # input name -> output name
    empty_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    cache_dtypes: dict[str, np.dtype] = field(default_factory=dict)

    @property
    def explicit(self) -> bool:
        return bool(self.cache_inputs)

    def empty_caches(self) -> dict[str, np.ndarray]:
        return {n: np.zeros(self.empty_shapes[n], self.cache_dtypes[n]) for n in self.cache_inputs}


def _out_name_for(inp: str, outputs: Sequence[str]) -> str | None:
    for a, b in (("in_", "out_"), ("past_key_values", "present"), ("past", "present")):
        if inp.startswith(a) or a in inp:
            cand = inp.replace(a, b, 1)
            if cand in outputs:
                return cand
    return None


def detect_signature(plan: Any, where: str = "<model>") -> DecodeSignature:
    """Recognise the ids input, cache inputs/outputs and logits output of a planned graph."""
    specs = list(plan.inputs)
    outputs = list(plan.output_names)
    ints = [s for s in specs if np.dtype(s.dtype).kind in "iu"]
    if not ints:
        raise InputError(f"{where}: no integer input to take token ids (inputs: {[s.name for s in specs]})")
    ids = next((s for s in ints if "id" in s.name.lower()), ints[0])
    id_symbols = {d for d in ids.shape if isinstance(d, str)}
    caches = []
    for s in specs:
        if s is ids:
            continue
        if np.dtype(s.dtype).kind != "f" or not any(w in s.name.lower() for w in _CACHE_WORDS):
            raise InputError(f"{where}: cannot drive input '{s.name}' ({s.dtype}): a decoder takes token ids and "
                             f"optionally cache inputs")
        caches.append(s)
    sig = DecodeSignature(
        ids_input=ids.name,
        logits_output=outputs[0] if outputs else "",
        input_names=[s.name for s in specs],
        output_names=outputs,
    )
    if caches:
        mapping: dict[str, str] = {}
        for s in caches:
            o = _out_name_for(s.name, outputs)
            if o is not None:
                mapping[s.name] = o
        if len(mapping) != len(caches):  # positional: outputs after the logits, in input order
            rest = outputs[1:]
            if len(rest) != len(caches):
                raise InputError(f"{where}: {len(caches)} cache inputs but {len(rest)} outputs after the logits; "
                                 f"cannot tell which output feeds which cache")
            mapping = {s.name: o for s, o in zip(caches, rest)}
        sig.cache_inputs = [s.name for s in caches]
        sig.cache_outputs = mapping
        used = set(mapping.values())
        logits = [o for o in outputs if o not in used]
        if not logits:
            raise InputError(f"{where}: no output left for the logits")
        sig.logits_output = logits[0]
        for s in caches:
            shape = []
            for d in s.shape:
                if isinstance(d, (int, np.integer)):
                    shape.append(int(d))
                elif isinstance(d, str) and d in id_symbols:
                    shape.append(1)
                else:
                    shape.append(0)
            sig.empty_shapes[s.name] = tuple(shape)
            sig.cache_dtypes[s.name] = np.dtype(s.dtype)
    if not sig.logits_output:
        raise InputError(f"{where}: the graph has no output")
    return sig


def _last_logits(x: np.ndarray) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim == 0:
        raise InputError("the logits output is a scalar")
    return a.reshape(-1, a.shape[-1])[-1].astype(np.float32, copy=True)


class InterpreterDecoder:
    """Decode with an nnef-kv session; optionally captures every attention op's output per call."""

    backend = "nnef-kv"

    def __init__(self, model: Any, capture_attention: bool = False) -> None:
        self.model = model
        self.session = model.session()
        self.sig = detect_signature(self.session.plan, str(getattr(model, "source", None) or "<model>"))
        self.capture = attention_step_indices(self.session.plan) if capture_attention else None
        self.last_attention: list[np.ndarray] = []
        #: None until a teacher-forced run tells; False: the graph cannot run stepwise (tract's folded last
        #: layer squeezes the one query it keeps), so :meth:`teacher` makes one-token calls: the same answers
        self.stepwise: bool | None = None
        self.reset()

    def reset(self) -> None:
        self.session.reset()
        self.cache = self.sig.empty_caches()

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        feed = dict(self.cache)
        feed[self.sig.ids_input] = np.asarray(ids, np.int64).reshape(1, -1)
        if self.capture is not None:
            out, self.last_attention = run_capturing(self.session, feed, self.capture)
        else:
            out = self.session.run(feed)
        if self.sig.explicit:
            self.cache = {i: out[o] for i, o in self.sig.cache_outputs.items()}
        return _last_logits(out[self.sig.logits_output])

    # -- teacher-forced evaluation ----------------------------------------------------------------
    def _feed(self, ids: Sequence[int]) -> dict[str, np.ndarray]:
        feed = dict(self.cache)
        feed[self.sig.ids_input] = np.asarray(ids, np.int64).reshape(1, -1)
        return feed

    def _logit_rows(self, out: dict[str, Any], n: int, what: str) -> np.ndarray:
        a = np.asarray(out[self.sig.logits_output])
        self.logits_dtype = str(a.dtype)
        rows = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
        if rows.shape[0] < n:
            raise InputError(f"{what}: the logits output '{self.sig.logits_output}' {list(a.shape)} gives "
                             f"{rows.shape[0]} rows for {n} tokens: cannot tell each token's prediction")
        return rows[-n:].astype(np.float32, copy=True)

    def _nodes(self) -> list[Any]:
        return [self.session.plan.step_nodes[i] for i in (self.capture or [])]

    def prefill(self, ids: Sequence[int], chunk: int | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        """Feed ``ids`` in one call (or calls of ``chunk`` tokens): the last position's logits ``[V]`` and,
        when capturing, each attention op's output for that position only (``[B, Hq, 1, D]``)."""
        ids = [int(t) for t in ids]
        size = len(ids) if not chunk else int(chunk)
        parts = [ids[i:i + size] for i in range(0, len(ids), size)]
        for part in parts[:-1]:
            self._update(self.session.run(self._feed(part)))
        last = parts[-1]
        if self.capture:
            out, caps = self.session.run(self._feed(last), capture=self._nodes(),
                                         capture_map=lambda a: np.array(a[..., -1:, :], copy=True))
            att = [caps[n.name] for n in self._nodes()]
        else:
            out, att = self.session.run(self._feed(last)), []
        self._update(out)
        return self._logit_rows(out, 1, "prefill")[0], att

    def teacher(self, ids: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Feed ``ids`` as one stepwise run (each token answered as a one-token call would have):
        logits ``[n, V]`` and, when capturing, each attention op's output ``[B, Hq, n, D]``. A graph that cannot
        run stepwise (the run is all-or-nothing: nothing changed) is fed one token a call instead."""
        n = len(ids)
        if n == 0:
            return np.zeros((0, 0), np.float32), []
        if self.stepwise is not False:
            try:
                got = self._teacher_stepwise(ids)
                self.stepwise = True
                return got
            except NnefKvError:
                if self.stepwise or n == 1:
                    raise
                self.stepwise = False
        rows, parts = [], []
        for t in ids:
            row, att = self.prefill([int(t)])
            rows.append(row)
            parts.append(att)
        att = [np.concatenate([p[i] for p in parts], axis=-2) for i in range(len(parts[0]))] if parts[0] else []
        return np.stack(rows).astype(np.float32, copy=False), att

    def _teacher_stepwise(self, ids: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        n = len(ids)
        if self.capture:
            out, caps = self.session.run(self._feed(ids), capture=self._nodes(), stepwise=True)
            att = [np.array(caps[nd.name], copy=True) for nd in self._nodes()]
        else:
            out, att = self.session.run(self._feed(ids), stepwise=True), []
        self._update(out)
        return self._logit_rows(out, n, "stepwise run"), att

    def _update(self, out: dict[str, Any]) -> None:
        if self.sig.explicit:
            self.cache = {i: out[o] for i, o in self.sig.cache_outputs.items()}

    def kv_ops(self) -> list[tuple[Any, Any]]:
        """``(node, state)`` of every stateful node that holds keys/values (has a census)."""
        return [(node, st) for (_, node), st in zip(self.session.plan.stateful, self.session.states)
                if st.census() is not None]

    def quantized_ops(self) -> list[tuple[Any, Any]]:
        return [(n, s) for n, s in self.kv_ops() if s.QUANTIZED]

    def reads_quantized(self, n: int, stepwise: bool) -> np.ndarray:
        """For each of the next ``n`` tokens, the most quantized entries one KV op will have it read
        (0: that token's prediction read nothing quantized)."""
        got = np.zeros(n, np.int64)
        for _, st in self.quantized_ops():
            got = np.maximum(got, np.asarray(st.reads_quantized(n, stepwise), np.int64))
        return got

    def census(self) -> list[dict[str, Any]]:
        """Per KV op: its node, op, tokens held quantized and in full precision, bytes held and as f32."""
        rows = []
        for node, st in self.kv_ops():
            c = st.census()
            nb = st.nbytes()
            held = int(nb.get("codes", 0) + nb.get("params", 0) + nb.get("full_precision", 0))
            used = st.used_nbytes()
            rows.append({"node": node.name, "op": node.op, "quantized": bool(st.QUANTIZED),
                         "tokens": c["tokens"], "quantized_tokens": c["quantized"],
                         "full_precision_tokens": c["full_precision"], "bytes": held, "bytes_used": int(used),
                         "bytes_f32": int(c.get("f32_bytes", 0))})
        for name, arr in self.cache.items():
            a = np.asarray(arr)
            rows.append({"node": name, "op": "explicit cache input", "quantized": False,
                         "tokens": int(a.shape[2]) if a.ndim == 4 else 0, "quantized_tokens": 0,
                         "full_precision_tokens": int(a.shape[2]) if a.ndim == 4 else 0,
                         "bytes": int(a.nbytes), "bytes_used": int(a.nbytes), "bytes_f32": 4 * int(a.size)})
        return rows

    def kv_bytes(self) -> dict[str, int]:
        """Bytes of KV cache held at this point: the session's stateful ops plus explicit caches (f32 as fed)."""
        got = dict(self.session.kv_cache_bytes())
        explicit = int(sum(a.nbytes for a in self.cache.values()))
        got["full_precision"] = got.get("full_precision", 0) + explicit
        got["explicit"] = explicit
        got["total"] = got.get("total", 0) + explicit
        return got


def tract_available() -> bool:
    return tract_driver.available()


class TractDecoder:
    """Decode with tract (the oracle) through :class:`nnef_kv.tract_driver.Decoder`: outputs matched by
    position with the graph signature."""

    backend = "tract"

    def __init__(self, source: Any, sig: DecodeSignature) -> None:
        """``source``: an archive path, or an in-memory model (given to tract as a temporary archive)."""
        self.driver = tract_driver.Decoder(str(source) if isinstance(source, (str, os.PathLike)) else source, sig)
        self.tract_inputs = self.driver.tract_inputs
        self.sig = sig  # the driver starts with a fresh state and empty caches

    def reset(self) -> None:
        self.driver.reset()

    @property
    def cache(self) -> dict[str, np.ndarray]:
        return self.driver.cache

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        return _last_logits(self.driver(ids)[self.sig.logits_output])

    def prefill(self, ids: Sequence[int], chunk: int | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        ids = [int(t) for t in ids]
        size = len(ids) if not chunk else int(chunk)
        lg = None
        for i in range(0, len(ids), size):
            lg = self(np.asarray(ids[i:i + size]))
        assert lg is not None
        return lg, []

    def teacher(self, ids: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One-token calls (tract has no stepwise run): logits ``[n, V]``."""
        rows = [self(np.asarray([int(t)])) for t in ids]
        return (np.stack(rows) if rows else np.zeros((0, 0), np.float32)), []

    def reads_quantized(self, n: int, stepwise: bool) -> np.ndarray:
        return np.zeros(n, np.int64)  # not observable in tract: validation counts them on nnef-kv's side

    def census(self) -> list[dict[str, Any]]:
        return []


@dataclass
class DecodeTrace:
    """What a decode run produced. ``logits[i]`` is the last-position logits of call ``i``."""

    backend: str
    tokens: list[int]
    n_prompt: int
    logits: np.ndarray  # [calls, vocab] f32
    attention: list[list[np.ndarray]] = field(default_factory=list)  # [calls][layers]
    kv_bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def calls(self) -> int:
        return int(self.logits.shape[0])

    @property
    def predictions(self) -> list[int]:
        return [int(i) for i in np.argmax(self.logits, axis=-1)]


def run_decode(decoder: Any, prompt: Sequence[int], steps: int, tokens: Sequence[int] | None = None,
               on_token: Callable[[int], None] | None = None, on_call: Callable[[], None] | None = None) -> DecodeTrace:
    """Prompt call then ``steps`` one-token calls. ``tokens`` (prompt + at least ``steps`` more) forces the
    fed tokens; otherwise the argmax of each call is fed next. ``on_token`` sees each greedy token."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise InputError("the prompt is empty")
    if tokens is not None and len(tokens) < len(prompt) + steps:
        raise InputError(f"teacher tokens: {len(tokens)} given, {len(prompt) + steps} needed")
    decoder.reset()
    fed = list(prompt)
    logits: list[np.ndarray] = []
    attention: list[list[np.ndarray]] = []
    t0 = time.perf_counter()
    chunk = np.asarray(prompt, np.int64)
    for i in range(steps + 1):
        lg = decoder(chunk)
        logits.append(lg)
        if getattr(decoder, "capture", None) is not None:
            attention.append(decoder.last_attention)
        nxt = int(np.argmax(lg))
        if on_token is not None:
            on_token(nxt)
        if on_call is not None:
            on_call()
        if i == steps:
            break
        tok = int(tokens[len(prompt) + i]) if tokens is not None else nxt
        fed.append(tok)
        chunk = np.asarray([tok], np.int64)
    seconds = time.perf_counter() - t0
    kv = decoder.kv_bytes() if hasattr(decoder, "kv_bytes") else {}
    return DecodeTrace(backend=decoder.backend, tokens=fed, n_prompt=len(prompt), logits=np.stack(logits),
                       attention=attention, kv_bytes=kv, seconds=seconds)
