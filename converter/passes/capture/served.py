"""Which calls a torch.export graph serves: its shape guards, made to say so in one line.

torch.export records the conditions its graph was traced under (``input_ids.size()[1] % 4 == 0``,
``x.size()[2] == 16``) and ``ep.module()`` checks them on every call in a ``_guards_fn`` submodule,
which raises a bare ``AssertionError: Guard failed: ...``. :func:`name_guard_failures` wraps that
check so that a call the graph does not serve raises :class:`ShapeNotServedError` instead: one line
naming the inputs of the call, the sizes the graph was captured for, the condition and the remedy.

The error is also the signal that the call should be captured again: ``conv.module`` of
:func:`converter.convert` and :func:`converter.apply` catch it (the guard runs before any op of the
graph, so nothing ran) and convert the model again for that call's sizes, bounded
(:mod:`converter.inplace`). The ``AssertionError`` base keeps callers that caught torch's working.
"""
from __future__ import annotations

from typing import Any

import torch

from converter.ir.errors import MpconvertError

__all__ = ["ShapeNotServedError", "name_guard_failures", "guard_owner"]


class ShapeNotServedError(MpconvertError, AssertionError):
    """A call of sizes that the converted graph's shape guards do not admit (nothing of the graph ran).

    ``guard``: the condition that failed (torch's text); ``shapes``: the call's tensor shapes by input name;
    ``captured``: the sizes the graph was captured for; ``owner``: the id of the guard module that refused."""

    def __init__(self, message: str, *, guard: str, shapes: dict, captured: dict, owner: int):
        super().__init__(message)
        self.guard, self.shapes, self.captured, self.owner = guard, shapes, captured, owner


def _shape_text(value: Any) -> str:
    return "(" + ", ".join(str(s) for s in value) + ("," if len(value) == 1 else "") + ")"


class _NamedGuards:
    """The ``forward`` of a ``_guards_fn`` module: torch's check, its failure raised as :class:`ShapeNotServedError`."""

    def __init__(self, check: Any, names: list[str], captured: dict[str, tuple], owner: int):
        self.check, self.names, self.captured, self.owner = check, names, captured, owner

    def __call__(self, *args: Any) -> Any:
        try:
            return self.check(*args)
        except AssertionError as exc:
            if isinstance(exc, ShapeNotServedError):
                raise
            guard = str(exc).removeprefix("Guard failed: ").strip() or type(exc).__name__
            shapes = {name: tuple(value.shape) for name, value in zip(self.names, args) if isinstance(value, torch.Tensor)}
            got = ", ".join(f"{name} of shape {_shape_text(s)}" for name, s in shapes.items()) or "these inputs"
            was = ", ".join(f"{name} {_shape_text(s)}" for name, s in self.captured.items() if name in shapes)
            raise ShapeNotServedError(
                f"the converted graph does not serve {got}: it was captured for {was or 'other sizes'} and "
                f"holds only where {guard}; call it through conv.module of converter.convert or converter.apply (both "
                "convert such calls again), or convert with an example of these sizes",
                guard=guard, shapes=shapes, captured=dict(self.captured), owner=self.owner) from None


def name_guard_failures(gm: torch.fx.GraphModule) -> None:
    """Make ``gm``'s ``_guards_fn`` (torch.export's shape guards) raise :class:`ShapeNotServedError`."""
    guards: Any = getattr(gm, "_guards_fn", None)
    check = getattr(guards, "forward", None) if guards is not None else None
    if check is None or isinstance(check, _NamedGuards) or "forward" not in vars(guards):
        return
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    captured = {name: tuple(_example_size(s) for s in v.shape) for name, v in zip(names, values) if isinstance(v, torch.Tensor)}
    guards.forward = _NamedGuards(check, names, captured, id(guards))


def _example_size(size: Any) -> Any:
    """A dim's size in the capture's example (a dynamic dim's hint)."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else str(size)


def guard_owner(gm: torch.nn.Module) -> frozenset:
    """The ids :class:`ShapeNotServedError` carries for refusals by ``gm``'s own guards (its ``_guards_fn``, and the
    eval graph's of a two-mode module); empty when it has none."""
    return frozenset(id(child) for child in gm.children() if isinstance(vars(child).get("forward"), _NamedGuards))
