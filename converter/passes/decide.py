"""Decide: give every compute node a precision from the rules, with its provenance.

Writes ``node.meta["mp"]`` (:class:`~converter.meta.Decision`). ``half`` is resolved to the
target dtype here; ``follow`` and ``promote`` are left for :mod:`converter.place`. A node that no
rule matches stays fp32 and is marked ``unmatched`` — never lowered silently.
"""
from __future__ import annotations

import torch.fx

from converter.ir.graphmodule import pauses_gc
from converter.ir.meta import BUILTIN, Decision, RuleRef, name_of
from converter.rules.loader import Rules
from converter.rules.precedence import DEFAULT_LEVEL, PRECEDENCE, SCOPED_LEVELS
from converter.ir.meta import META_DECISION, META_INFO
from converter.ir.errors import MpconvertError

__all__ = ["decide", "BannedOpError", "decision_reason"]


class BannedOpError(MpconvertError, ValueError):
    """The model uses an op that a rule bans; the message says what to use instead."""


def decision_reason(level: str, pattern: str, file: str, reason: str, scope: str = "") -> str:
    where = f" (via module {scope!r})" if scope and level in SCOPED_LEVELS else ""
    base = f"{level} rule {pattern!r} in {file}{where}"
    return f"{base}: {reason}" if reason else base


@pauses_gc
def decide(gm: torch.fx.GraphModule, rules: Rules, *, precision: str) -> None:
    """Annotate every call node of ``gm`` with a :class:`Decision` (see module docstring)."""
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is None or node.op in ("placeholder", "get_attr", "output") or info.kind == "passive":
            continue
        matches = tuple(rules.matches_for(node=node.name, op=info.op, module_stack=info.module_stack))
        if info.kind == "fixed":
            node.meta[META_DECISION] = Decision(
                precision=name_of(info.fixed_dtype),
                requested="fixed",
                rule=RuleRef(BUILTIN, "builtin", "fixed-dtype"),
                reason=info.why,
                matches=matches,
            )
            continue
        if info.kind == "alias":
            node.meta[META_DECISION] = Decision(
                precision="alias",
                requested="alias",
                rule=RuleRef(BUILTIN, "builtin", "alias"),
                reason=info.why,
                matches=matches,
            )
            continue
        if not matches:
            node.meta[META_DECISION] = Decision(
                precision="fp32",
                requested="fp32",
                rule=RuleRef(BUILTIN, "default"),
                reason=f"no rule matches op {info.op!r}: kept in fp32 (never lowered silently)",
                unmatched=True,
            )
            continue
        win = matches[0]
        ban = next((m for m in matches if m.precision == "banned"), None)
        if ban is not None and (win.level_name != PRECEDENCE[0] or win.precision == "banned"):  # a node rule may lift a ban
            message = rules.rule_for(ban).message
            raise BannedOpError(f"node {node.name!r} (op {info.op}) is banned by {ban.rule}: {message}")
        # tf32 is fp32 storage (placement and rewrite treat it as fp32); fp32_math scopes its math
        resolved = precision if win.precision == "half" else "fp32" if win.precision == "tf32" else win.precision
        reason = decision_reason(win.level_name, win.rule.pattern, win.rule.file, win.reason, win.scope)
        if win.level_name == DEFAULT_LEVEL:
            reason = f"no rule matches op {info.op!r}: {win.rule.file} default is {win.precision}"
        node.meta[META_DECISION] = Decision(
            precision=resolved,
            requested=win.precision,
            rule=win.rule,
            reason=reason,
            matches=matches,
            unmatched=win.level_name == DEFAULT_LEVEL,
        )
