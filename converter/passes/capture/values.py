"""Shared input and value helpers of capture, also read by lower, verify, placement and numerics.

How example inputs are accepted (:func:`normalize_inputs`), which values a graph's placeholders take
(:func:`placeholder_values`), the tensor-free description of a runtime value that ``node.meta["mp_value"]``
holds (:func:`spec_of`, :func:`flat_specs`), and what capture learns about dynamic dims (:class:`Shapes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from converter.ir.meta import META_VALUE, TensorSpec

__all__ = ["Shapes", "normalize_inputs", "placeholders", "placeholder_values", "spec_of", "size_hint", "flat_specs",
           "input_nodes", "float_specs"]


@dataclass
class Shapes:
    """What the caller asked for and what capture found about dynamic dimensions."""

    dynamic: bool = True
    user_spec: Any = None
    dims: dict = field(default_factory=dict)
    #: input name -> {dim: why}: dims the graph keeps symbolic but a guard of the model narrows (not in ``dims``)
    narrowed: dict = field(default_factory=dict)
    #: input name -> dims of ``narrowed`` that a guard pins to the example's size (not only a divisibility)
    pinned: dict = field(default_factory=dict)
    #: input name -> {dim: {"min", "max", "why"}}: dims in ``dims`` served only within a range
    ranges: dict = field(default_factory=dict)
    note: str = ""
    #: why every-dim-dynamic export was stopped (SizesTooComplex), kept for a second trace of the model
    too_complex: Any = None
    #: :class:`~converter.passes.guards.Tie` groups of input dims exported as one ``Dim``, kept for the next trace
    ties: list = field(default_factory=list)
    #: why exporting a tie failed ("" if none did)
    tie_failure: str = ""
    #: input name -> {dim: [other input, its dim]}: the dims the graph gives another input's size (``labels``)
    tied: dict = field(default_factory=dict)


def normalize_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Accept a tuple of args, an ``(args_tuple, kwargs_dict)`` pair, or a single tensor."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if (
        isinstance(example_inputs, (tuple, list))
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], dict)
    ):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tuple of positional arguments or an (args, kwargs) pair, got {type(example_inputs).__name__}"
    )


def placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's placeholder nodes, in order."""
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def placeholder_values(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values of ``gm``'s placeholders for a call ``gm(*args, **kwargs)``.

    Export graphs flatten their inputs with a pytree spec; symbolic_trace keeps every forward
    parameter as a placeholder, so missing ones take their defaults.
    """
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        import torch.fx._pytree as fx_pytree

        return list(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), info.in_spec))
    values = list(args)
    for p in placeholders(gm)[len(args):]:
        if p.target in kwargs:
            values.append(kwargs[p.target])
        elif p.args:
            values.append(p.args[0])
        else:
            values.append(None)
    return values


def spec_of(value: Any) -> Any:
    """A lightweight, tensor-free description of a runtime value (shape+dtype for tensors)."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(size_hint(s) for s in value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(spec_of(v) for v in value)
    if isinstance(value, dict):
        return tuple(spec_of(v) for v in value.values())
    if isinstance(value, torch.dtype):
        return value
    return type(value).__name__


def size_hint(size: Any) -> int:
    """The example's size for a (possibly symbolic) dim. Never ``int(SymInt)``: that specialises it."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None) if node is not None else None
    if hint is None and node is not None and getattr(node, "expr", None) is not None and node.expr.is_number:
        hint = node.expr
    return int(hint) if hint is not None else 1  # unbacked sizes (data-dependent) have no example value


def flat_specs(spec: Any) -> list[TensorSpec]:
    """The tensor specs in a ``META_VALUE`` (a spec, or a nested tuple of them), flattened."""
    if isinstance(spec, TensorSpec):
        return [spec]
    if isinstance(spec, tuple):
        out: list[TensorSpec] = []
        for s in spec:
            out.extend(flat_specs(s))
        return out
    return []


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The distinct nodes this node reads (FX keeps this list; no need to walk args again)."""
    return node.all_input_nodes


def float_specs(node: torch.fx.Node) -> list[TensorSpec]:
    """The floating-point tensor specs of ``node``'s value."""
    return [s for s in flat_specs(node.meta.get(META_VALUE)) if s.dtype.is_floating_point]
