"""Attribute expressions: evaluated when the graph is built when they can be, else kept and evaluated per
run (:class:`~.values.Lazy`), integer arithmetic on symbols compiled to closures, and the item budget
(``Limits.max_comprehension_items``) of comprehensions, ranges and list repetitions.

:class:`AttributeEvaluator` is a mixin of :class:`~.builder.GraphBuilder`: it reads the builder's scope,
symbols, constants and limits."""
from __future__ import annotations

import operator
import threading
from typing import Any, Callable

import numpy as np

from ..errors import GraphError, LimitError, NnefKvError
from ..grammar import ast as A
from ..grammar.printer import expr_text, message_text, short as _short
from .catalog import lookup
from .values import DYN, LRef, Lazy, TRef, _Ctx, _is_int, to_py

__all__ = ["AttributeEvaluator", "BINARY_OPS", "UNARY_OPS", "BUILTINS", "MAX_INT_BITS"]


BINARY_OPS = {
    "+": "add", "-": "sub", "*": "mul", "/": "div", "^": "pow",
    "<": "lt", ">": "gt", "<=": "le", ">=": "ge", "==": "eq", "!=": "ne",
    "&&": "and", "||": "or",
}
UNARY_OPS = {"-": "neg", "!": "not"}


def _int_div(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool):
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    return a / b


_PY_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": _int_div, "^": operator.pow,
    "<": operator.lt, ">": operator.gt, "<=": operator.le, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne,
    "&&": lambda a, b: bool(a) and bool(b), "||": lambda a, b: bool(a) or bool(b),
    "in": lambda a, b: a in b,
}


#: exceptions of Python's own evaluation of an attribute expression (ill-typed operands, bad indices ...),
#: reported as GraphError naming the expression
_EVAL_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError, OverflowError)

#: "not computed here": a compiled attribute closure hands the expression back to the interpreter
_MISS = object()

#: integers wider than this are refused (tract's TDim is an i64; u64 values still fit)
MAX_INT_BITS = 64


class _RunBudget(threading.local):
    """Items produced by one run-time (Lazy) attribute evaluation, per thread."""

    depth = 0
    items = 0


_RUN_BUDGET = _RunBudget()


BUILTINS = {
    "length_of": lambda x: len(x),
    "range_of": lambda x: list(range(len(x))),
    "integer": lambda x: int(x),
    "scalar": lambda x: float(x),
    "logical": lambda x: bool(x),
    "string": lambda x: str(x),
}


class AttributeEvaluator:
    """Attribute evaluation for the builder (mixin; see the module docstring)."""

    def attr(self, e: A.Expr, ctx: _Ctx) -> Any:
        """An attribute value: static Python value, or a Lazy re-evaluating ``e`` per run."""
        v = self._attr(e, ctx, None)
        if v is DYN:
            # snapshot the names used: later assignments may shadow them (tract allows reassignment)
            snap = _Ctx({n: ctx.scope[n] for n in set(A.identifiers(e)) if n in ctx.scope}, ctx.prefix, ctx.depth)
            snap.memo = ctx.memo
            slow = (lambda vals, e=e, c=snap: self._attr_at_run(e, c, vals))
            fast = self._compile_int(e, snap)
            if fast is not None:
                def fn(vals: list, fast: Callable = fast, slow: Callable = slow) -> Any:
                    r = fast(vals)
                    return slow(vals) if r is _MISS else r
                return Lazy(fn, expr_text(e), self._reads(e, snap))
            return Lazy(slow, expr_text(e), self._reads(e, snap))
        return v

    def _compile_int(self, e: A.Expr, ctx: _Ctx) -> Callable[[list], Any] | None:
        """A closure for the integer arithmetic attributes are mostly made of (``P + S``, ``[S - 1]``,
        ``[1, n_heads, P, 64]``): literals, symbols, tensors and per-run values read as integers, ``+ - * /``
        and negation, arrays of these. It returns what :meth:`_attr_at_run` returns, or ``_MISS`` when an
        operand is not an integer or a result does not fit in 64 bits (then the interpreter evaluates the
        expression, and reports what is wrong); None when ``e`` has another form."""
        if isinstance(e, A.IntegerLiteral) and type(e.value) is int:
            value = e.value
            return lambda vals: value
        if isinstance(e, A.Identifier):
            if e.name in ctx.scope:
                b = ctx.scope[e.name]
                if type(b) is int:
                    return lambda vals: b
                if isinstance(b, Lazy):
                    lazy = b.fn
                    return lambda vals: r if type(r := lazy(vals)) is int else _MISS
                if isinstance(b, TRef):
                    slot = b.slot
                    return lambda vals: r if type(r := to_py(vals[slot])) is int else _MISS
                return None
            if e.name in self.declared_symbols or e.name in self.symbols:
                sym = self.symbol(e.name).fn
                return lambda vals: r if type(r := sym(vals)) is int else _MISS
            return None
        if isinstance(e, A.UnaryExpr) and e.op == "-":
            f = self._compile_int(e.operand, ctx)
            if f is None:
                return None
            return lambda vals: _MISS if (r := f(vals)) is _MISS else -r
        if isinstance(e, A.BinaryExpr) and e.op in ("+", "-", "*", "/"):
            fa, fb = self._compile_int(e.left, ctx), self._compile_int(e.right, ctx)
            if fa is None or fb is None:
                return None
            op = _PY_BINARY[e.op]

            def binary(vals: list) -> Any:
                a = fa(vals)
                b = fb(vals)
                if a is _MISS or b is _MISS or (b == 0 and op is _int_div):
                    return _MISS
                r = op(a, b)
                return r if r.bit_length() <= MAX_INT_BITS else _MISS
            return binary
        if isinstance(e, A.ArrayExpr):
            items = [self._compile_int(i, ctx) for i in e.items]
            if any(f is None for f in items):
                return None
            fs = tuple(items)  # type: ignore[arg-type]

            def array(vals: list) -> Any:
                out = [f(vals) for f in fs]
                return _MISS if _MISS in out else out
            return array
        return None

    def _attr_at_run(self, e: A.Expr, ctx: _Ctx, vals: list) -> Any:
        """A Lazy attribute evaluated for one run: items produced are bounded per evaluation (nested Lazy
        reads count towards the outermost one)."""
        budget = _RUN_BUDGET
        if budget.depth == 0:
            budget.items = 0
        budget.depth += 1
        try:
            return self._attr(e, ctx, vals)
        finally:
            budget.depth -= 1

    def _reads(self, e: A.Expr, ctx: _Ctx) -> tuple[int, ...] | None:
        """Slots an attribute expression reads at run time: tensors named in it, nested invocations
        (memoised when the expression was first evaluated), symbols; None if one is not known."""
        out: set[int] = set()

        def add(v: Any) -> bool:
            if isinstance(v, (TRef, LRef)):
                out.add(v.slot)
            elif isinstance(v, Lazy):
                if v.reads is None:
                    return False
                out.update(v.reads)
            elif isinstance(v, (list, tuple)):
                return all(add(x) for x in v)
            return True

        stack: list[Any] = [e]
        while stack:
            x = stack.pop()
            if isinstance(x, A.Identifier):
                if x.name in ctx.scope:
                    if not add(ctx.scope[x.name]):
                        return None
                elif x.name in self.symbols:
                    out.add(self.symbols[x.name])
            elif isinstance(x, A.Invocation) and id(x) in ctx.memo:
                if not add(ctx.memo[id(x)]):
                    return None
            if isinstance(x, (list, tuple)):
                stack.extend(x)
            elif hasattr(x, "__dataclass_fields__"):
                stack.extend(getattr(x, f) for f in x.__dataclass_fields__ if f != "pos")
        return tuple(sorted(out))

    def _static_literal(self, e: A.Expr) -> Any:
        v = self._attr(e, _Ctx({}, "", 0), None)
        if v is DYN:
            raise GraphError(f"{self.loc(getattr(e, 'pos', None))}: a literal is expected")
        return v

    def _attr(self, e: A.Expr, ctx: _Ctx, vals: list | None) -> Any:
        """Evaluate an attribute expression (``vals``: the run's values, None while building; DYN when it
        needs them). Python's own failures (``-[[1.0]]``, ``length_of(1)``, ``1.5[0:1]``) -> GraphError."""
        try:
            return self._attr_eval(e, ctx, vals)
        except NnefKvError:
            raise
        except _EVAL_ERRORS as exc:
            raise GraphError(f"{self.loc(getattr(e, 'pos', None))}: cannot evaluate {message_text(e)}: "
                             f"{_short(f'{type(exc).__name__}: {exc}', 160)}") from None

    def _spend(self, n: int, e: A.Expr, vals: list | None, what: str) -> None:
        """Account for ``n`` items produced by ``e`` (a comprehension, a range, a list repetition or
        concatenation): refused with LimitError if ``n`` alone, or the total of the document build (of this
        run's evaluation, at run time), exceeds ``max_comprehension_items``."""
        limit = self.limits.max_comprehension_items
        where = f"{self.loc(getattr(e, 'pos', None))}: {message_text(e)}"
        if n > limit:
            raise LimitError(f"{where}: {what} of {n} items, over max_comprehension_items={limit}")
        if vals is None:
            self.items_built += n
            total = self.items_built
        else:
            _RUN_BUDGET.items += n
            total = _RUN_BUDGET.items
        if total > limit:
            raise LimitError(f"{where}: attribute expressions produce {total} items in all, over "
                             f"max_comprehension_items={limit}")

    def _binary(self, e: A.BinaryExpr, a: Any, b: Any, vals: list | None) -> Any:
        """``a op b`` on build-time values, bounded: list/string repetition and concatenation are sized
        before they are made, integer powers and results wider than 64 bits are refused."""
        op = e.op
        seq = (list, tuple, str)
        count = (int, np.integer)
        if op == "*" and (isinstance(a, seq) and isinstance(b, count) or isinstance(b, seq) and isinstance(a, count)):
            items, times = (a, b) if isinstance(a, seq) else (b, a)
            self._spend(len(items) * max(int(times), 0), e, vals, "a repetition")
        elif op == "+" and isinstance(a, seq) and isinstance(b, seq):
            self._spend(len(a) + len(b), e, vals, "a concatenation")
        elif op == "^" and _is_int(a) and _is_int(b) and abs(a) > 1 and b > MAX_INT_BITS:
            # |a| >= 2: the result needs more than b bits (checked before Python computes it, unboundedly)
            raise GraphError(f"{self.loc(e.pos)}: {message_text(e)} does not fit in {MAX_INT_BITS} bits")
        try:
            r = _PY_BINARY[op](a, b)
        except NnefKvError:
            raise
        except Exception as exc:
            raise GraphError(f"{self.loc(e.pos)}: cannot evaluate {message_text(e)}: {_short(str(exc), 160)}") from None
        if _is_int(r) and r.bit_length() > MAX_INT_BITS:
            raise GraphError(f"{self.loc(e.pos)}: {message_text(e)} does not fit in {MAX_INT_BITS} bits")
        return r

    def _attr_eval(self, e: A.Expr, ctx: _Ctx, vals: list | None) -> Any:
        if isinstance(e, (A.IntegerLiteral, A.ScalarLiteral, A.LogicalLiteral, A.StringLiteral)):
            return e.value
        if isinstance(e, A.Identifier):
            if e.name in ctx.scope:
                return self._read(ctx.scope[e.name], vals)
            if e.name in self.declared_symbols or e.name in self.symbols:
                return self._read(self.symbol(e.name), vals)
            raise GraphError(f"{self.loc(e.pos)}: undefined identifier '{e.name}'")
        if isinstance(e, (A.ArrayExpr, A.TupleExpr)):
            items = [self._attr(i, ctx, vals) for i in e.items]
            if any(i is DYN for i in items):
                return DYN
            return items if isinstance(e, A.ArrayExpr) else tuple(items)
        if isinstance(e, A.UnaryExpr):
            x = self._attr(e.operand, ctx, vals)
            if x is DYN:
                return DYN
            if e.op == "-":
                return [-i for i in x] if isinstance(x, list) else -x
            if e.op == "!":
                return not x
            return x
        if isinstance(e, A.BinaryExpr):
            a = self._attr(e.left, ctx, vals)
            b = self._attr(e.right, ctx, vals)
            if a is DYN or b is DYN:
                return DYN
            return self._binary(e, a, b, vals)
        if isinstance(e, A.IfElseExpr):
            c = self._attr(e.condition, ctx, vals)
            if c is DYN:
                self._attr(e.then_value, ctx, vals)
                self._attr(e.else_value, ctx, vals)
                return DYN
            return self._attr(e.then_value if c else e.else_value, ctx, vals)
        if isinstance(e, A.Subscript):
            base = self._attr(e.base, ctx, vals)
            idx = self._attr(e.index, ctx, vals)
            if base is DYN or idx is DYN:
                return DYN
            try:
                return base[idx]
            except Exception as exc:
                raise GraphError(
                    f"{self.loc(e.pos)}: bad subscript {message_text(e)}: {_short(str(exc), 160)}"
                ) from None
        if isinstance(e, A.SliceExpr):
            base = self._attr(e.base, ctx, vals)
            lo = self._attr(e.begin, ctx, vals) if e.begin is not None else None
            hi = self._attr(e.end, ctx, vals) if e.end is not None else None
            if any(x is DYN for x in (base, lo, hi)):
                return DYN
            if not isinstance(base, (list, tuple, str)) or not all(x is None or _is_int(x) for x in (lo, hi)):
                raise GraphError(f"{self.loc(e.pos)}: cannot evaluate the slice {message_text(e)}: an array or string "
                                 f"sliced by integers is expected")
            return base[lo:hi]
        if isinstance(e, A.Comprehension):
            return self._comprehension(e, ctx, vals)
        if isinstance(e, A.Invocation):
            if e.name in BUILTINS and e.name not in self.fragments and lookup(e.name) is None:
                args = [self._attr(a.value, ctx, vals) for a in e.args]
                if any(a is DYN for a in args):
                    return DYN
                if len(args) != 1:
                    raise GraphError(f"{self.loc(e.pos)}: {e.name} takes one argument")
                if e.name in ("length_of", "range_of") and not isinstance(args[0], (list, tuple, str)):
                    raise GraphError(f"{self.loc(e.pos)}: cannot evaluate {message_text(e)}: {e.name} takes an array "
                                     f"or a string, got {_short(repr(args[0]), 60)}")
                if e.name == "range_of":
                    self._spend(len(args[0]), e, vals, "a range")
                return BUILTINS[e.name](args[0])
            if vals is None:
                if id(e) not in ctx.memo:
                    res = self.invoke(e, ctx, ctx.prefix + e.name, None)
                    ctx.memo[id(e)] = res[0] if len(res) == 1 else list(res)
                return self._read(ctx.memo[id(e)], None)
            return self._read(ctx.memo[id(e)], vals)
        raise GraphError(f"{self.loc(getattr(e, 'pos', None))}: cannot evaluate {type(e).__name__}")

    def _read(self, v: Any, vals: list | None) -> Any:
        if isinstance(v, (TRef, LRef)):
            return DYN if vals is None else to_py(vals[v.slot])
        if isinstance(v, Lazy):
            return DYN if vals is None else v.fn(vals)
        if isinstance(v, list):
            items = [self._read(i, vals) for i in v]
            return DYN if any(i is DYN for i in items) else items
        return v

    def _comprehension(self, e: A.Comprehension, ctx: _Ctx, vals: list | None) -> Any:
        iters = [self._attr(it.iterable, ctx, vals) for it in e.iterators]
        if any(i is DYN for i in iters):
            return DYN
        for it, seq in zip(e.iterators, iters):
            if not isinstance(seq, (list, tuple)):
                raise GraphError(
                    f"{self.loc(e.pos)}: cannot evaluate {message_text(e)}: {message_text(it.iterable)} is "
                    f"not an array ({_short(repr(seq), 60)})"
                )
        n = len(iters[0]) if iters else 0
        self._spend(n, e, vals, "a comprehension")
        if any(len(i) != n for i in iters):
            raise GraphError(f"{self.loc(e.pos)}: comprehension iterables differ in length")
        out = []
        for k in range(n):
            inner = _Ctx(dict(ctx.scope), ctx.prefix, ctx.depth)
            inner.memo = ctx.memo
            for it, seq in zip(e.iterators, iters):
                self._bind_static(it.target, seq[k], inner)
            if e.condition is not None:
                c = self._attr(e.condition, inner, vals)
                if c is DYN:
                    return DYN
                if not c:
                    continue
            b = self._attr(e.body, inner, vals)
            if b is DYN:
                return DYN
            out.append(b)
        return out

    def _bind_static(self, target: A.Expr, value: Any, ctx: _Ctx) -> None:
        if isinstance(target, A.Identifier):
            ctx.scope[target.name] = value
        elif isinstance(target, (A.TupleExpr, A.ArrayExpr)):
            if not isinstance(value, (list, tuple)) or len(value) != len(target.items):
                raise GraphError(f"{self.loc(getattr(target, 'pos', None))}: cannot unpack {_short(repr(value), 60)} "
                                 f"into {message_text(target)}")
            for t, v in zip(target.items, value):
                self._bind_static(t, v, ctx)
