"""Decide: give every compute node a precision from the rules, with its provenance.

Writes ``node.meta["mp"]`` (:class:`~converter.meta.Decision`). ``half`` is resolved to the
target dtype here; ``follow`` and ``promote`` are left for :mod:`converter.place`. A node that no
rule matches stays fp32 and is marked ``unmatched`` — never lowered silently.

Constants that half cannot hold: a node whose scalar *value* argument (a ``masked_fill``/``fill``
value, a ``clamp`` bound, an added or multiplied constant, a ``full``/``where`` value) lies beyond
the largest finite number of the half dtype it would run in stays fp32 (rule
``<builtin>:[builtin].constant-range``; the reason names the constant and the dtype). In half,
``masked_fill`` refuses such a value, and the arithmetic ops turn it into ±inf — which changes the
meaning of Hugging Face's ``torch.finfo(torch.float32).min`` masks: a fully masked row gives NaN
instead of a uniform softmax. The tensor such a node produces may hold the constant, so the
``follow``/``promote``/alias nodes that read it stay fp32 too, up to the next node that a rule
fixes (typically the fp32 ``softmax``), instead of casting the constant to ±inf.

In-place accumulation (``out = zeros_like(x); out.index_add_(0, idx, y)``, ``scatter_add_``,
``index_put_``…, :data:`~converter.ir.ops.ACCUMULATE_OPS`): the in-place node shares the precision of
the tensor it mutates, so the op's rule decides that tensor's producer, the *accumulator*, when the
producer is movable (``follow``/``promote``): ``promote`` keeps it in its fp32-model dtype, as autocast
leaves a buffer made from an fp32 tensor (the sums run in fp32, as the out-of-place op would promote
to its widest input); ``half``/``fp32``/… set it. The producer's decision records the in-place node and
its rule (``accumulator of in-place index_add_ 'index_add_' (<rule>): …``); rewrite casts the operands
to the accumulator's dtype.

The user's intent outranks every rule file (:mod:`converter.passes.intent`): a compute node under an
``autocast(enabled=False)`` block, or in a module of ``_keep_in_fp32_modules`` (fp16), is fp32; a
matmul-class node under an enabled ``autocast(dtype=...)`` block runs in that dtype. The decision's
rule is ``[user] autocast region at file.py:LINE`` (or ``[user] _keep_in_fp32_modules of …``) and
its first match is that intent at the ``user`` level. In an enabled autocast region, a rule's ``half``
means the region's dtype (the reason says so). A ``banned`` op is still an error there. Once every
node is decided, the autocast calls of enabled regions leave the graph (their ops' dtypes are now
explicit; :func:`~converter.passes.intent.drop_enabled_autocast`).

``fp8`` (a compute mode of GEMMs, :data:`~converter.rules.loader.FP8_OPS`): a node a rule marks ``fp8``
stores and exchanges bf16 (``precision`` bf16, ``requested`` fp8), so placement and rewrite treat it as a
bf16 node; :mod:`converter.passes.fp8` later runs its GEMMs in float8. A matmul/mm/addmm with the op alias
``weight_matmul`` (an activation times a 2-D weight parameter, :mod:`converter.ir.weight_gemm`) is such a GEMM
too; op rules match a node's alias as well as its op (:meth:`~converter.rules.loader.Rules.matches_for`). A ``module``/``module_type`` rule
``fp8`` reaches only the GEMMs of its scope (the other ops fall through to the next rule); a ``node`` rule
that marks another op ``fp8`` is a :class:`~converter.rules.loader.RulesError`.
"""
from __future__ import annotations

import math
from typing import cast

import torch
import torch.fx

from converter.ir.errors import MpconvertError
from converter.ir.graphmodule import pauses_gc
from converter.ir.meta import (
    BUILTIN,
    META_DECISION,
    META_INFO,
    META_VALUE,
    Decision,
    DecisionPrecision,
    Match,
    RequestedPrecision,
    RuleRef,
    TensorSpec,
    name_of,
)
from converter.ir.ops import ACCUMULATE_OPS
from converter.passes.autograd_fns import autograd_function
from converter.passes.intent import UserIntent, applicable_intent, drop_enabled_autocast, half_in
from converter.rules.loader import FP8_OPS, GEMM_PRECISIONS, Rules, RulesError
from converter.rules.precedence import DEFAULT_LEVEL, PRECEDENCE, SCOPED_LEVELS, USER_LEVEL, rank

__all__ = ["AUTOGRAD_FUNCTION_RULE", "CONSTANT_RANGE_RULE", "VALUE_SCALAR_OPS", "BannedOpError", "decide", "decision_reason", "overflowing_constant"]

#: ops whose scalar arguments are values written to or combined with the tensor (not sizes or dims)
VALUE_SCALAR_OPS = frozenset({
    "masked_fill", "fill", "full", "full_like", "new_full", "scalar_tensor", "index_fill", "where", "clamp",
    "clamp_min", "clamp_max", "clip", "hardtanh", "threshold", "add", "sub", "rsub", "mul", "div", "maximum",
    "minimum", "fmax", "fmin", "lerp", "addcmul", "addcdiv", "nan_to_num",
})
CONSTANT_RANGE_RULE = RuleRef(BUILTIN, "builtin", "constant-range")
#: a custom autograd Function that no op or node rule names runs on fp32 inputs (passes.autograd_fns)
AUTOGRAD_FUNCTION_RULE = RuleRef(BUILTIN, "builtin", "autograd-function")
_HALF_MAX = {"fp16": torch.finfo(torch.float16).max, "bf16": torch.finfo(torch.bfloat16).max}


class BannedOpError(MpconvertError, ValueError):
    """The model uses an op that a rule bans; the message says what to use instead."""


def decision_reason(level: str, pattern: str, file: str, reason: str, scope: str = "") -> str:
    where = f" (via module {scope!r})" if scope and level in SCOPED_LEVELS else ""
    base = f"{level} rule {pattern!r} in {file}{where}"
    return f"{base}: {reason}" if reason else base


def _scalars(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _scalars(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def overflowing_constant(node: torch.fx.Node, op: str, dtype_name: str) -> float | None:
    """The first finite scalar value argument of ``node`` that ``dtype_name`` (fp16/bf16) cannot hold."""
    limit = _HALF_MAX.get(dtype_name)
    if limit is None or op not in VALUE_SCALAR_OPS:
        return None
    for value in _scalars((node.args, tuple(node.kwargs.values()))):
        if math.isfinite(value) and abs(value) > limit:
            return value
    return None


def _keep_for_constant(node: torch.fx.Node, decision: Decision, target: str, tainted: dict) -> Decision:
    """Keep ``node`` in fp32 when it holds, or reads a tensor that may hold, a constant the half dtype
    it would run in cannot represent; records in ``tainted`` the nodes whose output may hold one."""
    movable = decision.requested in ("follow", "promote")
    runs_in = decision.precision if decision.precision in _HALF_MAX else (target if movable else None)
    value = overflowing_constant(node, node.meta[META_INFO].op, runs_in or target)
    if value is not None:
        tainted[node] = f"{node.name!r} holds the constant {value:.6g}"
        if runs_in is None:  # fp32 or a dtype the model fixes: unchanged, but its output carries the constant
            return decision
        sign = "-" if value < 0 else "+"
        return decision.replace(precision="fp32", requested="fp32", rule=CONSTANT_RANGE_RULE, reason=(
            f"the constant {value:.6g} does not fit in {runs_in} (largest finite {_HALF_MAX[runs_in]:.6g}): kept in "
            f"fp32 (in {runs_in} it fails or becomes {sign}inf)"))
    source = next((tainted[a] for a in node.all_input_nodes if a in tainted), None)
    if source is None:
        return decision
    if decision.requested == "alias":  # shares its producer's precision; carries the constant on
        if node.args and node.args[0] in tainted:
            tainted[node] = source
        return decision
    if not movable:
        return decision
    tainted[node] = source
    return decision.replace(precision="fp32", requested="fp32", rule=CONSTANT_RANGE_RULE, reason=(
        f"reads a tensor that may hold a constant beyond {target}'s range ({source}): kept in fp32 rather than "
        f"cast to {target}, where it would become inf"))


@pauses_gc
def decide(gm: torch.fx.GraphModule, rules: Rules, *, precision: str) -> None:
    """Annotate every call node of ``gm`` with a :class:`Decision` (see module docstring)."""
    tainted: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        region = half_in(node)  # an enabled autocast region: a rule's half is its dtype
        half = cast(str, region.half) if region is not None else precision  # an autocast region has its dtype
        _decide_node(node, rules, precision, half)
        if META_DECISION in node.meta:
            node.meta[META_DECISION] = _keep_for_constant(node, node.meta[META_DECISION], half, tainted)
        info = node.meta.get(META_INFO)
        if info is not None and info.inplace and info.kind == "alias" and info.op in ACCUMULATE_OPS:
            _decide_accumulator(node, half)
    drop_enabled_autocast(gm)  # its ops are decided now: no live autocast re-decides them at run time


def _resolved(requested: str, target: str) -> str:
    """A rule's precision as a node's: ``half`` is the target dtype; tf32 is fp32 storage (placement and
    rewrite treat it as fp32; fp32_math scopes its math); the others as they are."""
    if requested in GEMM_PRECISIONS:  # fp8: a GEMM compute mode; storage and IO stay bf16
        return "bf16"
    return target if requested == "half" else "fp32" if requested == "tf32" else requested


def _gemm_matches(matches: tuple[Match, ...], op: str, node: str, alias: str = "") -> tuple[Match, ...]:
    """``matches`` without the scoped fp8 rules that do not reach ``op`` (a non-GEMM; ``alias``: the node's op
    alias, ``weight_matmul`` makes a matmul/mm/addmm an fp8 GEMM); an unscoped fp8 rule (node, op) on a
    non-GEMM is an error (the loader already refuses op patterns)."""
    if op in FP8_OPS or alias in FP8_OPS or not any(m.precision in GEMM_PRECISIONS for m in matches):
        return matches
    kept = tuple(m for m in matches if not (m.precision in GEMM_PRECISIONS and m.level_name in SCOPED_LEVELS))
    if kept and kept[0].precision in GEMM_PRECISIONS:
        raise RulesError(f"{kept[0].rule}: marks node {node!r} fp8, but its op {op!r} is not an fp8 GEMM "
                         f"({', '.join(sorted(FP8_OPS))}); mark it half, bf16 or fp32 instead")
    return kept


def _decide_accumulator(node: torch.fx.Node, target: str) -> None:
    """The in-place accumulation ``node``'s rule decides the producer of the tensor it mutates (see
    the module docstring); ``node`` itself records that rule."""
    from converter.passes.place.graph import alias_root

    decision: Decision = node.meta[META_DECISION]
    win = decision.matches[0] if decision.matches else None
    if win is None or win.precision in ("follow", "alias", "banned"):
        return
    root = alias_root(node)
    spec = root.meta.get(META_VALUE)
    rooted: Decision | None = root.meta.get(META_DECISION)
    if rooted is None or not isinstance(spec, TensorSpec) or not spec.dtype.is_floating_point:
        return
    if win.precision == "promote":
        want, how = name_of(spec.dtype), f"kept in {name_of(spec.dtype)}, its dtype in the fp32 model"
    else:
        want = _resolved(win.precision, target)
        how = f"set to {want}"
    rule_text = decision_reason(win.level_name, win.rule.pattern, win.rule.file, win.reason, win.scope)
    op = f"{node.meta[META_INFO].op}_"
    node.meta[META_DECISION] = decision.replace(
        rule=win.rule, reason=f"in-place {op}: accumulates into {root.name!r} and runs in its dtype; {rule_text}")
    if rooted.requested not in ("follow", "promote") or rooted.precision == want:
        return  # the accumulator's own rule fixes it (or it already is): rewrite casts the operands to it
    root.meta[META_DECISION] = rooted.replace(
        precision=want, requested=want, rule=win.rule,
        reason=f"accumulator of in-place {op} {node.name!r} ({rule_text}): {how}")


def _decide_node(node: torch.fx.Node, rules: Rules, precision: str, half: str) -> None:
    """Decide one node; ``precision``: the conversion's target, ``half``: what a rule's ``half`` means here."""
    info = node.meta.get(META_INFO)
    if info is None or node.op in ("placeholder", "get_attr", "output") or info.kind == "passive":
        return
    matches = _gemm_matches(tuple(rules.matches_for(node=node.name, op=info.op, module_stack=info.module_stack,
                                                    alias=info.op_alias)), info.op, node.name, info.op_alias)
    if info.kind == "fixed":
        node.meta[META_DECISION] = Decision(
            precision=cast(DecisionPrecision, name_of(info.fixed_dtype)),
            requested="fixed",
            rule=RuleRef(BUILTIN, "builtin", "fixed-dtype"),
            reason=info.why,
            matches=matches,
        )
        return
    if info.kind == "alias":
        node.meta[META_DECISION] = Decision(
            precision="alias",
            requested="alias",
            rule=RuleRef(BUILTIN, "builtin", "alias"),
            reason=info.why,
            matches=matches,
        )
        return
    intent = applicable_intent(node, info.op, precision)
    function = autograd_function(node)
    if function is not None and intent is None and not any(m.level_name in (PRECEDENCE[0], "op") for m in matches):
        node.meta[META_DECISION] = Decision(
            precision="fp32",
            requested="fp32",
            rule=AUTOGRAD_FUNCTION_RULE,
            reason=(f"custom autograd Function {function.__qualname__} (user code mpconvert cannot see into, "
                    f"backward included): runs on fp32 inputs; an [op] rule {function.__name__!r} sets it"),
            matches=matches,
        )
        return
    if not matches and intent is None:
        node.meta[META_DECISION] = Decision(
            precision="fp32",
            requested="fp32",
            rule=RuleRef(BUILTIN, "default"),
            reason=f"no rule matches op {info.op!r}: kept in fp32 (never lowered silently)",
            unmatched=True,
        )
        return
    win = matches[0] if matches else None
    ban = next((m for m in matches if m.precision == "banned"), None)
    if ban is not None and win is not None and (win.level_name != PRECEDENCE[0] or win.precision == "banned"):  # a node rule may lift a ban
        message = rules.rule_for(ban).message
        raise BannedOpError(f"node {node.name!r} (op {info.op}) is banned by {ban.rule}: {message}")
    if intent is not None:  # the user's intent in the model code outranks every rule file
        user = Match(rule=intent.rule, precision=cast(RequestedPrecision, intent.precision), level=rank(USER_LEVEL), level_name=USER_LEVEL,
                     reason=intent.reason)
        node.meta[META_DECISION] = Decision(
            precision=cast(DecisionPrecision, intent.precision), requested=user.precision, rule=intent.rule,
            reason=f"{USER_LEVEL} intent [{intent.label}]: {intent.reason}", matches=(user, *matches))
        return
    assert win is not None  # no matches and no intent returned above
    resolved = _resolved(win.precision, half)
    reason = decision_reason(win.level_name, win.rule.pattern, win.rule.file, win.reason, win.scope)
    if win.level_name == DEFAULT_LEVEL:
        reason = f"no rule matches op {info.op!r}: {win.rule.file} default is {win.precision}"
    if win.precision == "half" and half != precision:
        reason += f"; half is {half} here, the dtype of the [user] {cast(UserIntent, half_in(node)).label}"
    node.meta[META_DECISION] = Decision(
        precision=cast(DecisionPrecision, resolved),
        requested=win.precision,
        rule=win.rule,
        reason=reason,
        matches=matches,
        unmatched=win.level_name == DEFAULT_LEVEL,
    )
