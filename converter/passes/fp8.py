"""The fp8 stage: linear nodes the rules decided ``fp8`` run their three GEMMs in float8.

**Precision fp8** is three things layered (docs/rules.md, "FP8"):

1. the rules: ``default.toml``, then the built-in ``rules/fp8.toml``, then the user's files
   (:func:`fp8_rule_set`), decided with ``half`` = bf16;
2. decide, then the gates right after it (:func:`gate_fp8`: the pattern check and the shape gates below,
   before placement, so the casts around a gated linear name the gate), then lower, place and rewrite as
   for bf16: a node decided ``fp8`` has ``precision`` bf16 and ``requested`` fp8
   (:mod:`converter.passes.decide`), so placement treats it as a bf16 node and its casts are bf16 casts;
3. this stage, right after rewrite (:func:`apply_fp8`): each linear still ``requested`` fp8 becomes a call
   of :func:`converter.fp8.kernels.fp8_linear` with the recipe, on the bf16 operands rewrite prepared, so
   forward, grad_input and grad_weight are each one ``torch._scaled_mm`` (``tensorwise``/``rowwise``).

The pipeline (``converter.api``) wires it as: for ``precision="fp8"``, rules = :func:`fp8_rule_set` of the
user's rules, target bf16, the recipe named once by :func:`resolved_recipe`; ``gate_fp8(gm, rules, recipe)``
after decide; ``apply_fp8(gm, recipe)`` after rewrite; :func:`check_patterns` once over every graph (a
pattern may match only the eval graph of a two-mode conversion). ``convert(precision="fp8")`` (or ``fp8_recipe=``) runs it.

The conversion runs after rewrite, not inside it, because rewrite reads only precisions and an fp8 node's
precision *is* bf16: the stage changes which kernel a bf16 node calls, not a dtype, and keeps rewrite
ignorant of recipes. It runs before simplify, which then sees an ordinary call.

**Weight GEMMs**: a matmul/mm/addmm with the op alias ``weight_matmul`` (an activation times a 2-D weight
parameter, :mod:`converter.ir.weight_gemm`: Falcon's ``x @ W.T``, GPT-2's Conv1D ``addmm(b, x, W)``) is an fp8
candidate exactly like a linear (``rules/fp8.toml``'s ``[op].weight_matmul``): the gates count it with the
linears, in graph order, and the stage calls ``fp8_linear(x, W, b, recipe)`` with ``W`` a ``t`` view
(:func:`_weight_view`) of its (K, N) weight operand, so autograd returns the weight gradient in the parameter's
own shape. The node keeps its canonical op; :func:`keep_bf16` turns it into a bf16 linear on the same view.

**Gates** (``[settings]`` of the rule files; the deciding rule of a gated node is
``file:[settings].key``, its reason names the size and the fp8 rule it overrode): ``fp8_keep_first`` and
``fp8_keep_last`` (the first and the last linear or weight GEMM of the graph, in graph order: the layer that reads the
embeddings and the output layer), ``fp8_align`` (in_features and out_features multiples of it; CUDA
``_scaled_mm`` needs 16 and the kernels never pad K or N; the token count is free: the grad_weight GEMM
zero-pads it), ``fp8_min_flops_per_token`` (2·K·N below it: the casts cost more than the faster GEMM
saves). A gated node keeps its bf16 linear and has ``requested`` bf16.

**Fallback** (with calibration, :mod:`converter.numerics.fp8_layers`): a layer whose measured SQNR of
a GEMM is under its floor (:func:`fp8_floors`: the settings ``fp8_min_sqnr_output``, ``fp8_min_sqnr_grad_input``,
``fp8_min_sqnr_grad_weight``) goes back to a plain bf16 linear call (:func:`keep_bf16`) with that setting as
its rule and the measured dB in its reason.

**Patterns that match nothing** are an error (:class:`Fp8PatternError`, exit 2): every ``node``,
``module`` and ``module_type`` pattern of a user's rule file (not a built-in one, whose patterns are generic)
must match at least one node of the graph. An exclusion that matches nothing silently leaves the layer in
fp8: torchtitan's float8 filter once quantised the LM head that way.
"""
from __future__ import annotations

import difflib
import functools
from pathlib import Path
from typing import Any, Iterable, Optional, Union, cast

import torch
import torch.fx
import torch.nn.functional as F

from converter.fp8.kernels import RECIPES, fp8_linear, misaligned_dims, resolve_recipe
from converter.ir.meta import (
    BUILTIN,
    META_CHECKPOINT,
    META_DECISION,
    META_INFO,
    META_VALUE,
    Decision,
    NodeInfo,
    RuleRef,
    TensorSpec,
)
from converter.ir.ops import WEIGHT_MATMUL
from converter.ir.weight_gemm import gemm_operands
from converter.rules.loader import GEMM_PRECISIONS, Rule, Rules, RulesError, default_rules_path, load_rules, rules_dir
from converter.rules.precedence import MATCH_TABLES

__all__ = ["FP8_RULES", "DEFAULT_RECIPE", "UNSUPPORTED_RULE", "MIN_SQNR_SETTINGS", "DEFAULT_MIN_SQNR", "Fp8PatternError",
           "fp8_rule_set", "check_patterns", "gate_fp8", "apply_fp8", "resolved_recipe", "fp8_floors", "keep_bf16"]

#: the built-in rule file that precision fp8 layers over default.toml, under the user's files
FP8_RULES = "fp8"
#: the recipe when neither the caller nor a rule file's ``fp8_recipe`` names one
DEFAULT_RECIPE = "tensorwise"
#: the call targets of a linear node the stage can rewrite (FX: F.linear; torch.export: aten.linear)
_LINEAR_TARGETS = (F.linear, torch.ops.aten.linear.default)
#: the deciding rule of an fp8 node the stage cannot run in fp8 (not a plain linear call, no 2-D weight)
UNSUPPORTED_RULE = RuleRef(BUILTIN, "builtin", "fp8-unsupported")
#: the rule tables whose patterns must match a node of the model
_NAMED_LEVELS = tuple(level for level in MATCH_TABLES if level != "op")
_WHAT: dict[str, str] = dict(zip(_NAMED_LEVELS, ("node name", "module path", "module class")))
#: the ``[settings]`` key of each GEMM's SQNR floor (the fp8 fallback with calibration)
MIN_SQNR_SETTINGS = {"output": "fp8_min_sqnr_output", "grad_input": "fp8_min_sqnr_grad_input",
                     "grad_weight": "fp8_min_sqnr_grad_weight"}
#: the floors (dB) when no rule file sets them: torchao's float8 test floors (rules/fp8.toml says why)
DEFAULT_MIN_SQNR = {"output": 18.0, "grad_input": 17.0, "grad_weight": 17.0}


class Fp8PatternError(RulesError):
    """A pattern of a user's rule file matches no node of the model (an fp8 exclusion would be silent)."""


def fp8_rule_set(rules: Union[None, str, Path, Iterable[Union[str, Path]], Rules] = None) -> Rules:
    """The rules of precision fp8: default.toml, ``rules/fp8.toml``, then ``rules`` (the user's files, on top).

    A :class:`Rules` object is taken as it is (the caller layered it) when it has an fp8 rule; otherwise its
    rules but default.toml's are layered over default.toml and ``fp8.toml``.
    """
    if isinstance(rules, Rules):
        if any(rule.precision in GEMM_PRECISIONS for rule in rules.rules):
            return rules
        default = default_rules_path().name
        own = Rules(tuple(r for r in rules.rules if r.file != default), tuple(f for f in rules.files if f != default),
                    rules.settings, rules.setting_files)
        return load_rules([FP8_RULES]) + own
    items = [] if rules is None else [rules] if isinstance(rules, (str, Path)) else list(rules)
    return load_rules([FP8_RULES, *items])


def _is_builtin(file: str) -> bool:
    """A built-in rule file's label is its bare name in the rules directory (``Rules.from_file``)."""
    return file == BUILTIN or (Path(file).name == file and file.endswith(".toml") and (rules_dir() / file).is_file())


def _names(graphs: Iterable[torch.fx.Graph]) -> dict[str, set[str]]:
    """What the patterns of each named table could match: node names, module paths, module classes."""
    found: dict[str, set[str]] = {level: set() for level in _NAMED_LEVELS}
    for graph in graphs:
        for node in graph.nodes:
            found["node"].add(node.name)
            info = node.meta.get(META_INFO)
            for path, cls in getattr(info, "module_stack", ()) or ():
                found["module"].add(path)
                found["module_type"].add(cls)
    return found


def check_patterns(rules: Rules, graphs: Iterable[torch.fx.Graph]) -> None:
    """Raise :class:`Fp8PatternError` for the first node/module/module_type pattern of a user's rule file
    that matched no node of ``graphs`` (decided graphs: the matches are read from each decision)."""
    graphs = list(graphs)
    matched = set()
    for graph in graphs:
        for node in graph.nodes:
            decision: Optional[Decision] = node.meta.get(META_DECISION)
            if decision is not None:
                matched.add(decision.rule)
                matched.update(m.rule for m in decision.matches)
    # a module rule with an ``ops`` table is several Rule objects under one pattern: it matched if any of them did
    hit = {(ref.file, ref.table, ref.pattern.split(".ops.")[0]) for ref in matched}
    unmatched: list[Rule] = [rule for rule in rules.rules if rule.level in _NAMED_LEVELS and not _is_builtin(rule.file)
                             and (rule.file, rule.level, rule.pattern) not in hit]
    if not unmatched:
        return
    rule = unmatched[0]
    names = sorted(_names(graphs)[rule.level])
    close = difflib.get_close_matches(rule.pattern, names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    what = _WHAT[rule.level]
    raise Fp8PatternError(
        f"{rule.file}: [{rule.level}].{rule.pattern}: the pattern matches no {what} of the model{hint} (a rule that "
        "matches nothing would silently leave those layers in fp8, as torchtitan's LM head was); fix or remove it")


def _tensor_of(gm: torch.fx.GraphModule, node: Any) -> Optional[torch.Tensor]:
    """The parameter/buffer behind ``node`` (through rewrite's ``.to`` casts), or None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == "to":
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    try:
        return cast(Optional[torch.Tensor], functools.reduce(getattr, str(node.target).split("."), gm))
    except AttributeError:
        return None


def _is_weight_gemm(node: torch.fx.Node) -> bool:
    """A matmul/mm/addmm of an activation and a 2-D weight parameter (capture's op alias ``weight_matmul``),
    still calling its GEMM (not yet an ``fp8_linear`` call, nor one :func:`keep_bf16` turned into a linear)."""
    return (getattr(node.meta.get(META_INFO), "op_alias", "") == WEIGHT_MATMUL and node.target is not fp8_linear
            and node.target not in _LINEAR_TARGETS)


def _operands(node: torch.fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of a linear call; of a weight GEMM, (input, its (K, N) weight operand, bias)."""
    if _is_weight_gemm(node):
        return gemm_operands(node, node.meta[META_INFO].op)
    args = list(node.args) + [None] * (3 - len(node.args))
    bias = node.kwargs.get("bias", args[2])
    return node.kwargs.get("input", args[0]), node.kwargs.get("weight", args[1]), bias


def _weight_shape(node: torch.fx.Node, gm: torch.fx.GraphModule) -> Optional[tuple[int, int]]:
    """(N, K) of the linear ``node`` computes (out_features, in_features), or None when the stage cannot see
    a 2-D weight parameter. A weight GEMM's weight operand is (K, N), its shape propagated by capture."""
    if _is_weight_gemm(node):
        spec = _operands(node)[1].meta.get(META_VALUE)
        return (int(spec.shape[1]), int(spec.shape[0])) if isinstance(spec, TensorSpec) and len(spec.shape) == 2 else None
    if node.target not in _LINEAR_TARGETS:
        return None
    weight = _tensor_of(gm, _operands(node)[1])
    return (int(weight.shape[0]), int(weight.shape[1])) if weight is not None and weight.dim() == 2 else None


def _gate(node: torch.fx.Node, gm: torch.fx.GraphModule, rules: Rules, recipe: str, position: str) -> Optional[tuple[str, str]]:
    """``(setting, why)`` when a gate keeps ``node`` bf16; None when it runs fp8."""
    if position and rules.setting(f"fp8_keep_{position}", True):
        what = "first linear or weight GEMM of the graph (it reads the embeddings)" if position == "first" else (
            "last linear or weight GEMM of the graph (the output layer: its logits feed the loss)")
        return f"fp8_keep_{position}", what
    if node.target not in _LINEAR_TARGETS and not _is_weight_gemm(node):
        return "", f"a linear call the fp8 stage cannot rewrite ({node.target})"
    shape = _weight_shape(node, gm)
    if shape is None:
        return "", "its weight is not a 2-D parameter the stage can see"
    n, k = shape
    align = int(rules.setting("fp8_align", 16))
    bad = [(name, size) for name, size in (("K", k), ("N", n)) if size % align] or misaligned_dims(k, n, recipe)
    if bad:
        dims = ", ".join(f"{name}={size}" for name, size in bad)
        return "fp8_align", f"{dims} not a multiple of {align} (scaled GEMMs never pad in_features or out_features)"
    floor = int(rules.setting("fp8_min_flops_per_token", 0))
    if 2 * k * n < floor:
        return "fp8_min_flops_per_token", f"2·K·N = {2 * k * n} FLOPs per token (K={k}, N={n}) is below {floor}"
    return None


def resolved_recipe(rules: Rules, recipe: Optional[str]) -> str:
    """The recipe's name: ``recipe``, else the rule files' ``fp8_recipe`` setting, else :data:`DEFAULT_RECIPE`."""
    return resolve_recipe(recipe or rules.setting("fp8_recipe", DEFAULT_RECIPE)).name


def _linears(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The decided linear nodes and weight GEMMs (op alias ``weight_matmul``) of ``gm`` in graph order."""
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and META_DECISION in n.meta
            and ((getattr(n.meta.get(META_INFO), "op", None) == "linear" and n.op == "call_function") or _is_weight_gemm(n))]


def _weight_view(gm: torch.fx.GraphModule, node: torch.fx.Node, weight: torch.fx.Node) -> torch.fx.Node:
    """A ``t`` node before ``node``: the (N, K) view of a weight GEMM's (K, N) weight operand, what
    ``fp8_linear`` takes (autograd returns its gradient through the view, in the parameter's own shape)."""
    aten = isinstance(node.target, torch._ops.OpOverload)
    with gm.graph.inserting_before(node):
        view = gm.graph.create_node("call_function", torch.ops.aten.t.default if aten else torch.t, (weight,),
                                    name=f"{node.name}_weight_nk")
    spec = weight.meta[META_VALUE]
    out = TensorSpec((spec.shape[1], spec.shape[0]), spec.dtype)
    info: NodeInfo = node.meta[META_INFO]
    view.meta[META_VALUE] = out
    view.meta[META_INFO] = NodeInfo(op="t", module=info.module, module_type=info.module_type, module_stack=info.module_stack,
                                    source=info.source, kind="compute", outputs=(out,))
    decision: Decision = node.meta[META_DECISION]
    view.meta[META_DECISION] = Decision(
        precision=decision.precision, requested="follow", rule=decision.rule,
        reason=f"the (N, K) view of weight GEMM {node.name!r}'s (K, N) weight operand: fp8_linear takes a linear's weight")
    if META_CHECKPOINT in node.meta:
        view.meta[META_CHECKPOINT] = node.meta[META_CHECKPOINT]
    return view


def gate_fp8(gm: torch.fx.GraphModule, rules: Rules, recipe: str) -> list[str]:
    """The fp8 gates on a decided graph, before placement (so the casts around a gated linear name the gate);
    returns the names of the gated nodes. Touches only nodes still ``requested`` fp8. ``recipe``: a name of
    ``converter.fp8.kernels.RECIPES`` (:func:`resolved_recipe`)."""
    linears = _linears(gm)
    gated: list[str] = []
    for index, node in enumerate(linears):
        decision: Decision = node.meta[META_DECISION]
        if decision.requested not in GEMM_PRECISIONS:
            continue
        position = "first" if index == 0 else "last" if index == len(linears) - 1 else ""
        found = _gate(node, gm, rules, recipe, position)
        if found is None:
            continue
        setting, why = found
        shown = f"{setting} = {rules.setting(setting)!r}: " if setting else ""
        node.meta[META_DECISION] = decision.replace(
            requested="bf16", rule=rules.setting_ref(setting) if setting else UNSUPPORTED_RULE,
            reason=f"fp8 gate {shown}{why}: kept bf16 (the fp8 rule was {decision.rule})")
        gated.append(node.name)
    return gated


def apply_fp8(gm: torch.fx.GraphModule, recipe: str) -> list[str]:
    """The fp8 stage on a rewritten graph (module docstring): each linear still ``requested`` fp8 after
    :func:`gate_fp8` becomes an ``fp8_linear`` call on its bf16 operands; returns their names. ``recipe``:
    a name of ``converter.fp8.kernels.RECIPES`` (:func:`resolved_recipe`)."""
    calls = RECIPES[recipe].scaled_mm_calls
    done: list[str] = []
    for node in _linears(gm):
        decision: Decision = node.meta[META_DECISION]
        if decision.requested not in GEMM_PRECISIONS:
            continue
        x, weight, bias = _operands(node)
        was = ""
        if _is_weight_gemm(node):
            weight, was = _weight_view(gm, node, weight), f" in place of its {node.meta[META_INFO].op}"
        node.op, node.target, node.args, node.kwargs = "call_function", fp8_linear, (x, weight, bias, recipe), {}
        node.meta[META_DECISION] = decision.replace(
            reason=f"{decision.reason}; runs fp8_linear{was} (recipe {recipe}: {calls} torch._scaled_mm per training "
                   "step), bf16 in and out")
        done.append(node.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def fp8_floors(rules: Rules) -> dict[str, tuple[float, RuleRef]]:
    """GEMM -> (SQNR floor in dB, the setting's provenance) for the fp8 fallback (:data:`MIN_SQNR_SETTINGS`)."""
    return {gemm: (float(rules.setting(key, DEFAULT_MIN_SQNR[gemm])), rules.setting_ref(key))
            for gemm, key in MIN_SQNR_SETTINGS.items()}


def keep_bf16(gm: torch.fx.GraphModule, kept: dict[str, tuple[RuleRef, str]], *, aten: bool) -> list[str]:
    """Turn the ``fp8_linear`` calls named in ``kept`` (node -> (rule, reason)) back into bf16 linear calls
    (``aten.linear`` in a torch.export graph, ``aten=True``; else ``F.linear``) on the same bf16 operands, each
    decision ``requested`` bf16 with that rule and reason; returns the names changed, in graph order."""
    target = torch.ops.aten.linear.default if aten else F.linear
    done: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not fp8_linear or node.name not in kept:
            continue
        rule, reason = kept[node.name]
        x, weight, bias = node.args[:3]
        node.target, node.args, node.kwargs = target, (x, weight) if bias is None else (x, weight, bias), {}
        node.meta[META_DECISION] = node.meta[META_DECISION].replace(requested="bf16", rule=rule, reason=reason)
        done.append(node.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
