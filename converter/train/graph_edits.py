"""The trainer's edits of the user's model: GLM-130B's embedding gradient shrink, and O2's dropped weight casts.

Both are found before anything changes (:func:`plan_embedding_shrink` raises when there is nothing to
shrink) and applied once the trainer's arguments are all known to be valid.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import torch
import torch.fx
from torch import nn

from converter.ir.meta import META_CAST, META_INFO, META_TRAINER

__all__ = ["EmbeddingShrink", "drop_identity_weight_casts", "plan_embedding_shrink"]


def _shrink_embedding_grad(alpha: float, _module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    """GLM-130B's embedding gradient shrink: same forward value, gradient multiplied by ``alpha``."""
    return output * alpha + output.detach() * (1.0 - alpha)


def _is_embedding_node(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in (nn.functional.embedding, torch.ops.aten.embedding.default):
        return True
    info = node.meta.get(META_INFO)  # the converter's canonical op name
    return getattr(info, "op", None) == "embedding"


def _shrink_graph_embeddings(gm: torch.fx.GraphModule, alpha: float) -> int:
    """Rewrite every embedding node ``e`` of ``gm`` into ``e*alpha + e.detach()*(1-alpha)``; returns the count.

    The converter inlines modules into functional calls (``F.embedding`` on a ``get_attr``
    weight), so a hook on the ``nn.Embedding`` module would never fire there.
    """
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if not _is_embedding_node(node):
            continue
        with graph.inserting_after(node):
            kept = graph.call_function(operator.mul, (node, alpha))
        with graph.inserting_after(kept):
            frozen = graph.call_method("detach", (node,))
        with graph.inserting_after(frozen):
            rest = graph.call_function(operator.mul, (frozen, 1.0 - alpha))
        with graph.inserting_after(rest):
            shrunk = graph.call_function(operator.add, (kept, rest))
        for new in (kept, frozen, rest, shrunk):
            new.meta[META_TRAINER] = "embedding_grad_shrink"
        node.replace_all_uses_with(shrunk, delete_user_cb=lambda user, mine=(kept, frozen): user not in mine)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def drop_identity_weight_casts(inner: nn.Module) -> int:
    """O2: remove the converter's weight casts that the half storage made identities.

    A converted graph casts each fp32 parameter to half where an op runs in half (O1). Once the
    parameter is *stored* in that dtype the cast returns its input unchanged, but each one is
    still a Python call and a dispatch per forward (~1.5 µs, 16 of them in a 2-layer encoder).
    Only casts the converter inserted on a ``get_attr`` of a parameter now stored in the cast's
    dtype are removed; the count is returned (and kept as ``trainer.dropped_weight_casts``).
    Storing the parameters back in fp32 afterwards would need the casts again: O2 is one-way.
    """
    if not isinstance(inner, torch.fx.GraphModule):
        return 0
    params = dict(inner.named_parameters())
    graph = inner.graph
    dropped = 0
    for node in list(graph.nodes):
        record = node.meta.get(META_CAST)
        if record is None or not record.on_weight or not record.inserted:
            continue
        if node.op != "call_method" or node.target != "to" or len(node.args) != 2 or node.kwargs:
            continue
        src, dtype = node.args
        if not (isinstance(src, torch.fx.Node) and src.op == "get_attr" and isinstance(dtype, torch.dtype)):
            continue
        param = params.get(str(src.target))
        if param is None or param.dtype != dtype:
            continue
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        dropped += 1
    if dropped:
        inner.recompile()
    return dropped



@dataclasses.dataclass(frozen=True)
class EmbeddingShrink:
    """Where ``embedding_grad_shrink`` acts, found without changing anything: :meth:`install` applies it."""

    alpha: float
    modules: list[nn.Embedding]  # the nn.Embedding modules that run: a forward hook each
    graph: torch.fx.GraphModule | None  # a GraphModule whose embedding nodes are rewritten in place

    def install(self) -> list[torch.utils.hooks.RemovableHandle]:
        """Rewrite the graph's embedding nodes and hook the modules; returns the hooks' handles."""
        if self.graph is not None:
            _shrink_graph_embeddings(self.graph, self.alpha)
        hook = functools.partial(_shrink_embedding_grad, self.alpha)
        return [m.register_forward_hook(hook) for m in self.modules]


def plan_embedding_shrink(inner: nn.Module, alpha: float) -> EmbeddingShrink:
    """The embeddings of ``inner`` to shrink; ValueError when it has none (the option would silently do nothing)."""
    graph = None
    if isinstance(inner, torch.fx.GraphModule):
        modules = dict(inner.named_modules())
        called = {node.target for node in inner.graph.nodes if node.op == "call_module"}
        embeddings = [modules[name] for name in sorted(called) if isinstance(modules.get(name), nn.Embedding)]
        if any(map(_is_embedding_node, inner.graph.nodes)):
            graph = inner
    else:
        embeddings = [m for m in inner.modules() if isinstance(m, nn.Embedding)]
    if not embeddings and graph is None:
        raise ValueError(
            "embedding_grad_shrink is set but the module has no nn.Embedding submodule and no embedding "
            "node in its graph, so there is nothing to shrink"
        )
    return EmbeddingShrink(alpha=alpha, modules=embeddings, graph=graph)
