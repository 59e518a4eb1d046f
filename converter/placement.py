"""Optimal cast placement for ``follow`` and ``promote`` nodes (DESIGN.md §2 "place").

The problem is pure (no torch): nodes carry a label in ``{"half", "fp32"}``.

* **fixed** nodes have a known label (rule decisions, graph-output sinks);
* **free** nodes (``follow``) choose a label;
* **promote** nodes choose a label too, but must be ``"fp32"`` as soon as one of
  their producers (the producer of any tensor they consume) is ``"fp32"``
  (widest-input semantics; an all-half input set still lets them be either).

Every :class:`Tensor` is one output of one producer node, with a ``cost`` (the
bytes a cast of it moves, computed by the caller) and the consumers that read
it.  A consumer needs the tensor in its own label.  One cast per (producer,
target dtype) is shared by all the consumers that need it; with two labels a
tensor therefore costs ``cost`` when at least one consumer's label differs from
its producer's, else 0.  Tensors a consumer can take in any dtype for free
(passive producers such as O2 fp32 parameters, "don't care" consumers) are
simply left out of the problem.

Objective
---------
Minimise the total cast cost; among equal-cost optima, minimise the number of
free/promote nodes labelled ``"fp32"`` (ties break towards half).  Within a
region of ``F`` free/promote nodes the solver minimises the integer
``cost * (F + 1) + #fp32``: the number of fp32 nodes is at most ``F`` so it can
never outweigh one unit of cost, and integer arithmetic keeps it exact.  Regions
are independent, so per-region lexicographic optima add up to the global
lexicographic optimum.

Min-cut encoding (source side ``s`` = half, sink side ``t`` = fp32)
------------------------------------------------------------------
* fixed half nodes *are* ``s``, fixed fp32 nodes *are* ``t``;
* a tensor with producer ``p`` and distinct consumers ``J`` costs
  ``c*[x_p=H and some x_j=F] + c*[x_p=F and some x_j=H]`` (at most one term is
  non-zero).  The first term is one auxiliary node ``a`` with ``a->j`` infinite
  for every ``j`` (so ``a`` is on the fp32 side as soon as a consumer is) and
  ``p->a`` of capacity ``c``; the second is ``b`` with ``j->b`` infinite and
  ``b->p`` of capacity ``c``.  A single consumer needs no auxiliary node:
  ``p->j`` and ``j->p``, both ``c``;
* a promote node ``q`` fed by ``p`` gets ``q->p`` infinite (cut when ``p`` is
  fp32 and ``q`` half);
* the tie-break is ``s->v`` of capacity 1 for each free/promote node, with all
  costs scaled by ``F + 1``;
* "infinite" is an exact finite integer: the sum of all finite capacities + 1.

Decomposition
-------------
The free/promote nodes split into independent *regions*: connected components
of the graph that links every free/promote node sharing a tensor (a tensor
whose producer is fixed links all its free consumers, since they share one
cast; fixed nodes are boundaries).  Tensors with cost 0 only link through
promote constraints; tensors whose cost is decided by fixed nodes alone are
folded into a constant.  Each region is solved on its own small graph, so the
total work stays linear in the graph size for bounded region sizes.  Regions of
at most ``small_region`` nodes are solved by exact enumeration (cheaper than
building a networkx graph); larger ones by ``networkx`` max-flow/min-cut.

Alternative costs
-----------------
``PlacementResult.alternative_cost[n]`` is the cost of the best labelling with
``n`` flipped, minus the optimal cost.  Enumerated regions get it for free.
For min-cut regions it is computed exactly from the max-flow residual network
(dynamic graph cuts, as for min-marginals: pinning ``n`` adds one infinite
edge, and the extra flow is augmented on a journaled copy of the residual
network, then rolled back), so no region is re-solved from scratch.  A promote
node that cannot be half (an fp32 producer forces it) has no entry.

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
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov

__all__ = [
    "HALF",
    "FP32",
    "Tensor",
    "PlacementProblem",
    "PlacementResult",
    "solve_mincut",
    "solve_exhaustive",
    "solve_greedy_tf",
    "total_cost",
    "is_feasible",
]

HALF = "half"
FP32 = "fp32"
_LABELS = (HALF, FP32)

# Producer markers in compiled terms (free producers are local indices >= 0).
_PROD_HALF = -1
_PROD_FP32 = -2


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
                        "node (declare graph outputs as fixed sink nodes; omit don't-care consumers)"
                    )
        object.__setattr__(self, "fixed", MappingProxyType(fixed))
        object.__setattr__(self, "free", free)
        object.__setattr__(self, "promote", promote)
        object.__setattr__(self, "tensors", tensors)


@dataclass(frozen=True)
class PlacementResult:
    """Labels for every free/promote node, and what they cost.

    ``alternative_cost[n]``: optimal cost with ``n`` flipped, minus ``cost``
    (absent when the flip is infeasible or alternatives were not requested).
    ``regions``: number of independent regions solved.
    """

    labels: Mapping[str, str]
    cost: int
    alternative_cost: Mapping[str, int] = field(default_factory=dict)
    regions: int = 0


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


# --------------------------------------------------------------------------- #
# Compilation into regions
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _Region:
    nodes: tuple[int, ...]  # global indices, ascending
    terms: tuple[tuple[int, int, tuple[int, ...], bool, bool], ...]  # local
    constraints: tuple[tuple[int, int], ...]  # (producer, promote), local
    forced: tuple[int, ...]  # local promote nodes forced to fp32


@dataclass(frozen=True)
class _Compiled:
    nodes: tuple[str, ...]
    constant: int
    regions: tuple[_Region, ...]


def _compile(problem: PlacementProblem) -> _Compiled:
    """Fold constants, link free/promote nodes, and split into regions (linear)."""
    nodes = tuple(problem.free) + tuple(problem.promote)
    n_free = len(problem.free)
    index = {node: i for i, node in enumerate(nodes)}
    fixed = problem.fixed
    parent = list(range(len(nodes)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    terms: list[tuple[int, int, tuple[int, ...], bool, bool]] = []
    constraints: list[tuple[int, int]] = []
    forced: set[int] = set()
    constant = 0
    for tensor in problem.tensors:
        producer = tensor.producer
        pi = index.get(producer, -1)
        plabel = fixed[producer] if pi < 0 else None
        cons: set[int] = set()
        fixed_half = fixed_fp32 = False
        for consumer in tensor.consumers:
            if consumer == producer:
                continue
            ci = index.get(consumer, -1)
            if ci < 0:
                if fixed[consumer] == HALF:
                    fixed_half = True
                else:
                    fixed_fp32 = True
                continue
            cons.add(ci)
            if ci >= n_free:  # promote consumer: widest-input constraint
                if pi < 0:
                    if plabel == FP32:
                        forced.add(ci)
                else:
                    constraints.append((pi, ci))
                    union(pi, ci)
        cost = tensor.cost
        if cost == 0:
            continue
        if pi < 0:
            if (fixed_fp32 if plabel == HALF else fixed_half):
                constant += cost  # a fixed consumer already needs the cast
                continue
            if not cons:
                continue
            prod = _PROD_HALF if plabel == HALF else _PROD_FP32
            fixed_half = fixed_fp32 = False  # same label as the producer: irrelevant
        else:
            if fixed_half and fixed_fp32:
                constant += cost  # someone always differs from the producer
                continue
            if not cons and not fixed_half and not fixed_fp32:
                continue
            prod = pi
        ordered = tuple(sorted(cons))
        anchor = ordered[0] if prod < 0 else prod
        for ci in ordered:
            union(anchor, ci)
        terms.append((prod, cost, ordered, fixed_half, fixed_fp32))

    members: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        members.setdefault(find(i), []).append(i)
    r_terms: dict[int, list] = {}
    for term in terms:
        prod, _, cons, _, _ = term
        root = find(prod if prod >= 0 else cons[0])
        r_terms.setdefault(root, []).append(term)
    r_cons: dict[int, list] = {}
    for pair in constraints:
        r_cons.setdefault(find(pair[1]), []).append(pair)
    r_forced: dict[int, list] = {}
    for q in sorted(forced):
        r_forced.setdefault(find(q), []).append(q)

    regions = []
    for root, mem in members.items():
        if len(mem) == 1:
            local = {mem[0]: 0}
        else:
            local = {g: i for i, g in enumerate(mem)}
        lterms = tuple(
            (local[p] if p >= 0 else p, c, tuple(local[j] for j in js), fh, ff)
            for p, c, js, fh, ff in r_terms.get(root, ())
        )
        lcons = tuple((local[p], local[q]) for p, q in r_cons.get(root, ()))
        lforced = tuple(local[q] for q in r_forced.get(root, ()))
        regions.append(_Region(tuple(mem), lterms, lcons, lforced))
    return _Compiled(nodes, constant, tuple(regions))


# --------------------------------------------------------------------------- #
# Exact enumeration (small regions, and the brute-force reference)
# --------------------------------------------------------------------------- #
def _enumerate(
    k: int,
    terms: Sequence[tuple[int, int, tuple[int, ...], bool, bool]],
    constraints: Sequence[tuple[int, int]],
    forced: Sequence[int],
    *,
    alternatives: bool,
) -> tuple[int, int, dict[int, int]]:
    """Return (fp32 mask, cost, {local node: alternative delta}) by trying all
    2**k labellings; bit i set = node i is fp32."""
    compiled = []
    for prod, cost, cons, fixed_half, fixed_fp32 in terms:
        cmask = 0
        for j in cons:
            cmask |= 1 << j
        if prod >= 0:
            compiled.append((1 << prod, False, cost, cmask, fixed_half, fixed_fp32))
        else:
            compiled.append((0, prod == _PROD_FP32, cost, cmask, fixed_half, fixed_fp32))
    forced_mask = 0
    for q in forced:
        forced_mask |= 1 << q
    need: dict[int, int] = {}
    for p, q in constraints:
        need[q] = need.get(q, 0) | (1 << p)
    needs = [(pmask, 1 << q) for q, pmask in need.items()]

    best_key = None
    best_mask = 0
    best_cost = 0
    costs: list[int] = []  # -1 = infeasible
    scale = k + 1
    for m in range(1 << k):
        if forced_mask & ~m or any(m & pm and not m & qb for pm, qb in needs):
            costs.append(-1)
            continue
        cost = 0
        for pbit, pfp32, c, cmask, fh, ff in compiled:
            if (m & pbit) if pbit else pfp32:
                if fh or cmask & ~m:
                    cost += c
            elif ff or cmask & m:
                cost += c
        costs.append(cost)
        key = cost * scale + m.bit_count()
        if best_key is None or key < best_key:
            best_key, best_mask, best_cost = key, m, cost
    alt: dict[int, int] = {}
    if alternatives:
        for i in range(k):
            bit = 1 << i
            want = (best_mask & bit) ^ bit
            flipped = [c for m, c in enumerate(costs) if c >= 0 and m & bit == want]
            if flipped:
                alt[i] = min(flipped) - best_cost
    return best_mask, best_cost, alt


# --------------------------------------------------------------------------- #
# Min-cut (networkx) with exact dynamic alternatives
# --------------------------------------------------------------------------- #
def _cut_graph(
    k: int,
    terms: Sequence[tuple[int, int, tuple[int, ...], bool, bool]],
    constraints: Sequence[tuple[int, int]],
    forced: Sequence[int],
) -> tuple[nx.DiGraph, int, int, int, int]:
    """Build the region's flow network; returns (G, s, t, inf, scale)."""
    s, t = k, k + 1
    scale = k + 1
    caps: dict[tuple[int, int], int] = {}
    infinite: list[tuple[int, int]] = []
    aux = k + 2

    def add(u: int, v: int, c: int) -> None:
        if u != t and v != s and u != v:
            caps[u, v] = caps.get((u, v), 0) + c

    def add_inf(u: int, v: int) -> None:
        if u != t and v != s and u != v:
            infinite.append((u, v))

    for prod, cost, cons, fixed_half, fixed_fp32 in terms:
        p = prod if prod >= 0 else (s if prod == _PROD_HALF else t)
        js = list(cons)
        if fixed_half:
            js.append(s)
        if fixed_fp32:
            js.append(t)
        w = cost * scale
        if len(js) == 1:
            add(p, js[0], w)
            add(js[0], p, w)
            continue
        if p != t:  # [x_p = H and some x_j = F]
            a = aux
            aux += 1
            add(p, a, w)
            for j in js:
                add_inf(a, j)
        if p != s:  # [x_p = F and some x_j = H]
            b = aux
            aux += 1
            add(b, p, w)
            for j in js:
                add_inf(j, b)
    for q in forced:
        add_inf(q, t)
    for p, q in constraints:
        add_inf(q, p)
    for v in range(k):
        add(s, v, 1)  # tie-break: one unit per fp32 node
    inf = sum(caps.values()) + 1
    for edge in infinite:
        caps[edge] = inf
    graph = nx.DiGraph()
    graph.add_nodes_from((s, t))
    graph.add_edges_from((u, v, {"capacity": c}) for (u, v), c in caps.items())
    return graph, s, t, inf, scale


def _sink_side(residual: nx.DiGraph, t: int) -> set[int]:
    """Nodes that can still reach ``t`` in the residual network (the fp32 side)."""
    seen = {t}
    queue = deque((t,))
    pred = residual.pred
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
        succ = residual.succ
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

    def rollback(self) -> None:
        res = self.res
        for e, value in self.journal.items():
            res[e] = value
        self.journal.clear()

    def augment_into(self, src: int, dst: int, limit: int) -> int:
        """Max flow src->dst, searching backwards from dst; stops at ``limit``."""
        adj, head, res = self.adj, self.head, self.res
        total = 0
        while total < limit:
            via = {dst: -1}
            queue = deque((dst,))
            found = False
            while queue and not found:
                x = queue.popleft()
                for e in adj[x]:
                    y = head[e]
                    if y not in via and res[e ^ 1] > 0:  # edge y -> x
                        via[y] = e ^ 1
                        if y == src:
                            found = True
                            break
                        queue.append(y)
            if not found:
                break
            path, x = [], src
            while x != dst:
                e = via[x]
                path.append(e)
                x = head[e]
            amount = min(res[e] for e in path)
            self._push(path, amount)
            total += amount
        return total

    def augment_from(self, src: int, dst: int, limit: int) -> int:
        """Max flow src->dst, searching forwards from src; stops at ``limit``."""
        adj, head, res = self.adj, self.head, self.res
        total = 0
        while total < limit:
            via = {src: -1}
            queue = deque((src,))
            found = False
            while queue and not found:
                x = queue.popleft()
                for e in adj[x]:
                    y = head[e]
                    if y not in via and res[e] > 0:
                        via[y] = e
                        if y == dst:
                            found = True
                            break
                        queue.append(y)
            if not found:
                break
            path, x = [], dst
            while x != src:
                e = via[x]
                path.append(e)
                x = head[e ^ 1]
            amount = min(res[e] for e in path)
            self._push(path, amount)
            total += amount
        return total


def _mincut(
    k: int,
    terms: Sequence[tuple[int, int, tuple[int, ...], bool, bool]],
    constraints: Sequence[tuple[int, int]],
    forced: Sequence[int],
    *,
    alternatives: bool,
    flow_func: Callable,
) -> tuple[int, int, dict[int, int]]:
    """Same contract as :func:`_enumerate`, solved as a minimum s-t cut."""
    graph, s, t, inf, scale = _cut_graph(k, terms, constraints, forced)
    residual = flow_func(graph, s, t, capacity="capacity")
    value = residual.graph["flow_value"]
    if value >= inf:  # cannot happen: all-fp32 is always feasible
        raise RuntimeError("placement: min-cut found no feasible labelling")
    fp32_side = _sink_side(residual, t)
    mask = 0
    for v in range(k):
        if v in fp32_side:
            mask |= 1 << v
    cost, n_fp32 = divmod(value, scale)
    if n_fp32 != mask.bit_count():  # pragma: no cover - internal consistency
        raise RuntimeError("placement: min-cut partition disagrees with its value")
    alt: dict[int, int] = {}
    if alternatives:
        net = _Residual(residual, max(graph.nodes) + 1)
        headroom = inf - value  # extra flow >= headroom means the flip is infeasible
        for v in range(k):
            if mask >> v & 1:  # fp32 now: pin half (s->v infinite)
                extra = net.augment_from(v, t, headroom)
            else:  # half now: pin fp32 (v->t infinite)
                extra = net.augment_into(s, v, headroom)
            net.rollback()
            if extra < headroom:
                alt[v] = (value + extra) // scale - cost
    return mask, cost, alt


# --------------------------------------------------------------------------- #
# Solvers
# --------------------------------------------------------------------------- #
def solve_mincut(
    problem: PlacementProblem,
    *,
    alternatives: bool = True,
    small_region: int = 4,
    flow_func: Callable | None = None,
) -> PlacementResult:
    """Exact minimum-cast labelling, region by region.

    ``small_region``: regions with at most this many free/promote nodes are
    enumerated exactly instead of building a flow network (0 forces min-cut
    everywhere).  ``flow_func``: a networkx max-flow function returning a
    residual network (default ``boykov_kolmogorov``).  ``alternatives``:
    compute ``alternative_cost`` (exact; see module doc).
    """
    if small_region < 0:
        raise ValueError(f"small_region must be >= 0, got {small_region}")
    func = boykov_kolmogorov if flow_func is None else flow_func
    compiled = _compile(problem)
    nodes = compiled.nodes
    labels: dict[str, str] = {}
    alt_cost: dict[str, int] = {}
    total = compiled.constant
    for region in compiled.regions:
        k = len(region.nodes)
        if not region.terms and not region.forced and not region.constraints:
            mask, cost, alt = 0, 0, ({i: 0 for i in range(k)} if alternatives else {})
        elif k <= small_region:
            mask, cost, alt = _enumerate(
                k, region.terms, region.constraints, region.forced, alternatives=alternatives
            )
        else:
            mask, cost, alt = _mincut(
                k,
                region.terms,
                region.constraints,
                region.forced,
                alternatives=alternatives,
                flow_func=func,
            )
        total += cost
        for i, g in enumerate(region.nodes):
            labels[nodes[g]] = FP32 if mask >> i & 1 else HALF
        for i, delta in alt.items():
            alt_cost[nodes[region.nodes[i]]] = delta
    ordered = {n: labels[n] for n in nodes}
    ordered_alt = {n: alt_cost[n] for n in nodes if n in alt_cost}
    return PlacementResult(
        labels=MappingProxyType(ordered),
        cost=total,
        alternative_cost=MappingProxyType(ordered_alt),
        regions=len(compiled.regions),
    )


def solve_exhaustive(problem: PlacementProblem, *, max_nodes: int = 20) -> PlacementResult:
    """Brute force over all labellings of all free/promote nodes (tests only).

    No decomposition and no constant folding: every tensor is compiled as is.
    Ties break towards fewer fp32 nodes, then the lowest enumeration index.
    ``regions`` is 1 (the whole problem) or 0 when there is nothing to label.
    """
    nodes = tuple(problem.free) + tuple(problem.promote)
    if len(nodes) > max_nodes:
        raise ValueError(f"solve_exhaustive: {len(nodes)} free/promote nodes > max_nodes={max_nodes}")
    index = {n: i for i, n in enumerate(nodes)}
    promote = set(problem.promote)
    fixed = problem.fixed
    terms = []
    constraints = []
    forced = set()
    for tensor in problem.tensors:
        p = tensor.producer
        prod = index[p] if p in index else (_PROD_HALF if fixed[p] == HALF else _PROD_FP32)
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
                    elif prod == _PROD_FP32:
                        forced.add(index[c])
            elif fixed[c] == HALF:
                fixed_half = True
            else:
                fixed_fp32 = True
        terms.append((prod, tensor.cost, tuple(sorted(cons)), fixed_half, fixed_fp32))
    mask, cost, alt = _enumerate(len(nodes), terms, constraints, sorted(forced), alternatives=True)
    labels = {n: FP32 if mask >> i & 1 else HALF for i, n in enumerate(nodes)}
    return PlacementResult(
        labels=MappingProxyType(labels),
        cost=cost,
        alternative_cost=MappingProxyType({nodes[i]: d for i, d in sorted(alt.items())}),
        regions=1 if nodes else 0,
    )


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
    fixed = problem.fixed
    free = set(problem.free)
    promote = set(problem.promote)
    succ: dict[str, set[str]] = {}
    pred: dict[str, set[str]] = {}
    for tensor in problem.tensors:
        for c in tensor.consumers:
            if c != tensor.producer:
                succ.setdefault(tensor.producer, set()).add(c)
                pred.setdefault(c, set()).add(tensor.producer)
    order = list(fixed) + list(problem.free) + list(problem.promote)
    position = {n: i for i, n in enumerate(order)}
    allow = {n for n in order if fixed.get(n) == HALF}
    deny_roots = [n for n in order if fixed.get(n) == FP32]
    deny = set(deny_roots)

    def dfs(roots, step, enter, visit) -> None:
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

    def outs(x):
        return succ.get(x, ())

    def ins(x):
        return pred.get(x, ())

    # (2) deny forward through clear/infer nodes upstream of deny or infer.
    upstream: set[str] = set()
    roots = [n for n in order if fixed.get(n) == FP32 or n in promote]
    for root in roots:
        dfs([root], ins, lambda y: y not in upstream and y in free, upstream.add)
    for root in deny_roots:
        dfs([root], outs, lambda y: y not in deny and y in upstream, deny.add)
    # (3) clear/infer between two allow nodes.
    paintable = free | promote
    downstream: set[str] = set()
    for root in sorted(allow, key=position.__getitem__):
        dfs(
            [root],
            outs,
            lambda y: y not in downstream and y not in allow and y not in deny and y in paintable,
            downstream.add,
        )
    upstream_allow: set[str] = set()
    between: set[str] = set()

    def mark_between(x: str) -> None:
        upstream_allow.add(x)
        if x in downstream and x not in allow:
            between.add(x)

    for root in sorted(allow, key=position.__getitem__):
        dfs(
            [root],
            ins,
            lambda y: y not in upstream_allow and y not in allow and y not in deny and y in paintable,
            mark_between,
        )
    allow |= between
    # (4) bf16: infer with an allow input and no deny input.
    if bf16:
        for q in problem.promote:
            if q not in deny and q not in allow:
                inputs = ins(q)
                if any(p in allow for p in inputs) and not any(p in deny for p in inputs):
                    allow.add(q)
    # (5) allow both ways through clear nodes.
    def both(x):
        return set(succ.get(x, ())) | set(pred.get(x, ()))

    grown: set[str] = set()
    for root in sorted(allow, key=position.__getitem__):
        dfs([root], both, lambda y: y not in allow and y not in deny and y in free and y not in grown, grown.add)
    allow |= grown
    labels = {n: HALF if n in allow else FP32 for n in itertools.chain(problem.free, problem.promote)}
    # Repair: a promote node with an fp32 producer is fp32.
    full = dict(fixed)
    full.update(labels)
    queue = deque(n for n in order if full[n] == FP32)
    while queue:
        x = queue.popleft()
        for y in succ.get(x, ()):
            if y in promote and full[y] == HALF:
                full[y] = labels[y] = FP32
                queue.append(y)
    nodes = tuple(problem.free) + tuple(problem.promote)
    return PlacementResult(
        labels=MappingProxyType(labels),
        cost=total_cost(problem, labels),
        alternative_cost=MappingProxyType({}),
        regions=1 if nodes else 0,
    )
