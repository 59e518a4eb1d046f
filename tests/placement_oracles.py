"""Test oracle for cast placement: brute force over every labelling.

:func:`solve_exhaustive` enumerates all labellings of all free/promote nodes of a small
problem, with no decomposition, no constant folding and the no-extra-rounding invariant checked
by simulating the rounding on each labelling (not by the min-cut encoding); the tests compare
:func:`converter.passes.place.solver.solve_mincut` against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MappingProxyType

from converter.passes.place.problem import (
    FP32,
    HALF,
    PRODUCER_FP32,
    PRODUCER_HALF,
    PlacementProblem,
    PlacementResult,
    Term,
    producer_sets,
    reference_labels,
)
from converter.passes.place.solver import enumerate_region

__all__ = ["solve_exhaustive"]


def _rounding_checker(problem: PlacementProblem, nodes: Sequence[str]) -> Callable[[int], bool]:
    """:func:`~converter.passes.place.problem.satisfies_invariant` on bit masks (bit i set = ``nodes[i]`` is fp32):
    the same simulation, written for speed, independent of the min-cut encoding."""
    index = {n: i for i, n in enumerate(nodes)}
    ref = reference_labels(problem)
    producers = producer_sets(problem)
    reference_fp32 = sum(1 << i for i, n in enumerate(nodes) if ref[n] == FP32)
    feeds = {n: sum(1 << index[p] for p in producers.get(n, ()) if p in index) for n in nodes}
    order: list[str] = []  # topological order of the choosable nodes (Kahn; cycles keep going round)
    indegree = {n: sum(1 for p in producers.get(n, ()) if p in index) for n in nodes}
    ready = [n for n in nodes if indegree[n] == 0]
    consumers: dict[str, list[str]] = {}
    for n in nodes:
        for p in producers.get(n, ()):
            if p in index:
                consumers.setdefault(p, []).append(n)
    while ready:
        n = ready.pop()
        order.append(n)
        for c in consumers.get(n, ()):
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    steps = [(feeds[n], 1 << index[n]) for n in order]
    cyclic = len(order) < len(nodes)
    if cyclic:
        steps = [(feeds[n], 1 << index[n]) for n in nodes]
    promote_mask = sum(1 << index[q] for q in problem.promote)
    guards = [feeds.get(g, 0) for g in problem.promote]
    guards += [sum(1 << index[p] for p in producers.get(g, ()) if p in index)
               for g, label in problem.fixed.items() if label == FP32]
    guards = [g for g in guards if g]
    full = (1 << len(nodes)) - 1

    def accept(mask: int) -> bool:
        rounded = reference_fp32 & ~mask & full
        while True:
            before = rounded
            for pm, bit in steps:
                if pm & rounded:
                    rounded |= bit
            if not cyclic or rounded == before:
                break
        return not (rounded & promote_mask) and not any(g & rounded for g in guards)

    return accept


def _forced_checker(
    forced: set[int], then: Callable[[int], bool] | None
) -> Callable[[int], bool] | None:
    """Refuse the masks that leave a node of ``forced`` half (promote nodes fed by a fixed fp32
    producer), then apply ``then``."""
    if not forced:
        return then
    forced_mask = sum(1 << q for q in forced)

    def accept(mask: int) -> bool:
        return not forced_mask & ~mask and (then is None or then(mask))

    return accept


def solve_exhaustive(
    problem: PlacementProblem, *, max_nodes: int = 20, invariant: bool = True
) -> PlacementResult:
    """Brute force over all labellings of all free/promote nodes (tests only).

    ``invariant``: only labellings that
    :func:`~converter.passes.place.problem.satisfies_invariant` (simulated on
    each labelling, not the min-cut encoding) compete.
    No decomposition and no constant folding: every tensor is compiled as is.
    Ties break towards fewer fp32 nodes, then the lowest enumeration index.
    ``regions`` is 1 (the whole problem) or 0 when there is nothing to label.
    """
    nodes = tuple(problem.free) + tuple(problem.promote)
    if len(nodes) > max_nodes:
        raise ValueError(
            f"solve_exhaustive: {len(nodes)} free/promote nodes > max_nodes={max_nodes}"
        )
    index = {n: i for i, n in enumerate(nodes)}
    promote = set(problem.promote)
    fixed = problem.fixed
    terms: list[Term] = []
    constraints: list[tuple[int, int]] = []
    forced: set[int] = set()
    for tensor in problem.tensors:
        p = tensor.producer
        prod = index[p] if p in index else (PRODUCER_HALF if fixed[p] == HALF else PRODUCER_FP32)
        cons = set()
        fixed_half = fixed_fp32 = False
        for c in tensor.consumers:
            if c == p:
                continue
            if c in index:
                cons.add(index[c])
                if c in promote:
                    if prod >= 0:
                        constraints.append((prod, index[c]))
                    elif prod == PRODUCER_FP32:
                        forced.add(index[c])
            elif fixed[c] == HALF:
                fixed_half = True
            else:
                fixed_fp32 = True
        terms.append(Term(prod, tensor.cost, tuple(sorted(cons)), fixed_half, fixed_fp32))
    accept = _forced_checker(forced, _rounding_checker(problem, nodes) if invariant else None)
    fp32, cost, alt = enumerate_region(
        len(nodes), terms, constraints, range(len(nodes)), alternatives=True, accept=accept
    )
    labels = {n: FP32 if f else HALF for n, f in zip(nodes, fp32)}
    return PlacementResult(
        labels=MappingProxyType(labels),
        cost=cost,
        alternative_cost=MappingProxyType({nodes[i]: d for i, d in sorted(alt.items())}),
        regions=1 if nodes else 0,
    )
