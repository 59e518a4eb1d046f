"""Capture: turn an ``nn.Module`` into a GraphModule whose nodes all carry :class:`NodeInfo`.

``tracer="auto"`` tries ``torch.fx.symbolic_trace`` first (fast, keeps Python-level structure) and
falls back to ``torch.export`` (training IR, ``.module()``) when symbolic tracing fails, which it
does on every Hugging Face model. ``"fx"`` and ``"export"`` force one.

The FX tracer traces *into* ``Linear``, ``Conv*``, ``LayerNorm``, ``GroupNorm``, ``RMSNorm`` and
``Embedding`` so that their weights become ``get_attr`` nodes the rewrite can cast (O1) and the op
becomes a functional call (``F.linear`` ...), the same op that export produces. ``BatchNorm`` stays
a leaf module so that ``train()``/``eval()`` keep working on the converted model.

Shape propagation runs the example inputs once (under ``no_grad``, restoring every buffer
afterwards) for FX graphs; export graphs already carry fake values in ``node.meta["val"]``.
"""
from __future__ import annotations

import copy
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

from converter.ir.graphmodule import new_graph_module
from converter.ir.meta import NodeInfo, TensorSpec
from converter.ir.ops import CAST_OPS, NORM_OPS, canonical_op, explicit_dtype, is_inplace
from converter.ir.meta import META_INFO, META_SOURCE, META_VALUE
from converter.ir.errors import MpconvertError

__all__ = ["Captured", "CaptureError", "capture", "normalize_inputs", "annotate", "placeholder_values", "TRACED_THROUGH"]

#: nn modules the FX tracer traces into (their forward is one functional call on their parameters)
TRACED_THROUGH = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose1d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
    torch.nn.Embedding,
    torch.nn.Identity,
    torch.nn.Flatten,
)


class CaptureError(MpconvertError, RuntimeError):
    """Neither tracer could capture the model; ``reasons`` maps tracer name to a one-line reason."""

    def __init__(self, reasons: dict[str, str]):
        self.reasons = dict(reasons)
        detail = "; ".join(f"{name}: {why}" for name, why in reasons.items())
        hint = "try --tracer export" if "export" not in reasons else "make the model traceable by torch.export (see its error)"
        super().__init__(f"could not capture the model ({detail}); {hint}")


@dataclass
class Captured:
    gm: torch.fx.GraphModule
    tracer: str
    args: tuple
    kwargs: dict
    errors: dict[str, str]


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


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200]


_SKIP_FRAMES = (f"{torch.__path__[0]}", str(__import__("pathlib").Path(__file__).resolve().parent.parent))


class _Tracer(torch.fx.Tracer):
    """FX tracer that traces into Linear/Conv/norm modules, with linear-time bookkeeping.

    torch's ``Tracer.getattr`` scans every parameter on each attribute access and its
    ``record_stack_traces`` formats a full traceback per node; both are quadratic or slow on big
    models. Here parameters are found through an id map and the source location is read from the
    first stack frame outside torch and this package.
    """

    def __init__(self) -> None:
        super().__init__()
        self._attr_names: dict[int, str] = {}

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, TRACED_THROUGH):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if not isinstance(attr_val, torch.nn.Parameter):
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if not self._attr_names:
            self._attr_names = {id(p): n for n, p in self.root.named_parameters(remove_duplicate=False)}
        name = self._attr_names.get(id(attr_val))
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FRAMES):
            frame = frame.f_back
        if frame is not None and hasattr(proxy, "node"):
            proxy.node.meta[META_SOURCE] = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        return proxy


def _trace_fx(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(model)
    gm = new_graph_module(tracer.root, graph, type(model).__name__)
    _propagate(gm, args, kwargs)
    return gm


def _trace_export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    ep = torch.export.export(model, args, kwargs, strict=False)
    gm = ep.module()
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta[META_VALUE] = _spec_of(node.meta["val"])
    return gm


def _spec_of(value: Any) -> Any:
    """A lightweight, tensor-free description of a runtime value (shape+dtype for tensors)."""
    if isinstance(value, torch.Tensor):
        try:
            shape = tuple(int(s) for s in value.shape)
        except (TypeError, ValueError):  # symbolic sizes
            shape = tuple(int(getattr(s, "node", s).hint) if hasattr(s, "node") else 1 for s in value.shape)
        return TensorSpec(shape, value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_spec_of(v) for v in value)
    if isinstance(value, dict):
        return tuple(_spec_of(v) for v in value.values())
    if isinstance(value, torch.dtype):
        return value
    return type(value).__name__


class _Propagator(torch.fx.Interpreter):
    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        n.meta[META_VALUE] = _spec_of(result)
        return result


def placeholder_values(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values of ``gm``'s placeholders for a call ``gm(*args, **kwargs)``.

    Export graphs flatten their inputs with a pytree spec; symbolic_trace keeps every forward
    parameter as a placeholder, so missing ones take their defaults.
    """
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        import torch.fx._pytree as fx_pytree

        return list(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), info.in_spec))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(args)
    for p in placeholders[len(args):]:
        if p.target in kwargs:
            values.append(kwargs[p.target])
        elif p.args:
            values.append(p.args[0])
        else:
            values.append(None)
    return values


def _propagate(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Run the example inputs once to learn every node's shapes and dtypes; leave no trace."""
    saved = {name: buf.detach().clone() for name, buf in gm.named_buffers()}
    values = placeholder_values(gm, args, kwargs)
    try:
        with torch.no_grad():
            _Propagator(gm).run(*values)
    finally:
        with torch.no_grad():
            for name, buf in gm.named_buffers():
                buf.copy_(saved[name])


def capture(model: torch.nn.Module, example_inputs: Any, *, tracer: str = "auto") -> Captured:
    """Capture ``model`` into an annotated GraphModule (see module docstring)."""
    if tracer not in ("auto", "fx", "export"):
        raise ValueError(f"tracer must be 'auto', 'fx' or 'export', got {tracer!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = normalize_inputs(example_inputs)
    errors: dict[str, str] = {}
    order = {"auto": ("fx", "export"), "fx": ("fx",), "export": ("export",)}[tracer]
    gm = None
    used = None
    for name in order:
        try:
            source = copy.deepcopy(model)
            gm = _trace_fx(source, args, kwargs) if name == "fx" else _trace_export(source, args, kwargs)
            used = name
            break
        except Exception as exc:  # any tracer failure is reported with its reason, then the next is tried
            errors[name] = _short(exc)
    if gm is None:
        raise CaptureError(errors)
    annotate(gm, root_type=type(model).__name__)
    opaque = _opaque_leaves(gm)
    if tracer == "auto" and used == "fx" and opaque:
        # FX kept modules it cannot see into (nn.MultiheadAttention, RNNs...) as fp32 leaves;
        # torch.export traces through them, so prefer it when it works.
        try:
            exported = _trace_export(copy.deepcopy(model), args, kwargs)
        except Exception as exc:  # keep the FX graph; the opaque modules stay fp32 (reported)
            errors["export"] = _short(exc)
        else:
            annotate(exported, root_type=type(model).__name__)
            errors["fx"] = f"opaque leaf modules {', '.join(sorted(set(opaque)))}: used torch.export to convert inside them"
            gm, used = exported, "export"
    return Captured(gm=gm, tracer=used, args=args, kwargs=kwargs, errors=errors)


def _opaque_leaves(gm: torch.fx.GraphModule) -> list[str]:
    """Class names of leaf modules FX could not trace into and that hold parameters."""
    return [
        node.meta[META_INFO].module_type
        for node in gm.graph.nodes
        if node.op == "call_module" and node.meta.get(META_INFO) is not None and "opaque leaf module" in node.meta[META_INFO].why
    ]


# ---------------------------------------------------------------------------------------------
# annotation


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


def _flat_specs(spec: Any) -> list[TensorSpec]:
    if isinstance(spec, TensorSpec):
        return [spec]
    if isinstance(spec, tuple):
        out: list[TensorSpec] = []
        for s in spec:
            out.extend(_flat_specs(s))
        return out
    return []


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The distinct nodes this node reads (FX keeps this list; no need to walk args again)."""
    return node.all_input_nodes


def _float_specs(node: torch.fx.Node) -> list[TensorSpec]:
    return [s for s in _flat_specs(node.meta.get(META_VALUE)) if s.dtype.is_floating_point]


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


def annotate(gm: torch.fx.GraphModule, *, root_type: str) -> None:
    """Write :class:`NodeInfo` on every node."""
    _annotate_nodes(gm, root_type)
    _rename_module_ops(gm)


def _annotate_nodes(gm: torch.fx.GraphModule, root_type: str) -> None:
    for node in gm.graph.nodes:
        stack = _module_stack(node, root_type)
        module, module_type = stack[-1]
        outputs = tuple(_flat_specs(node.meta.get(META_VALUE)))
        if node.op in ("placeholder", "get_attr", "output"):
            node.meta[META_INFO] = NodeInfo(op=node.op, module=module, module_type=module_type, module_stack=stack, outputs=outputs)
            continue
        op = canonical_op(node, gm)
        kind, fixed, why = _classify(gm, node, op, outputs)
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
        )


def _classify(gm, node, op, outputs) -> tuple[str, Optional[torch.dtype], str]:
    float_out = [s for s in outputs if s.dtype.is_floating_point]
    in_nodes = input_nodes(node)
    float_in = [s for n in in_nodes for s in _float_specs(n)]
    if any(s.dtype == torch.float64 for s in float_out + float_in):
        return "passive", None, "fp64 tensors are never converted"
    if not float_out:
        return "passive", None, "produces no floating-point tensor"
    if is_inplace(node, op):
        return "alias", None, "in-place op: runs in the dtype of the tensor it mutates"
    if op == "getitem" and in_nodes and isinstance(in_nodes[0].meta.get(META_VALUE), tuple):
        return "alias", None, "element of a tuple output: has its producer's precision"
    fixed = explicit_dtype(node, op)
    if fixed is not None:
        observed = float_out[0].dtype
        if isinstance(fixed, torch.fx.Node):
            return "fixed", observed, f"cast to a dtype computed at run time (observed {observed}); kept as observed"
        kind_why = "explicit cast in the model code" if op in CAST_OPS else f"the op's own dtype argument fixes its output to {fixed}"
        return "fixed", fixed, kind_why
    if not float_in:
        return "fixed", float_out[0].dtype, "no floating-point input: its dtype is set by its own arguments"
    if node.op == "call_module" and op not in NORM_OPS:
        sub = gm.get_submodule(node.target)
        if any(p.is_floating_point() for p in sub.parameters(recurse=True)):
            return (
                "fixed",
                float_out[0].dtype,
                f"opaque leaf module {type(sub).__name__} with fp32 parameters; capture with tracer='export' to convert inside it",
            )
    return "compute", None, ""
