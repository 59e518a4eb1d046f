"""Which dynamic dims a torch.export graph really serves, and the model line that narrows the others.

torch.export keeps a dim symbolic (``Dim.AUTO``) even when the model's code then pins it with a
shape guard: DINOv2's position-embedding interpolation branch (``if num_patches == num_positions``)
leaves ``(H // 8) * (W // 8) == 16``, MobileViT's ``unfolding`` leaves ``(H - 1) // 8 + 1 == 4``.
The converted module then refuses any other image size (``Guard failed: ...``) although the graph's
placeholders look dynamic. :func:`narrowed_dims` reads the guards the export's ``ShapeEnv`` recorded
(equalities pin a dim to a few sizes), and names for each such dim the guard and the user-code line
that made it (``modeling_mobilevit.py:406 in unfolding``), so that the report lists only the dims
that are served and says why the others are not.

A range is not a pin: BERT's position table of ``max_position_embeddings`` rows leaves its sequence
length ``2..512`` (``position_ids[:, :seq_length]`` guards ``seq_length <= 512``), and every length
in it is served. :func:`dim_ranges` names such dims with their range, the guard and the model line
(read from the graph node that made it), and the dim stays dynamic. Its lower bound is export's 0/1
specialisation (the graph was traced for sizes >= 2: a ``squeeze`` or an ``if size == 1`` there is
resolved for them) unless the example itself was smaller.

A relation between inputs is not a pin either. A Hugging Face model given ``labels`` flattens its logits
and the labels for the loss (``logits.view(-1, V)``, ``labels.view(-1)``), which leaves the guard
``Eq(input_ids.size(0)*input_ids.size(1), labels.size(0)*labels.size(1))``: it holds for every batch
and length as long as the labels have the shape of the ``input_ids``, but it fails when any one size
changes alone, so it would read as pinning all four. torch.export gives each ``Dim.AUTO`` dim its own
symbol and does not solve such a product. :func:`tied_dims` finds such guards, and the dims of
same-shaped inputs that make them identities when they share a symbol (``labels.size(0)`` is
``input_ids.size(0)``, ``labels.size(1)`` is ``input_ids.size(1)``); capture exports again with each
group sharing one ``Dim`` (:mod:`converter.passes.capture.export_trace`), and the guard is gone.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional, cast

import sympy
import torch

__all__ = ["narrowing_guards", "dim_ranges", "narrowed_dims", "pinned_dims", "tied_dims", "Tie"]


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


def _symbols(named_values: list[tuple[str, Any]]) -> tuple[dict, Any]:
    """``{symbol: [(input name, dim), ...]}`` for the symbolic dims of ``named_values``, and their ShapeEnv."""
    symbols: dict[sympy.Symbol, list[tuple[str, int]]] = {}  # a symbol may size several dims (H == W)
    shape_env = None
    for name, value in named_values:
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            sym = _symbol(size)
            if sym is not None:
                symbols.setdefault(sym, []).append((name, dim))
                shape_env = shape_env or cast(torch.SymInt, size).node.shape_env  # a symbol: a SymInt
    return symbols, shape_env


def _hints(shape_env: Any) -> dict:
    """The example's size of each symbol."""
    examples = getattr(shape_env, "backed_var_to_val", None)
    if examples is None:  # torch before backed_var_to_val
        examples = getattr(shape_env, "var_to_val", {})
    return {sym: sympy.Integer(int(val)) for sym, val in examples.items()}


def _range(shape_env: Any, sym: sympy.Symbol) -> tuple[int, Optional[int]]:
    """The sizes export's inferred range allows for ``sym`` (None: no upper bound)."""
    bound = getattr(shape_env, "var_to_range", {}).get(sym)
    lower, upper = getattr(bound, "lower", None), getattr(bound, "upper", None)
    low = int(lower) if isinstance(lower, (int, sympy.Integer)) else 0
    return low, (int(upper) if isinstance(upper, (int, sympy.Integer)) else None)  # int_oo: unbounded


def _fails_at_multiples(expr: Any, sym: sympy.Symbol, hints: dict) -> bool:
    """Whether the equality ``expr`` fails at twice and three times the example's size of ``sym``: a pin to that size
    (``s // 8 == 2`` of a chunk loop unrolled twice), not a divisibility (``s % 8 == 0`` holds there)."""
    for value in (2 * hints[sym], 3 * hints[sym]):
        try:
            holds = expr.xreplace({**hints, sym: sympy.Integer(value)})
        except Exception:  # an expression sympy cannot evaluate: a pin (the safe answer)
            return True
        if holds is sympy.true:
            return False
    return True


def pinned_dims(named_values: list[tuple[str, Any]]) -> dict[str, tuple[int, ...]]:
    """``{input name: dims}`` of the narrowed dims (:func:`narrowed_dims`) that a guard pins to the example's size
    itself: it fails at multiples of that size too. The emitted model.py serves such a dim at that size only; a dim
    only a divisibility narrows keeps its checks (a multiple of 8 for a UNet's image size)."""
    symbols, shape_env = _symbols(named_values)
    if shape_env is None:
        return {}
    replacements = dict(getattr(shape_env, "replacements", {}))
    hints = _hints(shape_env)
    out: dict[str, set[int]] = {}
    for guard in getattr(shape_env, "guards", ()):
        expr = guard.expr.xreplace(replacements) if replacements else guard.expr
        if not isinstance(expr, sympy.Eq) or not expr.free_symbols <= set(hints):
            continue
        for sym in expr.free_symbols & set(symbols):
            if sym in hints and _fails_at_multiples(expr, sym, hints):
                for name, dim in symbols[sym]:
                    out.setdefault(name, set()).add(dim)
    return {name: tuple(sorted(dims)) for name, dims in out.items()}


def narrowing_guards(named_values: list[tuple[str, Any]]) -> list[tuple[Any, str]]:
    """``[(expr, where)]``: the recorded equality guards that narrow a symbolic dim of ``named_values`` (they fail for
    other sizes of one of its symbols: ``Eq(Mod(s1, 4), 0)``, ``Eq(s1 // 8, 2)``), in the symbols of the graph's
    shapes (export's unifications applied), each with the user's ``file:line`` that recorded it, once each."""
    symbols, shape_env = _symbols(named_values)
    if shape_env is None:
        return []
    replacements = dict(getattr(shape_env, "replacements", {}))
    hints = _hints(shape_env)
    out: dict[Any, str] = {}
    for guard in getattr(shape_env, "guards", ()):
        expr = guard.expr.xreplace(replacements) if replacements else guard.expr
        if isinstance(expr, sympy.Eq) and expr.free_symbols <= set(hints) and expr not in out \
                and any(_pins(expr, sym, hints) for sym in expr.free_symbols & set(symbols)):
            out[expr] = _where(guard)
    return list(out.items())


def narrowed_dims(named_values: list[tuple[str, Any]]) -> dict[str, dict[int, str]]:
    """``{input name: {dim: why}}`` for the symbolic dims of ``named_values`` (placeholder names and
    their fake tensors) that a recorded equality guard, or a range of a single size, pins.
    A finite range of several sizes is not a pin (:func:`dim_ranges`)."""
    symbols, shape_env = _symbols(named_values)
    if shape_env is None:
        return {}
    label = {sym: f"{dims[0][0]}.size({dims[0][1]})" for sym, dims in symbols.items()}
    replacements = dict(getattr(shape_env, "replacements", {}))  # symbols export unified (W := H)

    def readable(expr: Any) -> str:
        return str(expr.xreplace({sym: sympy.Symbol(text) for sym, text in label.items()}))

    hints = _hints(shape_env)
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
    for sym, dims in symbols.items():
        low, high = _range(shape_env, sym)
        if high is not None and low == high:
            for name, dim in dims:
                out.setdefault(name, {}).setdefault(dim, f"size {high} only (the range the guards leave)")
    return out


def _stack_line(node: torch.fx.Node) -> str:
    """``file.py:LINE in fn`` of the innermost frame of a node's recorded stack trace ("" if none)."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    path, line, fn = frames[-1]
    return f"{os.path.basename(path)}:{line} in {fn}"


def _bounding_line(gm: Optional[torch.fx.GraphModule], sym: sympy.Symbol, replacements: dict, high: int) -> str:
    """The model line that caps ``sym`` at ``high``: the first graph op that reads a size of ``sym``
    together with a tensor with a fixed dim of ``high`` (``self.position_ids[:, :seq_length]``)."""
    if gm is None:
        return ""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        inputs: list[torch.fx.Node] = []
        torch.fx.node.map_arg((node.args, node.kwargs), inputs.append)
        reads = caps = False
        for arg in inputs:
            val = arg.meta.get("val")
            if isinstance(val, torch.SymInt):
                expr = val.node.expr.xreplace(replacements) if replacements else val.node.expr
                reads = reads or sym in getattr(expr, "free_symbols", ())
            elif isinstance(val, torch.Tensor):
                caps = caps or any(isinstance(size, int) and size == high for size in val.shape)
        if reads and caps and _stack_line(node):
            return _stack_line(node)
    return ""


def dim_ranges(named_values: list[tuple[str, Any]],
               gm: Optional[torch.fx.GraphModule] = None) -> dict[str, dict[int, dict]]:
    """``{input name: {dim: {"min": low, "max": high, "why": text}}}`` for the symbolic dims of
    ``named_values`` that export's inferred range bounds: a finite upper bound (``max``; None when
    only the lower bound is above 2), or a lower bound above 2 (2 itself is export's 0/1
    specialisation, which every dynamic dim has; it is listed with a finite upper bound). ``why``
    names the guard and the model line (``gm``'s node that made it, when found). The dims stay
    dynamic: every size in the range is served. A range of one size is a pin (:func:`narrowed_dims`)."""
    symbols, shape_env = _symbols(named_values)
    if shape_env is None:
        return {}
    label = {sym: f"{dims[0][0]}.size({dims[0][1]})" for sym, dims in symbols.items()}
    replacements = dict(getattr(shape_env, "replacements", {}))
    hints = _hints(shape_env)
    out: dict[str, dict[int, dict]] = {}
    for sym, dims in symbols.items():
        low, high = _range(shape_env, sym)
        if (high is None and low <= 2) or (high is not None and low >= high):
            continue
        if sym in hints:  # a size-1 example dim traced size-obliviously serves its own size
            low = min(low, int(hints[sym]))
        guards = []
        for guard in getattr(shape_env, "guards", ()):
            expr = guard.expr.xreplace(replacements) if replacements else guard.expr
            if (isinstance(expr, sympy.core.relational.Relational) and not isinstance(expr, (sympy.Eq, sympy.Ne))
                    and expr.free_symbols == {sym}):
                guards.append(str(expr.xreplace({s: sympy.Symbol(t) for s, t in label.items()})))
        where = _bounding_line(gm, sym, replacements, high) if high is not None else ""
        why = (f"guard {', '.join(dict.fromkeys(guards))}" if guards else "the range export inferred") + (
            f" at {where}" if where else "")
        for name, dim in dims:
            out.setdefault(name, {})[dim] = {"min": low, "max": high, "why": why}
    return out


@dataclass(frozen=True)
class Tie:
    """Input dims that one guard relates and that are the same size: ``dims[0]`` (an input's dim, as
    ``(input name, dim)``) and the others, which a new export gives ``dims[0]``'s symbol."""

    dims: tuple
    #: the dims among ``dims`` that the first export gave symbols of their own (``labels``'), not ``dims[0]``'s
    joined: tuple
    #: the sizes the first export allowed for all of them (``high`` None: no upper bound)
    low: int
    high: Optional[int]
    #: the guard that relates them and its source line
    why: str

    def dim(self) -> Any:
        """A new ``torch.export.Dim`` for the group, named after its first member, with its range."""
        name, index = self.dims[0]
        text = re.sub(r"\W", "_", f"{name}_{index}")
        bounds = {"min": self.low} if self.high is None else {"min": self.low, "max": self.high}
        return torch.export.Dim(text if text[0].isalpha() else f"d_{text}", **bounds)


def tied_dims(named_values: list[tuple[str, Any]]) -> list[Tie]:
    """The groups of input dims that an equality guard relates, where giving the dims of same-shaped
    inputs one symbol makes the guard hold for every size of them (see the module docstring). Only
    guards that would pin a dim count (:func:`narrowed_dims`); inputs are matched dim by dim, each
    to the first earlier input of the example's shape whose dims the guard names too. Dims another
    guard fixes to one size are not shared (a size-1 batch traced size-obliviously): the guard may
    then still pin other dims, which stay narrowed."""
    symbols, shape_env = _symbols(named_values)
    if shape_env is None:
        return []
    hints = _hints(shape_env)
    replacements = dict(getattr(shape_env, "replacements", {}))
    label = {sym: sympy.Symbol(f"{dims[0][0]}.size({dims[0][1]})") for sym, dims in symbols.items()}
    at = {name: [_symbol(size) for size in value.shape] for name, value in named_values if isinstance(value, torch.Tensor)}
    example = {name: tuple(hints.get(sym) if sym is not None else None for sym in syms) for name, syms in at.items()}
    guards = [(guard, guard.expr.xreplace(replacements) if replacements else guard.expr)
              for guard in getattr(shape_env, "guards", ())]
    # dims a guard fixes (a size-1 batch traced size-obliviously: Eq(labels.size(0), 1)) take their size
    fixed = {expr.lhs: expr.rhs for _, expr in guards
             if isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Symbol) and expr.rhs.is_Integer}
    merged: dict[sympy.Symbol, sympy.Symbol] = {}  # a symbol -> the one it shares
    why: dict[sympy.Symbol, str] = {}
    for guard, expr in guards:
        if not isinstance(expr, sympy.Eq) or not expr.free_symbols <= set(symbols) or not expr.free_symbols <= set(hints):
            continue
        expr = expr.xreplace(fixed).xreplace(merged)
        if expr is sympy.true or not any(_pins(expr, sym, hints) for sym in expr.free_symbols):
            continue
        subst = _same_shape_pairs(expr.free_symbols, at, example)
        # kept when the guard no longer pins the shared symbols (other dims in it may stay narrowed)
        if subst and not any(_pins(expr.xreplace(subst), sym, hints) for sym in set(subst.values())):
            merged.update(subst)
            where = _where(guard)
            for target in set(subst.values()):
                why.setdefault(target, f"guard {guard.expr.xreplace(replacements).xreplace(label)}"
                               + (f" at {where}" if where else ""))
    ties = []
    for target, text in why.items():
        group = [target] + [sym for sym, to in merged.items() if to == target]
        ranges = [_range(shape_env, sym) for sym in group]
        highs = [high for _, high in ranges if high is not None]
        ties.append(Tie(tuple(dim for sym in group for dim in symbols[sym]), tuple(dim for sym in group[1:] for dim in symbols[sym]),
                        max(low for low, _ in ranges), min(highs) if highs else None, text))
    return ties


def _same_shape_pairs(free: set, at: dict, example: dict) -> dict:
    """``{symbol: symbol}``: each dim named in ``free`` of an input, to the same dim of the first
    earlier input of the same example shape whose matching dims ``free`` names as well."""
    subst: dict[sympy.Symbol, sympy.Symbol] = {}
    names = list(at)
    for j, b in enumerate(names):
        if not any(sym in free for sym in at[b]) or None in example[b]:
            continue
        for a in names[:j]:
            if example[a] != example[b]:
                continue
            pairs = [(sb, sa) for sb, sa in zip(at[b], at[a]) if sb in free]
            if not all(sa in free for _, sa in pairs):
                continue
            for sb, sa in pairs:
                while sa in subst:  # a's dim already shares an earlier input's symbol
                    sa = subst[sa]
                if sb != sa and sb not in subst:
                    subst[sb] = sa
            break
    return subst
