"""The signature, input prologue and return statement of model.py's forward (FX's code generator).

:class:`EmitCodeGen` is FX's :class:`~torch.fx.graph.CodeGen` with our own ``def forward(...)``
line, prologue and return statement. For a graph captured by ``torch.export``
(:func:`export_codegen`), the forward takes the original forward's argument names, binds each
graph input by indexing into the nested inputs (pytree flatten order), checks the input sizes the
graph serves (:mod:`converter.export.shape_guards`) and returns the original output structure with
plain Python containers.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Mapping, Optional, cast

import torch
import torch.fx
from torch import nn
from torch.fx.graph import CodeGen

from converter.export.errors import EmitError
from converter.export.shape_guards import guard_lines
from converter.numerics.optional_inputs import fill_lines

__all__ = ["EmitCodeGen", "export_codegen", "check_argument_names"]



def _spec_children(spec) -> list:
    return list(spec.children()) if hasattr(spec, "children") and callable(spec.children) else list(spec.children_specs)


def _is_namedtuple_type(typ: type) -> bool:
    return isinstance(typ, type) and issubclass(typ, tuple) and hasattr(typ, "_fields")


def _input_paths(spec, expr: str, out: list[str]) -> None:
    """Append, in pytree flatten order, an expression that reaches each leaf of ``spec`` from ``expr``."""
    if spec.is_leaf():
        out.append(expr)
        return
    children = _spec_children(spec)
    typ = spec.type
    if typ is type(None):
        return
    if typ in (tuple, list) or _is_namedtuple_type(typ):
        for i, child in enumerate(children):
            _input_paths(child, f"{expr}[{i}]", out)
        return
    context = spec.context
    if isinstance(context, (list, tuple)) and len(context) == len(children):
        for key, child in zip(context, children):
            _input_paths(child, f"{expr}[{key!r}]", out)
        return
    raise EmitError(f"cannot emit model.py: unsupported input structure {getattr(typ, '__name__', typ)!r}; pass plain tensors, tuples, lists or dicts")


def _output_expr(spec, leaves: list[str]) -> str:
    """Python source that rebuilds the output structure ``spec`` from flat leaf names."""
    if spec.is_leaf():
        return leaves.pop(0)
    children = _spec_children(spec)
    typ = spec.type
    if typ is type(None):
        return "None"
    if typ is tuple or _is_namedtuple_type(typ):
        items = [_output_expr(c, leaves) for c in children]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if typ is list:
        return "[" + ", ".join(_output_expr(c, leaves) for c in children) + "]"
    context = spec.context
    if isinstance(context, (list, tuple)) and len(context) == len(children):
        return "{" + ", ".join(f"{k!r}: {_output_expr(c, leaves)}" for k, c in zip(context, children)) + "}"
    raise EmitError(f"cannot emit model.py: unsupported output structure {getattr(typ, '__name__', typ)!r}")


def _signature_names(original: Optional[nn.Module], count: int) -> list[str]:
    names: list[str] = []
    if original is not None:
        try:
            params = list(inspect.signature(original.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    while len(names) < count:
        names.append(f"arg{len(names)}")
    return names[:count]


def check_argument_names(names: Iterable[str]) -> None:
    """Refuse a forward argument name that is not a plain Python parameter name (EmitError)."""
    import keyword

    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            raise EmitError(
                f"cannot emit model.py: the forward argument {name!r} is not a valid Python parameter name; "
                "pass it under a plain identifier in example_inputs"
            )


# ---------------------------------------------------------------------------------------------
# the forward: FX code generation with our signature, prologue and return statement


class EmitCodeGen(CodeGen):
    """FX code generation with our own signature, input prologue and return statement."""

    def __init__(self, signature: Optional[str], prologue: list[str], output: Optional[Callable[[Any], str]]):
        super().__init__()
        self._signature = signature
        self._prologue = prologue
        self._output = output

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def: bool = False) -> str:  # noqa: D102
        if self._signature is None:
            head = super().gen_fn_def(free_vars, "", expanded_def=expanded_def)
        else:
            head = f"def forward({self._signature}):"
        return "\n    ".join([head] + self._prologue)

    def generate_output(self, output_args, *, descs=None, repr_fn=None) -> str:  # noqa: D102
        if self._output is None:
            # repr_fn only when torch passed one: torch < 2.12's CodeGen.generate_output has no such parameter
            extra = {} if repr_fn is None else {"repr_fn": repr_fn}
            return super().generate_output(output_args, descs=descs, **extra)
        return self._output(output_args)


def export_codegen(source: torch.fx.Graph, graph: torch.fx.Graph, original: Optional[nn.Module], *,
                   narrowed: Optional[Mapping[str, tuple[int, ...]]] = None,
                   optional: tuple = ()) -> tuple[EmitCodeGen, str]:
    """Code generation for a graph captured by torch.export: the original argument names, explicit
    indexing into nested inputs, and the original output structure. Returns (codegen, io note).
    ``narrowed``: input -> dims a guard of the model pins (checked as fixed at the example's size).
    ``optional``: the inputs a caller may leave out (``GraphMeta.optional_inputs``): ``name=None`` in the
    signature, and the original's own value for them (:func:`converter.numerics.optional_inputs.fill_lines`)."""
    pytree_info = cast(Any, source._codegen).pytree_info  # a _PyTreeCodeGen
    children = _spec_children(pytree_info.in_spec)
    if pytree_info.in_spec.type is not tuple or len(children) != 2:
        raise EmitError("cannot emit model.py: unexpected input structure of the exported graph")
    args_spec, kwargs_spec = children
    arg_specs = _spec_children(args_spec)
    names = _signature_names(original, len(arg_specs))
    kw_names = list(kwargs_spec.context or [])
    check_argument_names(names + kw_names)
    paths: list[str] = []
    for name, spec in zip(names, arg_specs):
        _input_paths(spec, name, paths)
    for name, spec in zip(kw_names, _spec_children(kwargs_spec)):
        _input_paths(spec, name, paths)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(paths) != len(placeholders):
        raise EmitError(f"cannot emit model.py: the exported graph has {len(placeholders)} inputs but its input structure has {len(paths)} leaves")
    params = ["self"] + names + [k for k in kw_names if k not in names]
    left_out = {o.name for o in optional}
    signature = [f"{p}=None" if p in left_out else p for p in params]
    prologue: list[str] = fill_lines(tuple(optional))
    for node, path in zip(placeholders, paths):
        node.target = node.name  # bound here or in the prologue, never as an argument
        if node.name != path:
            prologue.append(f"{node.name} = {path}")
    prologue += guard_lines(placeholders, paths, narrowed=narrowed)  # the sizes the graph serves (export.shape_guards)
    out_spec = pytree_info.out_spec

    def output(output_args) -> str:
        flat = output_args if isinstance(output_args, (tuple, list)) else (output_args,)
        return "return " + _output_expr(out_spec, [repr(a) for a in flat])

    note = (
        "Captured with torch.export: the forward takes the original argument names "
        f"({', '.join(params[1:])}); non-tensor inputs were fixed at capture time and are ignored. "
        "A ModelOutput-like result is returned as a dict with the same keys (out['logits'] works on both). "
        "The forward first checks the input sizes the graph serves (the dims it fixed, the ranges and relations "
        "of its dynamic dims) and raises ValueError naming the input, the dim and both sizes."
    )
    if optional:
        note += (f" {', '.join(sorted(left_out))} may be left out (or None), as in the original's forward: the forward "
                 f"then uses the value the original uses ({'; '.join(_fill_text(o) for o in optional)}), checked on the "
                 "example at conversion.")
    return EmitCodeGen(", ".join(signature), prologue, output), note


def _fill_text(o: Any) -> str:
    d = o.to_dict()
    return f"{d['name']}: all {d['fill']!r}, {d['dtype']}, shape ({', '.join(map(str, d['shape']))})"
