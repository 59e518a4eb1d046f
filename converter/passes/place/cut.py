"""The min-cut solver of one placement region: its flow network and the exact alternative costs.

:mod:`converter.passes.place.solver` compiles a problem into independent regions of
:class:`~converter.passes.place.problem.Term` s and hands the regions too large to enumerate to
:func:`solve_region_by_cut`.  Its labelling is the *smallest* sink side of all minimum cuts (the
nodes that can still reach ``t`` in the final residual network), which is the unique tie-broken
optimum (solver module doc, "Objective").

Min-cut encoding (source side ``s`` = half, sink side ``t`` = fp32)
------------------------------------------------------------------
* fixed half nodes *are* ``s``, fixed fp32 nodes *are* ``t``;
* a tensor with producer ``p`` and distinct consumers ``J`` costs
  ``c*[x_p=H and some x_j=F] + c*[x_p=F and some x_j=H]`` (at most one term is
  non-zero, so the sum is exact).  The first term is one auxiliary node ``a``
  with ``a->j`` infinite for every ``j`` (so ``a`` is on the fp32 side as soon
  as a consumer is) and ``p->a`` of capacity ``c``; the second is ``b`` with
  ``j->b`` infinite and ``b->p`` of capacity ``c``.  Exact shortcuts: a term
  over a single free consumer is the edge ``p->j`` (resp. ``j->p``); a fixed
  fp32 consumer turns the first term into ``p->t`` (a fixed half one turns the
  second into ``s->p``); a fixed producer only has the term towards the other
  label;
* a promote node ``q`` fed by ``p`` gets ``q->p`` infinite (cut when ``p`` is
  fp32 and ``q`` half);
* "infinite" is an exact finite integer: the sum of all finite capacities + 1.

Alternative costs are exact dynamic cuts on the max-flow residual network (solver module doc,
"Alternative costs"): :class:`_Residual` augments the extra flow a pinned node needs on a journaled
array copy of the network and rolls it back, so no region is re-solved.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import networkx as nx

from converter.passes.place.problem import PRODUCER_FP32, PRODUCER_HALF, Term

__all__ = ["solve_region_by_cut"]


def _cut_graph(
    k: int, terms: Sequence[Term], constraints: Sequence[tuple[int, int]], index: Sequence[int]
) -> tuple[nx.DiGraph, int, int, int]:
    """Build the region's flow network over nodes ``0..k-1`` (``index`` maps the node numbers of
    ``terms`` and of the ``(producer, promote)`` pairs of ``constraints`` there, ``s = k``,
    ``t = k + 1``, auxiliary nodes after them); returns (G, s, t, inf)."""
    s, t = k, k + 1
    caps: dict[tuple[int, int], int] = {}
    infinite: list[tuple[int, int]] = []
    aux = k + 2

    def add(u: int, v: int, c: int) -> None:
        if u != t and v != s and u != v:
            caps[u, v] = caps.get((u, v), 0) + c

    def add_inf(u: int, v: int) -> None:
        if u != t and v != s and u != v:
            infinite.append((u, v))

    def any_fp32(p: int, cons: tuple[int, ...], cost: int) -> None:
        """cost * [x_p = H and some consumer in cons is F]"""
        nonlocal aux
        if len(cons) == 1:
            add(p, index[cons[0]], cost)
            return
        a = aux
        aux += 1
        add(p, a, cost)
        for j in cons:
            add_inf(a, index[j])

    def any_half(p: int, cons: tuple[int, ...], cost: int) -> None:
        """cost * [x_p = F and some consumer in cons is H]"""
        nonlocal aux
        if len(cons) == 1:
            add(index[cons[0]], p, cost)
            return
        b = aux
        aux += 1
        add(b, p, cost)
        for j in cons:
            add_inf(index[j], b)

    for prod, cost, cons, fixed_half, fixed_fp32 in terms:
        if prod == PRODUCER_HALF:  # fixed consumers agree with p (others were folded)
            any_fp32(s, cons, cost)
        elif prod == PRODUCER_FP32:
            any_half(t, cons, cost)
        else:
            prod = index[prod]
            if fixed_fp32:  # a fixed fp32 consumer: cost whenever p is half
                add(prod, t, cost)
            elif cons:
                any_fp32(prod, cons, cost)
            if fixed_half:  # a fixed half consumer: cost whenever p is fp32
                add(s, prod, cost)
            elif cons:
                any_half(prod, cons, cost)
    for p, q in constraints:
        add_inf(index[q], index[p])
    inf = sum(caps.values()) + 1
    for edge in infinite:
        caps[edge] = inf
    graph: nx.DiGraph[int] = nx.DiGraph()
    graph.add_nodes_from(range(k + 2))
    graph.add_edges_from((u, v, {"capacity": c}) for (u, v), c in caps.items())
    return graph, s, t, inf


def _sink_side(residual: nx.DiGraph, t: int) -> set[int]:
    """Nodes that can still reach ``t`` in the residual network (the fp32 side)."""
    seen = {t}
    queue = deque((t,))
    pred = residual._pred  # type: ignore[attr-defined]  # raw dicts (not in the stubs): the public views iterate in Python
    while queue:
        v = queue.popleft()
        for u, attr in pred[v].items():
            if u not in seen and attr["flow"] < attr["capacity"]:
                seen.add(u)
                queue.append(u)
    return seen


class _Residual:
    """Array form of a networkx residual network with journaled augmentation."""

    __slots__ = ("adj", "head", "res", "journal")

    def __init__(self, residual: nx.DiGraph, n: int) -> None:
        adj: list[list[int]] = [[] for _ in range(n)]
        head: list[int] = []
        res: list[int] = []
        succ = residual._succ  # type: ignore[attr-defined]  # raw dicts (not in the stubs): the public views iterate in Python
        for u, nbrs in succ.items():
            for v, attr in nbrs.items():
                if u < v:  # networkx keeps both directions of every pair
                    back = succ[v][u]
                    e = len(head)
                    head.append(v)
                    res.append(attr["capacity"] - attr["flow"])
                    head.append(u)
                    res.append(back["capacity"] - back["flow"])
                    adj[u].append(e)
                    adj[v].append(e + 1)
        self.adj, self.head, self.res = adj, head, res
        self.journal: dict[int, int] = {}

    def _push(self, path: list[int], amount: int) -> None:
        res, journal = self.res, self.journal
        for e in path:
            for x in (e, e ^ 1):
                if x not in journal:
                    journal[x] = res[x]
            res[e] -= amount
            res[e ^ 1] += amount

    def reachable(self, src: int) -> set[int]:
        """Nodes reachable from ``src`` over edges with residual capacity."""
        adj, head, res = self.adj, self.head, self.res
        seen = {src}
        queue = deque((src,))
        while queue:
            for e in adj[queue.popleft()]:
                y = head[e]
                if y not in seen and res[e] > 0:
                    seen.add(y)
                    queue.append(y)
        return seen

    def rollback(self) -> None:
        res = self.res
        for e, value in self.journal.items():
            res[e] = value
        self.journal.clear()

    def augment(
        self, src: int, dst: int, *, limit: int, budget: int | None, backward: bool
    ) -> int | None:
        """Push up to ``limit`` more flow src->dst (shortest augmenting paths).

        ``backward`` searches from ``dst`` over reversed residual edges (use it
        when ``src`` is the hub ``s``).  Returns the flow pushed, or None when
        more than ``budget`` residual edges had to be scanned.
        """
        adj, head, res = self.adj, self.head, self.res
        start, goal = (dst, src) if backward else (src, dst)
        flip = 1 if backward else 0  # residual edge y->x is e^1 when searching backwards
        remaining = math.inf if budget is None else budget
        total = 0
        while total < limit:
            via = {start: -1}
            queue = deque((start,))
            found = False
            while queue and not found:
                x = queue.popleft()
                edges = adj[x]
                remaining -= len(edges)
                if remaining < 0:
                    return None
                for e in edges:
                    y = head[e]
                    if y not in via and res[e ^ flip] > 0:
                        via[y] = e ^ flip
                        if y == goal:
                            found = True
                            break
                        queue.append(y)
            if not found:
                break
            path = []
            x = goal
            while x != start:  # walk back to start; the path is made of src->dst edges
                e = via[x]
                path.append(e)
                x = head[e] if backward else head[e ^ 1]
            amount = min(res[e] for e in path)
            self._push(path, amount)
            total += amount
        return total


def solve_region_by_cut(
    k: int,
    terms: Sequence[Term],
    constraints: Sequence[tuple[int, int]],
    index: Sequence[int],
    *,
    alternatives: bool,
    flow_func: Callable,
    budget: int | None,
) -> tuple[list[bool], int, dict[int, int]]:
    """Same contract as :func:`converter.passes.place.solver.enumerate_region`, solved as a
    minimum s-t cut with the networkx max-flow function ``flow_func``.

    Alternatives: dynamic cuts on the residual network, ``budget`` edge scans
    per flip at most (a flip over budget gets no entry).
    """
    graph, s, t, inf = _cut_graph(k, terms, constraints, index)
    residual = flow_func(graph, s, t, capacity="capacity")
    value = residual.graph["flow_value"]
    if value >= inf:  # cannot happen: all-fp32 is always feasible
        raise RuntimeError("placement: min-cut found no feasible labelling")
    fp32_side = _sink_side(residual, t)
    fp32 = [v in fp32_side for v in range(k)]
    alt: dict[int, int] = {}
    if alternatives:
        net = _Residual(residual, max(graph.nodes) + 1)
        source_side = net.reachable(s)
        headroom = inf - value  # extra flow >= headroom means the flip is infeasible
        for v in range(k):
            if fp32[v]:  # pin half: s->v infinite, so push v->t
                extra = net.augment(v, t, limit=headroom, budget=budget, backward=False)
            elif v not in source_side:  # no residual path s->v: fp32 is just as cheap
                extra = 0
            else:  # pin fp32: v->t infinite, so push s->v
                extra = net.augment(s, v, limit=headroom, budget=budget, backward=True)
            net.rollback()
            if extra is not None and extra < headroom:
                alt[v] = extra
    return fp32, value, alt


# --------------------------------------------------------------------------- #
