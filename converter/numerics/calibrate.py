"""Calibrate: measure per-node value ranges on real inputs and re-decide nodes that would overflow.

Runs after *decide* and *place* and before *rewrite*, on the still-fp32 graph::

    capture ─► decide ─► place ─► calibrate ─► rewrite ─► report
                          ▲          │ re-decides overflowing fp16 nodes,
                          └──────────┘ then re-runs placement for their neighbours

1. **Statistics** (:func:`converter.numerics.stats.collect_statistics`): forward and gradient range
   statistics of every node on the calibration batches, as ``node.meta["mp_stats"]``.
2. **Overflow fallback** (:func:`redecide_overflow`). For an fp16 conversion, a node that runs in
   fp16 and whose output or a floating input it casts has ``absmax × margin > 65504`` (the
   largest *finite* value: an inf already in fp32, like an attention mask, stays inf) is
   re-decided to the rules setting ``overflow_fallback`` (``bf16`` by default: the range of
   fp32 at half the bytes; ``fp32`` for the most conservative choice). Placement is then re-run
   so that ``follow`` neighbours are consistent; a neighbour whose own values also overflow is
   re-decided in turn (to a fixed point).
3. **Report data** in ``gm.meta["mp_calibration"]`` (a plain dict, for report.json's
   ``"calibration"`` section): the risky nodes with their evidence, the gradient underflow risk
   and a recommended initial loss scale.
4. **Accuracy search** (:mod:`converter.numerics.search`) when a ``tolerance`` is given.

The options are one :class:`~converter.numerics.options.CalibrationOptions`.

Why the margin defaults to 2 (one binade of headroom): calibration sees a finite sample, and a
value only twice the largest one seen already overflows; half rounding of the inputs and a
different summation order in the half kernels move the result slightly; and the activations of
a model in training grow as the weights move. Larger margins fall back more eagerly. Set it per
rule file with ``[settings] overflow_margin``, or per call with ``CalibrationOptions(margin=...)``.
"""
from __future__ import annotations

import math
import time
from typing import Any, Iterable, Mapping, Optional, cast

import torch
import torch.fx

from converter.ir.meta import (
    GM_CALIBRATION,
    GM_READ_CASTS,
    HALF_NAMES,
    META_DECISION,
    META_INFO,
    META_STATS,
    Decision,
    Match,
    RequestedPrecision,
    RuleRef,
)
from converter.numerics.common import json_float
from converter.numerics.options import CalibrationOptions
from converter.numerics.ranges import FP16_MAX
from converter.numerics.redecide import PlaceSettings, fresh_decisions, replace_decisions, setting_source
from converter.numerics.search import ToleranceNotMet, accuracy_search
from converter.numerics.stats import Calibration, NodeStats, collect_statistics
from converter.passes.place.stage import castable_inputs
from converter.rules.loader import Rules
from converter.rules.precedence import OVERRIDE_LEVEL, rank

__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_FALLBACK",
    "MAX_LOSS_SCALE",
    "ToleranceNotMet",
    "calibrate_and_redecide",
    "redecide_overflow",
    "recommend_loss_scale",
]

DEFAULT_MARGIN = 2.0
DEFAULT_FALLBACK = "bf16"
MAX_LOSS_SCALE = 2.0**24  # LossScaler's default max_scale


# ---------------------------------------------------------------------------------------------
# re-deciding

def _overflow_evidence(node: torch.fx.Node, margin: float) -> Optional[tuple[str, float, str]]:
    """(what, absmax, source) for the largest finite value of ``node`` that would overflow fp16, else None.

    Values already infinite in fp32 (an attention mask's -inf) are not an overflow: fp16 has inf too.
    """
    limit = FP16_MAX / margin
    stats: Optional[NodeStats] = node.meta.get(META_STATS)
    worst = None
    if stats is not None and stats.forward.absmax_finite > limit:
        worst = ("output", stats.forward.absmax_finite, node.name)
    for producer in castable_inputs(node):
        ps: Optional[NodeStats] = producer.meta.get(META_STATS)
        if ps is not None and ps.forward.absmax_finite > limit and (worst is None or ps.forward.absmax_finite > worst[1]):
            worst = ("input", ps.forward.absmax_finite, producer.name)
    return worst


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _fallback_decision(node: torch.fx.Node, decision: Decision, evidence: tuple[str, float, str], ref: RuleRef, *,
                       margin: float, fallback: str) -> tuple[Decision, dict]:
    """The re-decision of an fp16 ``node`` that would overflow, and its row for the report."""
    what, absmax, src = evidence
    info = node.meta[META_INFO]
    value = "absmax" if what == "output" else f"input {src!r} absmax"
    reason = (
        f"calibration: {value} {_fmt(absmax)} × margin {margin:g} > fp16 max 65504 → {fallback} "
        f"(was fp16 by {decision.rule}: {decision.full_reason})"
    )
    match = Match(rule=ref, precision=cast(RequestedPrecision, fallback), level=rank(OVERRIDE_LEVEL), level_name=OVERRIDE_LEVEL, reason=reason)
    new = decision.replace(precision=fallback, requested=fallback, rule=ref, reason=reason,
                           matches=(match,) + tuple(decision.matches), unmatched=False, notes=())
    stats: NodeStats = node.meta[META_STATS]
    row = {
        "name": node.name,
        "op": info.op,
        "module": info.module,
        "evidence": what,
        "source": src,
        "absmax": json_float(absmax),
        "output_absmax": json_float(stats.forward.absmax_finite),
        "frac_over_fp16": stats.forward.frac_over_fp16,
        "grad_absmax": json_float(stats.grad.absmax) if stats.grad is not None else None,
        "was": decision.precision,
        "precision": fallback,
        "rule": str(ref),
        "reason": reason,
    }
    return new, row


def redecide_overflow(
    gm: torch.fx.GraphModule,
    *,
    rules: Rules,
    settings: PlaceSettings,
    margin: float,
    fallback: str,
    fresh: Optional[Mapping[str, Decision]] = None,
) -> list[dict]:
    """Re-decide every fp16 node that would overflow to ``fallback``; returns the risky-node rows.

    Iterates to a fixed point: after placement re-runs (with ``settings``), a ``follow`` neighbour
    that placement put in fp16 and whose own values overflow is re-decided too.
    """
    if settings.target != "fp16":
        return []
    if fallback not in ("bf16", "fp32"):
        raise ValueError(f"overflow_fallback must be 'bf16' or 'fp32', got {fallback!r}")
    ref = None  # the rule reference, made on the first re-decision (finding the file reads TOML)
    fresh = fresh if fresh is not None else fresh_decisions(gm, rules, settings.target)
    overrides: dict[str, Decision] = {}
    rows: list[dict[str, Any]] = []
    for _ in range(len(gm.graph.nodes) + 1):
        newly = 0
        for node in gm.graph.nodes:
            info = node.meta.get(META_INFO)
            decision: Optional[Decision] = node.meta.get(META_DECISION)
            if info is None or decision is None or info.kind != "compute" or decision.precision != "fp16":
                continue
            evidence = None if node.name in overrides else _overflow_evidence(node, margin)
            if evidence is None:
                continue
            if ref is None:
                source = setting_source(rules, "overflow_fallback") or "<calibration>"
                ref = RuleRef(file=source, table="calibration", pattern="overflow_fallback")
            overrides[node.name], row = _fallback_decision(node, decision, evidence, ref, margin=margin, fallback=fallback)
            rows.append(row)
            newly += 1
        if not newly:
            break
        replace_decisions(gm, overrides, fresh=fresh, settings=settings)
    return rows


# ---------------------------------------------------------------------------------------------
# loss scale and underflow


def recommend_loss_scale(max_abs_grad: float, margin: float) -> Optional[float]:
    """The largest power of two ``s`` with ``max|grad| × s × margin < 65504``, within [1, 2**24]."""
    if not (max_abs_grad > 0) or not math.isfinite(max_abs_grad):
        return None
    k = math.floor(math.log2(FP16_MAX / (margin * max_abs_grad)))
    if max_abs_grad * 2.0**k * margin >= FP16_MAX:  # exact power-of-two boundary
        k -= 1
    return float(min(max(2.0**k, 1.0), MAX_LOSS_SCALE))


def _read_in_fp16(node: torch.fx.Node) -> bool:
    """Whether an fp16 node reads this parameter (its gradient then passes through half)."""
    return any(u.meta.get(META_DECISION) is not None and u.meta[META_DECISION].precision == "fp16" for u in node.users)


def _half_gradient_absmax(node: torch.fx.Node, per_read: Mapping[str, float]) -> Optional[float]:
    """max |gradient| that ``node`` has in half after the rewrite, None when it has none in half.

    fp16 nodes' outputs; a parameter an fp16 node reads: its whole gradient, or for a parameter
    whose reads are cast one by one (``per_read``), the largest part of one read."""
    stats: Optional[NodeStats] = node.meta.get(META_STATS)
    if stats is None or stats.grad is None:
        return None
    if node.op == "get_attr":
        if not _read_in_fp16(node):
            return None
        return per_read.get(str(node.target), stats.grad.absmax)
    decision = node.meta.get(META_DECISION)
    return stats.grad.absmax if decision is not None and decision.precision == "fp16" else None


def shared_reads_in_fp32(gm: torch.fx.GraphModule, cal: Calibration, margin: float,
                         target: str) -> tuple[list[dict], dict[str, float]]:
    """Parameters several fp16 nodes read whose summed gradient would overflow fp16 in half.

    One cast shared by all reads (and O2's half storage) adds the reads' gradients in half: an
    unrolled cell's weight, read T times, gets a gradient up to T times larger than any one read's.
    The loss scale that keeps every other half gradient finite (:func:`recommend_loss_scale` over
    fp16 node outputs, single-read parameters and each read of a shared one) then overflows the sum,
    and the scaler would have to settle up to T times lower, flushing small gradients elsewhere.
    Such a parameter is cast once per read and stored in fp32 under O2 (``gm.meta["mp_read_casts"]``):
    the reads' parts, each finite at that scale, add in fp32. Returns the report rows, and the largest
    part of one read of each parameter chosen (what those have in half, for the gradient report)."""
    gm.meta[GM_READ_CASTS] = {}
    if target != "fp16" or not cal.backward or not cal.param_uses:
        return [], {}
    per_read = {name: max(a for _, a in reads) for name, reads in cal.param_uses.items()}
    finite = [g for n in gm.graph.nodes if (g := _half_gradient_absmax(n, per_read)) is not None and math.isfinite(g)]
    scale = recommend_loss_scale(max(finite, default=0.0), margin)
    if scale is None:
        return [], {}
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op != "get_attr" or name not in per_read or name in seen or not _read_in_fp16(node):
            continue
        seen.add(name)
        total = _half_gradient_absmax(node, {})  # the whole gradient: what one shared cast has in half
        if total is None or not total * scale * margin >= FP16_MAX:
            continue
        reads = cal.param_uses[name]
        reason = (f"calibration: its gradient adds {len(reads)} reads and reaches {_fmt(total)}; at loss scale {scale:g} "
                  f"(the largest that keeps every other half gradient finite, margin {margin:g}) the sum overflows fp16 "
                  f"({_fmt(total)} × {scale:g} × {margin:g} > 65504) while each read's part (at most {_fmt(per_read[name])}) "
                  "fits: each read is cast on its own, so the parts add in fp32, and O2 keeps fp32 storage")
        rows.append({"param": name, "reads": len(reads), "grad_absmax": json_float(total),
                     "read_grad_absmax": json_float(per_read[name]), "loss_scale": scale, "margin": margin,
                     "reason": reason})
    gm.meta[GM_READ_CASTS] = {row["param"]: row["reason"] for row in rows}
    return rows, {row["param"]: per_read[row["param"]] for row in rows}


def _gradient_report(gm: torch.fx.GraphModule, margin: float, target: str, per_read: Mapping[str, float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Underflow risk and the loss scale, over the gradients that fp16 nodes produce in half.

    Those are the gradients of the outputs of fp16 nodes and of the parameters they cast (O1:
    the weight gradient is computed in half before it reaches the fp32 master; a parameter cast
    once per read has each read's part in half, ``per_read``).
    """
    if target != "fp16":
        return {"recommended_initial_scale": None,
                "why": f"{target} has the range of fp32: no loss scaling is needed"}, {"applies": False, "why": f"{target} has the range of fp32"}
    hist: Optional[dict[int, int]] = None
    count = zeros = 0
    max_grad = 0.0
    names = []
    for node in gm.graph.nodes:
        absmax = _half_gradient_absmax(node, per_read)
        if absmax is None:
            continue
        names.append(node.name)
        stats: NodeStats = node.meta[META_STATS]
        g = stats.grad
        assert g is not None  # _half_gradient_absmax: the node has gradient statistics
        hist = {} if hist is None else hist
        for e, c in stats.grad_log2_hist:
            hist[e] = hist.get(e, 0) + c
        count += g.count
        zeros += g.n_zero
        if not math.isnan(absmax):
            max_grad = max(max_grad, absmax)
    if hist is None:
        scale_info: dict[str, Any] = {"recommended_initial_scale": None, "why": "no gradient reached an fp16 node (backward off, or nothing requires grad)"}
        return scale_info, {"applies": False, "why": scale_info["why"]}
    scale = recommend_loss_scale(max_grad, margin)
    nonzero = sum(hist.values())

    def below(threshold_exp: int) -> int:
        # |g| in [2**e, 2**(e+1)) is below 2**threshold_exp  <=>  e < threshold_exp
        return sum(c for e, c in hist.items() if e < threshold_exp)

    k = int(round(math.log2(scale))) if scale else 0
    under_unscaled = below(-24)
    under_scaled = below(-24 - k)
    scale_info = {
        "recommended_initial_scale": scale,
        "max_abs_grad": json_float(max_grad),
        "margin": margin,
        "rule": "largest power of two s with max|grad| × s × margin < 65504 (clamped to [1, 2**24])",
        "nodes": len(names),
    }
    underflow = {
        "applies": True,
        "gradient_values": count,
        "nonzero_values": nonzero,
        "frac_below_fp16_subnormal": under_unscaled / nonzero if nonzero else 0.0,
        "frac_below_fp16_subnormal_at_recommended_scale": under_scaled / nonzero if nonzero else 0.0,
        "frac_below_fp16_normal": below(-14) / nonzero if nonzero else 0.0,
        "note": "fractions of the non-zero gradient values that fp16 nodes produce; below 2**-24 they flush to 0 in fp16",
    }
    return scale_info, underflow



# ---------------------------------------------------------------------------------------------
# the stage


def calibrate_and_redecide(
    gm: torch.fx.GraphModule,
    calibration: Iterable,
    *,
    rules: Rules,
    settings: PlaceSettings,
    options: Optional[CalibrationOptions] = None,
) -> dict:
    """The calibrate stage (see the module docstring); returns ``gm.meta["mp_calibration"]``.

    ``calibration``: an iterable of inputs in the example-input form. ``settings``: how the
    conversion placed its casts (re-placement after a re-decision uses the same). ``options``
    (None: the defaults): see
    :class:`~converter.numerics.options.CalibrationOptions`. Raises
    :class:`~converter.numerics.search.ToleranceNotMet` when ``options.tolerance`` cannot be met.
    """
    t0 = time.perf_counter()
    options = options if options is not None else CalibrationOptions()
    if settings.target not in HALF_NAMES:
        raise ValueError(f"target must be fp16 or bf16, got {settings.target!r}")
    margin, margin_source, fallback = _margin_and_fallback(rules, options)
    cal = collect_statistics(gm, calibration, loss_fn=options.loss_fn, backward=options.backward,
                             progress=options.progress, max_batches=options.max_batches)
    if cal.batches == 0:
        raise ValueError("calibration: the calibration iterable gave no batches")
    fresh = fresh_decisions(gm, rules, settings.target)
    t1 = time.perf_counter()
    risky = redecide_overflow(gm, rules=rules, settings=settings, margin=margin, fallback=fallback, fresh=fresh)
    shared, per_read = shared_reads_in_fp32(gm, cal, margin, settings.target)
    result = _calibration_report(gm, cal, settings.target, margin=margin, margin_source=margin_source, fallback=fallback,
                                 risky=risky, shared=shared, per_read=per_read)
    result["timings"] = {"statistics_s": cal.seconds, "redecide_s": time.perf_counter() - t1}
    gm.meta[GM_CALIBRATION] = result
    if options.tolerance is not None:
        t2 = time.perf_counter()
        try:
            result["search"] = accuracy_search(gm, cal.inputs, tolerance=options.tolerance, settings=settings,
                                               fresh=fresh, options=options.search, progress=options.progress)
        except ToleranceNotMet as exc:
            result["search"] = exc.to_dict()
            raise
        finally:
            result["timings"]["search_s"] = time.perf_counter() - t2
    result["timings"]["total_s"] = time.perf_counter() - t0
    return result


def _margin_and_fallback(rules: Rules, options: CalibrationOptions) -> tuple[float, str, str]:
    """(margin, where it came from, fallback): the options, else the rules settings, else the defaults."""
    if options.margin is not None:
        margin, source = options.margin, "argument"
    else:
        source = setting_source(rules, "overflow_margin") or ("rules" if rules.setting("overflow_margin") else "default")
        margin = rules.setting("overflow_margin", DEFAULT_MARGIN)
    margin = float(margin)
    if not margin > 0:
        raise ValueError(f"overflow margin must be > 0, got {margin}")
    fallback = options.fallback if options.fallback is not None else rules.setting("overflow_fallback", DEFAULT_FALLBACK)
    if fallback not in ("bf16", "fp32"):
        raise ValueError(f"overflow_fallback must be 'bf16' or 'fp32', got {fallback!r}")
    return margin, source, fallback


def _calibration_report(gm: torch.fx.GraphModule, cal: Calibration, target: str, *, margin: float, margin_source: str,
                        fallback: str, risky: list[dict], shared: list[dict], per_read: Mapping[str, float]) -> dict:
    """The ``mp_calibration`` dict (report.json's ``"calibration"`` section), timings aside."""
    nonfinite = [
        {"name": n.name, "inf": n.meta[META_STATS].forward.n_inf, "nan": n.meta[META_STATS].forward.n_nan}
        for n in gm.graph.nodes
        if META_STATS in n.meta and (n.meta[META_STATS].forward.n_inf or n.meta[META_STATS].forward.n_nan)
    ]
    scale_info, underflow = _gradient_report(gm, margin, target, per_read)
    return {
        "target": target,
        "batches": cal.batches,
        "loss": cal.loss,
        "backward": cal.backward,
        "margin": margin,
        "margin_source": margin_source,
        "overflow_fallback": fallback,
        "fp16_max": FP16_MAX,
        "risky_nodes": risky,
        "shared_reads_in_fp32": shared,
        "nonfinite_in_fp32": nonfinite,
        "underflow": underflow,
        "loss_scale": scale_info,
        "nodes": {name: s.to_dict() for name, s in cal.stats.items()},
    }
