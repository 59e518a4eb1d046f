"""The cast-placement problem: its data, the compiled term form, and labelling evaluation.

Pure (no torch).  The formulation, the objective and the no-extra-rounding invariant are in
:mod:`converter.passes.place.solver`, which solves the problem; this module defines what a
problem is and how a labelling of it is judged (cost, promote feasibility, the invariant by direct
simulation).

Validation (``ValueError``)
---------------------------
Labels other than ``"half"``/``"fp32"``; a node listed twice (within or across
``fixed``/``free``/``promote``); a tensor whose producer or a consumer is not a
declared node (every consumer must be declared: model graph outputs as fixed
sink nodes and leave "don't care" consumers out); a cost that is not a
non-negative integer (``bool`` is refused).  A consumer equal to the producer
is ignored, and duplicated consumers count once.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

__all__ = [
    "HALF",
    "FP32",
    "PRODUCER_HALF",
    "PRODUCER_FP32",
    "Tensor",
    "PlacementProblem",
    "PlacementResult",
    "Term",
    "total_cost",
    "is_feasible",
    "producer_sets",
    "reference_labels",
    "satisfies_invariant",
]

HALF = "half"
FP32 = "fp32"
_LABELS = (HALF, FP32)

# ``Term.producer`` of a fixed producer (a producer to solve has its node index, >= 0).
PRODUCER_HALF = -1
PRODUCER_FP32 = -2


# --------------------------------------------------------------------------- #
# Public data
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Tensor:
    """One output of ``producer``; a cast of it moves ``cost`` bytes."""

    producer: str
    cost: int
    consumers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.cost, bool):
            raise ValueError(f"tensor of {self.producer!r}: cost must be an int, got bool")
        try:
            cost = operator.index(self.cost)
        except TypeError:
            raise ValueError(
                f"tensor of {self.producer!r}: cost must be an int, got {type(self.cost).__name__}"
            ) from None
        if cost < 0:
            raise ValueError(f"tensor of {self.producer!r}: cost must be >= 0, got {cost}")
        object.__setattr__(self, "cost", cost)
        if isinstance(self.consumers, str):
            raise ValueError(
                f"tensor of {self.producer!r}: consumers must be a sequence of node names, "
                f"not the string {self.consumers!r}"
            )
        object.__setattr__(self, "consumers", tuple(self.consumers))


@dataclass(frozen=True)
class PlacementProblem:
    """Nodes, their constraints and the tensors between them (see module doc)."""

    fixed: Mapping[str, str]
    free: Sequence[str]
    promote: Sequence[str] = ()
    tensors: Sequence[Tensor] = ()

    def __post_init__(self) -> None:
        fixed = dict(self.fixed)
        free = tuple(self.free)
        promote = tuple(self.promote)
        tensors = tuple(self.tensors)
        for node, label in fixed.items():
            if label not in _LABELS:
                raise ValueError(
                    f"fixed node {node!r}: unknown label {label!r} (expected 'half' or 'fp32')"
                )
        seen = set(fixed)
        for kind, nodes in (("free", free), ("promote", promote)):
            for node in nodes:
                if node in seen:
                    raise ValueError(f"{kind} node {node!r} is declared more than once")
                seen.add(node)
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                raise ValueError(f"tensors must be Tensor instances, got {type(tensor).__name__}")
            if tensor.producer not in seen:
                raise ValueError(f"tensor producer {tensor.producer!r} is not a declared node")
            for consumer in tensor.consumers:
                if consumer not in seen:
                    raise ValueError(
                        f"tensor of {tensor.producer!r}: consumer {consumer!r} is not a declared "
                        "node (declare graph outputs as fixed sink nodes; omit don't-care "
                        "consumers)"
                    )
        object.__setattr__(self, "fixed", MappingProxyType(fixed))
        object.__setattr__(self, "free", free)
        object.__setattr__(self, "promote", promote)
        object.__setattr__(self, "tensors", tensors)


@dataclass(frozen=True)
class PlacementResult:
    """Labels for every free/promote node, and what they cost.

    ``alternative_cost[n]``: optimal cost with ``n`` flipped, minus ``cost``
    (absent when the flip is infeasible, over the alternative budget, or
    alternatives were not requested).  ``regions``: number of independent
    regions solved (isolated nodes count as one each; promote nodes forced to
    fp32 are labelled without a region).  ``pinned``: the nodes that the
    no-extra-rounding invariant alone keeps fp32 (labelled without a region).
    """

    labels: Mapping[str, str]
    cost: int
    alternative_cost: Mapping[str, int] = field(default_factory=dict)
    regions: int = 0
    pinned: frozenset[str] = frozenset()


class Term(NamedTuple):
    """One tensor compiled over node indices: it costs ``cost`` when a consumer's label differs
    from its producer's (one shared cast per target dtype, so at most ``cost`` in all).

    ``producer``: the index of a node to solve (``>= 0``), or :data:`PRODUCER_HALF` /
    :data:`PRODUCER_FP32` for a fixed producer.  ``consumers``: the distinct indices of the
    consumers to solve, ascending.  ``fixed_half`` / ``fixed_fp32``: some fixed consumer is
    half / fp32.  A NamedTuple: the solvers' hot loops unpack terms at tuple speed.
    """

    producer: int
    cost: int
    consumers: tuple[int, ...]
    fixed_half: bool
    fixed_fp32: bool


# --------------------------------------------------------------------------- #
# Evaluation
# --------------------------------------------------------------------------- #
def _full_labels(problem: PlacementProblem, labels: Mapping[str, str]) -> dict[str, str]:
    full = dict(problem.fixed)
    choosable = set(problem.free) | set(problem.promote)
    for node, label in labels.items():
        if label not in _LABELS:
            raise ValueError(f"node {node!r}: unknown label {label!r}")
        if node in full:
            if full[node] != label:
                raise ValueError(f"fixed node {node!r} is {full[node]!r}, labelling says {label!r}")
        elif node not in choosable:
            raise ValueError(f"labelling names unknown node {node!r}")
    missing = [n for n in itertools.chain(problem.free, problem.promote) if n not in labels]
    if missing:
        raise ValueError(f"labelling misses free/promote nodes: {missing[:5]}")
    full.update(labels)
    return full


def total_cost(problem: PlacementProblem, labels: Mapping[str, str]) -> int:
    """Cast cost of a full labelling (``labels`` covers every free/promote node;
    it may repeat fixed nodes with their fixed label).  Ignores promote
    constraints: see :func:`is_feasible`."""
    full = _full_labels(problem, labels)
    cost = 0
    for tensor in problem.tensors:
        src = full[tensor.producer]
        if any(full[c] != src for c in tensor.consumers if c != tensor.producer):
            cost += tensor.cost
    return cost


def is_feasible(problem: PlacementProblem, labels: Mapping[str, str]) -> bool:
    """True when no promote node is half while one of its producers is fp32."""
    full = _full_labels(problem, labels)
    promote = set(problem.promote)
    for tensor in problem.tensors:
        if full[tensor.producer] != FP32:
            continue
        for c in tensor.consumers:
            if c in promote and c != tensor.producer and full[c] == HALF:
                return False
    return True


def producer_sets(problem: PlacementProblem) -> dict[str, set[str]]:
    """Consumer -> the producers of the tensors it reads (self-reads ignored)."""
    out: dict[str, set[str]] = {}
    for tensor in problem.tensors:
        for c in tensor.consumers:
            if c != tensor.producer:
                out.setdefault(c, set()).add(tensor.producer)
    return out


def reference_labels(problem: PlacementProblem) -> dict[str, str]:
    """Labels under per-consumer casting (autocast): fixed nodes keep theirs, a
    free/promote node is fp32 when one of its producers is (type promotion)."""
    labels = dict(problem.fixed)
    labels.update(dict.fromkeys(itertools.chain(problem.free, problem.promote), HALF))
    consumers: dict[str, set[str]] = {}
    for tensor in problem.tensors:
        for c in tensor.consumers:
            if c != tensor.producer and c not in problem.fixed:
                consumers.setdefault(tensor.producer, set()).add(c)
    stack = [n for n, label in problem.fixed.items() if label == FP32]
    while stack:
        for c in consumers.get(stack.pop(), ()):
            if labels[c] == HALF:
                labels[c] = FP32
                stack.append(c)
    return labels


def satisfies_invariant(problem: PlacementProblem, labels: Mapping[str, str]) -> bool:
    """True when ``labels`` keeps the no-extra-rounding invariant (module doc):
    no fixed fp32 or promote node reads a value that a half label rounded where
    per-consumer casting keeps it fp32.  Direct simulation (the solver compiles the invariant into
    fixed labels instead): for tests and the exhaustive test oracle."""
    full = _full_labels(problem, labels)
    ref = reference_labels(problem)
    producers = producer_sets(problem)
    choosable = set(problem.free) | set(problem.promote)
    rounded = {n for n in choosable if full[n] == HALF and ref[n] == FP32}
    changed = True
    while changed:  # rounding propagates through free/promote nodes (monotone fixpoint)
        changed = False
        for n in choosable - rounded:
            if producers.get(n, set()) & rounded:
                rounded.add(n)
                changed = True
    guarded = {n for n, label in problem.fixed.items() if label == FP32} | set(problem.promote)
    return not any(producers.get(g, set()) & rounded for g in guarded) and not (rounded & set(problem.promote))

