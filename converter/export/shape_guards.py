"""Input shape checks for the emitted model.py of a torch.export capture.

An export graph serves only the sizes it was captured for: the dims it fixed (a hidden size, an
LSTM's state shape, a dim the model specialised) and, for its dynamic dims, the range and the
relations between them that export recorded (two inputs that share a sequence length, a dim that is
``16 * k``). Called at another size, such a graph fails deep inside an op (aten.lstm with a wrong
state size can even crash the process) or computes something else. ``conv.module`` checks this
with export's guard function; model.py, which is plain PyTorch, checks it with the lines
:func:`guard_lines` writes at the top of ``forward``::

    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected a 2-d tensor, got {input_ids.dim()}-d")
    if input_ids.shape[1] != 12:
        raise ValueError(f"input_ids: dim 1 has size {input_ids.shape[1]}, but the converted graph fixed it at 12: ...")

The checks are integer comparisons on ``tensor.shape`` (no sympy at run time): sizes are read from
the placeholders' fake values (``node.meta["val"]``) when the file is generated. Dynamic dims get a
check only where export recorded something: a lower bound above 2 (export treats 0 and 1 as
ordinary sizes below that), a finite range (both ends, named in the message: ``2..512`` for BERT's
sequence length; 2 is then a limit too, the graph was traced for sizes >= 2), the equality of two dims that share a symbol,
and a dim that is a linear expression ``a*s + b`` of a symbol (``s`` is then read from the first
such dim). Other expressions of several symbols are left to the ops.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import sympy
import torch
import torch.fx

__all__ = ["guard_lines"]

#: what every size message ends with
_HINT = "convert the model with an example of the sizes you need"


def _check(condition: str, message: str) -> str:
    """One prologue statement: ``if condition: raise ValueError(f"message")`` (two lines)."""
    return f"if {condition}:\n        raise ValueError(f{message!r})"


class _Sources:
    """Where each size symbol can be read from the inputs: ``input_ids.shape[1]`` or ``(x.shape[2] - 1) // 16``."""

    def __init__(self) -> None:
        self.expr: dict[sympy.Symbol, str] = {}
        self.label: dict[sympy.Symbol, str] = {}

    def python(self, expr: sympy.Expr) -> Optional[str]:
        """``expr`` as Python over input sizes, or None if a symbol has no source."""
        from torch.utils._sympy.printers import PythonPrinter

        if not expr.free_symbols <= set(self.expr):
            return None
        if isinstance(expr, sympy.Symbol):
            return self.expr[expr]
        names = {s: sympy.Symbol(f"({self.expr[s]})", integer=True) for s in expr.free_symbols}
        return PythonPrinter().doprint(expr.xreplace(names))


def _symbol_range(size: torch.SymInt, symbol: sympy.Symbol) -> tuple[int, Optional[int]]:
    """The range export recorded for ``symbol`` (from the shape environment of ``size``)."""
    value_range = size.node.shape_env.var_to_range.get(symbol)
    if value_range is None:
        return 0, None
    lower, upper = value_range.lower, value_range.upper  # int_oo: torch's integer infinity
    return (int(lower) if lower.is_Integer else 0), (int(upper) if upper.is_Integer else None)


def _linear(expr: sympy.Expr) -> Optional[tuple[sympy.Symbol, int, int]]:
    """``(s, a, b)`` if ``expr`` is ``a*s + b`` with integers a >= 1 and b; else None."""
    if len(expr.free_symbols) != 1:
        return None
    symbol = next(iter(expr.free_symbols))
    if not expr.is_polynomial(symbol):
        return None
    poly = sympy.Poly(expr, symbol)
    if poly.degree() != 1 or not all(c.is_Integer for c in poly.all_coeffs()):
        return None
    a, b = (int(c) for c in poly.all_coeffs())
    return (symbol, a, b) if a >= 1 else None


def _range_lines(read: str, got: str, low: int, high: Optional[int], *, check_low: bool) -> list[str]:
    """Checks of a size against its range; a finite range is named in both messages (``2..512``)."""
    span = f" (its range is {low}..{high})" if high is not None else ""
    lines = [_check(f"{read} < {low}", f"{got}, but the converted graph serves sizes >= {low} there{span}: {_HINT}")] if check_low else []
    if high is not None:
        lines.append(_check(f"{read} > {high}", f"{got}, but the converted graph serves sizes <= {high} there{span}: {_HINT}"))
    return lines


def _dim_lines(size: Any, read: str, where: str, sources: _Sources) -> list[str]:
    """Checks for one dim read as ``read`` (``x.shape[1]``), described as ``where`` (``x: dim 1``)."""
    got = f"{where} has size {{{read}}}"
    if isinstance(size, torch.SymInt) and size.node.expr.is_Integer:
        size = int(size.node.expr)
    if isinstance(size, int):
        return [_check(f"{read} != {size}", f"{got}, but the converted graph fixed it at {size}: {_HINT}")]
    if not isinstance(size, torch.SymInt):
        return []
    expr = size.node.expr
    known = sources.python(expr)
    if known is not None:  # a symbol seen before: the two dims must agree
        by = ", ".join(sorted({sources.label[s] for s in expr.free_symbols}))
        return [_check(f"{read} != {known}", f"{got}, but the converted graph needs {{{known}}} there (set by {by}); the inputs' sizes disagree")]
    linear = _linear(expr)
    if linear is None:  # several unknown symbols: left to the ops
        return []
    symbol, a, b = linear
    low, high = _symbol_range(size, symbol)
    hint = getattr(size.node, "hint", None)
    if isinstance(hint, int):  # a size-1 example dim traced size-obliviously serves its own size
        low = min(low, (hint - b) // a)
    # a finite range (BERT's sequence length 2..512) is checked at both ends: the graph was traced for
    # sizes >= 2 there (export's 0/1 specialisation); an unbounded dim is checked below only above 2
    lines = _range_lines(read, got, a * low + b, None if high is None else a * high + b,
                         check_low=low > 2 or high is not None)
    offset = f"{read} - {b}" if b else read
    if a > 1:
        form = f"a multiple of {a}" + (f" plus {b}" if b else "")
        lines.insert(0, _check(f"({offset}) % {a}", f"{got}, but the converted graph serves only {form} there: {_HINT}"))
    sources.expr[symbol] = f"({offset}) // {a}" if a > 1 else offset
    sources.label[symbol] = where
    return lines


def guard_lines(placeholders: list[torch.fx.Node], paths: list[str], *,
                narrowed: Optional[Mapping[str, tuple[int, ...]]] = None) -> list[str]:
    """Prologue statements that check each tensor input's rank and sizes (see module docstring).

    ``placeholders``: the graph's input nodes (with export's ``meta["val"]``); ``paths``: the
    Python expression the forward reads each from (``input_ids``, ``xs[1]``), in the same order.
    ``narrowed``: path -> dims the graph keeps symbolic but a guard in the model's code pins to the
    example's size (``idx.size(1) // 8 == 2`` of a chunk loop): checked as fixed at that size.
    """
    lines: list[str] = []
    sources = _Sources()
    for node, path in zip(placeholders, paths):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        name = node.name
        rank = value.dim()
        label = path.replace("{", "{{").replace("}", "}}")
        lines.append(_check(f"{name}.dim() != {rank}",
                            f"{label}: expected a {rank}-d tensor, got {{{name}.dim()}}-d"))
        pinned = set((narrowed or {}).get(path, ()))
        for i, size in enumerate(value.shape):
            hint = getattr(getattr(size, "node", None), "hint", None)
            if i in pinned and isinstance(hint, int):
                size = hint  # a guard of the model's code pins it: served at the example's size only
            lines += _dim_lines(size, f"{name}.shape[{i}]", f"{label}: dim {i}", sources)
    return lines + _narrowing_lines(placeholders, sources)


def _narrowing_lines(placeholders: list[torch.fx.Node], sources: _Sources) -> list[str]:
    """Checks of the guards the model's code recorded on dynamic dims (``x.size(1) % 4 == 0``: a reshape into
    chunks), where each of their sizes can be read from the inputs: the graph computes something else, or fails
    inside an op, for sizes they refuse."""
    from converter.passes.guards import narrowing_guards

    lines = []
    for expr, where in narrowing_guards([(n.name, n.meta.get("val")) for n in placeholders]):
        test = sources.python(expr)
        if test is None or not expr.free_symbols:
            continue
        dims = ", ".join(sorted({sources.label[s] for s in expr.free_symbols}))
        sizes = ", ".join(f"{{{sources.expr[s]}}}" for s in sorted(expr.free_symbols, key=str))
        at = f" (the model's code at {where})".replace("{", "{{").replace("}", "}}") if where else ""
        lines.append(_check(f"not ({test})", f"{dims}: size {sizes}, but the converted graph serves only sizes where "
                                             f"{test}{at}: {_HINT}, or pad the input to such a size"))
    return lines
