"""The fp8 accuracy target: the fewest fp8 layers to keep in bf16 so that the outputs meet a tolerance.

A conversion with ``precision="fp8"`` and ``CalibrationOptions(tolerance=...)`` (CLI ``--precision fp8
--tolerance 30``) runs two searches, one per axis of the conversion, in pipeline order:

1. **before rewrite, the half search** (:mod:`converter.numerics.search`): the graph is still fp32 and every
   half node is bf16 (an fp8 linear counts as bf16 there: its operands and output are bf16). It keeps the
   fewest nodes in fp32 for the *bf16* conversion to meet the tolerance. When bf16 meets it, as it usually
   does, that costs the fp32 reference and one emulated pass and keeps nothing.
2. **after the fp8 stage and its SQNR-floor fallback** (:func:`converter.numerics.fp8_layers.measure_and_fall_back`:
   per-layer floors, each layer on its own), **this search**: the rewritten graph runs for real, every
   ``fp8_linear`` call still there a candidate. It keeps the fewest of them in bf16 (``F.linear``/``aten.linear`` on the same bf16 operands:
   no re-placement, no new casts) so that the whole conversion meets the tolerance.

Why this order rather than fp8 first and fp32 nodes only when every fp8 layer in bf16 still misses: the half
search needs the fp32 graph (it runs before rewrite), and the fp8 search needs the rewritten one; in this
order each runs where it can, and the fp8 search starts from a bf16 conversion that meets the tolerance, so
keeping every fp8 layer in bf16 is a known-feasible end point (up to the emulation's summation order: if
even that misses, :class:`~converter.numerics.search.ToleranceNotMet` says so; it is not searched further).
The fp8 layers spend whatever margin the bf16 conversion leaves; none is spent on fp32 nodes first unless
bf16 alone needs them.

**One evaluation** (:class:`Fp8Evaluator`) is one forward pass of the converted graph over the calibration
batches with a given set of fp8 layers switched to bf16 (a copy of the graph whose fp8 calls read a switch;
the graph itself is untouched until the end), judged against the *original fp32 model's* outputs, computed
once before rewrite (:func:`fp32_references`, the same reference as the half search's, with the same seeds
for random ops). Repeated sets are looked up, not counted.

**The ranking** (:func:`rank_fp8_layers`): one instrumented pass with every candidate in bf16 computes each
layer's local fp8 error ``δᵢ = fp8_linear(x) − linear(x)`` on its own bf16 input and, by backward passes
along random output directions ``v``, ``gᵢ = Jᵢᵀv``; ``(gᵢ·δᵢ)²`` estimates ``‖Jᵢδᵢ‖²``, the output error
energy that layer ``i`` adds alone in fp8 (as :mod:`converter.numerics.sensitivity` does for half rounding).
It also reports each layer's local output SQNR. Charged ``2 + 2·projections`` evaluations (measured: about
2.6 evaluations of CPU time). :func:`per_layer_db_ranking` orders by the local output SQNR of
:func:`~converter.numerics.fp8_layers.measure_fp8_layers` instead (lowest first); it finds the same layers
when a few are broken, but it cannot tell a layer whose error the model amplifies from one whose error it
averages away, and took more evaluations at every tolerance of ``benchmarks/fp8_search.py``. Any ranking
(layer names, most sensitive first, and its cost) can be passed in.

**The search** is :func:`~converter.numerics.search.search_ranked` over the ranked layers (galloping, then
bisection on the prefix length, then pruning: each kept layer, least sensitive first, goes back to fp8 when
the rest still passes). With ``m`` sensitive layers first, about ``2·log2(m) + m`` evaluations, against
O(m·log n) for the graph-order bisection of onnxconverter-common
(:func:`~converter.numerics.search.bisect_graph_order`, the benchmark baseline). Every kept layer is pruned
(the half search stops at 16): the fewest bf16 layers is the goal, so after the search no single kept layer
can go back to fp8 alone (each was tried against the final set: :func:`prune_to_minimal`). ``SearchOptions`` apply as to the half search: ``max_evaluations``
(candidate runs, its own budget), ``max_keep`` (layers kept in bf16 at most), ``prune``, ``max_batches``,
``projections``, ``seed``.

**The result**: each kept layer's ``fp8_linear`` call becomes its linear again, and its decision is requested
``bf16`` by :data:`FP8_SEARCH_REF` with the measured end-to-end SQNRs in the reason; report.json's
``calibration.fp8_search`` holds the search (target, SQNR with every layer in fp8 and at the end, the kept
layers, the ranking's head, evaluations by kind). :class:`~converter.numerics.search.ToleranceNotMet` (CLI
exit 1) when even every layer in bf16 misses, or ``max_evaluations`` run out.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, cast

import torch
import torch.fx
import torch.nn.functional as F

from converter.fp8.kernels import fp8_linear
from converter.ir.meta import GM_CALIBRATION, META_DECISION, Decision, RuleRef
from converter.numerics.common import copy_graph, floating_outputs, json_float, preserved_state, progress_bar
from converter.numerics.fp8_layers import Fp8LayerNumerics, fp8_nodes, measure_fp8_layers
from converter.numerics.search import (
    Budget,
    Outcome,
    OutOfBudget,
    SearchOptions,
    Tolerance,
    ToleranceNotMet,
    judge,
    search_ranked,
)
from converter.passes.capture.values import normalize_inputs
from converter.passes.fp8 import keep_bf16

__all__ = [
    "FP8_SEARCH_REF",
    "Fp8Evaluator",
    "Fp8Sensitivity",
    "Fp8SearchPlan",
    "fp32_references",
    "rank_fp8_layers",
    "propagated_ranking",
    "per_layer_db_ranking",
    "prune_to_minimal",
    "fp8_accuracy_search",
    "prepare_fp8_search",
]

#: the deciding rule of an fp8 layer the accuracy search keeps in bf16
FP8_SEARCH_REF = RuleRef(file="<accuracy-search>", table="calibration", pattern="fp8_tolerance")

#: a ranking: the evaluator in, (layer names most sensitive first, its cost in evaluations, report rows) out
Ranking = Callable[["Fp8Evaluator"], tuple[list[str], int, list[dict]]]


def _operands(node: torch.fx.Node) -> tuple[Any, Any, Any, Any]:
    """(x, weight, bias, recipe) of an ``fp8_linear`` call (the fp8 stage writes them positionally)."""
    args = list(node.args) + [None] * (4 - len(node.args))
    return tuple(node.kwargs.get(k, a) for k, a in zip(("x", "weight", "bias", "recipe"), args))  # type: ignore[return-value]


def _run_batches(module: torch.nn.Module, batches: Sequence[tuple[tuple, dict]], seed: int,
                 guard: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The floating outputs of ``module`` per batch, without gradients; random ops draw the same numbers each run."""
    outs = []
    with torch.no_grad(), preserved_state(guard):
        for b, (args, kwargs) in enumerate(batches):
            torch.manual_seed(seed + b)
            outs.append([t.detach() for t in floating_outputs(module(*args, **kwargs))])
    return outs


def fp32_references(gm: torch.fx.GraphModule, batches: Sequence[tuple[tuple, dict]], *, seed: int = 0) -> list[list[torch.Tensor]]:
    """The reference outputs: ``gm`` run *before rewrite* (still the fp32 model), seeded as the half search is."""
    return _run_batches(gm, batches, seed, gm)


class Fp8Evaluator:
    """Evaluates sets of fp8 layers switched back to bf16 on the converted ``gm`` (after the fp8 stage).

    ``references``: :func:`fp32_references` of the same batches. ``layers``: the candidate names (default:
    every ``fp8_linear`` call). :meth:`evaluate_keep` runs the graph with those layers in bf16; ``runs``
    counts the forward passes over the batches actually made (repeated sets come from the memo).
    """

    def __init__(self, gm: torch.fx.GraphModule, batches: Sequence[tuple[tuple, dict]],
                 references: Sequence[Sequence[torch.Tensor]], *, tolerance: Any,
                 layers: Optional[Iterable[str]] = None, seed: int = 0):
        self.gm = gm
        self.batches = list(batches)
        self.references = [list(r) for r in references]
        if len(self.references) != len(self.batches):
            raise ValueError(f"fp8 search: {len(self.references)} reference outputs for {len(self.batches)} batches")
        self.tolerance = Tolerance.parse(tolerance)
        self.seed = seed
        calls = {n.name: n for n in fp8_nodes(gm)}
        self.layers = list(calls) if layers is None else [name for name in layers if name in calls]
        self.index = {name: i for i, name in enumerate(self.layers)}
        self.runs = 0
        self.memo: dict[frozenset, Outcome] = {}
        state = [False] * len(self.layers)  # True: that layer runs its bf16 linear
        self.state = state

        def _mp_fp8_or_bf16(i, x, weight, bias, recipe):
            return F.linear(x, weight, bias) if state[i] else fp8_linear(x, weight, bias, recipe)

        graph, mapping = copy_graph(gm)
        for name, i in self.index.items():
            operands = tuple(mapping[a] if isinstance(a, torch.fx.Node) else a for a in _operands(calls[name]))
            node = mapping[calls[name]]
            node.target, node.args, node.kwargs = _mp_fp8_or_bf16, (i, *operands), {}
        graph.lint()
        self.switch = _mp_fp8_or_bf16
        self.module = torch.fx.GraphModule(gm, graph, class_name="Fp8Switch")

    def _key(self, keep: Iterable[str]) -> frozenset:
        return frozenset(name for name in keep if name in self.index)

    def known_keep(self, keep: Iterable[str]) -> bool:
        """Whether :meth:`evaluate_keep` would answer from the memo (no run)."""
        return self._key(keep) in self.memo

    def outputs(self, keep: Iterable[str]) -> list[list[torch.Tensor]]:
        """The floating outputs per batch with the layers in ``keep`` in bf16 (one run, not counted)."""
        key = self._key(keep)
        for name, i in self.index.items():
            self.state[i] = name in key
        try:
            return _run_batches(self.module, self.batches, self.seed, self.gm)
        finally:
            for i in range(len(self.state)):
                self.state[i] = False

    def evaluate_keep(self, keep: Iterable[str], *, memo: bool = True) -> Outcome:
        """The outcome with the layers in ``keep`` in bf16 and every other candidate in fp8."""
        key = self._key(keep)
        if memo and key in self.memo:
            return self.memo[key]
        outs = self.outputs(key)
        self.runs += 1
        refs = [t for batch in self.references for t in batch]
        result = judge(self.tolerance, refs, [t for batch in outs for t in batch])
        self.memo[key] = result
        return result


# ---------------------------------------------------------------------------------------------
# ranking


@dataclass(frozen=True)
class Fp8Sensitivity:
    """One fp8 layer's estimated output error energy alone in fp8, and its local output SQNR."""

    name: str
    score: float  # sum over batches of E[(g·δ)²] ≈ ‖J δ‖²
    est_sqnr_db: float  # 10·log10(‖ref‖² / score): the end-to-end SQNR if only this layer ran in fp8
    local_sqnr_db: float  # the layer's own output: fp8 against its bf16 linear, on the same input

    def to_dict(self) -> dict:
        return {"name": self.name, "score": json_float(self.score), "est_sqnr_db": json_float(self.est_sqnr_db),
                "local_sqnr_db": json_float(self.local_sqnr_db)}


def _probe_module(ev: Fp8Evaluator, slots: list) -> torch.fx.GraphModule:
    """A copy of ``ev.module`` in which every candidate runs its bf16 linear and records its fp8 error."""
    def _mp_fp8_probe(i, x, weight, bias, recipe):
        y = F.linear(x, weight, bias)
        with torch.no_grad():
            delta = fp8_linear(x.detach(), weight.detach(), None if bias is None else bias.detach(), recipe).float() - y.detach().float()
        shift = torch.zeros_like(y, requires_grad=True)  # d(out)/d(shift) = d(out)/d(y), also for frozen weights
        slots[i] = (shift, delta, float(y.detach().double().norm()))
        return y + shift

    graph, _ = copy_graph(ev.module)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is ev.switch:
            node.target = _mp_fp8_probe
    graph.lint()
    return torch.fx.GraphModule(ev.module, graph, class_name="Fp8Probe")


def _score_batch(module: torch.nn.Module, args: tuple, kwargs: dict, slots: list, acc: dict,
                 gen: torch.Generator, projections: int) -> None:
    """One probed forward pass over a batch, then ``projections`` backward passes along random directions."""
    for i in range(len(slots)):
        slots[i] = None
    with torch.enable_grad():
        outs = [t for t in floating_outputs(module(*args, **kwargs)) if t.requires_grad]
        acc["ref"] += sum(float(t.detach().double().pow(2).sum()) for t in outs)
        owned = [(i, slot) for i, slot in enumerate(slots) if slot is not None]
        for i, (_, delta, norm) in owned:
            acc["local"][i][0] += norm * norm
            acc["local"][i][1] += float(delta.double().pow(2).sum())
        if not outs or not owned:
            return
        for k in range(projections):
            dot = cast(torch.Tensor, sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in outs))
            grads = torch.autograd.grad(dot, [slot[0] for _, slot in owned], allow_unused=True,
                                        retain_graph=k + 1 < projections)
            for g, (i, (_, delta, _)) in zip(grads, owned):
                if g is not None:
                    acc["score"][i] += float((g.double() * delta.double()).nan_to_num(0.0, 0.0, 0.0).sum()) ** 2 / projections


def rank_fp8_layers(ev: Fp8Evaluator, *, projections: int = 1, seed: int = 0) -> list[Fp8Sensitivity]:
    """The candidates of ``ev``, the largest estimated output error energy alone in fp8 first (see the
    module docstring); a layer whose fp8 output is not finite ranks first. Ties keep graph order."""
    slots: list = [None] * len(ev.layers)
    module = _probe_module(ev, slots)
    acc: dict = {"ref": 0.0, "score": [0.0] * len(ev.layers), "local": [[0.0, 0.0] for _ in ev.layers]}
    gen = torch.Generator().manual_seed(seed)
    with preserved_state(ev.gm):
        for b, (args, kwargs) in enumerate(ev.batches):
            torch.manual_seed(ev.seed + b)
            _score_batch(module, args, kwargs, slots, acc, gen, projections)
    result = []
    for i, name in enumerate(ev.layers):
        signal, noise = acc["local"][i]
        score = acc["score"][i] if math.isfinite(noise) else math.inf
        est = -math.inf if score == math.inf else math.inf if score == 0 else 10 * math.log10(max(acc["ref"], 1e-300) / score)
        local = -math.inf if not math.isfinite(noise) else math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise)
        result.append(Fp8Sensitivity(name, score, est, local))
    result.sort(key=lambda s: -s.score)  # stable: ties keep graph order
    return result


def propagated_ranking(projections: int = 1, seed: int = 0) -> Ranking:
    """The default ranking (:func:`rank_fp8_layers`), charged ``2 + 2·projections`` evaluations."""
    def ranking(ev: Fp8Evaluator) -> tuple[list[str], int, list[dict]]:
        ranked = rank_fp8_layers(ev, projections=projections, seed=seed)
        return [s.name for s in ranked], 2 + 2 * projections, [s.to_dict() for s in ranked[:10]]
    return ranking


#: what :func:`~converter.numerics.fp8_layers.measure_fp8_layers` costs in evaluations: a forward and a backward
#: of the graph (1 + 2), and each layer's GEMMs again in fp8 and in bf16, forward and backward (about 3 more)
LAYER_SQNR_COST = 6


def per_layer_db_ranking(numerics: Optional[Mapping[str, Fp8LayerNumerics]] = None) -> Ranking:
    """Lowest per-layer output SQNR first (:func:`~converter.numerics.fp8_layers.measure_fp8_layers`: each layer's
    fp8 output against its bf16 linear on the same operands). ``numerics`` already measured cost nothing; else
    they are measured on the evaluator's batches and charged :data:`LAYER_SQNR_COST` evaluations."""
    def ranking(ev: Fp8Evaluator) -> tuple[list[str], int, list[dict]]:
        found, cost = numerics, 0
        if found is None:
            recipes = {_operands(n)[3] for n in fp8_nodes(ev.gm) if n.name in ev.index}
            found, cost = measure_fp8_layers(ev.gm, ev.batches, recipes.pop() if recipes else "tensorwise", seed=ev.seed), LAYER_SQNR_COST
        ranked = sorted(ev.layers, key=lambda name: found[name].sqnr_output if name in found else math.inf)
        rows = [{"name": name, "local_sqnr_db": json_float(found[name].sqnr_output)} for name in ranked[:10] if name in found]
        return ranked, cost, rows
    return ranking


# ---------------------------------------------------------------------------------------------
# the search


def _kept_reason(name: str, keep: Sequence[str], ev: Fp8Evaluator, first: Outcome, final: Outcome,
                 rows: Mapping[str, dict], ranked: Sequence[str], old: Decision) -> str:
    """Why ``name`` stays bf16: the target, the end-to-end SQNRs measured, what dropping it gave, its rank."""
    tol = ev.tolerance
    without = ev.memo.get(frozenset(keep) - {name})
    parts = [f"{final.sqnr_db:.1f} dB with {len(keep)} of {len(ev.layers)} fp8 layer(s) kept bf16",
             f"{first.sqnr_db:.1f} dB with all in fp8"]
    if without is not None:
        parts.append(f"{without.sqnr_db:.1f} dB with this one back in fp8")
    if name in ranked:
        row = rows.get(name, {})
        alone = row.get("est_sqnr_db")
        parts.append(f"sensitivity rank {ranked.index(name) + 1}" + (
            f", alone in fp8 ~{alone:.1f} dB" if isinstance(alone, float) and math.isfinite(alone) else ""))
    return (f"fp8 accuracy search: kept bf16 to meet {tol} against fp32 end to end ({'; '.join(parts)}) "
            f"(was fp8 by {old.rule})")


def prune_to_minimal(evaluate_keep: Callable[[Sequence[str]], Outcome], keep: Sequence[str]) -> list[str]:
    """``keep`` pruned to a fixed point: no single layer of the result can go back to fp8 and still pass.

    :func:`~converter.numerics.search.search_ranked`'s pruning tries each layer once, against the kept set of
    that moment; fp8 errors are not additive (they partly cancel), so a layer needed beside a larger set may
    not be needed beside the final one. Sets tried before come from the memo: when one pass removed nothing,
    as usual, this costs no evaluation.
    """
    keep = list(keep)
    changed = True
    while changed:
        changed = False
        for name in reversed(list(keep)):
            trial = [x for x in keep if x != name]
            if evaluate_keep(trial).ok:
                keep, changed = trial, True
    return keep


def _not_met(ev: Fp8Evaluator, budget: Budget, first: Outcome, limit: int, exc: Exception, cost: int) -> ToleranceNotMet:
    """The error of a search that found no passing set (``exc``: what stopped it)."""
    best_sqnr, best_set = budget.best if budget.best else (first.sqnr_db, ())
    if isinstance(exc, OutOfBudget):
        why = f"{budget.max} evaluations were not enough"
    elif limit == len(ev.layers):
        why = (f"even with all {limit} fp8 layer(s) in bf16 the outputs miss it, so the bf16 conversion itself does "
               "(the half search before rewrite met it on an emulation; relax the tolerance)")
    else:
        why = f"keeping the {limit} most sensitive fp8 layer(s) in bf16 (max_keep) is not enough"
    return ToleranceNotMet(best_sqnr, best_set, tolerance=ev.tolerance, evaluations=1 + ev.runs + cost, why=why,
                           kept="fp8 layer(s) kept in bf16")


def fp8_accuracy_search(gm: torch.fx.GraphModule, batches: Sequence[tuple[tuple, dict]],
                        references: Sequence[Sequence[torch.Tensor]], *, tolerance: Any,
                        options: Optional[SearchOptions] = None, ranking: Optional[Ranking] = None,
                        aten: bool = False, progress: bool = False) -> tuple[dict, list[str]]:
    """Keep the fewest fp8 layers of ``gm`` (after the fp8 stage) in bf16 so that its outputs meet ``tolerance``
    against ``references`` (:func:`fp32_references` of ``batches``, taken before rewrite).

    ``ranking`` (default :func:`propagated_ranking`) orders the layers; ``options`` bound the evaluations
    (``max_evaluations``), the kept layers (``max_keep``) and say whether to ``prune``. Changes ``gm``: each kept
    layer becomes its bf16 linear again (:func:`converter.passes.fp8.keep_bf16`; ``aten``: a torch.export graph)
    requested bf16 by :data:`FP8_SEARCH_REF`. Returns (the report dict, the layers still in fp8). Raises
    :class:`~converter.numerics.search.ToleranceNotMet` when the tolerance cannot be met.
    """
    t0 = time.perf_counter()
    options = options if options is not None else SearchOptions()
    ev = Fp8Evaluator(gm, batches, references, tolerance=tolerance, seed=options.seed)
    budget = Budget(ev, options.max_evaluations)
    report: dict = {"tolerance": str(ev.tolerance), "batches": len(ev.batches), "candidates": len(ev.layers)}
    keep: list[str] = []
    ranked: list[str] = []
    rows: list[dict] = []
    cost = 0
    with progress_bar(progress) as bar:
        bar.add_task("fp8 accuracy search", total=None)
        first = budget(())
        report["initial_sqnr_db"] = json_float(first.sqnr_db)
        if not first.ok:
            ranked, cost, rows = (ranking or propagated_ranking(options.projections, options.seed))(ev)
            report["ranking"] = rows
            limit = len(ranked) if options.max_keep is None else min(options.max_keep, len(ranked))
            try:
                if limit <= 0:
                    raise LookupError("no fp8 layer to keep in bf16")
                # prune every kept layer (search_ranked's default stops at 16): the fewest bf16 layers is the goal
                keep = search_ranked(budget, ranked, max_keep=limit, prune=options.prune, max_prune=len(ranked))
                keep = prune_to_minimal(budget, keep) if options.prune else keep
            except (LookupError, OutOfBudget) as exc:
                raise _not_met(ev, budget, first, limit, exc, cost) from None
    final = ev.evaluate_keep(keep)  # the last passing set: from the memo
    by_name = {row["name"]: row for row in rows}
    decisions = {n.name: n.meta[META_DECISION] for n in fp8_nodes(gm)}
    keep_bf16(gm, {name: (FP8_SEARCH_REF, _kept_reason(name, keep, ev, first, final, by_name, ranked, decisions[name]))
                   for name in keep}, aten=aten)
    report.update({
        "met": True,
        "kept_bf16": list(keep),
        "fp8_layers": len(ev.layers) - len(keep),
        "sqnr_db": json_float(final.sqnr_db),
        "allclose_ratio": None if final.allclose_ratio is None else json_float(final.allclose_ratio),
        # every forward-equivalent pass: the fp32 reference, the candidate runs, and the ranking
        "evaluations": 1 + ev.runs + cost,
        "evaluation_breakdown": {"reference": 1, "candidates": ev.runs, "ranking": cost},
        "seconds": time.perf_counter() - t0,
    })
    return report, [name for name in ev.layers if name not in keep]


# ---------------------------------------------------------------------------------------------
# the pipeline's entry points


@dataclass
class Fp8SearchPlan:
    """What the fp8 search needs from before rewrite: the batches, the fp32 outputs, each layer's linear call."""

    batches: list
    references: list
    aten: bool  # a torch.export graph: a kept layer calls aten.linear again
    tolerance: Tolerance
    options: SearchOptions
    progress: bool = False

    def run(self, gm: torch.fx.GraphModule, layers: Sequence[str]) -> list[str]:
        """After the fp8 stage (``layers``: the ``fp8_linear`` calls it made): the search; its report goes to
        ``gm.meta["mp_calibration"]["fp8_search"]`` (also when the tolerance is not met). Returns the layers
        still in fp8."""
        calibration = gm.meta.setdefault(GM_CALIBRATION, {})
        try:
            report, remaining = fp8_accuracy_search(gm, self.batches, self.references, tolerance=self.tolerance,
                                                    options=self.options, aten=self.aten, progress=self.progress)
        except ToleranceNotMet as exc:
            calibration["fp8_search"] = exc.to_dict()
            raise
        calibration["fp8_search"] = report
        kept = set(report["kept_bf16"])
        return [name for name in layers if name not in kept]


def prepare_fp8_search(gm: torch.fx.GraphModule, calibration: Sequence, options: Any) -> Optional[Fp8SearchPlan]:
    """Before rewrite, for a conversion with fp8 GEMMs: the fp32 reference outputs and the linear calls the fp8
    stage will replace; None without a tolerance. ``calibration``: the batches in the example-input form;
    ``options``: the :class:`~converter.numerics.options.CalibrationOptions` (``max_batches`` and
    ``search.max_batches`` bound the batches, ``search.seed`` seeds random ops)."""
    if options.tolerance is None:
        return None
    limits = [n for n in (options.max_batches, options.search.max_batches) if n is not None]
    items = list(calibration)[: min(limits)] if limits else list(calibration)
    batches = [normalize_inputs(item) for item in items]
    if not batches:
        raise ValueError("fp8 accuracy search: no calibration batches to evaluate on")
    aten = any(n.op == "call_function" and n.target is torch.ops.aten.linear.default for n in gm.graph.nodes)
    return Fp8SearchPlan(batches=batches, references=fp32_references(gm, batches, seed=options.search.seed),
                         aten=aten, tolerance=options.tolerance, options=options.search, progress=options.progress)
