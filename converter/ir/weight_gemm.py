"""Weight GEMMs: a ``matmul``/``mm``/``addmm`` of an activation and a 2-D weight parameter, a linear by another name.

Not every projection is an ``F.linear`` call. Falcon's ``FalconLinear`` computes ``input @ self.weight.T``
(captured as a ``matmul`` whose second operand is the transposed parameter), GPT-2's ``Conv1D`` computes
``torch.addmm(self.bias, x.view(-1, nx), self.weight)`` with the weight stored (K, N). Both are what a linear
computes: ``x`` times a weight matrix, plus a bias vector.

:func:`weight_gemm_operands` recognises them on a captured graph: the second matrix operand is a 2-D
``nn.Parameter`` seen through layout and cast ops only (``.t()``, ``.T``, ``transpose``, ``permute``,
``contiguous``, ``alias`` and ``.to`` casts: the model's own and those rewrite inserts), the first is not a
parameter, and an ``addmm`` adds a 1-D bias of the output width with ``beta`` = ``alpha`` = 1. Capture gives such a
node the op alias :data:`~converter.ir.ops.WEIGHT_MATMUL` (``NodeInfo.op_alias``) besides its canonical op, so a
rule can name them (``rules/fp8.toml`` marks them fp8 like linears) while every rule naming ``matmul``/``mm``/
``addmm`` still reaches them.

The second operand of such a GEMM is a (K, N) matrix whatever the parameter's layout, so the linear it computes
has the weight ``operand.t()`` of shape (N, K) (what ``F.linear`` and ``fp8_linear`` take); autograd takes that
weight's gradient back through the views to the parameter's own shape.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.fx

from converter.ir.meta import META_VALUE, TensorSpec
from converter.ir.ops import WEIGHT_MATMUL, canonical_op

__all__ = ["WEIGHT_MATMUL", "WEIGHT_GEMM_OPS", "gemm_operands", "weight_gemm_operands", "weight_parameter", "op_alias"]

#: the canonical ops a weight GEMM can have
WEIGHT_GEMM_OPS = frozenset({"matmul", "mm", "addmm"})
#: ops between a parameter and its GEMM that keep a 2-D matrix a 2-D matrix (a view, a transpose or a cast)
_MATRIX_VIEW_OPS = frozenset({"t", "numpy_T", "transpose", "permute", "contiguous", "alias", "to"})
#: the attributes that transpose a matrix (``weight.T``, ``weight.mT``): FX records them as ``getattr`` calls
_TRANSPOSE_ATTRS = ("T", "mT")
#: each op's (first matrix, second matrix, bias) argument positions and keyword names
_POSITIONS = {"matmul": ((0, ("input", "self")), (1, ("other",)), None),
              "mm": ((0, ("input", "self")), (1, ("mat2",)), None),
              "addmm": ((1, ("mat1",)), (2, ("mat2",)), (0, ("input", "self")))}


def _arg(node: torch.fx.Node, where: Optional[tuple[int, tuple[str, ...]]]) -> Any:
    if where is None:
        return None
    pos, names = where  # a method call (``x.matmul(w)``, ``b.addmm(x, w)``) has the tensor as args[0] too
    if len(node.args) > pos:
        return node.args[pos]
    return next((node.kwargs[name] for name in names if name in node.kwargs), None)


def gemm_operands(node: torch.fx.Node, op: str) -> tuple[Any, Any, Any]:
    """``(x, second matrix, bias)`` of a ``matmul``/``mm``/``addmm`` node (bias None for matmul and mm)."""
    first, second, bias = _POSITIONS[op]
    return _arg(node, first), _arg(node, second), _arg(node, bias)


def weight_parameter(node: Any, root: Optional[torch.nn.Module]) -> Optional[torch.nn.Parameter]:
    """The 2-D parameter that ``node`` is a view, transpose or cast of, or None."""
    seen = 0
    while isinstance(node, torch.fx.Node) and node.op in ("call_method", "call_function") and seen < 16:
        op = canonical_op(node, root)
        transposed_attr = op == "getattr" and len(node.args) == 2 and node.args[1] in _TRANSPOSE_ATTRS
        if op not in _MATRIX_VIEW_OPS and not transposed_attr:
            return None
        node, seen = node.args[0] if node.args else None, seen + 1
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr" or root is None:
        return None
    try:
        tensor = functools.reduce(getattr, str(node.target).split("."), root)
    except AttributeError:
        return None
    return tensor if isinstance(tensor, torch.nn.Parameter) and tensor.dim() == 2 else None


def _default_scale(node: torch.fx.Node, name: str, pos: int) -> bool:
    value = node.args[pos] if len(node.args) > pos else node.kwargs.get(name, 1)
    return not isinstance(value, torch.fx.Node) and bool(value == 1)


def weight_gemm_operands(node: torch.fx.Node, op: str, root: Optional[torch.nn.Module]) -> Optional[tuple[Any, Any, Any]]:
    """``(x, weight operand, bias)`` when ``node`` (canonical op ``op``) is a weight GEMM (module docstring);
    the weight operand is the (K, N) matrix the GEMM reads. None otherwise."""
    if op not in WEIGHT_GEMM_OPS or node.op not in ("call_function", "call_method"):
        return None
    x, weight, bias = gemm_operands(node, op)
    if not isinstance(x, torch.fx.Node) or weight_parameter(x, root) is not None or weight_parameter(weight, root) is None:
        return None
    spec = weight.meta.get(META_VALUE)
    if not isinstance(spec, TensorSpec) or len(spec.shape) != 2:
        return None
    if op == "addmm":
        bias_spec = bias.meta.get(META_VALUE) if isinstance(bias, torch.fx.Node) else None
        if not isinstance(bias_spec, TensorSpec) or tuple(bias_spec.shape) != (spec.shape[1],):
            return None  # a 2-D "bias" is a matrix added, not a linear's bias
        if not (_default_scale(node, "beta", 3) and _default_scale(node, "alpha", 4)):
            return None
    return x, weight, bias


def op_alias(node: torch.fx.Node, op: str, root: Optional[torch.nn.Module]) -> str:
    """:data:`WEIGHT_MATMUL` for a weight GEMM, else ``""`` (``NodeInfo.op_alias``)."""
    return WEIGHT_MATMUL if weight_gemm_operands(node, op, root) is not None else ""
