"""Which dynamic dims a torch.export graph really serves, and the model line that narrows the others.

torch.export keeps a dim symbolic (``Dim.AUTO``) even when the model's code then pins it with a
shape guard: DINOv2's position-embedding interpolation branch (``if num_patches == num_positions``)
leaves ``(H // 8) * (W // 8) == 16``, MobileViT's ``unfolding`` leaves ``(H - 1) // 8 + 1 == 4``.
The converted module then refuses any other image size (``Guard failed: ...``) although the graph's
placeholders look dynamic. :func:`narrowed_dims` reads the guards the export's ``ShapeEnv`` recorded
(equalities pin a dim to a few sizes) and the value ranges it inferred (a finite upper bound caps
it), and names for each such dim the guard and the user-code line that made it
(``modeling_mobilevit.py:406 in unfolding``), so that the report lists only the dims that are
served and says why the others are not.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

import sympy
import torch

__all__ = ["narrowed_dims"]


def _symbol(size: Any) -> Optional[sympy.Symbol]:
    node = getattr(size, "node", None)
    expr = getattr(node, "expr", None)
    return expr if isinstance(expr, sympy.Symbol) else None


def _where(guard: Any) -> str:
    """The guard's source location, the user's frame first (``file.py:LINE in fn``)."""
    sloc = getattr(guard, "sloc", None)
    frame = getattr(sloc, "maybe_user_loc", None) or getattr(sloc, "framework_loc", None)
    if frame is None:
        return ""
    if isinstance(frame, str):
        return re.sub(r"^.*/(?=[^/]+\.py:)", "", frame.strip("() "))
    return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


def _pins(expr: Any, sym: sympy.Symbol, hints: dict) -> bool:
    """Whether the equality ``expr`` fails for other sizes of ``sym`` (the others at their example
    sizes): ``Eq(16*B*h*w, 256*B)`` holds for any batch ``B``, so it does not pin ``B``."""
    for value in (hints[sym] + 1, 2 * hints[sym] + 3):
        try:
            holds = expr.xreplace({**hints, sym: sympy.Integer(value)})
        except Exception:  # an expression sympy cannot evaluate: count it as pinning (the safe answer)
            return True
        if holds is not sympy.true:
            return True
    return False


def narrowed_dims(named_values: list[tuple[str, Any]]) -> dict[str, dict[int, str]]:
    """``{input name: {dim: why}}`` for the symbolic dims of ``named_values`` (placeholder names and
    their fake tensors) that a recorded guard or a finite inferred range narrows."""
    symbols: dict[sympy.Symbol, list[tuple[str, int]]] = {}  # a symbol may size several dims (H == W)
    shape_env = None
    for name, value in named_values:
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            sym = _symbol(size)
            if sym is not None:
                symbols.setdefault(sym, []).append((name, dim))
                shape_env = shape_env or size.node.shape_env
    if shape_env is None:
        return {}
    label = {sym: f"{dims[0][0]}.size({dims[0][1]})" for sym, dims in symbols.items()}
    replacements = dict(getattr(shape_env, "replacements", {}))  # symbols export unified (W := H)

    def readable(expr: Any) -> str:
        return str(expr.xreplace({sym: sympy.Symbol(text) for sym, text in label.items()}))

    examples = getattr(shape_env, "backed_var_to_val", None)
    if examples is None:  # torch before backed_var_to_val
        examples = getattr(shape_env, "var_to_val", {})
    hints = {sym: sympy.Integer(int(val)) for sym, val in examples.items()}
    out: dict[str, dict[int, str]] = {}
    for guard in getattr(shape_env, "guards", ()):
        expr = guard.expr.xreplace(replacements) if replacements else guard.expr
        if not isinstance(expr, sympy.Eq) or not expr.free_symbols <= set(hints):
            continue
        for sym in expr.free_symbols & set(symbols):
            if all(dim in out.get(name, {}) for name, dim in symbols[sym]) or not _pins(expr, sym, hints):
                continue
            where = _where(guard)
            for name, dim in symbols[sym]:
                out.setdefault(name, {}).setdefault(dim, f"guard {readable(expr)}" + (f" at {where}" if where else ""))
    ranges = getattr(shape_env, "var_to_range", {})
    for sym, dims in symbols.items():
        bound = ranges.get(sym)
        upper = getattr(bound, "upper", None)
        if not isinstance(upper, (int, sympy.Integer)):  # int_oo: unbounded
            continue
        for name, dim in dims:
            out.setdefault(name, {}).setdefault(dim, f"sizes {int(bound.lower)}..{int(upper)} only (the range the guards leave)")
    return out
