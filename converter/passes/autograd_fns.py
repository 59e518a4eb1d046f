"""Keep a user's ``torch.autograd.Function`` as one opaque call in the captured graph, backward included.

Both tracers record only what a Function's ``forward`` computes: ``symbolic_trace`` traces into
``forward`` with proxies, and torch.export (non-strict, training IR) inlines its aten ops. The
``backward`` is lost without a word: a gradient-reversal layer's gradient comes back sign-flipped,
a safe square root's (a backward that masks zero inputs) becomes NaN.

During capture, :class:`OpaqueFunctions` (active only around the trace) routes ``Fn.apply(...)`` of
every Function not defined by torch itself (``torch.utils.checkpoint``'s own Function keeps its
handling) to one graph node whose target is :func:`function_call` ``(Fn)``, a function that calls
``Fn.apply``: running the graph runs the Function, forward and backward, as the model did.

* symbolic_trace: the node is recorded directly (a ``call_function`` leaf with the call's arguments).
* torch.export: the call runs as the stand-in custom op ``mpconvert::autograd_function`` (its tensors
  and a key naming the call); its fake kernel runs the Function's forward on the fake inputs for the
  output sizes (dynamic dims stay dynamic). :func:`restore_function_calls` then replaces each
  stand-in by the ``function_call(Fn)`` node with the call's own arguments, so the graph needs
  nothing from this package to run.

Downstream, the node's canonical op name is the Function's class name (``GradReverse``): decide
runs it on fp32 inputs (``<builtin>:[builtin].autograd-function``: user code mpconvert cannot see
into) unless an ``op`` or ``node`` rule names it; model.py carries the class (its source, or an
import of its module); the ONNX exporters record its forward.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.autograd.function import Function

from converter.ir.errors import MpconvertError

__all__ = ["OpaqueFunctions", "UnsupportedFunctionCall", "autograd_function", "function_call", "restore_function_calls"]


class UnsupportedFunctionCall(MpconvertError, RuntimeError):
    """A custom autograd Function is called in a way the graph cannot keep as one call."""


#: Function class -> the graph's call target for it (one per class)
_TARGETS: dict[type, Callable] = {}


def function_call(cls: type) -> Callable:
    """The graph's call target for ``cls.apply``: named after the class, ``autograd_function`` = ``cls``."""
    target = _TARGETS.get(cls)
    if target is None:
        def target(*args, **kwargs):
            return cls.apply(*args, **kwargs)

        target.__name__ = f"{cls.__name__}_apply"
        target.__qualname__ = f"{cls.__qualname__}_apply"
        target.__module__ = cls.__module__
        target.__doc__ = f"{cls.__qualname__}.apply: the custom autograd Function, forward and backward."
        setattr(target, "autograd_function", cls)  # noqa: B010 (an attribute of ours on a function)
        _TARGETS[cls] = target
    return target


def autograd_function(node: torch.fx.Node) -> Optional[type]:
    """The custom autograd Function class ``node`` calls as one opaque op, or None."""
    if node.op != "call_function":
        return None
    cls = getattr(node.target, "autograd_function", None)
    return cls if isinstance(cls, type) and issubclass(cls, Function) else None


def _is_user_function(cls: type) -> bool:
    """Functions that torch defines (reentrant checkpoint...) are traced as torch means them to be."""
    return not str(getattr(cls, "__module__", "")).startswith("torch.")


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------------
# torch.export: a stand-in custom op per call


@dataclass
class _Call:
    """One call of a Function during an export: the class and its arguments with tensor slots."""

    cls: type
    spec: Any
    #: the flat arguments; None where a tensor goes (the stand-in op's tensors, in order)
    constants: list
    #: the Function returned one tensor (True) or a tuple of tensors (False); set by the fake kernel
    single: Optional[bool] = None

    def rebuild(self, tensors: list) -> tuple[tuple, dict]:
        it = iter(tensors)
        flat = [next(it) if c is None else c for c in self.constants]
        args, kwargs = pytree.tree_unflatten(flat, self.spec)
        return tuple(args), dict(kwargs)


#: key -> the call it stands for (a key is unique per call and process)
_CALLS: dict[str, _Call] = {}
_KEYS = itertools.count()
#: the original ``Function.apply`` (a classmethod object)
_ORIGINAL_APPLY = Function.__dict__["apply"]


def _run(call: _Call, tensors: list) -> list[torch.Tensor]:
    args, kwargs = call.rebuild(tensors)
    with torch.no_grad():
        out = _ORIGINAL_APPLY.__func__(call.cls, *args, **kwargs)
    if isinstance(out, torch.Tensor):
        call.single = True
        return [out]
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
        call.single = False
        return list(out)
    what = type(out).__name__ if not isinstance(out, (tuple, list)) else f"a {type(out).__name__} with non-tensors"
    raise UnsupportedFunctionCall(
        f"custom autograd Function {_name(call.cls)} returns {what}: torch.export cannot keep it as one call with its "
        "backward; return tensors only, or use tracer='fx'")


def _standin_kernel(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return [o.clone() for o in _run(_CALLS[key], tensors)]


def _standin_fake(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return [torch.empty_like(o) for o in _run(_CALLS[key], tensors)]


def _define_standin():
    op = torch.library.custom_op("mpconvert::autograd_function", _standin_kernel, mutates_args=(),
                                 schema="(Tensor[] tensors, str key) -> Tensor[]")
    op.register_fake(_standin_fake)
    return torch.ops.mpconvert.autograd_function.default


_STANDIN = _define_standin()


class OpaqueFunctions:
    """Record each ``Fn.apply`` of a user's autograd Function as one call (see the module docstring).

    ``tracer``: the FX tracer of a symbolic trace (the call becomes a node directly); None for
    torch.export (the call runs as the stand-in op). ``Function.apply`` is replaced for the
    duration of the ``with`` block only, and put back also when the trace raises.
    """

    def __init__(self, tracer: Optional[torch.fx.Tracer] = None) -> None:
        self.tracer = tracer
        self._saved: Any = None

    def __enter__(self) -> "OpaqueFunctions":
        original = _ORIGINAL_APPLY.__func__
        record = self._record_fx if self.tracer is not None else self._record_export

        def apply(cls, *args, **kwargs):
            if not _is_user_function(cls):
                return original(cls, *args, **kwargs)
            return record(cls, args, kwargs, original)

        self._saved = Function.__dict__["apply"]
        setattr(Function, "apply", classmethod(apply))  # noqa: B010 (torch's classmethod is replaced on purpose)
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(Function, "apply", self._saved)  # noqa: B010

    def _record_fx(self, cls, args, kwargs, original):
        if not any(isinstance(v, torch.fx.Proxy) for v in pytree.tree_leaves((args, kwargs))):
            return original(cls, *args, **kwargs)  # no traced input: a constant, computed now as FX does
        return self.tracer.create_proxy("call_function", function_call(cls), tuple(args), dict(kwargs))

    def _record_export(self, cls, args, kwargs, original):
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        if not tensors:
            return original(cls, *args, **kwargs)
        symbolic = [v for v in flat if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))]
        if symbolic:
            raise UnsupportedFunctionCall(
                f"custom autograd Function {_name(cls)} is called with a size ({symbolic[0]}) of a dynamic dim, "
                "which the graph cannot keep in one call; pass it as a tensor, or capture with dynamic=False")
        key = f"{_name(cls)}#{next(_KEYS)}"
        call = _Call(cls, spec, [None if isinstance(v, torch.Tensor) else v for v in flat])
        _CALLS[key] = call
        outs = _STANDIN(tensors, key)
        return outs[0] if call.single else tuple(outs)


def restore_function_calls(gm: torch.fx.GraphModule) -> int:
    """Replace the stand-in ops of an exported ``gm`` by calls of the Functions; returns how many."""
    count = 0
    for sub in gm.modules():  # nested graphs too (no_grad/autocast regions before they are inlined)
        if isinstance(sub, torch.fx.GraphModule):
            count += _restore_in(sub)
    return count


def _restore_in(gm: torch.fx.GraphModule) -> int:
    count = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _STANDIN:
            continue
        tensors, key = node.args[0], node.args[1]
        call = _CALLS[key]
        args, kwargs = call.rebuild(list(tensors))
        with graph.inserting_before(node):
            new = graph.call_function(function_call(call.cls), args, kwargs)
        new.meta = dict(node.meta)
        vals = node.meta.get("val")
        if call.single:
            if isinstance(vals, (list, tuple)) and vals:
                new.meta["val"] = vals[0]
            for user in list(node.users):
                if user.op == "call_function" and user.args[1] == 0 and len(user.args) == 2:
                    user.replace_all_uses_with(new)
                    graph.erase_node(user)
                else:  # anything else reads the list: give it a one-element list
                    raise UnsupportedFunctionCall(f"custom autograd Function {_name(call.cls)}: unexpected use "
                                                  f"{user.format_node()} of its output in the exported graph")
        else:
            if isinstance(vals, list):
                new.meta["val"] = tuple(vals)
            node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count
