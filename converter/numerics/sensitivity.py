"""Sensitivity ranking for the accuracy search: which half nodes add the most output error alone.

Part 2 of the accuracy search (:mod:`converter.numerics.search`). One instrumented pass computes,
for every half node ``i``, the local error of running it alone in half,
``δᵢ = half(fᵢ(half(inputs))) − fᵢ(inputs)`` (exact, nonlinear: catastrophic cancellation inside
the node is seen), and a backward pass gives ``gᵢ = Jᵢᵀv`` for a random output direction ``v``.
``(gᵢ·δᵢ)²`` is an unbiased estimate of ``‖Jᵢδᵢ‖²``, the first-order output error energy that
node ``i`` alone adds (E[(vᵀe)²] = ‖e‖² for v ~ N(0, I)), averaged over the batches and
``projections`` directions. A node whose rounding overflows (inf) ranks first.

Also the two emulation primitives the search's :class:`~converter.numerics.search.HalfEmulator`
shares with the ranking: :func:`round_through` and :func:`emulated_nodes`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, cast

import torch
import torch.fx
from torch.utils import _pytree as pytree

from converter.ir.meta import DTYPES, META_INFO
from converter.ir.ops import castable_arg_positions
from converter.numerics.common import copy_graph, floating_outputs, json_float, preserved_state

__all__ = ["Sensitivity", "rank_sensitivity", "round_through", "emulated_nodes"]

#: ops whose output is random: their half error is the output rounding only (no second run)
_RANDOM_OPS = re.compile(r"dropout|rrelu|bernoulli|rand|multinomial|normal")


def round_through(value: Any, dtype: torch.dtype) -> Any:
    """``value`` rounded through ``dtype`` (floating tensors only; structure kept)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype != torch.float64 and value.dtype != dtype:
            return value.to(dtype).to(value.dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(round_through(v, dtype) for v in value)
    return value


def emulated_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes whose precision an assignment may set: compute nodes with floating outputs."""
    out = []
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is None or info.kind != "compute" or node.op not in ("call_function", "call_method", "call_module"):
            continue
        out.append(node)
    return out


@dataclass(frozen=True)
class Sensitivity:
    """One node's estimated output error energy when it alone runs in half."""

    name: str
    score: float  # sum over batches of E[(g·δ)²] ≈ ‖J δ‖²
    est_sqnr_db: float  # 10·log10(‖ref‖² / score): the SQNR if only this node were half

    def to_dict(self) -> dict:
        return {"name": self.name, "score": json_float(self.score), "est_sqnr_db": json_float(self.est_sqnr_db)}


def _call(node_op: str, target: Any, root: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    if node_op == "call_function":
        return target(*args, **kwargs)
    if node_op == "call_method":
        return getattr(args[0], target)(*args[1:], **kwargs)
    sub = root.get_submodule(target)
    return sub(*args, **kwargs)


def _make_probe(gm: torch.fx.GraphModule, old: torch.fx.Node, dtype: torch.dtype, i: int, slots: list) -> Callable:
    """The probe inserted after ``old`` (node ``i``): it reruns the node on its inputs rounded
    through ``dtype`` and stores ``(outputs, local errors)`` in ``slots[i]``."""
    info = old.meta[META_INFO]
    positions = castable_arg_positions(info.op, len(old.args))
    random_op = bool(_RANDOM_OPS.search(info.op))
    op, target = old.op, old.target

    def _mp_sense(y, *args, **kwargs):
        with torch.no_grad():
            if random_op:
                z = round_through(y, dtype)
            else:
                def rnd(a):
                    return round_through(a.detach(), dtype) if isinstance(a, torch.Tensor) else a

                def det(a):
                    return a.detach() if isinstance(a, torch.Tensor) else a

                if positions is None:
                    r_args = tuple(pytree.tree_map(rnd, a) for a in args)
                    r_kwargs = {k: pytree.tree_map(rnd, v) for k, v in kwargs.items()}
                else:
                    r_args = tuple(pytree.tree_map(rnd if p in positions else det, a) for p, a in enumerate(args))
                    r_kwargs = {k: pytree.tree_map(det, v) for k, v in kwargs.items()}
                z = round_through(_call(op, target, gm, r_args, r_kwargs), dtype)
            ys, zs = floating_outputs(y), floating_outputs(z)
            deltas = [zz.float() - yy.detach().float() for yy, zz in zip(ys, zs)]
        slots[i] = (ys, deltas)
        return None

    return _mp_sense


def _probe_module(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node], base: Mapping[str, str],
                  slots: list) -> torch.fx.GraphModule:
    """A copy of ``gm`` with a probe after each of ``nodes`` (probe ``i`` fills ``slots[i]``)."""
    graph, mapping = copy_graph(gm)
    for i, old in enumerate(nodes):
        new = mapping[old]
        with graph.inserting_after(new):
            probe = _make_probe(gm, old, DTYPES[base[old.name]], i, slots)
            graph.call_function(probe, (new,) + tuple(new.args), dict(new.kwargs))
    return torch.fx.GraphModule(gm, graph, class_name="SensitivityProbe")


class _Scores:
    """What the batches add up: a score and an overflow flag per node, the reference energy."""

    def __init__(self, n: int) -> None:
        self.scores = [0.0] * n
        self.overflow = [False] * n
        self.ref_energy = 0.0


def _probed_outputs(slots: list, acc: _Scores) -> tuple[list[torch.Tensor], list[tuple[int, torch.Tensor]]]:
    """The probed outputs to differentiate, and (node, local error) for each; flags the nodes
    whose local error is not finite."""
    wrt, owner = [], []
    for i, slot in enumerate(slots):
        if slot is None:
            continue
        ys, deltas = slot
        for y, d in zip(ys, deltas):
            if not bool(torch.isfinite(d).all()):
                acc.overflow[i] = True
            if y.requires_grad:
                wrt.append(y)
                owner.append((i, d))
    return wrt, owner


def _add_projection(outs: list[torch.Tensor], wrt: list[torch.Tensor], owner: list[tuple[int, torch.Tensor]],
                    acc: _Scores, gen: torch.Generator, *, projections: int, retain: bool) -> None:
    """One random output direction ``v``: adds ``(gᵢ·δᵢ)² / projections`` to each node's score."""
    vs = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in outs]
    dot = cast(torch.Tensor, sum((t * v).sum() for t, v in zip(outs, vs)))
    grads = torch.autograd.grad(dot, wrt, allow_unused=True, retain_graph=retain)
    per_node: dict[int, float] = {}
    for g, (i, d) in zip(grads, owner):
        if g is None:
            continue
        per_node[i] = per_node.get(i, 0.0) + float((g.double() * d.double()).nan_to_num(0.0, 0.0, 0.0).sum())
    for i, value in per_node.items():
        acc.scores[i] += value * value / projections


def _score_batch(module: torch.fx.GraphModule, args: tuple, kwargs: dict, slots: list, acc: _Scores,
                 gen: torch.Generator, *, projections: int) -> None:
    """One instrumented forward pass over a batch, then ``projections`` backward passes."""
    for i in range(len(slots)):
        slots[i] = None
    with torch.enable_grad():
        out = module(*args, **kwargs)
        outs = [t for t in floating_outputs(out) if t.requires_grad]
        acc.ref_energy += sum(float(t.detach().double().pow(2).sum()) for t in floating_outputs(out))
        wrt, owner = _probed_outputs(slots, acc)
        if not outs or not wrt:
            return
        for k in range(projections):
            _add_projection(outs, wrt, owner, acc, gen, projections=projections, retain=k + 1 < projections)


def _ranked(nodes: Sequence[torch.fx.Node], acc: _Scores) -> list[Sensitivity]:
    """Most sensitive first (an overflowing node scores inf); ties keep graph order."""
    result = []
    for i, node in enumerate(nodes):
        score = math.inf if acc.overflow[i] else acc.scores[i]
        est = -math.inf if score == math.inf else (
            math.inf if score == 0 else 10 * math.log10(max(acc.ref_energy, 1e-300) / score))
        result.append(Sensitivity(node.name, score, est))
    order = {n.name: i for i, n in enumerate(nodes)}
    result.sort(key=lambda s: (-s.score, order[s.name]))
    return result


def rank_sensitivity(gm: torch.fx.GraphModule, batches: Sequence[tuple[tuple, dict]], *, base: Mapping[str, str],
                     projections: int = 1, seed: int = 0) -> list[Sensitivity]:
    """Rank the half nodes of ``base`` by the output error each adds alone (see the module docstring)."""
    if projections < 1:
        raise ValueError(f"projections must be >= 1, got {projections}")
    nodes = [n for n in emulated_nodes(gm) if n.name in base]
    slots: list = [None] * len(nodes)
    module = _probe_module(gm, nodes, base, slots)
    acc = _Scores(len(nodes))
    gen = torch.Generator().manual_seed(seed)
    with preserved_state(gm):
        for b, (args, kwargs) in enumerate(batches):
            torch.manual_seed(seed + b)
            _score_batch(module, args, kwargs, slots, acc, gen, projections=projections)
    return _ranked(nodes, acc)
