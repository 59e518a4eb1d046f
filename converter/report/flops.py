"""FLOP counts from shapes (forward pass; one multiply-add = 2 FLOPs).

Shapes come from shape propagation (``node.meta["mp_value"]``, a :class:`~converter.ir.meta.TensorSpec`);
for leaf ``call_module`` nodes the weight shape is read from the module. Formulas, with
``numel(out)`` the number of output elements (an M×K by K×N product is 2·M·N·K):

* ``linear``: 2 · numel(out) · in_features  (the bias add is not counted)
* ``matmul``/``mm``/``bmm``/``mv``: 2 · numel(out) · K, with K the last dim of the first operand
  (broadcast batch dimensions are in numel(out); a 1-d first operand has K = its length)
* ``grouped_mm`` (MoE experts: torch's ``_grouped_mm``, transformers' ``grouped_mm_fallback``): the same,
  an (S, K) input against one (K, N) expert weight per row group gives 2 · S · N · K
* ``dot``/``vdot``: 2 · K
* ``addmm``/``baddbmm``/``addbmm``/``addmv``: as mm/bmm/mv on their two matrix operands
  (``addbmm`` sums over its batch, so it is 2 · numel(batch1) · N)
* ``addr``: numel(out) (one multiply per element of the outer product)
* ``conv{1,2,3}d``: 2 · numel(out) · (C_in/groups · ∏kernel) = 2 · numel(out) · ∏weight.shape[1:]
* ``conv_transpose{1,2,3}d``: 2 · numel(in) · (C_out/groups · ∏kernel) = 2 · numel(in) · ∏weight.shape[1:]
* ``scaled_dot_product_attention``: 2·B·H·L·S·E (QKᵀ) + 2·B·H·L·S·Ev (P·V), with q of shape
  (…, L, E), k (…, S, E), v (…, S, Ev). Dense count: a causal mask does not halve it (the
  kernels on this CPU compute the masked blocks too); softmax work is not counted
* ``einsum`` with two or more operands: 2 · ∏(sizes of all distinct indices); one operand: 0
* norms: ``layer_norm``/``group_norm``/``batch_norm``/``instance_norm`` 5 · numel(out) (mean,
  variance, normalise, scale, shift); ``rms_norm`` 4 · numel(out) (square, mean, normalise, scale)
* everything else: 0. Pointwise and shape ops are bandwidth-bound; their cost shows up in the
  report as output bytes and cast bytes, not as FLOPs. A hand-written norm built from pow/mean/
  rsqrt/mul is therefore 0 FLOPs, like every other pointwise op.

``half_flop_fraction`` in the report is the share of these FLOPs that runs in fp16/bf16.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx

from converter.ir.meta import META_VALUE, TensorSpec

__all__ = ["node_flops", "FLOP_OPS", "NORM_FLOPS", "GEMM_OPS"]

_MATMUL = ("matmul", "mm", "bmm", "mv", "grouped_mm")
_ADDMM = ("addmm", "baddbmm", "addmv")
#: ops with a non-zero formula (everything else counts 0)
FLOP_OPS = frozenset(
    {"linear", "dot", "vdot", "addbmm", "addr", "scaled_dot_product_attention", "einsum"}
    | set(_MATMUL) | set(_ADDMM)
    | {f"conv{d}d" for d in (1, 2, 3)} | {f"conv_transpose{d}d" for d in (1, 2, 3)}
    | {"layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm"}
)
#: FLOPs per output element of the norms
NORM_FLOPS = {"layer_norm": 5, "group_norm": 5, "batch_norm": 5, "instance_norm": 5, "rms_norm": 4}
#: the matrix products among them (all but the norms): report.json's fp8 ``gemm_flops`` counts these
GEMM_OPS = FLOP_OPS - frozenset(NORM_FLOPS)


def _first_spec(value: Any) -> Optional[TensorSpec]:
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_spec(item)
            if found is not None:
                return found
    return None


def _spec(arg: Any) -> Optional[TensorSpec]:
    if isinstance(arg, torch.fx.Node):
        return _first_spec(arg.meta.get(META_VALUE))
    if isinstance(arg, torch.Tensor):
        return TensorSpec(tuple(arg.shape), arg.dtype)
    return None


def _arg(node: torch.fx.Node, pos: int, *names: str) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    for name in names:
        if name in node.kwargs:
            return node.kwargs[name]
    return None


def _module_weight(node: torch.fx.Node) -> Optional[TensorSpec]:
    """The weight of a leaf ``call_module`` node (``nn.Linear``/``nn.Conv*`` left untraced)."""
    root = node.graph.owning_module
    if node.op != "call_module" or root is None:
        return None
    try:
        weight = getattr(root.get_submodule(str(node.target)), "weight", None)
    except AttributeError:
        return None
    return TensorSpec(tuple(weight.shape), weight.dtype) if isinstance(weight, torch.Tensor) else None


def node_flops(node: torch.fx.Node, op: str) -> int:
    """Forward FLOPs of ``node`` whose canonical op name is ``op`` (see the module docstring)."""
    if op not in FLOP_OPS:
        return 0
    out = _first_spec(node.meta.get(META_VALUE))
    a = _spec(_arg(node, 0, "input", "query", "self"))
    if op == "linear":
        w = _module_weight(node) if node.op == "call_module" else _spec(_arg(node, 1, "weight"))
        return 2 * out.numel * w.shape[-1] if (w is not None and out is not None and w.shape) else 0
    if op in _MATMUL:
        return 2 * out.numel * a.shape[-1] if (a is not None and a.shape and out is not None) else 0
    if op in ("dot", "vdot"):
        return 2 * a.numel if a is not None else 0
    if op in _ADDMM:
        m1 = _spec(_arg(node, 1, "mat1", "batch1", "mat"))
        return 2 * out.numel * m1.shape[-1] if (m1 is not None and m1.shape and out is not None) else 0
    if op == "addbmm":
        b1, b2 = _spec(_arg(node, 1, "batch1")), _spec(_arg(node, 2, "batch2"))
        return 2 * b1.numel * b2.shape[-1] if (b1 is not None and b2 is not None) else 0
    if op == "addr":
        return out.numel if out is not None else 0
    if op.startswith("conv_transpose"):
        w = _module_weight(node) if node.op == "call_module" else _spec(_arg(node, 1, "weight"))
        return 2 * a.numel * math.prod(w.shape[1:]) if (w is not None and a is not None) else 0
    if op.startswith("conv"):
        w = _module_weight(node) if node.op == "call_module" else _spec(_arg(node, 1, "weight"))
        return 2 * out.numel * math.prod(w.shape[1:]) if (w is not None and out is not None) else 0
    if op == "scaled_dot_product_attention":
        k, v = _spec(_arg(node, 1, "key")), _spec(_arg(node, 2, "value"))
        if a is None or k is None or v is None or len(k.shape) < 2:
            return 0
        rows = math.prod(a.shape[:-1])  # B·H·L
        s = k.shape[-2]
        return 2 * rows * s * a.shape[-1] + 2 * rows * s * v.shape[-1]
    if op == "einsum":
        return _einsum_flops(node)
    if op in NORM_FLOPS:
        return NORM_FLOPS[op] * out.numel if out is not None else 0
    return 0


def _einsum_flops(node: torch.fx.Node) -> int:
    args = node.args
    if not args or not isinstance(args[0], str):
        return 0
    eq = args[0].replace(" ", "")
    lhs = eq.split("->")[0].split(",")
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if len(lhs) < 2 or len(operands) < 2:
        return 0
    sizes: dict[str, int] = {}
    for letters, arg in zip(lhs, operands):
        spec = _spec(arg)
        if spec is None or "." in letters or len(letters) != len(spec.shape):
            return 0
        for letter, size in zip(letters, spec.shape):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    return 2 * math.prod(sizes.values())
