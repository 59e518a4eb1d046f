"""Verify: the converted graph must run on the example inputs; if it does not, say which node fails.

``convert`` runs this last, so that it never hands back a module whose example forward fails
(a constant the half dtype cannot hold, an op without a half kernel that a rule put in half...).
The forward runs once under ``no_grad``; buffers (BatchNorm statistics), train/eval flags and the
RNG state are restored afterwards. Only when it fails is the graph run again node by node, with an
:class:`torch.fx.Interpreter`, to find the failing node; the error names it, its op, its precision,
the rule behind that precision and its source line, and says how to pin it to fp32.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError
from converter.ir.meta import META_DECISION, META_INFO
from converter.ir.state import preserved_state
from converter.passes.capture.values import placeholder_values

__all__ = ["check_forward", "ForwardCheckError"]


class ForwardCheckError(MpconvertError, RuntimeError):
    """The converted module fails on the example inputs; ``node`` names the failing node (or is None).

    Exit status 1, a check that failed: every conversion checks its example forward, and the message
    names the node, its precision and the rule that decided it, and how to pin it to fp32. Exit 3
    stays for true internal errors."""

    exit_code = EXIT_CHECK_FAILED

    def __init__(self, message: str, *, node: Optional[str] = None):
        super().__init__(message)
        self.node = node


class _Locator(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.failed: Optional[torch.fx.Node] = None

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception:
            if self.failed is None:
                self.failed = n
            raise


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _describe(node: torch.fx.Node) -> str:
    info = node.meta.get(META_INFO)
    decision = node.meta.get(META_DECISION)
    parts = [f"op {info.op}" if info is not None else f"target {node.target}"]
    if decision is not None:
        parts.append(f"{decision.precision} by {decision.rule}")
    if info is not None and info.source:
        parts.append(f"at {info.source}")
    return ", ".join(parts)


def check_forward(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Run ``gm`` on the example inputs; raise :class:`ForwardCheckError` naming the failing node."""
    with preserved_state(gm), torch.no_grad():
        try:
            gm(*args, **kwargs)
            return
        except Exception as exc:  # located below; the message names the node
            error = exc
    locator = _Locator(gm)
    with preserved_state(gm), torch.no_grad():
        try:
            locator.run(*placeholder_values(gm, args, kwargs))
        except Exception as exc:  # the same failure, now with its node
            error = exc
    node = locator.failed
    if node is None:
        raise ForwardCheckError(f"the converted model fails on the example inputs: {_one_line(error)}") from error
    if node.op == "call_function" and "assert" in str(node.target):
        hint = "a tracer assertion that the conversion broke; please report it"
    else:
        hint = f'keep it in fp32: add `{node.name} = "fp32"` under [node] in a rules file (--rules)'
    raise ForwardCheckError(
        f"the converted model fails on the example inputs at node {node.name!r} ({_describe(node)}): "
        f"{_one_line(error)}; {hint}",
        node=node.name,
    ) from error
