"""Accuracy search: a small set of nodes to keep in fp32 so that the outputs meet a tolerance.

Used by the calibrate stage when ``tolerance`` is given (``CalibrationOptions(tolerance=30)``,
``--tolerance 30``). Three parts:

1. **Emulation** (:class:`HalfEmulator`). A precision assignment is evaluated on the still-fp32
   graph by rounding through the half dtype exactly where the converted model changes dtype:
   every input a half node casts, and its output. The arithmetic between is fp32. This is exact
   for the correctly rounded ops (add, mul, div, sqrt...: fp32 has more than 2p+2 bits for both
   half formats, so rounding the fp32 result equals the half op), equal up to summation order for
   matmul-class ops whose half kernels accumulate in fp32, and avoids fp16 arithmetic, which is
   about 200× slower than bf16 on this CPU. One evaluation is one forward pass over the
   validation batches; the counter counts every pass that runs (a configuration evaluated before is
   looked up, not counted).
2. **Ranking** (:func:`converter.numerics.sensitivity.rank_sensitivity`, its own module). One
   instrumented forward pass gives every half node's local error of running alone in half, and
   backward passes along random output directions estimate the output error energy each adds.
   A node whose rounding overflows (inf) ranks first. This pass is charged as 2 + 2·projections
   evaluations (a forward that runs the half nodes twice, and backward passes at twice a forward).
3. **Search** (:func:`search_ranked`) over the ranked list: keep the top-k in fp32 with k = 1, 2,
   4, ... until the tolerance is met, bisect k between the last failing and the first passing
   prefix, then prune: drop each kept node, least sensitive first, when the rest still passes.
   With a ranking that puts the ``m`` culprits first this costs about ``2·log2(m) + m``
   evaluations, against O(m·log n) for the graph-order bisection of onnxconverter-common's
   ``auto_convert_mixed_precision`` (:func:`bisect_graph_order`, kept as the benchmark baseline).

The kept nodes get a ``Decision`` pinned to fp32 (table ``calibration``, pattern ``tolerance``),
placement is re-run, and the final assignment is verified once more by emulation. The reference
is the original model, so keeping *every* half node in fp32 always meets a tolerance; that is no
conversion, so the search keeps at most all but one (or ``max_keep``). When the tolerance cannot
be met that way, or within ``max_evaluations`` candidate evaluations,
:class:`ToleranceNotMet` carries the best SQNR and set reached.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

import torch
import torch.fx

from converter.ir.errors import EXIT_CHECK_FAILED, EXIT_INTERNAL, MpconvertError
from converter.ir.meta import DTYPES, HALF_NAMES, META_DECISION, META_INFO, Decision, Match, RuleRef
from converter.ir.ops import map_castable_args
from converter.numerics.common import copy_graph, floating_outputs, json_float, preserved_state, progress_bar, sqnr_db
from converter.numerics.redecide import PlaceSettings, fresh_decisions, replace_decisions
from converter.numerics.sensitivity import Sensitivity, emulated_nodes, rank_sensitivity, round_through
from converter.passes.place.stage import castable_inputs
from converter.rules.precedence import OVERRIDE_LEVEL, rank

__all__ = [
    "ToleranceNotMet",
    "Tolerance",
    "SearchOptions",
    "Outcome",
    "HalfEmulator",
    "search_ranked",
    "NoPassingSet",
    "bisect_graph_order",
    "accuracy_search",
    "judge",
    "Budget",
    "OutOfBudget",
    "SEARCH_REF",
]

SEARCH_REF = RuleRef(file="<accuracy-search>", table="calibration", pattern="tolerance")


class ToleranceNotMet(MpconvertError, ValueError):
    """The accuracy search could not meet the tolerance; carries the best result reached.

    A ``ValueError`` so that it reaches the caller of :func:`converter.convert` unwrapped
    (the pipeline wraps other exceptions in ``PassError``). The CLI maps it to exit status 1.
    """

    exit_code = EXIT_CHECK_FAILED

    def __init__(self, best_sqnr: float, best_set: Sequence[str], *, tolerance: Any = None, evaluations: int = 0, why: str = "",
                 kept: str = "node(s) kept in fp32"):
        self.best_sqnr = float(best_sqnr)
        self.best_set = tuple(best_set)
        self.tolerance = tolerance
        self.evaluations = evaluations
        self.why = why
        self.kept = kept  # what best_set holds (the fp8 search: "fp8 layer(s) kept in bf16")
        detail = f"; {why}" if why else ""
        super().__init__(
            f"tolerance {tolerance} not met{detail}: best SQNR {self.best_sqnr:.2f} dB with {len(self.best_set)} "
            f"{kept} ({', '.join(self.best_set[:8])}{', ...' if len(self.best_set) > 8 else ''}) "
            f"after {evaluations} evaluations"
        )

    def to_dict(self) -> dict:
        """The search section of the calibration report for a tolerance that was not met."""
        return {"tolerance": str(self.tolerance), "met": False, "best_sqnr_db": json_float(self.best_sqnr),
                "best_set": list(self.best_set), "kept": self.kept, "evaluations": self.evaluations, "why": self.why}


# ---------------------------------------------------------------------------------------------
# tolerance


@dataclass(frozen=True)
class Tolerance:
    """What the outputs must meet: an SQNR in dB against fp32, and/or ``allclose(rtol, atol)``."""

    sqnr_db: Optional[float] = None
    rtol: Optional[float] = None
    atol: Optional[float] = None

    def __post_init__(self) -> None:
        if self.sqnr_db is None and self.rtol is None and self.atol is None:
            raise ValueError("a tolerance needs an SQNR in dB, or rtol/atol")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"tolerance {name} must be >= 0, got {value}")

    @classmethod
    def parse(cls, value: Any) -> "Tolerance":
        """``30`` / ``"30"`` / ``"30dB"`` (SQNR), ``{"sqnr": 30}``, ``{"rtol": 1e-2, "atol": 1e-3}``,
        ``"rtol=1e-2,atol=1e-3"``, or a :class:`Tolerance`."""
        if isinstance(value, Tolerance):
            return value
        if isinstance(value, bool):
            raise ValueError(f"tolerance must be a number of dB or rtol/atol, got {value!r}")
        if isinstance(value, (int, float)):
            return cls(sqnr_db=float(value))
        if isinstance(value, Mapping):
            unknown = set(value) - {"sqnr", "sqnr_db", "rtol", "atol"}
            if unknown:
                raise ValueError(f"unknown tolerance key(s) {sorted(unknown)}; use sqnr, rtol, atol")
            sqnr = value.get("sqnr", value.get("sqnr_db"))
            rtol, atol = value.get("rtol"), value.get("atol")
            if (rtol is None) != (atol is None):  # allclose with one of them: the other defaults like numpy's
                rtol = 1e-5 if rtol is None else rtol
                atol = 1e-8 if atol is None else atol
            return cls(sqnr_db=None if sqnr is None else float(sqnr), rtol=None if rtol is None else float(rtol),
                       atol=None if atol is None else float(atol))
        if isinstance(value, str):
            text = value.strip().lower().replace(" ", "")
            match = re.fullmatch(r"(?:sqnr[=:])?([-+0-9.e]+)(?:db)?", text)
            if match:
                return cls(sqnr_db=float(match.group(1)))
            parts = {}
            for item in filter(None, re.split(r"[,;]", text)):
                key, _, number = item.partition("=")
                try:
                    parts[key] = float(number.removesuffix("db"))
                except ValueError:
                    raise ValueError(f"cannot read tolerance {value!r}: use e.g. 30 (dB) or rtol=1e-2,atol=1e-3") from None
            return cls.parse(parts)
        raise ValueError(f"tolerance must be a number (SQNR dB), a mapping or a string, got {type(value).__name__}")

    def __str__(self) -> str:
        parts = []
        if self.sqnr_db is not None:
            parts.append(f"SQNR >= {self.sqnr_db:g} dB")
        if self.rtol is not None:
            parts.append(f"allclose(rtol={self.rtol:g}, atol={self.atol:g})")
        return " and ".join(parts)


@dataclass(frozen=True)
class Outcome:
    """One evaluated assignment: whether it meets the tolerance, its SQNR and allclose margin."""

    ok: bool
    sqnr_db: float
    allclose_ratio: Optional[float] = None  # max |out - ref| / (atol + rtol |ref|); <= 1 passes


@dataclass(frozen=True)
class SearchOptions:
    """Bounds and knobs of :func:`accuracy_search` (see the module docstring).

    ``max_evaluations``: candidate evaluations at most; ``max_keep``: nodes kept in fp32 at most
    (None: all but one); ``projections``: random output directions for the ranking; ``prune``: drop
    kept nodes that turn out unnecessary; ``max_batches``: calibration batches evaluated (None: all);
    ``seed``: for the random ops and the projections.
    """

    max_evaluations: int = 64
    max_keep: Optional[int] = None
    projections: int = 1
    prune: bool = True
    max_batches: Optional[int] = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("max_evaluations", 1), ("projections", 1), ("max_keep", 1), ("max_batches", 1), ("seed", 0)):
            value = getattr(self, name)
            if value is None and name in ("max_keep", "max_batches"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"search option {name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.prune, bool):
            raise ValueError(f"search option prune must be True or False, got {self.prune!r}")


def judge(tol: Tolerance, refs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> Outcome:
    """The outcome of one evaluation: the SQNR of ``outs`` against ``refs`` (all tensors pooled) against ``tol``
    (used by this search and by the fp8 search, :mod:`converter.numerics.fp8_search`)."""
    ref = torch.cat([r.detach().double().reshape(-1) for r in refs]) if refs else torch.zeros(0, dtype=torch.float64)
    out = torch.cat([o.detach().double().reshape(-1) for o in outs]) if outs else torch.zeros(0, dtype=torch.float64)
    q = sqnr_db(ref, out)
    ok = True
    ratio = None
    if tol.sqnr_db is not None:
        ok = q >= tol.sqnr_db
    if tol.rtol is not None or tol.atol is not None:
        # allclose; given one of rtol/atol, the other defaults like numpy's (as Tolerance.parse fills it in): a
        # Tolerance(atol=...) was not checked at all and a Tolerance(rtol=...) failed on None + tensor
        rtol = 1e-5 if tol.rtol is None else tol.rtol
        atol = 1e-8 if tol.atol is None else tol.atol
        if not bool(torch.isfinite(out).all()):
            ratio = math.inf
        else:
            bound = atol + rtol * ref.abs()
            excess = (ref - out).abs()
            ratio = float((excess / bound).max()) if bound.numel() and bool((bound > 0).all()) else (
                0.0 if bool((excess == 0).all()) else math.inf)
        ok = ok and ratio <= 1.0
    return Outcome(ok=ok, sqnr_db=q, allclose_ratio=ratio)


# ---------------------------------------------------------------------------------------------
# emulation


def _half_nodes(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Node name -> precision for every compute node that currently runs in half."""
    out = {}
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        decision = node.meta.get(META_DECISION)
        if info is not None and decision is not None and info.kind == "compute" and decision.precision in HALF_NAMES:
            out[node.name] = decision.precision
    return out


class HalfEmulator:
    """Evaluates precision assignments of ``gm`` (still fp32) on ``batches`` by rounding at dtype boundaries.

    ``base`` maps node name -> half precision for the nodes that run in half (the current
    decisions, by default); :meth:`evaluate_keep` evaluates ``base`` with some nodes moved to fp32,
    :meth:`evaluate` any assignment. ``runs`` counts the forward passes over the batches actually
    executed (the fp32 reference included); repeated configurations are memoised.
    """

    def __init__(self, gm: torch.fx.GraphModule, batches: Sequence[tuple[tuple, dict]], *, tolerance: Any,
                 base: Optional[Mapping[str, str]] = None, seed: int = 0):
        self.gm = gm
        self.batches = list(batches)
        self.tolerance = Tolerance.parse(tolerance)
        self.base = dict(base if base is not None else _half_nodes(gm))
        self.seed = seed
        self.runs = 0
        self.memo: dict = {}
        graph, mapping = copy_graph(gm)
        nodes = emulated_nodes(gm)
        self.index = {n.name: i for i, n in enumerate(nodes)}
        self.order = [n.name for n in nodes]
        state: list = [None] * len(nodes)
        self.state = state

        def _mp_qin(i, x):
            d = state[i]
            return x if d is None else round_through(x, d)

        def _mp_qout(i, y):
            d = state[i]
            return y if d is None else round_through(y, d)

        # 1) every input a node would cast goes through its own rounding (raw producers here) ...
        for i, old in enumerate(nodes):
            new = mapping[old]
            replaced = {}
            for p in castable_inputs(old):
                with graph.inserting_before(new):
                    replaced[mapping[p]] = graph.call_function(_mp_qin, (i, mapping[p]))
            if not replaced:
                continue
            swap = lambda a, _r=replaced: _r.get(a, a) if isinstance(a, torch.fx.Node) else a  # noqa: E731
            map_castable_args(new, old.meta[META_INFO].op, swap)
        # 2) ... and every output through the producer's rounding, seen by all its users
        for i, old in enumerate(nodes):
            new = mapping[old]
            with graph.inserting_after(new):
                q = graph.call_function(_mp_qout, (i, new))
            new.replace_all_uses_with(q, delete_user_cb=lambda user, _q=q: user is not _q)
        graph.lint()
        self.module = torch.fx.GraphModule(gm, graph, class_name="HalfEmulation")
        self.references = self._run()  # the fp32 reference: every state None
        self.runs += 1

    # -- running ---------------------------------------------------------------------------------
    def _run(self) -> list[list[torch.Tensor]]:
        outs = []
        with torch.no_grad(), preserved_state(self.gm):
            for b, (args, kwargs) in enumerate(self.batches):
                torch.manual_seed(self.seed + b)  # random ops (dropout) draw the same numbers every run
                outs.append([t.detach() for t in floating_outputs(self.module(*args, **kwargs))])
        return outs

    @staticmethod
    def _key(assignment: Mapping[str, str]) -> tuple:
        return tuple(sorted((k, v) for k, v in assignment.items() if v in HALF_NAMES))

    def _keep_assignment(self, keep: Iterable[str]) -> dict[str, str]:
        kept = set(keep)
        return {k: v for k, v in self.base.items() if k not in kept}

    def known_keep(self, keep: Iterable[str]) -> bool:
        """Whether :meth:`evaluate_keep` would answer from the memo (no run)."""
        return self._key(self._keep_assignment(keep)) in self.memo

    def evaluate(self, assignment: Mapping[str, str], *, memo: bool = True) -> Outcome:
        """Run with ``assignment`` (node name -> fp16/bf16; absent nodes fp32)."""
        key = self._key(assignment)
        if memo and key in self.memo:
            return self.memo[key]
        for i in range(len(self.state)):
            self.state[i] = None
        for name, precision in key:
            if name in self.index:
                self.state[self.index[name]] = DTYPES[precision]
        try:
            outs = self._run()
        finally:
            for i in range(len(self.state)):
                self.state[i] = None
        self.runs += 1
        refs = [t for batch in self.references for t in batch]
        flat = [t for batch in outs for t in batch]
        result = judge(self.tolerance, refs, flat)
        self.memo[key] = result
        return result

    def evaluate_keep(self, keep: Iterable[str], *, memo: bool = True) -> Outcome:
        """``base`` with the nodes in ``keep`` moved to fp32."""
        return self.evaluate(self._keep_assignment(keep), memo=memo)


# ---------------------------------------------------------------------------------------------
# search


class Evaluator(Protocol):
    """What :class:`Budget` runs: :class:`HalfEmulator`, or the fp8 search's ``Fp8Evaluator``."""

    runs: int

    def known_keep(self, keep: Iterable[str]) -> bool: ...

    def evaluate_keep(self, keep: Iterable[str], *, memo: bool = True) -> Outcome: ...


class Budget:
    """``evaluate_keep`` with a cap on the runs and a record of the best result reached."""

    def __init__(self, emulator: Evaluator, max_evaluations: int):
        self.em = emulator
        self.max = max_evaluations
        self.start = emulator.runs
        self.best: Optional[tuple[float, tuple[str, ...]]] = None

    def __call__(self, keep: Sequence[str]) -> Outcome:
        if self.em.runs - self.start >= self.max and not self.em.known_keep(keep):
            raise OutOfBudget()
        out = self.em.evaluate_keep(keep)
        if self.best is None or out.sqnr_db > self.best[0]:
            self.best = (out.sqnr_db, tuple(keep))
        return out


class OutOfBudget(MpconvertError):
    """The search ran out of evaluations (caught inside the search)."""

    exit_code = EXIT_INTERNAL


class NoPassingSet(MpconvertError, LookupError):
    """:func:`search_ranked` found no passing prefix; ``why`` says so in one phrase (``ToleranceNotMet.why``).
    Caught by the searches, which raise :class:`ToleranceNotMet`; it never reaches a user (exit 3 if it did)."""

    exit_code = EXIT_INTERNAL

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def search_ranked(evaluate_keep: Callable[[Sequence[str]], Outcome], ranked: Sequence[str], *,
                  max_keep: Optional[int] = None, prune: bool = True, max_prune: int = 16) -> list[str]:
    """The smallest passing prefix of ``ranked`` (galloping + bisection), then pruned.

    ``evaluate_keep(nodes)`` evaluates the assignment with ``nodes`` in fp32. The empty set is
    assumed to fail (the caller checked it). Raises :class:`NoPassingSet` (a ``LookupError``) when even the longest allowed
    prefix fails.
    """
    n = len(ranked) if max_keep is None else min(len(ranked), max_keep)
    if n <= 0:
        raise NoPassingSet("no node may be kept in fp32")
    lo, hi = 0, None
    k = 1
    while hi is None:
        k = min(k, n)
        if evaluate_keep(ranked[:k]).ok:
            hi = k
        else:
            lo = k
            if k == n:
                raise NoPassingSet(f"keeping the {n} most sensitive node(s) in fp32 is not enough")
            k *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if evaluate_keep(ranked[:mid]).ok:
            hi = mid
        else:
            lo = mid
    keep = list(ranked[:hi])
    if prune and 1 < len(keep) <= max_prune:
        for node in list(reversed(keep)):
            trial = [x for x in keep if x != node]
            if trial and evaluate_keep(trial).ok:
                keep = trial
    return keep


def bisect_graph_order(evaluate_keep: Callable[[Sequence[str]], Outcome], nodes: Sequence[str]) -> tuple[list[str], int]:
    """BASELINE: onnxconverter-common's ``auto_convert_mixed_precision`` segment bisection.

    Nodes in graph order form one segment. Repeatedly take the largest undecided segment and try
    converting it to half while every other segment not yet known good stays fp32: success marks
    it good, failure splits it in two halves (a failing single node is bad). The final assignment
    (every non-good node in fp32) is validated once more, as onnxconverter-common does. Returns the
    fp32 set and the number of attempts, final validation included (the fp32 reference run is not
    included: the caller adds it, as for :func:`search_ranked`).
    """
    segments: list[list[Any]] = [[0, len(nodes), "?"]]  # start, size, state: ? / good / bad
    attempts = 0

    def blocked(skip: Optional[list[Any]]) -> list[str]:
        out: list[str] = []
        for seg in segments:
            if seg is not skip and seg[2] != "good":
                out.extend(nodes[seg[0]: seg[0] + seg[1]])
        return out

    while True:
        pending = [s for s in segments if s[2] == "?"]
        if not pending:
            break
        seg = pending[0]
        for s in pending:
            if s[1] > seg[1]:
                seg = s
        attempts += 1
        if evaluate_keep(blocked(seg)).ok:
            seg[2] = "good"
        elif seg[1] == 1:
            seg[2] = "bad"
        else:
            half = seg[1] // 2
            at = segments.index(seg)
            segments[at: at + 1] = [[seg[0], half, "?"], [seg[0] + half, seg[1] - half, "?"]]
    final = blocked(None)
    attempts += 1
    evaluate_keep(final)
    return final, attempts


# ---------------------------------------------------------------------------------------------
# the stage's entry point


def _pin(original: Mapping[str, Decision], keep: Sequence[str], ranks: Mapping[str, int],
         sens: Mapping[str, Sensitivity], tol: Tolerance, base_sqnr: float) -> dict[str, Decision]:
    """fp32 decisions for the kept nodes, with the evidence and what they were before the search."""
    overrides = {}
    for name in keep:
        old = original[name]
        s = sens.get(name)
        est = f"alone in {old.precision} ~{s.est_sqnr_db:.1f} dB" if s is not None and math.isfinite(s.est_sqnr_db) else (
            f"alone in {old.precision} it overflows" if s is not None and s.score == math.inf else "")
        reason = (f"accuracy search: kept in fp32 to meet {tol} (sensitivity rank {ranks.get(name, 0) + 1}"
                  f"{'; ' + est if est else ''}; SQNR before the search {base_sqnr:.1f} dB) (was {old.precision} by {old.rule})")
        match = Match(rule=SEARCH_REF, precision="fp32", level=rank(OVERRIDE_LEVEL), level_name=OVERRIDE_LEVEL, reason=reason)
        overrides[name] = old.replace(precision="fp32", requested="fp32", rule=SEARCH_REF, reason=reason,
                                           matches=(match,) + tuple(old.matches), unmatched=False, notes=())
    return overrides


def accuracy_search(
    gm: torch.fx.GraphModule,
    batches: Sequence[tuple[tuple, dict]],
    *,
    tolerance: Any,
    settings: PlaceSettings,
    rules: Any = None,
    fresh: Optional[Mapping[str, Decision]] = None,
    options: Optional[SearchOptions] = None,
    progress: bool = False,
) -> dict:
    """Pin the fewest nodes to fp32 so that ``gm``'s outputs meet ``tolerance``; returns the report dict.

    ``batches`` are normalised ``(args, kwargs)`` pairs (the calibration inputs; the first
    ``options.max_batches`` are used). ``options`` bound the candidate evaluations and the size of
    the fp32 set. Decisions of the kept nodes are replaced and placement re-run with ``settings``
    (``fresh`` are the pre-placement decisions, see :func:`converter.numerics.redecide.replace_decisions`;
    without them ``rules`` gives them). Raises :class:`ToleranceNotMet` when the tolerance cannot be met.
    """
    t0 = time.perf_counter()
    options = options if options is not None else SearchOptions()
    tol = Tolerance.parse(tolerance)
    batches = list(batches)[: options.max_batches] if options.max_batches else list(batches)
    if not batches:
        raise ValueError("accuracy search: no batches to evaluate on")
    base = _half_nodes(gm)
    original = {n.name: n.meta[META_DECISION] for n in gm.graph.nodes if META_DECISION in n.meta}
    em = HalfEmulator(gm, batches, tolerance=tol, base=base, seed=options.seed)
    budget = Budget(em, options.max_evaluations)
    report: dict = {"tolerance": str(tol), "batches": len(batches), "candidates": len(base)}
    bar = progress_bar(progress)
    with bar:
        task = bar.add_task("accuracy search", total=None)
        first = budget(())
        report["initial_sqnr_db"] = json_float(first.sqnr_db)
        found = _Found()
        if not first.ok:
            found = _rank_and_search(gm, batches, base, budget, first, tol, options, report)
            bar.advance(task)
        final = first
        if found.keep:
            if fresh is None:
                if rules is None:
                    raise ValueError("accuracy_search needs rules= (or fresh=) to re-run placement")
                fresh = fresh_decisions(gm, rules, settings.target)
            final = _pin_and_verify(gm, em, found, original, tol, first.sqnr_db, fresh=fresh, settings=settings,
                                    max_keep=options.max_keep, n_base=len(base))
    report.update({
        "met": True,
        "kept_fp32": list(found.keep),
        "sqnr_db": json_float(final.sqnr_db),
        "allclose_ratio": None if final.allclose_ratio is None else json_float(final.allclose_ratio),
        # every forward-equivalent pass: the fp32 reference, the candidate runs, and the ranking
        "evaluations": em.runs + found.ranking_cost,
        "evaluation_breakdown": {"reference": 1, "candidates": em.runs - 1, "ranking": found.ranking_cost},
        "seconds": time.perf_counter() - t0,
    })
    return report


@dataclass
class _Found:
    """What the ranked search found: the fp32 set, the sensitivities and what the ranking cost."""

    keep: list = field(default_factory=list)
    sens: dict = field(default_factory=dict)
    ranks: dict = field(default_factory=dict)
    ranking_cost: int = 0


def _rank_and_search(gm: torch.fx.GraphModule, batches: list, base: Mapping[str, str], budget: Budget, first: Outcome,
                     tol: Tolerance, options: SearchOptions, report: dict) -> _Found:
    """Rank the half nodes, then search the ranked list for the smallest passing fp32 set."""
    ranked = rank_sensitivity(gm, batches, base=base, projections=options.projections, seed=options.seed)
    found = _Found(sens={s.name: s for s in ranked}, ranks={s.name: i for i, s in enumerate(ranked)},
                   ranking_cost=2 + 2 * options.projections)
    report["ranking"] = [s.to_dict() for s in ranked[:10]]
    # at least one node must stay in half: keeping every candidate is no conversion at all
    limit = len(ranked) - 1 if options.max_keep is None else min(options.max_keep, len(ranked) - 1)
    try:
        found.keep = search_ranked(budget, [s.name for s in ranked], max_keep=limit, prune=options.prune)
    except (NoPassingSet, OutOfBudget) as exc:
        best_sqnr, best_set = budget.best if budget.best else (first.sqnr_db, ())
        why = exc.why if isinstance(exc, NoPassingSet) else f"{options.max_evaluations} evaluations were not enough"
        raise ToleranceNotMet(best_sqnr, best_set, tolerance=tol, evaluations=found.ranking_cost + budget.em.runs,
                              why=why) from None
    return found


def _pin_and_verify(gm: torch.fx.GraphModule, em: HalfEmulator, found: _Found, original: Mapping[str, Decision],
                    tol: Tolerance, base_sqnr: float, *, fresh: Mapping[str, Decision], settings: PlaceSettings,
                    max_keep: Optional[int], n_base: int) -> Outcome:
    """Pin ``found.keep`` to fp32, re-place, and verify the assignment placement produced.

    Placement may move ``follow`` neighbours back to half; while the result fails, the next most
    sensitive node joins the kept set.
    """
    keep = found.keep
    for _ in range(n_base + 1):
        overrides = _pin(original, keep, found.ranks, found.sens, tol, base_sqnr)
        current = {n.name: n.meta[META_DECISION] for n in gm.graph.nodes if META_DECISION in n.meta}
        # earlier calibration decisions (overflow fallback) stay; this search's pins are replaced
        kept_before = {k: d for k, d in current.items() if d.rule.table == "calibration" and d.rule != SEARCH_REF}
        replace_decisions(gm, {**{k: v for k, v in kept_before.items() if k not in overrides}, **overrides},
                          fresh=fresh, settings=settings)
        final = em.evaluate(_half_nodes(gm))
        if final.ok:
            return final
        candidates = [s.name for s in sorted(found.sens.values(), key=lambda s: -s.score) if s.name not in keep]
        if not candidates or (max_keep is not None and len(keep) >= max_keep):
            raise ToleranceNotMet(final.sqnr_db, keep, tolerance=tol, evaluations=found.ranking_cost + em.runs,
                                  why="the assignment after re-placement does not meet it")
        keep.append(candidates[0])
    return final
