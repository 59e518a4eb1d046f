"""Inline torch.export's higher-order regions into the outer graph (part of *capture*).

torch.export records a ``torch.no_grad()`` / ``torch.set_grad_enabled(...)`` block as a call of
``torch.ops.higher_order.wrap_with_set_grad_enabled(enabled, submod, *operands)`` and a
``torch.autocast(...)`` block (Hugging Face rotary embeddings disable autocast) as
``wrap_with_autocast(device_type, dtype, enabled, cache_enabled, submod, *operands)``, where
``submod`` is a nested GraphModule. The rules could not reach the ops inside, and model.py cannot be
emitted from a nested graph.

:func:`inline_regions` copies the region's ops into the outer graph, bracketed by plain calls that
FX code generation writes as ordinary Python::

    grad_was = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    ... the region's ops ...
    torch._C._set_grad_enabled(grad_was)

and for autocast ``ctx = torch.amp.autocast_mode._enter_autocast(...)`` … ``_exit_autocast(ctx)``.
Both bracket functions are on FX's side-effect list, so dead-code elimination keeps them. The
inlined nodes carry ``node.meta["mp_region"]`` (a tuple of region ids, outermost first); the
rewrite never shares a cast between consumers in different regions, because a cast made under
``no_grad`` would cut the gradient of a consumer outside it. Nested regions are inlined inside
out. An exception raised inside a region leaves the grad mode as the region set it (a plain
graph has no ``finally``); the model's own ``with`` block would have restored it.

An autocast region is also the user's precision intent: its nodes get ``node.meta["mp_intent"]``
from the region's arguments and its ``with`` line (:mod:`converter.passes.intent`; an inner
region's own intent wins).
"""
from __future__ import annotations

import operator
from typing import Any, Optional, cast

import torch
import torch.fx

from converter.ir.meta import META_CHECKPOINT, META_REGION
from converter.passes.intent import add_intent, autocast_intent, region_location

__all__ = ["inline_regions", "REGION_OPS"]


def _hop(name: str) -> Optional[Any]:
    return getattr(torch.ops.higher_order, name, None) if hasattr(torch.ops, "higher_order") else None


_GRAD = _hop("wrap_with_set_grad_enabled")
_AUTOCAST = _hop("wrap_with_autocast")
#: the higher-order ops this module inlines
REGION_OPS = tuple(op for op in (_GRAD, _AUTOCAST) if op is not None)


def inline_regions(gm: torch.fx.GraphModule) -> int:
    """Inline every grad-mode and autocast region of ``gm`` (recursively); returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in REGION_OPS:
            continue
        if _inline_one(gm, node, region_id=count):
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _split_args(node: torch.fx.Node) -> tuple[tuple, torch.fx.Node, tuple]:
    """(bracket arguments, the get_attr of the submodule, the operands)."""
    if node.target is _GRAD:
        enabled, sub, *operands = node.args
        return (enabled,), cast(torch.fx.Node, sub), tuple(operands)
    device_type, dtype, enabled, cache_enabled, sub, *operands = node.args
    return (device_type, dtype, enabled, cache_enabled), cast(torch.fx.Node, sub), tuple(operands)


def _inline_one(gm: torch.fx.GraphModule, node: torch.fx.Node, *, region_id: int) -> bool:
    bracket, sub_node, operands = _split_args(node)
    if not (isinstance(sub_node, torch.fx.Node) and sub_node.op == "get_attr"):
        return False
    sub = getattr(gm, str(sub_node.target), None)
    if not isinstance(sub, torch.fx.GraphModule):
        return False
    if any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
        return False  # the tuple itself is used: keep the region (emit names it)
    inline_regions(sub)  # nested regions first
    graph = gm.graph
    tag = (f"{'grad' if node.target is _GRAD else 'autocast'}{region_id}",)
    first = node.prev
    with graph.inserting_before(node):
        enter, leave = _bracket(graph, node, bracket)
        outputs = _copy_body(gm, sub, operands, str(sub_node.target), tag)
        leave()
    if node.target is _AUTOCAST:  # the user's precision intent over the region's nodes
        device_type, dtype, enabled, _ = bracket
        body = []
        new = enter.next
        while new is not node:
            body.append(new)
            new = new.next
        intent = autocast_intent(str(device_type), dtype, bool(enabled), region_location(body))
        for n in body:
            if n.op != "get_attr" and n.target is not torch.amp.autocast_mode._exit_autocast:
                add_intent(n, intent)
    _keep_checkpoint(first, node)
    for user in list(node.users):
        user.replace_all_uses_with(outputs[cast(int, user.args[1])])
        graph.erase_node(user)
    graph.erase_node(node)
    if not sub_node.users:
        graph.erase_node(sub_node)
        if not any(n.op == "get_attr" and n.target == sub_node.target for n in graph.nodes):
            delattr(gm, str(sub_node.target))
    return True


def _keep_checkpoint(first: torch.fx.Node, end: torch.fx.Node) -> None:
    """A region inside a torch.utils.checkpoint call stays inside it, brackets included
    (:mod:`converter.passes.checkpoint`): the new nodes after ``first`` take the call's tag."""
    made = []
    new = first.next
    while new is not end:
        made.append(new)
        new = new.next
    tag = end.meta.get(META_CHECKPOINT) or next((n.meta[META_CHECKPOINT] for n in made if META_CHECKPOINT in n.meta), None)
    if tag is not None:
        for n in made:
            n.meta.setdefault(META_CHECKPOINT, tag)


def _bracket(graph: torch.fx.Graph, node: torch.fx.Node, bracket: tuple):
    """Insert the entering call(s); return (the first node, a function that inserts the leaving call)."""
    if node.target is _GRAD:
        was = graph.call_function(torch.is_grad_enabled, ())
        graph.call_function(torch._C._set_grad_enabled, (bracket[0],))

        def leave() -> None:
            graph.call_function(torch._C._set_grad_enabled, (was,))

        return was, leave
    ctx = graph.call_function(torch.amp.autocast_mode._enter_autocast, bracket)

    def leave_autocast() -> None:
        graph.call_function(torch.amp.autocast_mode._exit_autocast, (ctx,))

    return ctx, leave_autocast


def _copy_body(gm: torch.fx.GraphModule, sub: torch.fx.GraphModule, operands: tuple, prefix: str, tag: tuple) -> list:
    """Copy ``sub``'s nodes before the insertion point; return the values its output returns."""
    graph = gm.graph
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise RuntimeError(f"region {prefix} takes {len(placeholders)} inputs but is called with {len(operands)}")
    env.update(zip(placeholders, operands))
    result: Any = ()
    for sn in sub.graph.nodes:
        if sn.op == "placeholder":
            continue
        if sn.op == "output":
            result = torch.fx.node.map_arg(sn.args[0], lambda n: env[n])
            break
        if sn.op == "get_attr":
            name = _unique_attr(gm, f"{prefix}_{sn.target}".replace(".", "_"))
            setattr(gm, name, _fetch(sub, str(sn.target)))
            new = graph.get_attr(name)
            new.meta.update(sn.meta)
        else:
            new = graph.node_copy(sn, lambda n: env[n])
        new.meta[META_REGION] = tag + tuple(sn.meta.get(META_REGION, ()))
        env[sn] = new
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _fetch(root: torch.nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _unique_attr(gm: torch.nn.Module, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
