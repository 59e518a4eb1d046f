"""Export tracing: ``torch.export`` with dynamic shapes, and its fallbacks.

Every dim of every tensor input gets ``Dim.AUTO``; an example with size-1 dims is first traced
size-obliviously (every such dim, then only the batch dim); dims of two inputs that a guard relates
(a Hugging Face model's ``labels`` and ``input_ids``: the loss flattens both) are exported again
sharing one ``Dim`` (:func:`~converter.passes.guards.tied_dims`); size expressions that blow up
(:class:`~converter.passes.size_budget.SizeBudget`) leave only dim 0 of each input dynamic; when
dynamic capture fails at all the shapes are static. :class:`~converter.passes.capture.values.Shapes`
says which dims stayed dynamic and why (see :mod:`converter.passes.capture`).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from converter.ir.meta import META_VALUE
from converter.passes.autograd_fns import OpaqueFunctions, restore_function_calls
from converter.passes.capture.advice import short_reason
from converter.passes.capture.served import name_guard_failures
from converter.passes.capture.values import Shapes, placeholder_values, placeholders, spec_of
from converter.passes.checkpoint import CheckpointMarks, tag_export_graph
from converter.passes.guards import dim_ranges, narrowed_dims, pinned_dims, tied_dims
from converter.passes.intent import AutocastMarks
from converter.passes.recurrent import RecurrentOps, restore_aten_ops
from converter.passes.regions import inline_regions
from converter.passes.size_budget import SizeBudget, SizesTooComplex

__all__ = ["trace_export"]


def trace_export(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: Shapes) -> torch.fx.GraphModule:
    """``model`` captured by torch.export (``.module()``), its regions inlined and every node's value spec
    written; ``shapes`` receives the dynamic dims, the narrowed ones and their ranges, and how they were chosen."""
    ep = _export_dynamic(model, args, kwargs, shapes)
    gm = _module_of(ep)
    name_guard_failures(gm)  # a call of sizes the graph does not serve: one line, and the signal to capture again
    restore_function_calls(gm)  # custom autograd Functions: their calls, not the stand-in ops
    # ep.module() replaces train()/eval() on the instance by ones that raise NotImplementedError;
    # the graph reads self.training instead (converter.passes.modes), so the class's methods serve
    for name in ("train", "eval"):
        if name in vars(gm):
            delattr(gm, name)
    tag_export_graph(gm)  # checkpoint regions (before inlining: the inlined nodes keep their tags)
    inline_regions(gm)
    _drop_metadata_asserts(gm)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta[META_VALUE] = spec_of(node.meta["val"])
    shapes.dims = {}
    named = list(zip(_input_names(gm, model, args, kwargs), (n.meta.get("val") for n in placeholders(gm))))
    # dims a recorded guard pins to a few sizes are not served: the converted module would refuse others
    shapes.narrowed = narrowed_dims(named)
    # of those, the dims a guard pins to the example's size itself (not a divisibility): model.py checks them as fixed
    shapes.pinned = {name: kept for name, dims in pinned_dims(named).items()
                     if (kept := tuple(d for d in dims if d in shapes.narrowed.get(name, {})))}
    # a finite range (BERT's 2..max_position_embeddings) is served: the dim stays dynamic, with its range
    shapes.ranges = {name: kept_ranges for name, dims in dim_ranges(named, gm).items()
                     if (kept_ranges := {d: r for d, r in dims.items() if d not in shapes.narrowed.get(name, {})})}
    for name, val in named:
        if isinstance(val, torch.Tensor):
            dims = [i for i, s in enumerate(val.shape) if not is_concrete_int(s) and i not in shapes.narrowed.get(name, {})]
            if dims:
                shapes.dims[name] = dims
    shapes.tied = _tied_in_graph(shapes.ties, dict(named))
    if shapes.tied:
        shapes.note += "; " + _tied_note(shapes)
    elif shapes.tie_failure:
        shapes.note += f"; exporting the dims a guard relates as one Dim failed ({shapes.tie_failure}), so they are narrowed"
    return gm


def _tied_in_graph(ties: list, values: dict) -> dict:
    """``{input: {dim: [input, dim]}}``: the dims the graph gives the symbol of another input's dim by
    a :class:`~converter.passes.guards.Tie` (a static fallback shares none)."""
    out: dict[str, dict[int, list]] = {}
    for tie in ties:
        first, index = tie.dims[0]
        size = getattr(values.get(first), "shape", (None,) * (index + 1))[index]
        for name, dim in tie.joined:
            value = values.get(name)
            if isinstance(value, torch.Tensor) and not is_concrete_int(value.shape[dim]) and size is not None \
                    and not is_concrete_int(size) and value.shape[dim].node.expr == size.node.expr:
                out.setdefault(name, {})[dim] = [first, index]
    return out


def _tied_note(shapes: Shapes) -> str:
    """``labels dims 0, 1 exported as input_ids dims 0, 1 (one Dim each: guard ... relates them)``."""
    parts = []
    for name, dims in shapes.tied.items():
        order = sorted(dims)
        others = [dims[d] for d in order]
        same = len({other for other, _ in others}) == 1
        target = (f"{others[0][0]} dim{'s' if len(order) > 1 else ''} {', '.join(str(i) for _, i in others)}" if same
                  else ", ".join(f"{other} dim {i}" for other, i in others))
        parts.append(f"{name} dim{'s' if len(order) > 1 else ''} {', '.join(map(str, order))} exported as {target}")
    whys = dict.fromkeys(tie.why for tie in shapes.ties if any(d in shapes.tied.get(n, {}) for n, d in tie.joined))
    return "; ".join(parts) + f" (one Dim each: {'; '.join(whys)} relates them)"


def _drop_metadata_asserts(gm: torch.fx.GraphModule) -> None:
    """Erase torch.export's ``_assert_tensor_metadata`` checks (recorded before each ``.to()``): they
    pin the fp32 model's dtypes and the capture device, which conversion and ``.to(device)`` change."""
    target = torch.ops.aten._assert_tensor_metadata.default
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is target and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _input_names(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """The user's name of each placeholder of an export graph: ``input_ids``, ``pixel_values``, ``xs[1]``."""
    import inspect

    params = [p.name for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def label(path, _leaf) -> str:
        head, *rest = path
        top = head.idx if hasattr(head, "idx") else None
        if top == 0 and rest:  # positional argument
            index = rest[0].idx
            name = params[index] if index < len(params) else f"args[{index}]"
            rest = rest[1:]
        else:  # keyword argument
            name = str(getattr(rest[0], "key", rest[0])) if rest else "input"
            rest = rest[1:]
        return name + "".join(pytree.keystr((k,)) for k in rest)

    names = pytree.tree_map_with_path(label, (tuple(args), dict(kwargs)))
    flat = placeholder_values(gm, *names)
    nodes = placeholders(gm)
    if len(flat) != len(nodes) or not all(isinstance(n, str) for n in flat):
        return [n.name for n in nodes]
    return flat


def _auto_spec(model: torch.nn.Module, args: tuple, kwargs: dict, *, unit_dims: str = "all",
               only_batch: bool = False, ties: tuple = ()) -> Optional[dict]:
    """``Dim.AUTO`` for the dims of every tensor input, keyed by the forward's parameter names.

    ``unit_dims``: which example dims of size 1 get it too: ``all``, or ``batch`` (dim 0 only: a
    ``(B, 1, T)`` mask keeps its broadcast dim static). ``only_batch``: dim 0 of each input only.
    ``ties``: :class:`~converter.passes.guards.Tie` groups whose dims share one ``Dim`` instead
    (a group with a dim the spec leaves static is left out).
    """
    import inspect

    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in inspect.signature(model.forward).parameters.values()
           if p.name in bound.arguments):
        return None

    made: dict[str, dict] = {}  # input label (as _input_names writes it) -> its dims' spec

    def leaf(label: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.dim():
            return None
        dims = {0: torch.export.Dim.AUTO} if only_batch else {
            i: torch.export.Dim.AUTO for i, size in enumerate(value.shape) if size != 1 or unit_dims == "all" or i == 0}
        made[label] = dims
        return dims or None

    spec = {name: pytree.tree_map_with_path(lambda path, v, name=name: leaf(name + pytree.keystr(path), v), value)
            for name, value in bound.arguments.items()}
    for tie in ties:
        if all(dim in made.get(name, {}) for name, dim in tie.dims):
            shared = tie.dim()
            for name, dim in tie.dims:
                made[name][dim] = shared
    return spec


def _has_unit_dims(args: tuple, kwargs: dict, *, only_batch: bool = False) -> bool:
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim()]
    return any((t.shape[0] == 1) if only_batch else (1 in tuple(t.shape)) for t in leaves)


def _run_export(model: torch.nn.Module, args: tuple, kwargs: dict, spec: Any, *, oblivious: bool = False,
                budget: bool = False):
    """One torch.export; ``budget``: stop early when size expressions blow up (SizesTooComplex)."""
    from torch.fx.experimental import _config as fx_config

    # RecurrentOps: LSTM/GRU/RNN keep their sequence dim dynamic (converter.passes.recurrent)
    # (patch is added to the config module by torch's install_config_module: not visible to mypy)
    size_oblivious = fx_config.patch(backed_size_oblivious=oblivious)  # type: ignore[attr-defined]
    with size_oblivious, RecurrentOps(), \
            (SizeBudget() if budget else contextlib.nullcontext()), CheckpointMarks(annotate=True), OpaqueFunctions(), \
            AutocastMarks(annotate=True), _quiet_failures():
        ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=spec)
    restore_aten_ops(ep.graph_module)
    return ep


@contextlib.contextmanager
def _quiet_failures():
    """torch.export prints the partial graph of a failed trace to stderr (hundreds of lines) before raising; capture
    handles the failure (another tracer, a narrower shape spec, a region), so what a failed export wrote is dropped.
    What a successful one wrote (the model's own warnings) is passed on."""
    import io
    import sys

    buffer = io.StringIO()
    with contextlib.redirect_stderr(buffer):
        yield
    sys.stderr.write(buffer.getvalue())


def _export_tied(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: Shapes, oblivious: bool = False,
                 budget: bool = False, **options: Any):
    """:func:`_run_export` of :func:`_auto_spec` (``options``) with ``shapes.ties``; when a guard of the
    result relates dims the spec kept apart (:func:`~converter.passes.guards.tied_dims`), exported again
    with them sharing one ``Dim``, the ties kept in ``shapes.ties`` for the model's next trace. If that
    export fails, the first one stands (its dims stay narrowed, as reported)."""
    def export():
        spec = _auto_spec(model, args, kwargs, ties=tuple(shapes.ties), **options)
        return _run_export(model, args, kwargs, spec, oblivious=oblivious, budget=budget)

    ep = export()
    for _ in range(3):  # each round can only add ties; one is the rule (labels next to input_ids)
        gm = _unlifted(ep)
        new = tied_dims(list(zip(_input_names(gm, model, args, kwargs), (n.meta.get("val") for n in placeholders(gm)))))
        if not new:
            break
        kept = shapes.ties
        shapes.ties = kept + new
        try:
            ep = export()
        except Exception as exc:  # noqa: BLE001 - the untied export stands
            shapes.ties = kept
            shapes.tie_failure = short_reason(exc)
            break
    return ep


def _export_dynamic(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: Shapes):
    """torch.export with dynamic dims (see :func:`~converter.passes.capture.capture`); falls back to static shapes, saying why."""
    def run(spec, oblivious=False, budget=False):
        return _run_export(model, args, kwargs, spec, oblivious=oblivious, budget=budget)

    def run_auto(oblivious=False, budget=False, **options):
        return _export_tied(model, args, kwargs, shapes, oblivious=oblivious, budget=budget, **options)

    if not shapes.dynamic:
        shapes.note = "static shapes requested (dynamic=False / --static)"
        return run(None)
    if shapes.user_spec is not None:
        shapes.note = "dynamic dims from the model file's dynamic_shapes()"
        return run(shapes.user_spec)
    if _auto_spec(model, args, kwargs) is None:
        shapes.note = "static: the forward takes *args/**kwargs, so no dynamic dims could be named"
        return run(None)
    failures = []
    try:
        if shapes.too_complex is not None:  # a first trace (other mode) already found out
            raise shapes.too_complex
        if _has_unit_dims(args, kwargs):
            # a size-1 example dim would be specialised to 1; size-oblivious tracing keeps it dynamic:
            # every such dim first, then only the batch dim
            for unit_dims in ("all", "batch"):
                try:
                    ep = run_auto(oblivious=True, budget=True, unit_dims=unit_dims)
                    _check_example_guards(ep, args, kwargs)
                    which = "" if unit_dims == "all" else " but size-1 dims past dim 0 (kept static: broadcast dims)"
                    shapes.note = f"Dim.AUTO on every input dim{which}, traced size-obliviously (size-1 example dims)"
                    return ep
                except SizesTooComplex:
                    raise
                except Exception as exc:  # retried below
                    failures.append(short_reason(exc))
        try:
            ep = run_auto(budget=True)
            shapes.note = "Dim.AUTO on every input dim (torch.export keeps static what the model fixes" + (
                "; size-1 example dims are static: give an example with sizes >= 2 to make them dynamic)" if failures else ")")
            return ep
        except SizesTooComplex:
            raise
        except Exception as exc:  # e.g. a size check the dynamic dims cannot pass: static shapes next
            failures.append(short_reason(exc))
    except SizesTooComplex as exc:
        shapes.too_complex = exc
        ep = _export_batch_only(model, args, kwargs, shapes, exc, failures)
        if ep is not None:
            return ep
    ep = run(None)
    shapes.note = f"static shapes: dynamic capture failed ({failures[-1]})"
    return ep


def _export_batch_only(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: Shapes,
                       why: SizesTooComplex, failures: list) -> Any:
    """The export with only dim 0 of each input dynamic, after ``why`` stopped the full one; None if it fails."""
    oblivious = _has_unit_dims(args, kwargs, only_batch=True)
    try:
        ep = _export_tied(model, args, kwargs, shapes, oblivious=oblivious, only_batch=True)
        _check_example_guards(ep, args, kwargs)
    except Exception as exc:  # static shapes next
        failures.append(f"{why}; with only the batch dims dynamic: {short_reason(exc)}")
        return None
    shapes.note = (f"Dim.AUTO on dim 0 of every input only: with every dim dynamic, {why} (e.g. window "
                   f"attention over a dynamic image size), so the other dims keep the example's sizes")
    return ep


def _check_example_guards(ep: Any, args: tuple, kwargs: dict) -> None:
    """Raise if the example itself fails the graph's shape guards.

    Size-oblivious tracing may unify a broadcast dim of size 1 (a ``(B, 1, T)`` mask) with the
    size it broadcasts to; the graph would then refuse the very inputs it was captured from.
    """
    gm = _unlifted(ep)
    guard = getattr(gm, "_guards_fn", None)
    if guard is not None:
        guard(*placeholder_values(gm, args, kwargs))


#: ExportedProgram -> the ``ep.module()`` built for its guard check, which capture then uses
_UNLIFTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _unlifted(ep: Any) -> torch.fx.GraphModule:
    """``ep.module()``, built once and kept for :func:`_module_of` (it copies the graph and generates its code)."""
    gm = _UNLIFTED.get(ep)
    if gm is None:
        gm = _UNLIFTED[ep] = ep.module()
    return gm


def _module_of(ep: Any) -> torch.fx.GraphModule:
    """``ep.module()``, built once per program (it copies the graph and generates its code)."""
    gm = _UNLIFTED.pop(ep, None)
    return gm if gm is not None else ep.module()
