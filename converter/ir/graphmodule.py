"""GraphModule plumbing shared by the stages: lazy code generation and a GC pause for graph passes.

* FX generates (and ``compile``s) Python source for a GraphModule each time it is built or
  recompiled. The captured graph is rewritten before it ever runs, so generating its code at
  capture time is wasted work, and on a 9k-node graph code generation costs more than the whole
  pass. :func:`new_graph_module` builds torch's ``_LazyGraphModule`` (the one inductor uses), whose
  ``recompile()`` only marks the code stale; the code is generated once, for the final graph, by
  :func:`materialize`, which hands back a plain GraphModule (``convert`` calls it and reports the
  time as ``codegen_s``).
  Where torch lacks that class, a plain GraphModule is built and nothing changes but the timing.
* :func:`gc_paused`: a pass allocates tens of thousands of small, acyclic records; CPython's
  cyclic collector runs repeatedly over the whole heap meanwhile (~10 % of the pass on a 9k-node
  graph) and finds nothing to free.
"""
from __future__ import annotations

import contextlib
import functools
import gc

import torch
import torch.fx

try:  # private, but stable since torch 2.3 and used by inductor on every compile
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:  # pragma: no cover - a torch without it gets eager code generation
    _LazyGraphModule = None

__all__ = ["new_graph_module", "materialize", "gc_paused", "pauses_gc"]


def new_graph_module(root: torch.nn.Module, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated on first use instead of now."""
    cls = _LazyGraphModule if _LazyGraphModule is not None else torch.fx.GraphModule
    return cls(root, graph, class_name)


def materialize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` as a plain GraphModule with its code generated (an eager one is returned as is).

    A lazy GraphModule is rebuilt as ``torch.fx.GraphModule`` over the same graph, parameters and
    submodules (nothing is copied), which generates the code once. The plain class matters:
    TorchScript cannot compile ``_LazyGraphModule``'s methods, and ``torch.jit.script`` worked on
    converted models before capture became lazy.
    """
    if _LazyGraphModule is None or not isinstance(gm, _LazyGraphModule):
        return gm
    plain = torch.fx.GraphModule(gm, gm.graph, type(gm).__name__)
    plain.meta.update(gm.meta)
    return plain


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector for the duration (reference counting still frees)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def pauses_gc(fn):
    """Decorator form of :func:`gc_paused`, for the graph passes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper
