"""Calibration statistics: per-node value ranges of forward values and gradients on real inputs.

Every calibration batch (the example-input form: a tuple of args or an ``(args, kwargs)`` pair)
runs through an *instrumented copy* of the graph: after every node that produces a floating tensor
a tiny recorder node is inserted, so the forward pass is the graph's own generated code (no
per-node Python dispatch as in ``torch.fx.Interpreter``, whose overhead alone exceeds the cost
budget on small models). One ``torch.autograd.grad`` call then gives the gradient of the loss
(``loss_fn(output, batch)`` or the sum of the floating outputs) with respect to every recorded
activation and parameter: one backward pass, no ``.grad`` left on the model. The statistics of all
nodes of a batch (forward values and gradients together) are computed by a handful of vectorised
ops over the concatenated fp32 bit patterns (two ``_foreach_max`` and one ``bincount``; see
:class:`~converter.numerics.ranges.RangeAccumulator`), not per node; layout ops (view, transpose, ...) and tuple producers (split)
take the statistics of the nodes that hold the same values instead of being recorded. They end up
as a frozen :class:`NodeStats` on ``node.meta["mp_stats"]``. Cost on the sample transformer:
2.6-2.9× twenty fp32 training steps (``benchmarks/calibration_cost.py``).

The calibrate stage that uses them is :mod:`converter.numerics.calibrate`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, cast

import torch
import torch.fx
from torch.utils import _pytree as pytree

from converter.ir.graphmodule import resolve_attr
from converter.ir.meta import META_INFO, META_STATS, META_VALUE, TensorSpec
from converter.numerics.common import copy_graph, floating_outputs, preserved_state, progress_bar, user_loss
from converter.numerics.ranges import (
    RangeAccumulator,
    TensorStats,
    merge_stats,
)
from converter.passes.capture.values import normalize_inputs

__all__ = [
    "NodeStats",
    "Calibration",
    "collect_statistics",
]


# ---------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class NodeStats:
    """``node.meta["mp_stats"]``: forward statistics and, when a backward pass ran, gradient ones.

    ``grad_log2_hist`` lists ``(e, n)`` for the binades that hold gradient values: ``n`` non-zero
    gradient values have ``|g|`` in ``[2**e, 2**(e + 1))``. The lowest binade (``LOG2_MIN``) also
    holds everything smaller, the highest (2**17 up) everything larger, inf and NaN included.
    Binade edges are powers of two, so the fraction that a loss scale 2**k lifts above the fp16
    subnormal 2**-24 is exact.
    """

    forward: TensorStats
    grad: Optional[TensorStats] = None
    grad_log2_hist: tuple[tuple[int, int], ...] = ()
    batches: int = 0

    def to_dict(self) -> dict:
        out = {"forward": self.forward.to_dict(), "batches": self.batches}
        out["grad"] = self.grad.to_dict() if self.grad is not None else None
        return out


@dataclass
class Calibration:
    """What :func:`collect_statistics` returns: per-node stats and how they were obtained."""

    stats: dict[str, NodeStats]
    batches: int
    loss: str
    backward: bool
    seconds: float
    inputs: list  # the normalised batches, kept for the accuracy search
    #: parameter (fqn) read by several nodes -> ((reading node, max |gradient| through that read), ...)
    param_uses: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# the instrumented graph


def _has_float_output(node: torch.fx.Node) -> bool:
    spec = node.meta.get(META_VALUE)
    specs = [spec] if isinstance(spec, TensorSpec) else [s for s in pytree.tree_leaves(spec) if isinstance(s, TensorSpec)] if isinstance(spec, tuple) else []
    return any(s.is_convertible and s.dtype.is_floating_point for s in specs)


def _mutated_later(gm: torch.fx.GraphModule) -> set:
    """Nodes whose tensor an in-place op modifies afterwards (recorded as a clone)."""
    out = set()
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is not None and info.inplace and node.args and isinstance(node.args[0], torch.fx.Node):
            out.add(node.args[0])
    return out


class _Probe:
    """An instrumented copy of ``gm`` that stores every floating node output of a forward pass."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node], uses: Sequence[tuple] = ()):
        graph, mapping = copy_graph(gm)
        self.slots: list = [None] * len(nodes)
        self.use_slots: list = [None] * len(uses)
        slots, use_slots = self.slots, self.use_slots

        def _mp_read(index, value):  # one read of a shared parameter, as its own autograd node
            use_slots[index] = value = value.view_as(value)
            return value

        def _mp_record(index, value):
            slots[index] = value
            return value

        def _mp_record_clone(index, value):
            slots[index] = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)
            return value

        mutated = _mutated_later(gm)
        last_placeholder = None
        for n in graph.nodes:
            if n.op == "placeholder":
                last_placeholder = n
        for i, old in enumerate(nodes):
            new = mapping[old]
            where = last_placeholder if new.op == "placeholder" else new
            fn = _mp_record_clone if old in mutated else _mp_record
            with graph.inserting_after(where):
                graph.call_function(fn, (i, new))
        for j, (param, reader) in enumerate(uses):
            new_param, new_reader = mapping[param], mapping[reader]
            with graph.inserting_before(new_reader):
                new_reader.replace_input_with(new_param, graph.call_function(_mp_read, (j, new_param)))
        self.module = torch.fx.GraphModule(gm, graph, class_name="CalibrationProbe")

    def __call__(self, args: tuple, kwargs: dict):
        return self.module(*args, **kwargs)

    def clear(self) -> None:
        """Drop the recorded values (the caller keeps what it needs)."""
        self.slots[:] = [None] * len(self.slots)
        self.use_slots[:] = [None] * len(self.use_slots)


# ---------------------------------------------------------------------------------------------
# statistics


def _loss(output: Any, item: Any, loss_fn: Optional[Callable], note: list) -> Optional[torch.Tensor]:
    loss = user_loss(output, item, loss_fn, note, "calibration", "the sum of the floating outputs")
    if loss is not None:
        return loss
    leaves = [t for t in floating_outputs(output, fp64=False) if t.requires_grad]
    if not leaves:
        return None
    return cast(torch.Tensor, sum(t.float().sum() for t in leaves))


#: ops whose output holds exactly the values of their input, rearranged
_LAYOUT_OPS = frozenset({"view", "reshape", "transpose", "permute", "t", "contiguous", "flatten", "unflatten",
                         "squeeze", "unsqueeze", "clone"})


def _single_spec(node: torch.fx.Node) -> Optional[TensorSpec]:
    spec = node.meta.get(META_VALUE)
    return spec if isinstance(spec, TensorSpec) else None


def _plan_taps(gm: torch.fx.GraphModule, candidates: Sequence[torch.fx.Node]) -> tuple[list, dict]:
    """Which nodes to record, and which to derive from others without recording them.

    * a layout op (view, transpose, ...) whose single-use input is recorded has that input's
      statistics: the same values forward, and (the input having no other user) the same gradient
      values backward;
    * a tuple producer (split, chunk, ...) whose every element is taken by a ``getitem`` has the
      merged statistics of those ``getitem`` nodes (the very same tensors).
    Deriving instead of recording saves a quarter of the work on a transformer.
    """
    mutated = _mutated_later(gm)
    chosen = set(candidates)
    derived: dict = {}
    for node in candidates:
        info = node.meta.get(META_INFO)
        if info is None or node in mutated:
            continue
        if info.op in _LAYOUT_OPS and node.args and isinstance(node.args[0], torch.fx.Node):
            src = node.args[0]
            spec, sspec = _single_spec(node), _single_spec(src)
            if (src in chosen and src not in mutated and len(src.users) == 1 and spec is not None and sspec is not None
                    and spec.numel == sspec.numel and spec.dtype == sspec.dtype):
                derived[node] = ("copy", src)
        elif isinstance(node.meta.get(META_VALUE), tuple):
            n_out = len(node.meta[META_VALUE])
            users = list(node.users)
            picks: dict[Any, Any] = {}
            ok = n_out > 0
            for u in users:
                uinfo = u.meta.get(META_INFO)
                if (u.op == "call_function" and uinfo is not None and uinfo.op == "getitem" and len(u.args) > 1
                        and isinstance(u.args[1], int) and u in chosen and u not in mutated):
                    picks.setdefault(u.args[1] % n_out, u)
                else:
                    ok = False
            if ok and len(picks) == n_out and all(_single_spec(u) is not None for u in picks.values()):
                derived[node] = ("merge", tuple(picks.values()))
    taps = [n for n in candidates if n not in derived]
    return taps, derived



def collect_statistics(
    gm: torch.fx.GraphModule,
    calibration: Iterable,
    *,
    loss_fn: Optional[Callable] = None,
    backward: bool = True,
    progress: bool = True,
    max_batches: Optional[int] = None,
) -> Calibration:
    """Run ``calibration`` through ``gm`` and write :class:`NodeStats` on ``node.meta["mp_stats"]``.

    ``gm`` must still be the fp32 graph (before rewrite). Buffers (e.g. BatchNorm running
    statistics) and the global RNG state are restored afterwards, and no ``.grad`` is written.
    """
    t0 = time.perf_counter()
    for n in gm.graph.nodes:
        n.meta.pop(META_STATS, None)
    plan = _Plan(gm)
    items = list(calibration) if max_batches is None else _take(calibration, max_batches)
    run = _run_batches(gm, plan, items, loss_fn=loss_fn, backward=backward, progress=progress)
    results = plan.results()
    stats: dict[str, NodeStats] = {}
    for n in gm.graph.nodes:
        if n not in results:
            continue
        f, g, hist = results[n]
        record = NodeStats(forward=f, grad=g, grad_log2_hist=hist, batches=run["batches"])
        n.meta[META_STATS] = record
        stats[n.name] = record
    loss_text = _loss_text(backward=backward, note=run["note"], loss_fn=loss_fn, grads_seen=run["grads_seen"])
    uses: dict[str, list] = {}
    if backward:
        for (param, reader), absmax in zip(plan.uses, run["use_absmax"]):
            uses.setdefault(str(param.target), []).append((reader.name, absmax))
    return Calibration(stats=stats, batches=run["batches"], loss=loss_text, backward=backward and run["grads_seen"],
                       seconds=time.perf_counter() - t0, inputs=run["inputs"],
                       param_uses={k: tuple(v) for k, v in uses.items()})


class _Plan:
    """What to record (nodes and parameters), the accumulator, and the derived statistics.

    Segment ``i`` of the accumulator holds the forward values of recorded node ``i`` (parameters
    after the nodes), segment ``total + i`` its gradients.
    """

    def __init__(self, gm: torch.fx.GraphModule):
        candidates = [n for n in gm.graph.nodes if n.op not in ("get_attr", "output") and _has_float_output(n)
                      and (n.op == "placeholder" or not (n.meta.get(META_INFO) is not None and n.meta[META_INFO].kind == "passive"))]
        self.nodes, self.derived = _plan_taps(gm, candidates)
        params = [n for n in gm.graph.nodes if n.op == "get_attr" and _has_float_output(n)]
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.p_index = {n: len(self.nodes) + i for i, n in enumerate(params)}
        self.total = len(self.nodes) + len(params)
        self.acc = RangeAccumulator(2 * self.total)
        param_values = {}
        for n in params:
            value = resolve_attr(gm, str(n.target))
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                param_values[n] = value
        self.acc.add(list(param_values.values()), [self.p_index[n] for n in param_values])
        self.param_pairs = [(v, self.p_index[n]) for n, v in param_values.items() if v.requires_grad]
        self.uses = _shared_param_uses(gm, {n for n, v in param_values.items() if v.requires_grad})

    def results(self) -> dict:
        """node -> (forward stats, gradient stats, gradient histogram), derived nodes included."""
        acc, total = self.acc, self.total
        results: dict[torch.fx.Node, tuple] = {}
        for n, i in list(self.index.items()) + list(self.p_index.items()):
            f = acc.result(i)
            if f is not None:
                g = acc.result(total + i)
                results[n] = (f, g, acc.log2_hist(total + i) if g is not None else ())
        for n in self.derived:
            _resolve(n, results, self.derived)
        return results


def _shared_param_uses(gm: torch.fx.GraphModule, params: set) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(get_attr node, reader) for every read of a parameter that several nodes read (an unrolled
    cell's weight, a layer applied twice). Their gradients add up in the parameter; the sum can
    overflow fp16 where each read's part fits, so calibration measures each part (``param_uses``)."""
    reads: dict[str, list] = {}
    for n in params:
        for user in n.users:
            info = user.meta.get(META_INFO)
            if info is None or info.kind != "passive":
                reads.setdefault(str(n.target), []).append((n, user))
    return [pair for pairs in reads.values() if len(pairs) > 1 for pair in pairs]


def _resolve(node: torch.fx.Node, results: dict, derived: dict) -> Optional[tuple]:
    """The statistics of ``node``: recorded, or derived from the nodes that hold its values."""
    if node in results or node not in derived:
        return results.get(node)
    how, src = derived[node]
    if how == "copy":
        got = _resolve(src, results, derived)
    else:
        parts = [_resolve(u, results, derived) for u in src]
        if any(p is None for p in parts):
            got = None
        else:
            full = cast("list[tuple[Any, ...]]", parts)  # (none is None)
            grads = [p[1] for p in full]
            merged: dict[int, int] = {}
            for p in full:
                for e, c in p[2]:
                    merged[e] = merged.get(e, 0) + c
            got = (merge_stats([p[0] for p in full]),
                   merge_stats(grads) if all(g is not None for g in grads) else None,
                   tuple(sorted(merged.items())))
    if got is not None:
        results[node] = got
    return got


def _recorded_tensors(slots: Sequence) -> tuple[list[torch.Tensor], list[int]]:
    """The floating tensors the probe recorded, with their segments (fp64 values are left out)."""
    tensors, segs = [], []
    for i, value in enumerate(slots):
        if type(value) is torch.Tensor:  # the common case, without pytree
            if value.is_floating_point() and value.dtype != torch.float64:
                tensors.append(value)
                segs.append(i)
        elif value is not None:
            for t in floating_outputs(value, fp64=False):
                tensors.append(t)
                segs.append(i)
    return tensors, segs


def _run_batches(gm: torch.fx.GraphModule, plan: _Plan, items: list, *, loss_fn: Optional[Callable], backward: bool,
                 progress: bool) -> dict:
    """Forward (and backward) every batch through the probe, feeding the accumulator."""
    probe = _Probe(gm, plan.nodes, plan.uses if backward else ())
    acc, total = plan.acc, plan.total
    run: dict = {"inputs": [], "note": [], "batches": 0, "grads_seen": False, "use_absmax": [0.0] * len(plan.uses)}
    bar = progress_bar(progress)
    with preserved_state(gm), bar:
        task = bar.add_task("calibrating", total=len(items))
        for item in items:
            args, kwargs = normalize_inputs(item)
            run["inputs"].append((args, kwargs))
            with torch.enable_grad():
                output = probe(args, kwargs)
                f_tensors, f_segs = _recorded_tensors(probe.slots)
                reads = list(probe.use_slots)
                probe.clear()
                tensors, segs = f_tensors, f_segs
                if backward:
                    loss = _loss(output, item, loss_fn, run["note"])
                    if loss is not None and loss.requires_grad:
                        pairs = [(t, s) for t, s in zip(f_tensors, f_segs) if t.requires_grad] + plan.param_pairs
                        read_at = [j for j, t in enumerate(reads) if isinstance(t, torch.Tensor) and t.requires_grad]
                        if pairs:
                            grads = torch.autograd.grad(loss, [t for t, _ in pairs] + [reads[j] for j in read_at],
                                                        allow_unused=True)
                            for j, g in zip(read_at, grads[len(pairs):]):
                                if g is not None:
                                    run["use_absmax"][j] = max(run["use_absmax"][j], float(g.detach().abs().max()))
                            grads = grads[:len(pairs)]
                            keep = [(g, s) for g, (_, s) in zip(grads, pairs) if g is not None]
                            tensors = f_tensors + [g for g, _ in keep]
                            segs = f_segs + [total + s for _, s in keep]
                            run["grads_seen"] = run["grads_seen"] or bool(keep)
                    del loss
                acc.add(tensors, segs)
                del output, f_tensors, tensors, reads
            run["batches"] += 1
            bar.advance(task)
    return run


def _loss_text(*, backward: bool, note: list, loss_fn: Optional[Callable], grads_seen: bool) -> str:
    """How the gradient statistics were obtained, for the report."""
    if not backward:
        text = "none (backward=False)"
    elif note:
        text = f"sum of the floating outputs ({note[0]})"
    elif loss_fn is not None:
        text = "loss_fn(output, batch)"
    else:
        text = "sum of the floating outputs"
    if backward and not grads_seen:
        text += "; no gradient: nothing in the graph requires grad"
    return text


def _take(iterable: Iterable, n: int) -> list:
    out: list[Any] = []
    for item in iterable:
        if len(out) >= n:
            break
        out.append(item)
    return out
