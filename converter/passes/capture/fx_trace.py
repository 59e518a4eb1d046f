"""FX tracing: ``torch.fx.symbolic_trace`` with capture's tracer, and shape propagation of its graphs.

The tracer traces *into* the :data:`TRACED_THROUGH` modules (their weights become ``get_attr`` nodes,
their op a functional call), records each node's source line, checkpoint region and autocast block,
and refuses a random tensor drawn at trace time (:class:`RandomAtTraceTime`). symbolic_trace records
no sizes, so :func:`propagate` runs the example once to write every node's value spec.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.fx
from torch.overrides import TorchFunctionMode

from converter.ir.errors import MpconvertError
from converter.ir.graphmodule import new_graph_module
from converter.ir.meta import META_CHECKPOINT, META_SOURCE, META_VALUE
from converter.ir.state import preserved_state
from converter.passes.autograd_fns import OpaqueFunctions
from converter.passes.capture.advice import user_location
from converter.passes.capture.values import Shapes, placeholder_values, placeholders, spec_of
from converter.passes.checkpoint import CheckpointMarks, active_tag
from converter.passes.intent import AutocastMarks, tag_traced
from converter.passes.modes import is_random

__all__ = ["TRACED_THROUGH", "RandomAtTraceTime", "trace_fx", "propagate"]


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


class _Tracer(torch.fx.Tracer):
    """FX tracer that traces into Linear/Conv/norm modules, with linear-time bookkeeping.

    torch's ``Tracer.getattr`` scans every parameter on each attribute access and its
    ``record_stack_traces`` formats a full traceback per node; both are quadratic or slow on big
    models. Here parameters are found through an id map and the source location is read from the
    first stack frame outside torch and this package. Buffers are proxied too (``get_attr``), so that
    what forward computes from a buffer and writes into it (an EMA codebook, a hand-written norm's running
    statistics) is in the graph.
    """

    def __init__(self) -> None:
        super().__init__()
        self._attr_names: dict[int, str] = {}

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, TRACED_THROUGH):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if not isinstance(attr_val, torch.Tensor):
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if not self._attr_names:
            # buffers are proxied as parameters are: `self.embed.t()` and an EMA's `self.avg.mul_(d)` are graph
            # nodes, not values computed once at trace time (the write lost, the result a constant)
            self._attr_names = {id(b): n for n, b in self.root.named_buffers(remove_duplicate=False)}
            self._attr_names.update({id(p): n for n, p in self.root.named_parameters(remove_duplicate=False)})
        name = self._attr_names.get(id(attr_val))
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        where = user_location(sys._getframe(1))
        if where and hasattr(proxy, "node"):
            proxy.node.meta[META_SOURCE] = where
        tag = active_tag()  # inside a torch.utils.checkpoint call (converter.passes.checkpoint)
        if tag is not None and hasattr(proxy, "node"):
            proxy.node.meta[META_CHECKPOINT] = tag
        if hasattr(proxy, "node"):
            tag_traced(proxy.node)  # inside a torch.autocast block (converter.passes.intent)
        return proxy


class RandomAtTraceTime(MpconvertError, RuntimeError):
    """symbolic_trace drew a random tensor eagerly (see :class:`_EagerRandom`); capture catches it.

    Fields: ``function`` (the torch function that drew, ``"rand"``), ``location`` (the user's ``file:line``,
    "" if none was found) and ``reason`` (the cause in one phrase, what a frozen mode or graph break reports)."""

    def __init__(self, *, function: str, location: str) -> None:
        where = f" at {location}" if location else ""
        self.function = function
        self.location = location
        self.reason = (f"forward draws random numbers at trace time{where} (torch.{function} of no traced tensor), "
                       "which symbolic_trace would bake into the graph")
        super().__init__(self.reason)


class _EagerRandom(TorchFunctionMode):
    """Raise when symbolic tracing draws a random tensor eagerly.

    ``torch.rand(())`` has no Proxy argument, so symbolic_trace runs it at trace time and a branch
    on it (LayerDrop) is decided once and baked into the graph: the converted model would always
    (or never) skip that layer. torch.export traces such calls, so capture falls back to it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and is_random(getattr(func, "__name__", "")):
            raise RandomAtTraceTime(function=func.__name__, location=user_location(sys._getframe(1)))
        return out


def trace_fx(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: Shapes) -> torch.fx.GraphModule:
    """``model`` traced by symbolic_trace (into the :data:`TRACED_THROUGH` modules); every input dim is dynamic."""
    tracer = _Tracer()
    # OpaqueFunctions: a custom autograd Function stays one call, backward included (passes.autograd_fns)
    with _EagerRandom(), CheckpointMarks(), OpaqueFunctions(tracer), AutocastMarks(tracer=tracer):
        graph = tracer.trace(model)
    gm = new_graph_module(tracer.root, graph, type(model).__name__)
    shapes.dims = {
        n.name: list(range(v.dim())) for n, v in zip(placeholders(gm), placeholder_values(gm, args, kwargs))
        if isinstance(v, torch.Tensor)
    }
    shapes.note = "symbolic_trace records no sizes: every dimension is dynamic" + (
        "" if shapes.dynamic else " (dynamic=False fixes torch.export captures only)")
    return gm


class _Propagator(torch.fx.Interpreter):
    """Runs the graph and writes each node's value spec (``META_VALUE``)."""

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        n.meta[META_VALUE] = spec_of(result)
        return result


def propagate(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Run the example inputs once to learn every node's shapes and dtypes; leave no trace."""
    values = placeholder_values(gm, args, kwargs)
    with preserved_state(gm), torch.no_grad():
        _Propagator(gm).run(*values)
