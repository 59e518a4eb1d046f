"""A baseline placement algorithm, for comparison only: TF grappler-style greedy painting.

The conversion never runs it (placement is :func:`converter.passes.place.solver.solve_mincut`).
:func:`solve_greedy_tf` replays the painting passes of TensorFlow's ``auto_mixed_precision.cc``
on a :class:`~converter.passes.place.problem.PlacementProblem`, so that the tests can check the
min-cut is never worse, and ``benchmarks/placement_scaling.py`` can report both costs.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import NamedTuple

from converter.passes.place.problem import FP32, HALF, PlacementProblem, PlacementResult, total_cost

__all__ = ["solve_greedy_tf"]


class _TfGraph(NamedTuple):
    """The producer -> consumer graph that :func:`solve_greedy_tf` paints."""

    succ: dict[str, set[str]]
    pred: dict[str, set[str]]
    order: list[str]  # fixed, then free, then promote nodes
    position: dict[str, int]

    def outs(self, x: str) -> Iterable[str]:
        return self.succ.get(x, ())

    def ins(self, x: str) -> Iterable[str]:
        return self.pred.get(x, ())

    def both(self, x: str) -> set[str]:
        return set(self.succ.get(x, ())) | set(self.pred.get(x, ()))

    def in_order(self, nodes: Iterable[str]) -> list[str]:
        return sorted(nodes, key=self.position.__getitem__)


def _tf_graph(problem: PlacementProblem) -> _TfGraph:
    succ: dict[str, set[str]] = {}
    pred: dict[str, set[str]] = {}
    for tensor in problem.tensors:
        for c in tensor.consumers:
            if c != tensor.producer:
                succ.setdefault(tensor.producer, set()).add(c)
                pred.setdefault(c, set()).add(tensor.producer)
    order = list(problem.fixed) + list(problem.free) + list(problem.promote)
    return _TfGraph(succ, pred, order, {n: i for i, n in enumerate(order)})


def _dfs(
    roots: Iterable[str],
    step: Callable[[str], Iterable[str]],
    enter: Callable[[str], bool],
    visit: Callable[[str], None],
) -> None:
    """Depth-first walk from each root in turn (a fresh ``seen`` per root):
    ``visit`` every node reached, following ``step`` into nodes that ``enter``
    accepts (neighbours in sorted order)."""
    for root in roots:
        stack = [root]
        seen = {root}
        while stack:
            x = stack.pop()
            visit(x)
            for y in sorted(step(x)):
                if y not in seen and enter(y):
                    seen.add(y)
                    stack.append(y)


def _tf_deny(problem: PlacementProblem, graph: _TfGraph) -> set[str]:
    """Pass 2: deny spreads forward through clear/infer nodes that are upstream
    of a deny or infer node; returns the deny set (roots included)."""
    fixed = problem.fixed
    free = set(problem.free)
    promote = set(problem.promote)
    deny_roots = [n for n in graph.order if fixed.get(n) == FP32]
    deny = set(deny_roots)
    upstream: set[str] = set()
    roots = [n for n in graph.order if fixed.get(n) == FP32 or n in promote]
    for root in roots:
        _dfs([root], graph.ins, lambda y: y not in upstream and y in free, upstream.add)
    for root in deny_roots:
        _dfs([root], graph.outs, lambda y: y not in deny and y in upstream, deny.add)
    return deny


def _tf_between(
    problem: PlacementProblem, graph: _TfGraph, allow: set[str], deny: set[str]
) -> set[str]:
    """Pass 3: the clear/infer nodes both downstream and upstream of allow nodes."""
    paintable = set(problem.free) | set(problem.promote)
    roots = graph.in_order(allow)
    downstream: set[str] = set()
    for root in roots:
        _dfs(
            [root],
            graph.outs,
            lambda y: y not in downstream and y not in allow and y not in deny and y in paintable,
            downstream.add,
        )
    upstream_allow: set[str] = set()
    between: set[str] = set()

    def mark_between(x: str) -> None:
        upstream_allow.add(x)
        if x in downstream and x not in allow:
            between.add(x)

    def enter_upstream(y: str) -> bool:
        return y not in upstream_allow and y not in allow and y not in deny and y in paintable

    for root in roots:
        _dfs([root], graph.ins, enter_upstream, mark_between)
    return between


def _tf_bf16_infer(
    problem: PlacementProblem, graph: _TfGraph, allow: set[str], deny: set[str]
) -> None:
    """Pass 4 (bf16 only): an infer node with an allow input and no deny input
    becomes allow (``allow`` is updated in place, in promote order)."""
    for q in problem.promote:
        if q not in deny and q not in allow:
            inputs = graph.ins(q)
            if any(p in allow for p in inputs) and not any(p in deny for p in inputs):
                allow.add(q)


def _tf_grow_clear(
    problem: PlacementProblem, graph: _TfGraph, allow: set[str], deny: set[str]
) -> set[str]:
    """Pass 5: allow spreads both ways through clear nodes; returns the new ones."""
    free = set(problem.free)
    grown: set[str] = set()

    def enter_clear(y: str) -> bool:
        return y not in allow and y not in deny and y in free and y not in grown

    for root in graph.in_order(allow):
        _dfs([root], graph.both, enter_clear, grown.add)
    return grown


def _tf_repair(problem: PlacementProblem, graph: _TfGraph, labels: dict[str, str]) -> None:
    """A promote node with an fp32 producer is fp32: spread fp32 forward through
    promote nodes (``labels`` is updated in place)."""
    promote = set(problem.promote)
    full = dict(problem.fixed)
    full.update(labels)
    queue = deque(n for n in graph.order if full[n] == FP32)
    while queue:
        x = queue.popleft()
        for y in graph.outs(x):
            if y in promote and full[y] == HALF:
                full[y] = labels[y] = FP32
                queue.append(y)


def solve_greedy_tf(problem: PlacementProblem, *, bf16: bool = False) -> PlacementResult:
    """TF grappler-style greedy painting (baseline for tests and benchmarks).

    Mapping: fixed half = allow, fixed fp32 = deny, free = clear, promote =
    infer; edges run producer -> consumer for every tensor (whatever its cost).
    Passes as in ``auto_mixed_precision.cc``: (2) deny spreads forward through
    clear/infer nodes that are upstream of a deny or infer node, (3) clear and
    infer nodes between two allow nodes become allow, (4, ``bf16`` only) an
    infer node with an allow input and no deny input becomes allow, (5) allow
    spreads both ways through clear nodes.  Everything not allow is fp32, then
    promote constraints are repaired by spreading fp32 forward through promote
    nodes.  No optimality guarantee; ``alternative_cost`` is empty and
    ``regions`` is 1 (the graph is painted as a whole) or 0.
    """
    graph = _tf_graph(problem)
    allow = {n for n in graph.order if problem.fixed.get(n) == HALF}
    deny = _tf_deny(problem, graph)
    allow |= _tf_between(problem, graph, allow, deny)
    if bf16:
        _tf_bf16_infer(problem, graph, allow, deny)
    allow |= _tf_grow_clear(problem, graph, allow, deny)
    choosable = itertools.chain(problem.free, problem.promote)
    labels = {n: HALF if n in allow else FP32 for n in choosable}
    _tf_repair(problem, graph, labels)
    nodes = tuple(problem.free) + tuple(problem.promote)
    return PlacementResult(
        labels=MappingProxyType(labels),
        cost=total_cost(problem, labels),
        alternative_cost=MappingProxyType({}),
        regions=1 if nodes else 0,
    )
