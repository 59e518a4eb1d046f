"""Optional forward arguments stay optional: ``conv.module(input_ids=..., attention_mask=...)`` without ``token_type_ids``.

A graph takes exactly the inputs it was captured with. A save_pretrained folder's example gives
BERT's ``attention_mask`` and ``token_type_ids`` (the padded batch the graph must serve), so the
graph requires them, while the original's forward has ``attention_mask=None, token_type_ids=None``
and computes a value of its own when one is left out: ones, and BERT's buffer of zeros.

:func:`find_optional_inputs` finds, for each tensor argument of the example whose parameter defaults
to ``None`` in the original forward, the constant tensor that the original treats as that argument
left out, and *verifies* it: the original (eval mode, no trace left, :func:`preserved_state`) runs on
the example without the argument and with the candidate fill (1, then 0, in the example's dtype),
and a fill counts only when every output agrees (floating outputs within :data:`SAME_DB` SQNR,
others equal). The fill's shape follows the required inputs: each dim takes the size of a required
input's dim that torch.export proved equal (the same symbol), else one of the same example size at
the same position, else the example's size where the graph fixed it. An argument with no such fill
(a data-dependent default, ``inputs_embeds``) stays required, and ``report.records.optional_inputs``
says why.

:func:`install` records the fills in ``GraphMeta.optional_inputs`` and gives the graph's code
generator the defaults: ``def forward(self, input_ids, attention_mask=None, token_type_ids=None)``,
then ``if attention_mask is None: attention_mask = torch.full(...)`` before the inputs are flattened.
model.py's forward gets the same lines (:func:`fill_lines`, :func:`converter.export.model_signature.export_codegen`).
Only a trailing run of parameters can have defaults (Python's rule), so an optional one followed by
a required one stays required. Graphs captured by torch.export only (FX keeps the forward's own
defaults in its signature).
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.fx
from torch.fx.graph import _PyTreeCodeGen

from converter.ir.meta import set_graph_facts
from converter.numerics.common import output_tensors, preserved_state, sqnr_db

__all__ = ["OptionalInput", "find_optional_inputs", "install", "fill_lines", "SAME_DB"]

#: a fill is the original's own default when every floating output agrees within this SQNR (rounding only)
SAME_DB = 80.0
_FILLS = (1, 0)

#: one dim of a fill's shape: a fixed size, or (required input, its dim)
Dim = Union[int, tuple[str, int]]


@dataclass(frozen=True)
class OptionalInput:
    """A graph input the caller may leave out (or pass as None): it is then ``torch.full(shape, fill)``."""

    name: str
    fill: Union[int, float, bool]
    dtype: str  # "torch.int64"
    shape: tuple[Dim, ...]
    device_of: str  # a required input: the fill goes on its device

    def to_dict(self) -> dict:
        return {"name": self.name, "fill": self.fill, "dtype": self.dtype.replace("torch.", ""),
                "shape": [d if isinstance(d, int) else f"{d[0]}.shape[{d[1]}]" for d in self.shape]}


def fill_lines(optional: tuple[OptionalInput, ...], indent: str = "") -> list[str]:
    """Python lines that put each left-out input's fill in its place (``torch`` in scope)."""
    lines = []
    for o in optional:
        dims = [str(d) if isinstance(d, int) else f"{d[0]}.shape[{d[1]}]" for d in o.shape]
        shape = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
        lines += [f"{indent}if {o.name} is None:",
                  f"{indent}    {o.name} = torch.full({shape}, {o.fill!r}, dtype={o.dtype}, device={o.device_of}.device)"]
    return lines


# ---------------------------------------------------------------------------------------------
# finding them


def _defaults_none(model: torch.nn.Module) -> list[str]:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _same(a: Any, b: Any) -> bool:
    xs, ys = output_tensors(a), output_tensors(b)
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() or x.is_complex():
            if not torch.equal(x, y) and not sqnr_db(x.detach(), y.detach()) >= SAME_DB:
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _shape(name: str, placeholders: dict[str, torch.fx.Node], required: list[str], kwargs: dict) -> Optional[tuple[Dim, ...]]:
    """Each dim of ``name``'s fill from the required inputs (None: a dynamic dim no required input gives).

    A dim torch.export proved equal to a required input's (the same symbol) takes that size; a dim it
    fixed keeps the example's size; another dynamic dim takes a required input's dim of the example's
    size (the same position first), else there is no fill."""
    val = _val(placeholders[name])
    symbols = {r: tuple(map(str, _val(placeholders[r]).shape)) for r in required if isinstance(_val(placeholders[r]), torch.Tensor)}
    donors = [(r, k) for r in required for k in range(kwargs[r].dim())]
    dims: list[Dim] = []
    for d, size in enumerate(kwargs[name].shape):
        sym = val.shape[d] if isinstance(val, torch.Tensor) and d < val.dim() else size
        same_symbol = [(r, k) for r, k in donors if not isinstance(sym, int) and symbols.get(r, ())[k:k + 1] == (str(sym),)]
        same_size = sorted(((r, k) for r, k in donors if kwargs[r].shape[k] == size), key=lambda rk: rk[1] != d)
        if same_symbol:
            dims.append(same_symbol[0])
        elif isinstance(sym, int):
            dims.append(size)
        elif same_size:
            dims.append(same_size[0])
        else:
            return None
    return tuple(dims)


def _val(node: torch.fx.Node) -> Any:
    return node.meta.get("val")


def _fill(model: torch.nn.Module, kwargs: dict, name: str, shape: tuple[Dim, ...], omitted: Any) -> Optional[Any]:
    """The first of :data:`_FILLS` that gives what the original gives without ``name`` (None: neither)."""
    example = kwargs[name]
    size = tuple(d if isinstance(d, int) else kwargs[d[0]].shape[d[1]] for d in shape)
    for value in _FILLS:
        fill = bool(value) if example.dtype == torch.bool else (float(value) if example.is_floating_point() else value)
        got = _call(model, {**kwargs, name: torch.full(size, fill, dtype=example.dtype, device=example.device)})
        if got is not _RAISED and _same(omitted, got):
            return fill
    return None


_RAISED = object()


def _call(model: torch.nn.Module, kwargs: dict) -> Any:
    """The original's output on ``kwargs``; :data:`_RAISED` when it refuses the call (an index out of range, a
    ``ValueError("You have to specify either input_ids or inputs_embeds")``): that argument, or that fill, is not it."""
    try:
        with torch.no_grad():
            return model(**kwargs)
    except Exception:  # noqa: BLE001 - any refusal of the user's forward is an answer here, never an error
        return _RAISED


def find_optional_inputs(model: torch.nn.Module, gm: torch.fx.GraphModule, args: tuple, kwargs: dict
                         ) -> tuple[tuple[OptionalInput, ...], dict[str, str]]:
    """The verified fills of ``gm``'s optional inputs, and why each other candidate stays required."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if args or not kwargs or not isinstance(gm.graph._codegen, _PyTreeCodeGen) or info is None:
        return (), {}
    order = list(info.orig_args)
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    wanted = [n for n in _defaults_none(model) if isinstance(kwargs.get(n), torch.Tensor) and n in placeholders]
    if not wanted or set(order) != set(kwargs) or any(p.is_meta for p in model.parameters()):
        return (), {}
    found: dict[str, OptionalInput] = {}
    why: dict[str, str] = {}
    with preserved_state(model):
        model.eval()
        omitted = {name: _call(model, {k: v for k, v in kwargs.items() if k != name}) for name in wanted}
        refused = [name for name in wanted if omitted[name] is _RAISED]  # input_ids: the original needs it (or inputs_embeds)
        required = [n for n in order if (n not in wanted or n in refused) and isinstance(kwargs[n], torch.Tensor)]
        if not required:
            return (), {n: "no required tensor input to take its size and device from" for n in wanted}
        for name in (n for n in wanted if n not in refused):
            shape = _shape(name, placeholders, required, kwargs)
            fill = None if shape is None else _fill(model, kwargs, name, shape, omitted[name])
            if fill is None:
                why[name] = ("no required input gives the size of its dynamic dims" if shape is None else
                             "the original computes something else than a constant tensor when it is left out")
                continue
            assert shape is not None  # (no shape: no fill)
            found[name] = OptionalInput(name, fill, str(kwargs[name].dtype), shape, required[0])
    out: list[OptionalInput] = []
    for i, name in enumerate(order):  # Python: only a trailing run of parameters has defaults
        if name in found and all(later in found for later in order[i + 1:]):
            out.append(found[name])
        elif name in found:
            why[name] = f"a required input follows it ({', '.join(n for n in order[i + 1:] if n not in found)})"
    return tuple(out), why


# ---------------------------------------------------------------------------------------------
# the code generator


_DEF = re.compile(r"^def (\w+)\((.*)\)(.*):$")


if TYPE_CHECKING:  # mixed into a CodeGen class (below): its super() is that class
    _OptionalBase = _PyTreeCodeGen
else:
    _OptionalBase = object


class _OptionalInputs(_OptionalBase):
    """A graph's code generator whose forward gives the optional inputs their default and fill."""

    _mp_optional: tuple[OptionalInput, ...] = ()

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def: bool = False) -> str:  # noqa: D102
        text = super().gen_fn_def(free_vars, maybe_return_annotation, expanded_def=expanded_def)
        head, sep, rest = text.partition("\n")
        match = _DEF.match(head)
        names = {o.name for o in self._mp_optional}
        if match is None or not names:
            return text
        params = [p.strip() for p in match.group(2).split(",") if p.strip()]
        params = [f"{p}=None" if p in names else p for p in params]
        head = f"def {match.group(1)}({', '.join(params)}){match.group(3)}:"
        return "\n".join([head] + fill_lines(self._mp_optional, "    ")) + (sep + rest if sep else "")


class OptionalPyTreeCodeGen(_OptionalInputs, _PyTreeCodeGen):
    """torch.export's pytree code generator with optional inputs."""


_CLASSES: dict[type, type[_OptionalInputs]] = {_PyTreeCodeGen: OptionalPyTreeCodeGen}


def _with_optional(codegen: Any, optional: tuple[OptionalInput, ...]) -> Any:
    base = type(codegen)
    if isinstance(codegen, _OptionalInputs):
        new = codegen
    else:
        cls = _CLASSES.get(base)
        if cls is None:  # a checkpoint code generator over the pytree one (converter.passes.checkpoint)
            cls = _CLASSES[base] = type(f"Optional{base.__name__}", (_OptionalInputs, base), {})
        new = cls.__new__(cls)
        new.__dict__.update(codegen.__dict__)
    new._mp_optional = optional
    return new


def install(gm: torch.fx.GraphModule, optional: tuple[OptionalInput, ...]) -> None:
    """Record ``optional`` on ``gm`` and regenerate its forward (both graphs of a two-mode module) with them."""
    if not optional:
        return
    set_graph_facts(gm, optional_inputs=optional)
    for graph in (gm.graph, getattr(gm, "eval_graph", None)):
        if graph is not None and isinstance(graph._codegen, _PyTreeCodeGen):
            graph._codegen = _with_optional(graph._codegen, optional)
    gm.recompile()

