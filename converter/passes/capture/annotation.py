"""Node annotation: the :class:`~converter.ir.meta.NodeInfo` every captured node carries.

Each node gets its canonical op, its module path and class, its source line, its value specs and its
kind (:func:`classify`: compute, fixed, alias or passive, and why); the one op of a Linear/Conv/norm
module is named after the module. A matmul/mm/addmm of an activation and a 2-D weight parameter also gets the
op alias ``weight_matmul`` (:mod:`converter.ir.weight_gemm`), which rules may name. Lower classifies the nodes it adds with the same :func:`classify`.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

import torch
import torch.fx
from torch.nn.utils.parametrize import ParametrizationList

from converter.ir.meta import META_INFO, META_SOURCE, META_VALUE, NodeInfo, NodeKind
from converter.ir.ops import CAST_OPS, NORM_OPS, canonical_op, explicit_dtype, is_inplace
from converter.ir.weight_gemm import op_alias
from converter.passes.capture.values import flat_specs, float_specs, input_nodes

__all__ = ["annotate", "classify", "opaque_leaves"]


def annotate(gm: torch.fx.GraphModule, *, root_type: str) -> None:
    """Write :class:`NodeInfo` on every node."""
    _annotate_nodes(gm, root_type)
    _pin_written_views(gm)
    _rename_module_ops(gm)


def _annotate_nodes(gm: torch.fx.GraphModule, root_type: str) -> None:
    for node in gm.graph.nodes:
        stack = _module_stack(node, root_type)
        module, module_type = stack[-1]
        outputs = tuple(flat_specs(node.meta.get(META_VALUE)))
        if node.op in ("placeholder", "get_attr", "output"):
            node.meta[META_INFO] = NodeInfo(op=node.op, module=module, module_type=module_type, module_stack=stack, outputs=outputs)
            continue
        op = canonical_op(node, gm)
        kind, fixed, why, opaque_leaf = classify(gm, node, op, outputs)
        node.meta[META_INFO] = NodeInfo(
            op=op,
            module=module,
            module_type=module_type,
            module_stack=stack,
            source=_source(node),
            kind=kind,
            outputs=outputs,
            fixed_dtype=fixed,
            inplace=is_inplace(node, op),
            why=why,
            opaque_leaf=opaque_leaf,
            op_alias=op_alias(node, op, gm),
        )


#: ops whose output is a view of their first argument in its dtype (``getitem``: a tensor's slice)
_VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "select", "slice", "narrow", "unsqueeze", "squeeze", "transpose",
                       "t", "permute", "expand", "expand_as", "as_strided", "diagonal", "unfold", "view_as", "flatten",
                       "unflatten", "movedim", "swapaxes", "swapdims", "alias", "detach", "getitem", "contiguous"})


def _pin_written_views(gm: torch.fx.GraphModule) -> None:
    """The views an in-place op writes through (``buf.view(-1, d)[:n].index_add_(0, i, y)``) become aliases of
    the tensor they view: a cast on the chain would take the write into a copy (the buffer never sees it) or
    give the op a ``self`` of another dtype than its operands ("index_add_(): self (Float) and source
    (BFloat16) must have the same scalar type"). As aliases they share the viewed tensor's precision, and
    rewrite casts the in-place op's other operands to it (:func:`~converter.passes.place.graph.alias_root`)."""
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is None or not info.inplace or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        view = node.args[0]
        while True:
            vinfo = view.meta.get(META_INFO)
            if vinfo is None or vinfo.kind != "compute" or vinfo.op not in _VIEW_OPS or not view.args:
                break
            base = view.args[0]
            if not isinstance(base, torch.fx.Node) or not float_specs(base):
                break
            view.meta[META_INFO] = dataclasses.replace(
                vinfo, kind="alias", why=f"a view that in-place {info.op} {node.name!r} writes through: has the dtype of "
                                         "the tensor it views")
            view = base


def classify(gm: torch.fx.GraphModule, node: torch.fx.Node, op: str,
             outputs: tuple) -> tuple[NodeKind, Optional[torch.dtype], str, bool]:
    """(kind, fixed dtype, why, opaque_leaf) of one node; ``opaque_leaf``: a module FX kept as a leaf whose
    floating parameters it cannot convert (NodeInfo.opaque_leaf; capture then tries torch.export)."""
    float_out = [s for s in outputs if s.dtype.is_floating_point]
    in_nodes = input_nodes(node)
    float_in = [s for n in in_nodes for s in float_specs(n)]
    if any(s.dtype == torch.float64 for s in float_out + float_in):
        return "passive", None, "fp64 tensors are never converted", False
    if float_in and any(s.dtype.is_complex for n in [node, *in_nodes] for s in flat_specs(n.meta.get(META_VALUE))):
        # rfft(x), view_as_complex(w), spectrum * gain: complex tensors are never converted (there is no
        # bf16 complex dtype, and the FFTs refuse half on CPU), so the real operands keep the fp32 model's dtype
        dtype = functools.reduce(torch.promote_types, [s.dtype for s in float_in])
        return "fixed", dtype, f"complex op: its real inputs stay {dtype} (complex tensors are never converted to half)", False
    if not float_out:
        return "passive", None, "produces no floating-point tensor", False
    if is_inplace(node, op):
        return "alias", None, "in-place op: runs in the dtype of the tensor it mutates", False
    if op == "getitem" and in_nodes and isinstance(in_nodes[0].meta.get(META_VALUE), tuple):
        return "alias", None, "element of a tuple output: has its producer's precision", False
    fixed = explicit_dtype(node, op)
    if fixed is not None:
        observed = float_out[0].dtype
        if isinstance(fixed, torch.fx.Node):
            return "fixed", observed, f"cast to a dtype computed at run time (observed {observed}); kept as observed", False
        kind_why = "explicit cast in the model code" if op in CAST_OPS else f"the op's own dtype argument fixes its output to {fixed}"
        return "fixed", fixed, kind_why, False
    parametrization = node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), ParametrizationList)
    if not float_in and not parametrization:  # a parametrized weight (weight_norm...) is computed from no input
        return "fixed", float_out[0].dtype, "no floating-point input: its dtype is set by its own arguments", False
    if node.op == "call_module" and op not in NORM_OPS:
        sub = gm.get_submodule(str(node.target))
        if any(p.is_floating_point() for p in sub.parameters(recurse=True)):
            return (
                "fixed",
                float_out[0].dtype,
                f"opaque leaf module {type(sub).__name__} with fp32 parameters; capture with tracer='export' to convert inside it",
                True,
            )
    return "compute", None, "", False


def opaque_leaves(gm: torch.fx.GraphModule) -> list[str]:
    """Class names of leaf modules FX could not trace into and that hold parameters."""
    return [
        node.meta[META_INFO].module_type
        for node in gm.graph.nodes
        if node.op == "call_module" and node.meta.get(META_INFO) is not None and node.meta[META_INFO].opaque_leaf
    ]


def _module_stack(node: torch.fx.Node, root_type: str) -> tuple[tuple[str, str], ...]:
    raw = node.meta.get("nn_module_stack") or {}
    stack: list[tuple[str, str]] = []
    for path, cls in raw.values():
        cls_name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
        path = re.sub(r"^L\['self'\]\.?", "", str(path))
        path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")
        path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
        if stack and stack[-1][0] == path:
            stack[-1] = (path, cls_name)
            continue
        stack.append((path, cls_name))
    if not stack or stack[0][0] != "":
        stack.insert(0, ("", root_type))
    return tuple(stack)


def _source(node: torch.fx.Node) -> str:
    if node.meta.get(META_SOURCE):
        return node.meta[META_SOURCE]
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


_SINGLE_OP_MODULES = {
    "Linear": "linear", "Conv1d": "conv1d", "Conv2d": "conv2d", "Conv3d": "conv3d",
    "ConvTranspose1d": "conv_transpose1d", "ConvTranspose2d": "conv_transpose2d", "ConvTranspose3d": "conv_transpose3d",
    "LayerNorm": "layer_norm", "GroupNorm": "group_norm", "RMSNorm": "rms_norm", "Embedding": "embedding",
}


def _rename_module_ops(gm: torch.fx.GraphModule) -> None:
    """Name the one op of a Linear/Conv/norm/Embedding module after the module (``block.proj`` -> ``block_proj``)."""
    owners: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is None or node.op not in ("call_function", "call_module") or not info.module:
            continue
        if _SINGLE_OP_MODULES.get(info.module_type) == info.op:
            owners.setdefault(info.module, []).append(node)
    for path, nodes in owners.items():
        if len(nodes) == 1:
            candidate = re.sub(r"[^0-9a-zA-Z_]", "_", path)
            if candidate and candidate[0].isdigit():
                candidate = "m_" + candidate
            nodes[0]._rename(candidate)


def scope_module_paths(gm: torch.fx.GraphModule, path: str, ancestors: tuple[tuple[str, str], ...]) -> None:
    """Make ``gm``'s module paths those of the larger model it is a part of: a graph captured from the submodule
    at ``path`` (partial capture) names ``layers.0.attn`` as ``encoder.layers.0.attn``, so that module rules and the
    report see the model's own paths. ``ancestors``: the (path, class name) of every module above it, root first."""
    def full(sub: str) -> str:
        return f"{path}.{sub}" if sub else path

    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is None:
            continue
        stack = ancestors + tuple((full(sub), cls) for sub, cls in info.module_stack)
        node.meta[META_INFO] = dataclasses.replace(info, module=full(info.module), module_stack=stack)
