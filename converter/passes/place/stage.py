"""Place: give every ``follow``, ``promote`` and alias node a concrete precision.

Two strategies share one contract (read ``meta["mp"]``, write concrete precisions back):

* ``"mincut"`` (default): the labelling that minimises the bytes moved by casts per forward
  among those that keep the **no-extra-rounding invariant**, solved exactly as a minimum s–t cut
  per independent region (:mod:`converter.passes.place.solver`). Ties go to half, which saves
  memory. The invariant: compared with casting per consumer (autocast's semantics), a cast moves
  only where that changes no value read by an fp32-decided op, a ``promote`` op or a graph output
  (e.g. LayerNorm -> dropout -> {linear, residual add}: the dropout stays fp32 and the cast sits
  after it, so the residual stream is never rounded).
* ``"mincut-bytes"``: fewest cast bytes, nothing else. **Risk**: it may move a down-cast before a
  follow op whose output also feeds an fp32 or ``promote`` consumer, which then reads a rounded
  value (measured on BERT with dropout after the embeddings' LayerNorm: 52.7 dB output SQNR
  against autocast's 77.9 dB). Use it only when the bytes matter more than that rounding.
* ``"simple"``: ``follow`` takes the precision of its first floating input and ``promote`` the
  widest; a baseline and a fallback.

Aliases (``getitem`` of a tuple output, in-place ops) always take the precision of the tensor they
alias.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from converter.ir.graphmodule import pauses_gc
from converter.ir.meta import DTYPES, HALF_NAMES, META_DECISION, META_INFO, META_VALUE, Decision, name_of
from converter.passes.place.graph import alias_root, cast_cost, castable_inputs
from converter.vocab import OPT_LEVELS, PLACEMENTS, choice

__all__ = ["place", "STRATEGIES", "cast_cost", "alias_root", "castable_inputs"]

STRATEGIES = PLACEMENTS
_UNRESOLVED = ("follow", "promote", "alias")


def _label(node: torch.fx.Node, current: dict[torch.fx.Node, str]) -> Optional[str]:
    """Runtime dtype name of a producer after placement, as far as known."""
    if node in current:
        return current[node]
    info = node.meta.get(META_INFO)
    if node.op in ("placeholder", "get_attr"):
        value: Any = node.meta.get(META_VALUE)
        return name_of(value.dtype) if hasattr(value, "dtype") else None
    decision = node.meta.get(META_DECISION)
    if decision is not None and decision.precision not in _UNRESOLVED:
        return decision.precision
    if info is not None and info.kind == "alias":
        root = alias_root(node)
        return None if root is node else _label(root, current)
    return None


def _simple(gm: torch.fx.GraphModule) -> None:
    current: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        decision = node.meta.get(META_DECISION)
        if decision is None:
            continue
        if decision.precision not in _UNRESOLVED:
            current[node] = decision.precision
            continue
        if decision.precision == "alias":
            label = _label(alias_root(node), current) or "fp32"
            node.meta[META_DECISION] = decision.noted("place", f"has its producer's precision, {label}", precision=label)
            current[node] = label
            continue
        labels = [lab for lab in (_label(n, current) for n in castable_inputs(node)) if lab in DTYPES]
        if decision.precision == "follow":
            label = labels[0] if labels else "fp32"
            why = "follows its first floating input (simple strategy)"
        else:
            label = "fp32" if (not labels or "fp32" in labels) else labels[0]
            why = "promotes to the widest floating input (simple strategy)"
        node.meta[META_DECISION] = decision.noted("place", why, precision=label)
        current[node] = label


@pauses_gc
def place(gm: torch.fx.GraphModule, *, target: str, strategy: str = "mincut", keep_io_types: bool = True,
          opt_level: str = "O1") -> None:
    """Resolve every unresolved precision in ``gm`` (see module docstring).

    ``opt_level`` tells the cost model how parameters are stored: ``O1`` keeps them fp32 (a weight
    consumed in half is cast every forward, and that cost counts); ``O2`` stores each in the dtype
    its consumers want (fp32 master weights live in the trainer), so weight casts cost nothing.
    """
    choice(opt_level, OPT_LEVELS, what="opt_level")
    choice(strategy, STRATEGIES, what="placement strategy")
    if target not in HALF_NAMES:
        raise ValueError(f"target must be fp16 or bf16, got {target!r}")
    unresolved = [n for n in gm.graph.nodes
                  if (d := n.meta.get(META_DECISION)) is not None and d.precision in ("follow", "promote")]
    if strategy in ("mincut", "mincut-bytes"):
        from converter.passes.place.mincut import place_mincut  # local: keeps the networkx import off the simple path

        place_mincut(gm, target=target, keep_io_types=keep_io_types, opt_level=opt_level,
                     invariant=strategy == "mincut")
    else:
        _simple(gm)
    if target == "fp16":
        _keep_bf16(unresolved)
    _resolve_aliases(gm)


def _keep_bf16(unresolved: list[torch.fx.Node]) -> None:
    """In an fp16 conversion, a follow/promote node placed in half whose inputs are all bf16 (the output of
    an op a rule runs in bf16, e.g. ``rules/llm.toml``'s MLP down-projection) stays bf16.

    The placement problem has one half label, so it would run such a node in fp16 behind a bf16 -> fp16
    cast: a cast that costs bytes and rounds bf16's range to fp16's (a value above 65504 becomes inf),
    for an op that computes the same in bf16. The node keeps bf16 unless that costs more bytes: its
    bf16 inputs' casts to fp16 are saved (unless another fp16 consumer needs them anyway), and its own
    output needs one cast to fp16 only for fixed fp16 consumers (follow consumers keep bf16 in turn).
    Where a bf16 value then meets an fp16 consumer, *rewrite* inserts the cast with that consumer's
    rule as its provenance. Nodes are visited in graph order, so a run of follow ops stays bf16."""
    free = set(unresolved)
    for node in unresolved:
        decision: Decision = node.meta[META_DECISION]
        if decision.precision != "fp16":
            continue
        inputs = castable_inputs(node)
        if not inputs or any(_label(i, {}) != "bf16" for i in inputs):
            continue
        saved = sum(_numel(i) for i in dict.fromkeys(inputs) if not _read_in_fp16(i, besides=node))
        cost = _numel(node) if any(_reads(u, node) and u not in free and _label(u, {}) == "fp16" for u in node.users) else 0
        if cost > saved:
            continue
        node.meta[META_DECISION] = decision.noted(
            "place", "stays bf16: every input it reads is bf16 (an op a rule runs in bf16), and fp16 would add a "
            "bf16 -> fp16 cast that costs bytes and rounds bf16's range to fp16's", precision="bf16")


def _numel(node: torch.fx.Node) -> int:
    info = node.meta.get(META_INFO)
    return info.out_numel if info is not None else 0


def _reads(user: torch.fx.Node, producer: torch.fx.Node) -> bool:
    return user.meta.get(META_INFO) is not None and user.meta.get(META_DECISION) is not None \
        and producer in castable_inputs(user)


def _read_in_fp16(producer: torch.fx.Node, *, besides: torch.fx.Node) -> bool:
    """Whether a consumer of ``producer`` other than ``besides`` runs in fp16 (its cast is there anyway)."""
    return any(u is not besides and _reads(u, producer) and _label(u, {}) == "fp16" for u in producer.users)


def _resolve_aliases(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        decision: Optional[Decision] = node.meta.get(META_DECISION)
        if decision is not None and decision.precision == "alias":
            label = _label(alias_root(node), {}) or "fp32"
            node.meta[META_DECISION] = decision.noted("place", f"has its producer's precision, {label}", precision=label)
