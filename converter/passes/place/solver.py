"""Optimal cast placement for ``follow`` and ``promote`` nodes (docs/architecture.md, "Placement").

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
free/promote nodes labelled ``"fp32"`` (ties break towards half).  Regions are
independent, so per-region lexicographic optima add up to the global one.

* Enumerated regions of ``F`` nodes minimise the integer
  ``cost * (F + 1) + #fp32``: at most ``F`` nodes are fp32, so the count can
  never outweigh one unit of cost, and integer arithmetic keeps it exact.
* Min-cut regions need no extra weights.  The minimum cuts of a network form a
  lattice; the set of nodes that can still reach ``t`` in the final residual
  network is the *smallest* sink side of all minimum cuts (it is contained in
  every one).  Every cost-optimal labelling is some minimum cut, so this cut's
  fp32 set is a subset of every optimum's fp32 set: fewest fp32 nodes, and
  even inclusion-minimal.  That also makes the tie-broken optimum *unique*, so
  enumeration, min-cut and any flow algorithm return the same labels.  (Unit
  tie-break edges ``s->v`` against costs scaled by ``F + 1`` would work too,
  but they need one augmenting path per fp32 node, and made long regions an
  order of magnitude slower.)

Min-cut regions are solved on a flow network whose minimum cuts are exactly the
labellings' costs (the encoding is in :mod:`converter.passes.place.cut`).

The no-extra-rounding invariant (``invariant=True``, the default)
-----------------------------------------------------------------
*Reference*: casting per consumer, as ``torch.autocast`` does.  There every
free/promote node computes in the widest label of its producers
(:func:`reference_labels`: ``fp32`` as soon as one producer is ``fp32``, type
promotion), and a cast to half happens only at the input of a fixed half node.
Placement may move a cast away from that reference only where this changes no
value read by a *guarded* consumer: a fixed ``fp32`` node (an fp32-decided op,
an explicit cast, the fp32 graph-output sink) or a ``promote`` node.  Moving an
up-cast earlier is allowed (a follow op then computes in fp32 on exactly
up-cast half values: a guarded consumer reads the same value or a more precise
one, never an extra rounding); moving a down-cast earlier past a follow node
whose reference label is ``fp32`` rounds that node's output, and is allowed only
when the rounded value reaches fixed half nodes alone.

Semantics (:func:`~converter.passes.place.problem.satisfies_invariant`, which the tests'
exhaustive oracle applies to every labelling): a
free/promote node is *extra-rounded* when it is half while its reference label
is fp32, or when one of its free/promote producers is extra-rounded (rounding
propagates through follow/promote nodes, whatever their label, and stops at
fixed nodes: a fixed half node rounds its inputs anyway).  A labelling keeps the
invariant when no guarded consumer reads an extra-rounded producer and no
promote node is extra-rounded itself.

Encoding (a hard constraint, never a penalty): let ``Z`` be the free/promote
nodes whose reference label is fp32 (those downstream of a fixed fp32 node
through free/promote nodes) and ``R`` the free nodes from which a guarded
consumer is reachable through free nodes only.  A labelling keeps the invariant
if and only if every node of ``Z ∩ R`` and every promote node of ``Z`` is fp32:
an extra-rounded guarded read needs a path ``s -> f1 -> ... -> g`` through free
nodes from a node ``s ∈ Z`` labelled half to the first guarded node ``g``, so
``s ∈ Z ∩ R``; conversely such an ``s`` labelled half is extra-rounded and
reaches ``g``.  These nodes are fixed to fp32 before solving (equivalently, an
infinite edge ``v -> t`` each), so the min-cut optimises exactly over the
labellings that keep the invariant; the tie-break and the region
decomposition are unchanged.  ``invariant=False`` ("mincut-bytes") drops the
constraint and minimises bytes alone: a follow node between an fp32 producer and
both a half and a guarded consumer (LayerNorm -> dropout -> {linear, residual
add}) may then be put in half, which rounds the fp32 residual stream.

Decomposition
-------------
First, promote nodes fed by a fixed fp32 node, and transitively the promote
nodes they feed, are fp32 in every feasible labelling: they are fixed before
solving (this also cuts long promote residual streams into small pieces).
The remaining free/promote nodes split into independent *regions*: connected
components of the graph that links free/promote nodes sharing a tensor (a
tensor whose producer is fixed links all its free consumers, since they share
one cast; fixed nodes are boundaries).  Tensors with cost 0 only link through
promote constraints; tensors whose cost is decided by fixed nodes alone are
folded into a constant.  Each region is solved on its own graph, so the work is
linear in the graph size for bounded region sizes.  Regions of at most
``small_region`` nodes are solved by exact enumeration (cheaper than a networkx
graph up to about 7 nodes); larger ones by networkx max-flow/min-cut
(``preflow_push`` by default).

Alternative costs
-----------------
``PlacementResult.alternative_cost[n]`` is the cost of the best labelling with
``n`` flipped, minus the optimal cost.  Enumerated regions get it for free.
For min-cut regions it is computed exactly from the max-flow residual network
(dynamic graph cuts, as for min-marginals): pinning ``n`` adds one infinite
edge, the extra flow is augmented on a journaled copy of the residual network
and rolled back, so no region is re-solved.  A half node that no residual path
from ``s`` reaches costs nothing to flip.  A promote node that cannot be half
(an fp32 producer forces it) has no entry, nor has a node the invariant fixes
to fp32.  In regions of more than 64 nodes
each flip may scan at most ``alternative_budget`` residual edges: a flip whose
effect spreads through the region (e.g. one that would flip a whole residual
stream) then gets no entry rather than costing quadratic time.

Modules
-------
This module compiles a problem into regions and solves them (:func:`solve_mincut`,
:func:`enumerate_region`).  The problem's types, their validation and the evaluation of a
labelling are in :mod:`converter.passes.place.problem` (re-exported here), the flow network of
a min-cut region in :mod:`converter.passes.place.cut`, and the greedy TF-style baseline that the
tests and benchmarks compare against in :mod:`converter.passes.place.baselines`.  The brute-force
oracle is a test helper (``tests/placement_oracles.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from networkx.algorithms.flow import preflow_push

from converter.passes.place.cut import solve_region_by_cut
from converter.passes.place.problem import (
    FP32,
    HALF,
    PRODUCER_FP32,
    PRODUCER_HALF,
    PlacementProblem,
    PlacementResult,
    Tensor,
    Term,
    is_feasible,
    reference_labels,
    satisfies_invariant,
    total_cost,
)

__all__ = [
    # the problem's types and evaluation (defined in converter.passes.place.problem)
    "HALF",
    "FP32",
    "Tensor",
    "PlacementProblem",
    "PlacementResult",
    "total_cost",
    "is_feasible",
    "reference_labels",
    "satisfies_invariant",
    # the solver
    "solve_mincut",
    "enumerate_region",
]

# Alternatives are always exact in min-cut regions up to this many nodes; larger
# regions give each flip ``alternative_budget`` residual-edge scans.
_EXACT_ALTERNATIVES_UP_TO = 64


def _invariant_forced(problem: PlacementProblem) -> set[str]:
    """The nodes the invariant fixes to fp32: ``Z ∩ R`` and the promote nodes of
    ``Z`` (module doc).  Linear."""
    ref = reference_labels(problem)
    free = set(problem.free)
    promote = set(problem.promote)
    fixed = problem.fixed
    reached: set[str] = set()  # R: free nodes reaching a guarded consumer through free nodes
    stack: list[str] = []
    fed_by: dict[str, list[str]] = {}  # free consumer -> its free producers
    for tensor in problem.tensors:
        p = tensor.producer
        if p not in free:
            continue
        for c in tensor.consumers:
            if c == p:
                continue
            if c in promote or fixed.get(c) == FP32:
                stack.append(p)
            elif c in free:
                fed_by.setdefault(c, []).append(p)
    while stack:
        v = stack.pop()
        if v not in reached:
            reached.add(v)
            stack.extend(fed_by.get(v, ()))
    return {n for n in reached | promote if ref[n] == FP32}


# --------------------------------------------------------------------------- #
# Compilation into regions
# --------------------------------------------------------------------------- #
class _Region(NamedTuple):
    """One independent region.  Its terms and constraints keep global node indices (terms are
    built once, while linking); ``_Compiled.local`` maps them to positions in ``nodes``."""

    nodes: tuple[int, ...]  # global indices, ascending
    terms: tuple[Term, ...]
    constraints: tuple[tuple[int, int], ...]  # (producer, promote)


@dataclass(frozen=True)
class _Compiled:
    nodes: tuple[str, ...]  # free/promote nodes left to solve
    forced: tuple[str, ...]  # nodes forced to fp32 (promote by an fp32 input; the invariant)
    constant: int
    regions: tuple[_Region, ...]
    local: list[int]  # global index -> its position in its region's nodes
    pinned: frozenset[str] = frozenset()  # fixed to fp32 by the invariant alone


def _forced_fp32(problem: PlacementProblem) -> set[str]:
    """Promote nodes that must be fp32: fed by a fixed fp32 node, or by a promote
    node that must be fp32 (closure; linear)."""
    promote = set(problem.promote)
    fixed = problem.fixed
    feeds: dict[str, list[str]] = {}
    stack: list[str] = []
    for tensor in problem.tensors:
        producer = tensor.producer
        plabel = fixed.get(producer)
        for consumer in tensor.consumers:
            if consumer in promote and consumer != producer:
                if plabel == FP32:
                    stack.append(consumer)
                elif producer in promote:
                    feeds.setdefault(producer, []).append(consumer)
    forced: set[str] = set()
    while stack:
        q = stack.pop()
        if q not in forced:
            forced.add(q)
            stack.extend(feeds.get(q, ()))
    return forced


class _DisjointSets:
    """Union-find over ``0..n-1`` (path halving; the first root wins a union)."""

    __slots__ = ("parent",)

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


class _Linked(NamedTuple):
    """Global-index terms and promote constraints, the folded constant, and the
    union-find whose classes are the regions."""

    terms: list[Term]
    constraints: list[tuple[int, int]]  # (producer, promote)
    constant: int
    sets: _DisjointSets


def _compile(problem: PlacementProblem, *, invariant: bool) -> _Compiled:
    """Fix forced promote nodes (and, with ``invariant``, the nodes the
    no-extra-rounding invariant pins), fold constants, link the remaining
    free/promote nodes and split them into regions (linear)."""
    forced_names = _forced_fp32(problem) if problem.promote else set()
    pinned: frozenset[str] = frozenset()
    if invariant:
        pinned = frozenset(_invariant_forced(problem) - forced_names)
        forced_names |= pinned
    free = tuple(n for n in problem.free if n not in forced_names)
    nodes = free + tuple(q for q in problem.promote if q not in forced_names)
    # One lookup per endpoint: index >= 0 for nodes to solve, else a fixed label.
    code = {n: PRODUCER_HALF if label == HALF else PRODUCER_FP32 for n, label in problem.fixed.items()}
    code.update(dict.fromkeys(forced_names, PRODUCER_FP32))
    code.update((node, i) for i, node in enumerate(nodes))
    linked = _link_tensors(problem.tensors, code, n_nodes=len(nodes), n_free=len(free))
    regions, local = _split_regions(len(nodes), linked)
    ordered = tuple(n for n in itertools.chain(problem.free, problem.promote) if n in forced_names)
    return _Compiled(nodes, ordered, linked.constant, regions, local, pinned)


def _link_tensors(
    tensors: Sequence[Tensor], code: Mapping[str, int], *, n_nodes: int, n_free: int
) -> _Linked:
    """Compile every tensor into a term over global indices (``code``: index
    ``>= 0`` for nodes to solve, ``< n_free`` for free ones, else a fixed-label
    marker), fold the terms that fixed nodes alone decide into a constant, and
    union the nodes each term or promote constraint links."""
    linked = _Linked([], [], 0, _DisjointSets(n_nodes))
    single = _link_single
    constant = 0
    for tensor in tensors:
        producer = tensor.producer
        consumers = tensor.consumers
        if len(consumers) == 1:  # fast path for the common case
            consumer = consumers[0]
            if consumer != producer:
                constant += single(code[producer], code[consumer], tensor.cost, n_free, linked)
            continue
        constant += _link_shared(tensor, code, n_free, linked)
    return linked._replace(constant=constant)


def _link_single(pc: int, cc: int, cost: int, n_free: int, linked: _Linked) -> int:
    """One tensor with a single consumer (codes ``pc`` -> ``cc``, distinct
    nodes); returns the cost folded into the constant."""
    if cc >= 0:
        if pc >= 0:
            if cc >= n_free:  # promote consumer: widest-input constraint
                linked.constraints.append((pc, cc))
            if cost:
                linked.terms.append(Term(pc, cost, (cc,), False, False))
            if cost or cc >= n_free:
                linked.sets.union(pc, cc)
        elif cost:
            linked.terms.append(Term(pc, cost, (cc,), False, False))
    elif cost:
        if pc >= 0:
            linked.terms.append(Term(pc, cost, (), cc == PRODUCER_HALF, cc == PRODUCER_FP32))
        elif pc != cc:
            return cost
    return 0


def _link_shared(tensor: Tensor, code: Mapping[str, int], n_free: int, linked: _Linked) -> int:
    """One tensor read by several consumers, who share one cast per target
    dtype; returns the cost folded into the constant."""
    producer = tensor.producer
    pc = code[producer]
    cost = tensor.cost
    cons: set[int] = set()
    fixed_half = fixed_fp32 = False
    for consumer in tensor.consumers:
        if consumer == producer:
            continue
        cc = code[consumer]
        if cc >= 0:
            cons.add(cc)
            if cc >= n_free and pc >= 0:  # promote consumer: widest-input constraint
                linked.constraints.append((pc, cc))  # (fixed fp32 producers were folded)
                linked.sets.union(pc, cc)
        elif cc == PRODUCER_HALF:
            fixed_half = True
        else:
            fixed_fp32 = True
    if cost == 0:
        return 0
    if pc < 0:
        if fixed_fp32 if pc == PRODUCER_HALF else fixed_half:
            return cost  # a fixed consumer already needs the cast
        if not cons:
            return 0
        fixed_half = fixed_fp32 = False  # same label as the producer: irrelevant
    else:
        if fixed_half and fixed_fp32:
            return cost  # someone always differs from the producer
        if not cons and not fixed_half and not fixed_fp32:
            return 0
    ordered = tuple(sorted(cons))
    anchor = ordered[0] if pc < 0 else pc
    for cc in ordered:
        linked.sets.union(anchor, cc)
    linked.terms.append(Term(pc, cost, ordered, fixed_half, fixed_fp32))
    return 0


def _split_regions(n_nodes: int, linked: _Linked) -> tuple[tuple[_Region, ...], list[int]]:
    """Regions in order of their first node, and each node's position in its region
    (local indices follow the global order)."""
    find = linked.sets.find
    region_of: dict[int, int] = {}
    members: list[list[int]] = []
    local = [0] * n_nodes
    for i in range(n_nodes):
        root = find(i)
        rid = region_of.get(root)
        if rid is None:
            rid = region_of[root] = len(members)
            members.append([])
        local[i] = len(members[rid])
        members[rid].append(i)
    r_terms: list[list[Term]] = [[] for _ in members]
    for term in linked.terms:
        pc = term.producer
        r_terms[region_of[find(pc if pc >= 0 else term.consumers[0])]].append(term)
    r_cons: list[list[tuple[int, int]]] = [[] for _ in members]
    for pair in linked.constraints:
        r_cons[region_of[find(pair[1])]].append(pair)
    regions = tuple(
        _Region(tuple(mem), tuple(rt), tuple(rc)) for mem, rt, rc in zip(members, r_terms, r_cons)
    )
    return regions, local


# --------------------------------------------------------------------------- #
# Exact enumeration (small regions, and the tests' brute-force oracle)
# --------------------------------------------------------------------------- #
def enumerate_region(
    k: int,
    terms: Sequence[Term],
    constraints: Sequence[tuple[int, int]],
    index: Sequence[int],
    *,
    alternatives: bool,
    accept: Callable[[int], bool] | None = None,
) -> tuple[list[bool], int, dict[int, int]]:
    """Return (fp32 flag per local node, cost, {local node: alternative delta})
    by trying all 2**k labellings (bit i of a labelling set = local node i is fp32).

    ``index`` maps the node numbers of ``terms`` and of the ``(producer, promote)``
    pairs of ``constraints`` to the local nodes ``0..k-1``.  ``accept(mask)``
    filters labellings further (the tests' oracle: the invariant, by simulation).
    Ties break towards fewer fp32 nodes, then the lowest labelling.
    """
    compiled = []
    for prod, cost, cons, fixed_half, fixed_fp32 in terms:
        cmask = 0
        for j in cons:
            cmask |= 1 << index[j]
        if prod >= 0:
            compiled.append((1 << index[prod], False, cost, cmask, fixed_half, fixed_fp32))
        else:
            compiled.append((0, prod == PRODUCER_FP32, cost, cmask, fixed_half, fixed_fp32))
    need: dict[int, int] = {}
    for p, q in constraints:
        q = index[q]
        need[q] = need.get(q, 0) | (1 << index[p])
    needs = [(pmask, 1 << q) for q, pmask in need.items()]

    best_key = None
    best_mask = 0
    best_cost = 0
    costs: list[int] = []  # -1 = infeasible
    scale = k + 1
    for m in range(1 << k):
        if any(m & pm and not m & qb for pm, qb in needs):
            costs.append(-1)
            continue
        if accept is not None and not accept(m):
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
    return [bool(best_mask >> i & 1) for i in range(k)], best_cost, alt


# --------------------------------------------------------------------------- #
# The solver

# --------------------------------------------------------------------------- #
def solve_mincut(
    problem: PlacementProblem,
    *,
    alternatives: bool = True,
    small_region: int = 6,
    flow_func: Callable | None = None,
    alternative_budget: int | None = 2048,
    invariant: bool = True,
) -> PlacementResult:
    """Exact minimum-cast labelling, region by region (see the module doc).

    ``invariant``: keep the no-extra-rounding invariant (a hard constraint; the
    optimum is taken over the labellings that keep it).  ``False`` minimises
    cast bytes alone ("mincut-bytes"), which may round values that per-consumer
    casting keeps in fp32.
    ``alternatives``: compute ``alternative_cost``.  ``small_region``: regions
    with at most this many free/promote nodes are enumerated exactly instead of
    building a flow network (0 forces min-cut everywhere).  ``flow_func``: a
    networkx max-flow function that returns a residual network holding a full
    flow (default ``preflow_push``).  ``alternative_budget``: residual-edge
    scans per flip in regions of more than 64 nodes (None: no limit, exact for
    every node but possibly quadratic in the region size).
    """
    if small_region < 0:
        raise ValueError(f"small_region must be >= 0, got {small_region}")
    if alternative_budget is not None and alternative_budget < 0:
        raise ValueError(f"alternative_budget must be >= 0 or None, got {alternative_budget}")
    budget = alternative_budget
    func = preflow_push if flow_func is None else flow_func
    compiled = _compile(problem, invariant=invariant)
    nodes, local = compiled.nodes, compiled.local
    labels: dict[str, str] = dict.fromkeys(compiled.forced, FP32)
    alt_cost: dict[str, int] = {}
    total = compiled.constant
    for region in compiled.regions:
        k = len(region.nodes)
        if not region.terms and not region.constraints:
            fp32, cost, alt = [False] * k, 0, (dict.fromkeys(range(k), 0) if alternatives else {})
        elif k <= small_region:
            fp32, cost, alt = enumerate_region(
                k, region.terms, region.constraints, local, alternatives=alternatives
            )
        else:
            fp32, cost, alt = solve_region_by_cut(
                k,
                region.terms,
                region.constraints,
                local,
                alternatives=alternatives,
                flow_func=func,
                budget=budget if k > _EXACT_ALTERNATIVES_UP_TO else None,
            )
        total += cost
        for g, is_fp32 in zip(region.nodes, fp32):
            labels[nodes[g]] = FP32 if is_fp32 else HALF
        for i, delta in alt.items():
            alt_cost[nodes[region.nodes[i]]] = delta
    order = itertools.chain(problem.free, problem.promote)
    return PlacementResult(
        labels=MappingProxyType({n: labels[n] for n in order}),
        cost=total,
        alternative_cost=MappingProxyType({n: alt_cost[n] for n in nodes if n in alt_cost}),
        regions=len(compiled.regions),
        pinned=compiled.pinned,
    )
