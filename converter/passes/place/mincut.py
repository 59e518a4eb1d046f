"""Build the placement problem from an annotated graph and write the min-cut solution back.

Model (exact for two labels, ``half`` and ``fp32``):

* every tensor a node produces costs one cast of ``numel × (src bytes + dst bytes)`` if at least
  one of its consumers runs in the other label — one cast per (producer, dtype), shared;
* fixed labels: decided compute nodes, explicit casts, graph inputs and parameters (fp32 in O1,
  so weight casts count), and the graph output when ``keep_io_types`` (it must get its dtype back);
* in O2, weights are free producers instead: a parameter that only matmuls/convolutions read (through
  layout ops) is stored in the dtype its consumers want (the trainer keeps fp32 master copies), so its
  cast costs nothing unless consumers disagree; other parameters (norm scales, tokens, positional
  tables) stay fp32 in O2 too, and their casts count;
* free: ``follow`` nodes; ``promote`` nodes are free but must be fp32 when any input is fp32;
* aliases (tuple elements, in-place ops) share their producer's label.
"""
from __future__ import annotations

import torch
import torch.fx

from converter.ir.meta import HALF_NAMES, META_DECISION, META_INFO, META_VALUE, TensorSpec
from converter.ir.ops import non_weight_use
from converter.passes.place.graph import alias_root, cast_cost, castable_inputs
from converter.passes.place.solver import PlacementProblem, Tensor, solve_mincut

__all__ = ["place_mincut", "build_problem"]

_OUT = "__output__"


def _lab(precision: str) -> str:
    return "half" if precision in HALF_NAMES else "fp32"


def _dtype_lab(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "half"


def _convertible(value) -> bool:
    return isinstance(value, TensorSpec) and value.is_convertible


def build_problem(gm: torch.fx.GraphModule, *, keep_io_types: bool = True, opt_level: str = "O1") -> PlacementProblem:
    fixed: dict[str, str] = {}
    free: list[str] = []
    promote: list[str] = []
    tensors: list[Tensor] = []
    params = {name for name, _ in gm.named_parameters()} if opt_level == "O2" else set()
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        value = node.meta.get(META_VALUE)
        if node.op in ("placeholder", "get_attr"):
            if _convertible(value):
                if node.op == "get_attr" and str(node.target) in params and non_weight_use(node) is None:
                    free.append(node.name)  # O2: a weight is stored in the dtype its matmuls want
                else:
                    fixed[node.name] = _dtype_lab(value.dtype)
            continue
        decision = node.meta.get(META_DECISION)
        if decision is None or info is None:
            continue
        if decision.precision == "follow":
            free.append(node.name)
        elif decision.precision == "promote":
            promote.append(node.name)
        elif decision.precision != "alias":
            fixed[node.name] = _lab(decision.precision)
    fixed[_OUT + "fp32"] = "fp32"
    fixed[_OUT + "half"] = "half"
    known = set(fixed) | set(free) | set(promote)
    reads: dict[torch.fx.Node, set] = {}  # consumer -> the producers its precision applies to

    def castable(user: torch.fx.Node) -> set:
        got = reads.get(user)
        if got is None:
            got = reads[user] = set(castable_inputs(user))
        return got

    for node in gm.graph.nodes:
        value = node.meta.get(META_VALUE)
        if not _convertible(value):
            continue
        info = node.meta.get(META_INFO)
        if info is not None and info.kind == "alias" and info.inplace:
            continue  # an in-place op's output is its input tensor: counted with the producer
        root = alias_root(node)
        if root.name not in known:
            continue
        consumers: list[str] = []
        pending = list(node.users)
        while pending:
            user = pending.pop()
            uinfo = user.meta.get(META_INFO)
            if user.op == "output":
                if keep_io_types:
                    consumers.append(_OUT + _dtype_lab(value.dtype))
                continue
            if uinfo is not None and uinfo.kind == "alias" and uinfo.inplace and user.args and user.args[0] is node:
                pending.extend(user.users)
                continue
            if user.name in known and node in castable(user):
                consumers.append(user.name)
        if consumers:
            tensors.append(Tensor(producer=root.name, cost=cast_cost(value.numel), consumers=tuple(dict.fromkeys(consumers))))
    return PlacementProblem(fixed=fixed, free=tuple(free), promote=tuple(promote), tensors=tuple(tensors))


def place_mincut(gm: torch.fx.GraphModule, *, target: str, keep_io_types: bool = True, opt_level: str = "O1",
                 invariant: bool = True) -> None:
    """Label every follow/promote node by min-cut; ``invariant``: keep the no-extra-rounding
    invariant (:mod:`converter.passes.place.solver`), else fewest bytes only ("mincut-bytes")."""
    problem = build_problem(gm, keep_io_types=keep_io_types, opt_level=opt_level)
    if not problem.free and not problem.promote:
        return
    result = solve_mincut(problem, alternatives=True, invariant=invariant)
    mode = "min-cut" if invariant else "min-cut (bytes only)"
    for node in gm.graph.nodes:
        decision = node.meta.get(META_DECISION)
        if decision is None or decision.precision not in ("follow", "promote"):
            continue
        label = result.labels[node.name]
        precision = target if label == "half" else "fp32"
        extra = result.alternative_cost.get(node.name)
        alt = f"; the alternative costs +{extra} bytes" if extra is not None else ""
        tie = " (a tie, broken towards half)" if extra == 0 and label == "half" else ""
        pinned = " (kept fp32: its value reaches an fp32 or promote op unrounded)" if node.name in result.pinned else ""
        node.meta[META_DECISION] = decision.noted("place", f"{mode} chose {precision}{alt}{tie}{pinned}",
                                                  precision=precision)
