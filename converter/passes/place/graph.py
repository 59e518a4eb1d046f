"""Graph helpers shared by the place stage and the min-cut problem builder (no solver here)."""
from __future__ import annotations

import torch
import torch.fx

from converter.ir.meta import META_INFO, META_VALUE, TensorSpec
from converter.ir.ops import castable_arg_positions
from converter.passes.capture.values import input_nodes

__all__ = ["cast_cost", "alias_root", "castable_inputs"]


def cast_cost(numel: int, a: str = "fp32", b: str = "bf16") -> int:
    """Bytes a cast moves: the source read plus the destination written."""
    size = {"fp32": 4, "fp16": 2, "bf16": 2, "half": 2}
    return numel * (size[a] + size[b])


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose precision an alias node shares."""
    seen = 0
    while True:
        info = node.meta.get(META_INFO)
        if info is None or info.kind != "alias" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return node
        node = node.args[0]
        seen += 1
        if seen > 10_000:  # pragma: no cover - malformed graph
            return node


def castable_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The producers of the floating tensors this node's precision applies to."""
    info = node.meta[META_INFO]
    positions = castable_arg_positions(info.op, len(node.args))
    candidates: list[torch.fx.Node] = []
    if positions is None:
        # not an ``out=`` tensor: the op writes it, so a cast copy would take the write (spectral_norm's
        # power iteration updates its u/v buffers with div(..., out=u)) and the tensor itself never would
        written = [v for k, v in node.kwargs.items() if k == "out" and isinstance(v, torch.fx.Node)]
        candidates = [n for n in input_nodes(node) if n not in written or any(a is n for a in node.args)]
    else:
        for pos in positions:
            if pos < len(node.args):
                arg = node.args[pos]
                if isinstance(arg, torch.fx.Node):
                    candidates.append(arg)
    out = []
    for n in candidates:
        value = n.meta.get(META_VALUE)
        if isinstance(value, TensorSpec) and value.is_convertible:
            out.append(n)
    return out
