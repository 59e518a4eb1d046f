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

Semantics (:func:`satisfies_invariant`, used by :func:`solve_exhaustive`): a
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
import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import networkx as nx
from networkx.algorithms.flow import preflow_push

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
    "reference_labels",
    "satisfies_invariant",
]

HALF = "half"
FP32 = "fp32"
_LABELS = (HALF, FP32)

# Producer markers in compiled terms (free producers are local indices >= 0).
_PROD_HALF = -1
_PROD_FP32 = -2
# Alternatives are always exact in min-cut regions up to this many nodes; larger
# regions give each flip ``alternative_budget`` residual-edge scans.
_EXACT_ALTERNATIVES_UP_TO = 64


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


def _producers(problem: PlacementProblem) -> dict[str, set[str]]:
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
    per-consumer casting keeps it fp32.  Direct simulation, for tests and the
    exhaustive solver."""
    full = _full_labels(problem, labels)
    ref = reference_labels(problem)
    producers = _producers(problem)
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
    nodes: tuple[int, ...]  # global indices, ascending
    terms: tuple[tuple[int, int, tuple[int, ...], bool, bool], ...]  # local
    constraints: tuple[tuple[int, int], ...]  # (producer, promote), local


@dataclass(frozen=True)
class _Compiled:
    nodes: tuple[str, ...]  # free/promote nodes left to solve
    forced: tuple[str, ...]  # nodes forced to fp32 (promote by an fp32 input; the invariant)
    constant: int
    regions: tuple[_Region, ...]
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

    terms: list[tuple[int, int, tuple[int, ...], bool, bool]]
    constraints: list[tuple[int, int]]
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
    code = {n: _PROD_HALF if label == HALF else _PROD_FP32 for n, label in problem.fixed.items()}
    code.update(dict.fromkeys(forced_names, _PROD_FP32))
    code.update((node, i) for i, node in enumerate(nodes))
    linked = _link_tensors(problem.tensors, code, n_nodes=len(nodes), n_free=len(free))
    regions = _split_regions(len(nodes), linked)
    ordered = tuple(n for n in itertools.chain(problem.free, problem.promote) if n in forced_names)
    return _Compiled(nodes, ordered, linked.constant, regions, pinned)


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
                linked.terms.append((pc, cost, (cc,), False, False))
            if cost or cc >= n_free:
                linked.sets.union(pc, cc)
        elif cost:
            linked.terms.append((pc, cost, (cc,), False, False))
    elif cost:
        if pc >= 0:
            linked.terms.append((pc, cost, (), cc == _PROD_HALF, cc == _PROD_FP32))
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
        elif cc == _PROD_HALF:
            fixed_half = True
        else:
            fixed_fp32 = True
    if cost == 0:
        return 0
    if pc < 0:
        if fixed_fp32 if pc == _PROD_HALF else fixed_half:
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
    linked.terms.append((pc, cost, ordered, fixed_half, fixed_fp32))
    return 0


def _split_regions(n_nodes: int, linked: _Linked) -> tuple[_Region, ...]:
    """Regions in order of their first node; local indices in global order."""
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
    r_terms: list[list] = [[] for _ in members]
    for pc, cost, cons, fixed_half, fixed_fp32 in linked.terms:
        if pc >= 0:
            rid = region_of[find(pc)]
            pc = local[pc]
        else:
            rid = region_of[find(cons[0])]
        lcons = (local[cons[0]],) if len(cons) == 1 else tuple(local[j] for j in cons)
        r_terms[rid].append((pc, cost, lcons, fixed_half, fixed_fp32))
    r_cons: list[list] = [[] for _ in members]
    for pc, q in linked.constraints:
        r_cons[region_of[find(q)]].append((local[pc], local[q]))
    return tuple(
        _Region(tuple(mem), tuple(rt), tuple(rc)) for mem, rt, rc in zip(members, r_terms, r_cons)
    )


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
    accept: Callable[[int], bool] | None = None,
) -> tuple[list[bool], int, dict[int, int]]:
    """Return (fp32 flag per local node, cost, {local node: alternative delta})
    by trying all 2**k labellings (bit i of a labelling set = node i is fp32);
    ``accept(mask)`` filters labellings further (the invariant, brute force)."""
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
# Min-cut (networkx) with exact dynamic alternatives
# --------------------------------------------------------------------------- #
def _cut_graph(
    k: int,
    terms: Sequence[tuple[int, int, tuple[int, ...], bool, bool]],
    constraints: Sequence[tuple[int, int]],
) -> tuple[nx.DiGraph, int, int, int]:
    """Build the region's flow network; returns (G, s, t, inf)."""
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
            add(p, cons[0], cost)
            return
        a = aux
        aux += 1
        add(p, a, cost)
        for j in cons:
            add_inf(a, j)

    def any_half(p: int, cons: tuple[int, ...], cost: int) -> None:
        """cost * [x_p = F and some consumer in cons is H]"""
        nonlocal aux
        if len(cons) == 1:
            add(cons[0], p, cost)
            return
        b = aux
        aux += 1
        add(b, p, cost)
        for j in cons:
            add_inf(j, b)

    for prod, cost, cons, fixed_half, fixed_fp32 in terms:
        if prod == _PROD_HALF:  # fixed consumers agree with p (others were folded)
            any_fp32(s, cons, cost)
        elif prod == _PROD_FP32:
            any_half(t, cons, cost)
        else:
            if fixed_fp32:  # a fixed fp32 consumer: cost whenever p is half
                add(prod, t, cost)
            elif cons:
                any_fp32(prod, cons, cost)
            if fixed_half:  # a fixed half consumer: cost whenever p is fp32
                add(s, prod, cost)
            elif cons:
                any_half(prod, cons, cost)
    for p, q in constraints:
        add_inf(q, p)
    inf = sum(caps.values()) + 1
    for edge in infinite:
        caps[edge] = inf
    graph = nx.DiGraph()
    graph.add_nodes_from(range(k + 2))
    graph.add_edges_from((u, v, {"capacity": c}) for (u, v), c in caps.items())
    return graph, s, t, inf


def _sink_side(residual: nx.DiGraph, t: int) -> set[int]:
    """Nodes that can still reach ``t`` in the residual network (the fp32 side)."""
    seen = {t}
    queue = deque((t,))
    pred = residual._pred  # raw dicts: the public views iterate in Python
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
        succ = residual._succ  # raw dicts: the public views iterate in Python
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


def _mincut(
    k: int,
    terms: Sequence[tuple[int, int, tuple[int, ...], bool, bool]],
    constraints: Sequence[tuple[int, int]],
    *,
    alternatives: bool,
    flow_func: Callable,
    budget: int | None,
) -> tuple[list[bool], int, dict[int, int]]:
    """Same contract as :func:`_enumerate`, solved as a minimum s-t cut.

    Alternatives: dynamic cuts on the residual network, ``budget`` edge scans
    per flip at most (a flip over budget gets no entry).
    """
    graph, s, t, inf = _cut_graph(k, terms, constraints)
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
# Solvers
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
    nodes = compiled.nodes
    labels: dict[str, str] = dict.fromkeys(compiled.forced, FP32)
    alt_cost: dict[str, int] = {}
    total = compiled.constant
    for region in compiled.regions:
        k = len(region.nodes)
        if not region.terms and not region.constraints:
            fp32, cost, alt = [False] * k, 0, (dict.fromkeys(range(k), 0) if alternatives else {})
        elif k <= small_region:
            fp32, cost, alt = _enumerate(
                k, region.terms, region.constraints, (), alternatives=alternatives
            )
        else:
            fp32, cost, alt = _mincut(
                k,
                region.terms,
                region.constraints,
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


def _rounding_checker(problem: PlacementProblem, nodes: Sequence[str]) -> Callable[[int], bool]:
    """:func:`satisfies_invariant` on bit masks (bit i set = ``nodes[i]`` is fp32):
    the same simulation, written for speed, independent of the min-cut encoding."""
    index = {n: i for i, n in enumerate(nodes)}
    ref = reference_labels(problem)
    producers = _producers(problem)
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


def solve_exhaustive(
    problem: PlacementProblem, *, max_nodes: int = 20, invariant: bool = True
) -> PlacementResult:
    """Brute force over all labellings of all free/promote nodes (tests only).

    ``invariant``: only labellings that :func:`satisfies_invariant` (simulated on
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
    accept = _rounding_checker(problem, nodes) if invariant else None
    fp32, cost, alt = _enumerate(
        len(nodes), terms, constraints, sorted(forced), alternatives=True, accept=accept
    )
    labels = {n: FP32 if f else HALF for n, f in zip(nodes, fp32)}
    return PlacementResult(
        labels=MappingProxyType(labels),
        cost=cost,
        alternative_cost=MappingProxyType({nodes[i]: d for i, d in sorted(alt.items())}),
        regions=1 if nodes else 0,
    )


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
