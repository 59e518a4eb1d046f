"""The fp16 overflow check of :func:`converter.api.convert`: run the converted graph beside its fp32 twin.

:func:`first_overflow` runs a converted graph and, in lockstep, the same graph with its inserted casts skipped
(fp32), and names the first node whose fp16 output is non-finite where fp32 is finite; mask fills and unwritten
memory are not overflow (see its docstring). ``convert`` turns a finding into ``Fp16OverflowError``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.fx

from converter.ir.meta import META_CAST, META_INFO
from converter.ir.state import preserved_state
from converter.numerics.common import output_tensors

__all__ = ["first_overflow"]


def _nonfinite(value: Any) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in output_tensors(value))


def _absmax(value: Any) -> float:
    return max((float(t.detach().abs().max()) for t in output_tensors(value) if t.is_floating_point() and t.numel()),
               default=0.0)


#: ops whose output is uninitialised memory (filled in place later): any bits, inf and NaN included
_UNINITIALIZED = frozenset({"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "empty_permuted"})

#: the largest finite fp16 value: a magnitude above it is inf in fp16
_FP16_MAX = float(torch.finfo(torch.float16).max)

#: ops that write a constant into a tensor (canonical names, see :mod:`converter.ir.ops`): one whose constant
#: lies beyond fp16's range (``-inf``, ``torch.finfo(dtype).min``, ``-1e9``) is a mask fill, not data
_FILL_OPS = frozenset({"full", "full_like", "new_full", "fill", "masked_fill", "index_fill", "where", "scalar_tensor"})

#: arithmetic ops that build an additive mask from a 0/1 tensor (``(1 - mask) * torch.finfo(dtype).min``):
#: their constant counts as a fill only at a dtype's extreme (``±inf``, ``finfo(fp32/bf16).min/max``)
_FILL_SCALE_OPS = frozenset({"mul"})
_DTYPE_EXTREME = float(torch.finfo(torch.bfloat16).max)


def _uninitialized(node: torch.fx.Node) -> bool:
    info = node.meta.get(META_INFO)
    return info is not None and info.op in _UNINITIALIZED


#: the calls that enter and leave an inlined autocast region (converter.passes.regions): global state, so the
#: lockstep run below makes each once for both runs (twice, the second exit would restore the first's autocast)
_AUTOCAST_ENTER, _AUTOCAST_EXIT = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast


def _fill_constant(value: Any, *, extreme: bool) -> bool:
    """A Python float a model writes as a mask fill: beyond fp16's range (``extreme``: at a dtype's extreme)."""
    if not isinstance(value, float) or value != value:  # NaN is no fill
        return False
    return abs(value) >= _DTYPE_EXTREME if extreme else abs(value) > _FP16_MAX


def _fill_source(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes a mask-fill constant (see :func:`_fill_constant`) into its output."""
    info = node.meta.get(META_INFO)
    if info is None or info.op not in _FILL_OPS | _FILL_SCALE_OPS:
        return False
    extreme = info.op in _FILL_SCALE_OPS
    return any(_fill_constant(v, extreme=extreme) for v in list(node.args) + list(node.kwargs.values()))


def _fill_tensor(value: Any) -> bool:
    """A small constant tensor (a lifted ``torch.tensor(torch.finfo(dtype).min)``) made of fill values only."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point() and 0 < value.numel() <= 64
            and not isinstance(value, torch.nn.Parameter) and value.device.type != "meta"
            and bool((value.abs() > _FP16_MAX).all()))


def _large(value: Any) -> bool:
    """Whether any floating tensor of ``value`` holds a magnitude fp16 cannot (inf included)."""
    return any(t.is_floating_point() and t.numel() and not bool((t.abs() <= _FP16_MAX).all())
               for t in output_tensors(value))


def _overflowed(mixed: Any, ref: Any) -> list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """Per floating output: (mixed, ref, mask of the elements that are inf/NaN in ``mixed`` but finite in ``ref``;
    None when the shapes differ, a data-dependent shape, so the whole tensor counts); empty when nothing overflowed."""
    found: list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = []
    for m, r in zip(output_tensors(mixed), output_tensors(ref)):
        if not (m.is_floating_point() and r.is_floating_point() and m.numel()):
            continue
        if m.shape != r.shape:
            if not bool(torch.isfinite(m).all()) and bool(torch.isfinite(r).all()):
                found.append((m, r, None))
            continue
        bad = ~torch.isfinite(m) & torch.isfinite(r)
        if bool(bad.any()):
            found.append((m, r, bad))
    return found


def _fill_only(found: list, shadow: Any) -> bool:
    """Whether every overflowed element is a mask fill: ``±inf`` in fp16 with fp32's sign, and in range in
    ``shadow`` (the fp32 run with every fill constant replaced by 0), so its large magnitude came from the
    fills alone. A NaN is never a fill (``-inf - -inf``, a softmax over a fully masked row)."""
    shadows = [t for t in output_tensors(shadow) if t.is_floating_point() and t.numel()]
    if shadow is None or len(shadows) < len(found):
        return False
    for (m, r, bad), s in zip(found, shadows):
        if bad is None or s.shape != m.shape:
            return False
        got, want, data = m[bad], r[bad], s[bad].float()
        if bool(torch.isnan(got).any()) or not bool((torch.sign(got.float()) == torch.sign(want)).all()):
            return False
        if not bool((data.abs() <= _FP16_MAX).all()):  # NaN compares False too
            return False
    return True


def _storages(value: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in output_tensors(value) if t.numel()}


def first_overflow(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> Optional[tuple[torch.fx.Node, float]]:
    """Run ``gm`` and, in lockstep, the same graph with its inserted casts skipped (fp32); return
    the first node whose converted output is non-finite where its fp32 output is finite, with the
    largest magnitude of that fp32 output.

    Two kinds of values are not overflow: **mask fills** and **unwritten memory**. A node that writes a
    constant beyond fp16's range (``masked_fill``/``full``/``where`` with ``-inf`` or
    ``torch.finfo(dtype).min``, ``(1 - mask) * finfo.min``) is a fill source; its values and those
    computed from them (additive masks: ``bias + mask``) also run a third time, in fp32 with every fill
    constant replaced by 0, as long as they hold magnitudes fp16 cannot. An element that is ``±inf`` in
    fp16 is a fill when that shadow is in fp16's range there: its magnitude came from the fill alone
    (autocast rounds the same mask to ``-inf``, which softmax and attention read as "masked"). Data that
    overflows beside a mask is still caught. ``empty``/``new_empty`` memory is zeroed in both runs before
    anything reads it (its bits differ between runs and calls), and a view of it is not checked until an
    in-place op (``copy_``, ``index_put_``) writes it.
    """
    from torch.fx.node import map_arg

    from converter.passes.capture import placeholder_values

    interp = torch.fx.Interpreter(gm)
    flat = iter(placeholder_values(gm, args, kwargs))
    nodes = list(gm.graph.nodes)
    last_use = {inp: i for i, node in enumerate(nodes) for inp in node.all_input_nodes}
    mixed: dict = {}
    ref: dict = {}
    entered: list = []  # autocast regions open now: left on an early return
    shadow: dict = {}  # fp32 values with the fill constants at 0, for the nodes that carry fills
    # storages of empty()/new_empty() outputs no in-place op has written yet (held, so no other tensor reuses them)
    unwritten: dict[int, torch.Tensor] = {}
    # both runs read the same buffers: restore them (a train-mode batch norm would update its statistics twice)
    with preserved_state(gm), torch.no_grad(), contextlib.ExitStack() as leave:
        leave.callback(lambda: [_AUTOCAST_EXIT(ctx) for ctx in reversed(entered)])
        for i, node in enumerate(nodes):
            if node.op == "output":
                break
            if node.op == "placeholder":
                value = next(flat, None)
                mixed[node], ref[node] = value, (value.clone() if isinstance(value, torch.Tensor) else value)
            elif node.op == "get_attr":
                mixed[node] = ref[node] = interp.fetch_attr(str(node.target))
                if _fill_tensor(ref[node]):
                    shadow[node] = torch.zeros_like(ref[node])
            else:
                run = getattr(interp, node.op)
                mixed[node] = run(node.target, *map_arg((node.args, node.kwargs), mixed.__getitem__))
                rec = node.meta.get(META_CAST)
                cast = rec is not None and rec.inserted
                if cast:
                    ref[node] = ref[node.args[0]]  # the fp32 graph has no such cast
                elif node.target in (_AUTOCAST_ENTER, _AUTOCAST_EXIT):
                    ref[node] = mixed[node]
                    if node.target is _AUTOCAST_ENTER:
                        entered.append(mixed[node])
                    else:
                        entered.remove(mixed[node.args[0]])
                else:
                    ref[node] = run(node.target, *map_arg((node.args, node.kwargs), ref.__getitem__))
                found = _checked_overflow(node, mixed, ref, shadow, unwritten, run, cast)
                if found:
                    return node, _absmax(ref[node])
            for inp in node.all_input_nodes:
                if last_use.get(inp) == i:
                    mixed.pop(inp, None)
                    ref.pop(inp, None)
                    shadow.pop(inp, None)
    return None


def _checked_overflow(node: torch.fx.Node, mixed: dict, ref: dict, shadow: dict, unwritten: dict, run, cast: bool) -> bool:
    """One step of :func:`_first_overflow` after ``node`` ran in both runs: track unwritten memory and
    fill-carrying values, and say whether ``node`` overflowed on data."""
    if _uninitialized(node):  # nothing reads its bits: zeros in both runs, checked once written
        for t in output_tensors(mixed[node]) + output_tensors(ref[node]):
            t.zero_()
            if t.numel():
                unwritten[t.untyped_storage().data_ptr()] = t
        return False
    info = node.meta.get(META_INFO)
    if unwritten and info is not None and info.inplace:
        for ptr in _storages(mixed[node]) | _storages(ref[node]):
            unwritten.pop(ptr, None)
    fills = _fill_source(node)
    if (fills or any(n in shadow for n in node.all_input_nodes)) and _large(ref[node]):
        try:
            shadow[node] = shadow[node.args[0]] if cast else _shadow_value(node, run, ref, shadow, fills)
        except Exception:  # e.g. a data-dependent shape the zeros change: no shadow, so nothing is excused
            pass
    if unwritten and not _storages(mixed[node]).isdisjoint(unwritten):
        return False  # a view of memory not written yet
    found = _overflowed(mixed[node], ref[node])
    return bool(found) and not _fill_only(found, shadow.get(node))


def _shadow_value(node: torch.fx.Node, run, ref: dict, shadow: dict, fills: bool) -> Any:
    """``node`` run on the shadow values of its fill-carrying inputs (fp32 values elsewhere), with its own
    fill constants replaced by 0 when it is a fill source (see :func:`_first_overflow`)."""
    from torch.fx.node import map_aggregate

    def value(a):
        if isinstance(a, torch.fx.Node):
            return shadow[a] if a in shadow else ref[a]
        return 0.0 if fills and _fill_constant(a, extreme=False) else a

    call_args, call_kwargs = map_aggregate((node.args, node.kwargs), value)
    info = node.meta.get(META_INFO)
    if info is not None and info.inplace and call_args and isinstance(call_args[0], torch.Tensor):
        call_args = (call_args[0].clone(),) + tuple(call_args[1:])  # never write into the fp32 run's tensors
    return run(node.target, call_args, call_kwargs)
