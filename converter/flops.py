"""FLOP counts from shapes (forward pass; one multiply-add = 2 FLOPs).

Formulas (M×K times K×N is 2·M·N·K):

* ``linear``: 2 · numel(out) · in_features  (the bias add is not counted)
* ``matmul``/``mm``/``bmm``: 2 · numel(out) · K, with K the last dim of the first operand
* ``addmm``/``baddbmm``/``addbmm``: as mm/bmm on their two matrix operands
* ``conv{1,2,3}d``: 2 · numel(out) · (C_in/groups · ∏kernel) = 2 · numel(out) · ∏weight.shape[1:]
* ``conv_transpose*``: 2 · numel(in) · ∏weight.shape[1:]
* ``scaled_dot_product_attention``: 2·B·H·L·S·E (QKᵀ) + 2·B·H·L·S·Ev (PV)
* ``einsum``: 2 · ∏(sizes of all distinct indices)
* norms: ``layer_norm``/``group_norm``/``batch_norm``/``instance_norm`` 5 · numel (mean, variance,
  normalise, scale, shift); ``rms_norm`` 4 · numel
* everything else: 0 (pointwise work is bandwidth-bound; its cost shows up as bytes, not FLOPs)
"""
from __future__ import annotations

import math
from typing import Optional

import torch.fx

from .meta import TensorSpec

__all__ = ["node_flops"]


def _spec(arg) -> Optional[TensorSpec]:
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("mp_value")
        return value if isinstance(value, TensorSpec) else None
    return None


def node_flops(node: torch.fx.Node, op: str) -> int:
    out = node.meta.get("mp_value")
    if not isinstance(out, TensorSpec):
        return 0
    args = node.args
    a = _spec(args[0]) if args else None
    if op == "linear":
        w = _spec(args[1]) if len(args) > 1 else _spec(node.kwargs.get("weight"))
        return 2 * out.numel * w.shape[-1] if w is not None else 0
    if op in ("matmul", "mm", "bmm"):
        return 2 * out.numel * a.shape[-1] if a is not None and a.shape else 0
    if op in ("addmm", "baddbmm", "addbmm"):
        m1 = _spec(args[1]) if len(args) > 1 else None
        return 2 * out.numel * m1.shape[-1] if m1 is not None else 0
    if op.startswith("conv_transpose"):
        w = _spec(args[1]) if len(args) > 1 else None
        return 2 * a.numel * math.prod(w.shape[1:]) if (w is not None and a is not None) else 0
    if op.startswith("conv"):
        w = _spec(args[1]) if len(args) > 1 else None
        return 2 * out.numel * math.prod(w.shape[1:]) if w is not None else 0
    if op == "scaled_dot_product_attention":
        k = _spec(args[1]) if len(args) > 1 else None
        v = _spec(args[2]) if len(args) > 2 else None
        if a is None or k is None or v is None:
            return 0
        batch_heads_l = math.prod(a.shape[:-1])
        s = k.shape[-2]
        return 2 * batch_heads_l * s * a.shape[-1] + 2 * batch_heads_l * s * v.shape[-1]
    if op == "einsum" and args and isinstance(args[0], str):
        eq = args[0].replace(" ", "")
        lhs = eq.split("->")[0].split(",")
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        sizes: dict[str, int] = {}
        for letters, arg in zip(lhs, operands):
            spec = _spec(arg)
            if spec is None or "." in letters:
                return 0
            for letter, size in zip(letters, spec.shape):
                sizes[letter] = size
        return 2 * math.prod(sizes.values())
    if op in ("layer_norm", "group_norm", "batch_norm", "instance_norm"):
        return 5 * out.numel
    if op == "rms_norm":
        return 4 * out.numel
    return 0
