"""Capture: turn an ``nn.Module`` into a GraphModule whose nodes all carry :class:`NodeInfo`.

``tracer="auto"`` tries ``torch.fx.symbolic_trace`` first (fast, keeps Python-level structure) and
falls back to ``torch.export`` (training IR, ``.module()``) when symbolic tracing fails. A
transformers ``PreTrainedModel`` (recognised without importing transformers) goes to torch.export
first, since symbolic tracing fails on every Hugging Face model; ``capture_errors["fx"]`` says so.
``"fx"`` and ``"export"`` force one.

**No weight is copied, the model is left as it was.** Every trace runs on a
:func:`~converter.passes.capture.shells.shell` of the model: new module objects (own modes, hooks, attribute tables, and a copy of ``config`` where
LayerDrop is switched off) over the *same* parameter storage and buffers. The captured graph and
so the converted module therefore share every weight with the user's model (no copy of W), and
nothing capture does to modes, config or hooks reaches the user's model. Runs that write buffers
(shape propagation, the eval check) run under :func:`~converter.ir.state.preserved_state`, and the
whole capture under one more, so a batch norm's statistics are put back also when a tracer raises.

The FX tracer traces *into* ``Linear``, ``Conv*``, ``LayerNorm``, ``GroupNorm``, ``RMSNorm`` and
``Embedding`` so that their weights become ``get_attr`` nodes the rewrite can cast (O1) and the op
becomes a functional call (``F.linear`` ...), the same op that export produces. ``BatchNorm`` stays
a leaf module so that ``train()``/``eval()`` keep working on the converted model.

Shape propagation runs the example inputs once (under ``no_grad``, restoring every buffer and the
RNG state afterwards) for FX graphs; export graphs already carry fake values in ``node.meta["val"]``.
Either way ``node.meta["mp_value"]`` holds the *example's* sizes, which placement uses as cast costs.

**Dynamic shapes.** torch.export captures with ``Dim.AUTO`` on every dimension of every tensor
input: what the model fixes (a hidden size that meets a weight) stays static, batch, sequence and
image sizes stay dynamic, and the converted module and the emitted model.py serve other sizes.
An example dim of size 1 would be specialised to 1 (torch's 0/1 specialisation), so when the
example has one, capture first traces size-obliviously (``backed_size_oblivious``) and keeps it
dynamic; if that fails it retries with plain ``Dim.AUTO``, and if dynamic capture fails at all it
captures static shapes and says why. ``dynamic=False`` fixes every dim; ``dynamic_shapes`` (the
model file's ``dynamic_shapes()``) replaces the default. symbolic_trace records no sizes, so FX
graphs are dynamic by construction. ``Captured.dynamic_dims`` (``report.records.capture.dynamic_dims``)
maps each input (``input_ids``, ``xs[1]``) to its dynamic dims; ``shapes_note`` says how.
Sizes are never read with ``int(SymInt)``, which would specialise them.

Two kinds of model need help to stay dynamic. LSTM/GRU/RNN: torch computes ``aten.lstm``'s fake
output with a Python loop over the time steps, which fixes the sequence length; during export they
run as stand-in ops with loop-free fake kernels (:mod:`converter.passes.recurrent`), and the graph
gets the aten ops back. Size expressions that blow up: with its image size dynamic, Swin's window
partition makes 270-400-operation sympy sizes and its export takes 120-250 s on a 2-core CPU (and
still serves no larger image: its ``min(resolution) <= window`` branch fixes that). A
:class:`~converter.passes.size_budget.SizeBudget` stops such an export once a size exceeds 32
operations (the zoo's other models stay at 4 or less), about 4 s in, and capture exports again with
only dim 0 of every input dynamic (0.8 s), saying so in ``shapes_note``.
Inputs the model relates: a Hugging Face model given ``labels`` flattens logits and labels for its
loss, which leaves the guard ``input_ids.numel() == labels.numel()``; with a symbol per dim it reads as
pinning batch and sequence length of both. Capture exports again with each such pair of dims sharing
one ``Dim`` (:func:`~converter.passes.guards.tied_dims`), so both stay dynamic; ``Captured.tied_dims``
(``report.records.capture.tied_dims``) names them (``labels`` dim 0 is ``input_ids`` dim 0).

**Train and eval.** Both tracers trace the model in *train* mode, where every mode-dependent op is
recorded with its train-mode arguments, and :mod:`converter.passes.modes` rewrites those arguments
to read the converted module's ``self.training`` (dropout, batch norm and its batch counter,
attention dropout, RNN dropout). The graph is then run in eval mode on the example and compared with
the original model in eval mode (both from the same seed), and the random ops that do not read
``self.training`` are counted. A model whose Python code branches on ``self.training`` some other
way (stochastic depth: ``if not training: return x``; its ``rand``/``bernoulli_`` is in the train
graph only) is traced again in eval mode: ``Captured.eval_gm`` holds that graph, ``convert`` converts
both and combines them into a :class:`~converter.ir.graphmodule.TwoModeGraphModule` that runs each in
its mode on shared parameters. Hugging Face LayerDrop (``if self.training and torch.rand([]) <
config.layerdrop``, a branch on a random number) is switched off in the shell's copy of ``config`` for
the train trace, and the note says so. symbolic_trace would draw a random tensor of no traced input (``torch.rand(())``)
once and bake the branch on it into the graph; such a trace is refused, naming the line. A model
whose train mode cannot be traced at all is captured in its own mode, its mode frozen. Either
way ``Captured.modes`` (``report.records.capture.modes``) says what happened and why. Partial capture
(:mod:`converter.partition`) sets :data:`REFUSE_FROZEN` while it tries a model whole: such a model is then a
capture failure and is converted region by region, so that its train mode keeps its dropout (DETR's
``if self.training: if not torch.isfinite(x).all()`` clamp). The converted module
starts in the original's mode.

**Key/value caches.** A Hugging Face model whose ``config.use_cache`` is true (stock decoders and
encoder-decoders) would return a ``DynamicCache``, which no graph can return and training never
reads: unless the example asks for a cache, it is traced with ``use_cache=False`` on a shell's copy of
its config, and ``Captured.cache`` (``report.records.capture.cache``) says so. Decoding calls are served by
:mod:`converter.inplace`.

**Higher-order regions.** ``torch.no_grad()``/``set_grad_enabled`` and ``torch.autocast`` blocks,
which torch.export records as nested graphs, are inlined between plain grad-mode/autocast calls
(:mod:`converter.passes.regions`), so their ops get decisions and model.py is plain Python.
Autocast blocks and transformers' ``_keep_in_fp32_modules`` are the user's precision intent: both
tracers tag the nodes they cover (symbolic_trace through :class:`~converter.passes.intent.AutocastMarks`,
as FX records no autocast), and *decide* ranks that intent above every rule file
(:mod:`converter.passes.intent`).

**Custom autograd Functions.** Both tracers record a ``torch.autograd.Function``'s forward only, so
its backward would be lost; :class:`~converter.passes.autograd_fns.OpaqueFunctions` keeps each
``Fn.apply(...)`` of a Function not defined by torch as one call node that runs the Function,
forward and backward (:mod:`converter.passes.autograd_fns`).

**Errors.** A branch on tensor values (``if x.sum() > 0``) is a :class:`CaptureError` whose
``advice`` says in plain words what to do (``torch.cond``, move the branch out of ``forward``, or
split the model) and names the file and line of the branch.

**Modules.** This module is the orchestration (tracer order, fallbacks, the :class:`Captured`
record); the stages live in modules of their own: :mod:`~converter.passes.capture.fx_trace`
(symbolic_trace and shape propagation), :mod:`~converter.passes.capture.export_trace` (torch.export
and its dynamic-shape fallbacks), :mod:`~converter.passes.capture.shells` (the model shell),
:mod:`~converter.passes.capture.train_eval` (train/eval splitting), :mod:`~converter.passes.capture.cache`
(key/value caches), :mod:`~converter.passes.capture.annotation` (node annotation),
:mod:`~converter.passes.capture.advice` (errors and advice) and :mod:`~converter.passes.capture.values`
(input and value helpers shared with the later stages).
"""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx

from converter.ir.meta import ModesNote
from converter.ir.state import preserved_state
from converter.passes.capture.advice import (
    CaptureError,
    break_reason,
    cache_advice,
    control_flow_advice,
    failure_location,
    short_reason,
)
from converter.passes.capture.annotation import annotate, opaque_leaves
from converter.passes.capture.cache import (
    CACHE_ARGUMENTS,
    CacheCallError,
    cache_off,
    cache_request,
    guard_cache_calls,
    guard_cache_calls_keeping,
)
from converter.passes.capture.export_trace import trace_export
from converter.passes.capture.fx_trace import TRACED_THROUGH, RandomAtTraceTime, trace_fx
from converter.passes.capture.reserved import keep_user_names, rename_reserved
from converter.passes.capture.shells import is_hf_model, shell, without_layerdrop
from converter.passes.capture.train_eval import split_modes, trace_in_mode
from converter.passes.capture.values import Shapes, input_nodes, normalize_inputs, placeholder_values
from converter.passes.intent import mark_kept_modules
from converter.vocab import TRACERS, choice

__all__ = ["Captured", "CaptureError", "CacheCallError", "guard_cache_calls", "guard_cache_calls_keeping",
           "CACHE_ARGUMENTS", "capture", "normalize_inputs", "annotate", "placeholder_values", "TRACED_THROUGH",
           "shell", "input_nodes", "keep_user_names", "REFUSE_FROZEN"]


#: True while partial capture tries a model or a region whole: a train mode that cannot be traced is then a
#: capture failure (the part is converted in smaller regions, train() keeping its dropout), not a graph frozen in
#: the model's mode
REFUSE_FROZEN: ContextVar[bool] = ContextVar("mpconvert_refuse_frozen", default=False)


@dataclass
class Captured:
    """What :func:`capture` produced: the annotated graph(s), the tracer used, the example and what capture found."""

    gm: torch.fx.GraphModule
    tracer: str
    args: tuple
    kwargs: dict
    errors: dict[str, str]
    #: placeholder name -> the dims that are dynamic in the captured graph
    dynamic_dims: dict = field(default_factory=dict)
    #: how the dims were chosen, or why they are static
    shapes_note: str = ""
    #: input name -> {dim: why} for dims a guard in the model's code narrows (not in ``dynamic_dims``)
    narrowed_dims: dict = field(default_factory=dict)
    #: input name -> {dim: {"min", "max", "why"}} for dynamic dims served only within a range
    dynamic_ranges: dict = field(default_factory=dict)
    #: input name -> the dims of ``narrowed_dims`` a guard pins to the example's size (model.py checks them as fixed)
    pinned_dims: dict = field(default_factory=dict)
    #: input name -> {dim: [other input, its dim]}: dynamic dims that must equal another input's (``labels``
    #: and ``input_ids``: a guard relates them, so they were exported as one ``Dim``)
    tied_dims: dict = field(default_factory=dict)
    #: whether train()/eval() work on the captured graph, and why not if they do not (None: not captured yet)
    modes: Optional[ModesNote] = None
    #: the graph of the model in eval mode, when it branches on self.training (``gm`` is then the train graph)
    eval_gm: Optional[torch.fx.GraphModule] = None
    #: why the graph returns no key/value cache (a Hugging Face model captured with use_cache=False), or ""
    cache: str = ""
    #: {name in the graph: the model's name} of root names that are GraphModule's own (``graph_``: ``graph``)
    user_names: dict = field(default_factory=dict)


def capture(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    tracer: str = "auto",
    dynamic: bool = True,
    dynamic_shapes: Any = None,
) -> Captured:
    """Capture ``model`` into an annotated GraphModule (see module docstring).

    ``dynamic``: torch.export captures with dynamic dims (False: the example's sizes are fixed).
    ``dynamic_shapes``: torch.export-style dims for the example inputs, used instead of the default.
    """
    choice(tracer, TRACERS, what="tracer")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = normalize_inputs(example_inputs)
    errors: dict[str, str] = {}
    order = {"auto": ("fx", "export"), "fx": ("fx",), "export": ("export",)}[tracer]
    if tracer == "auto" and is_hf_model(model):
        # symbolic_trace fails on every Hugging Face model: torch.export first, FX only if it fails
        order = ("export", "fx")
    # every trace runs on a shell of the model (see shell.shell); this guard puts back any buffer a run
    # writes in place, also when a tracer raises
    with preserved_state(model):
        cache = cache_off(model, args, kwargs)
        traced = model if cache is None else shell(model, config={"use_cache": False})
        failures: list[BaseException] = []
        result, used, shapes, advice = _first_capture(order, traced, args, kwargs, dynamic, dynamic_shapes, errors, failures)
        if result is not None and used == "export" and order[0] == "export" and "fx" not in errors:
            errors["fx"] = (f"not tried: {type(model).__name__} is a Hugging Face PreTrainedModel, which "
                            "symbolic_trace cannot trace (Python control flow on inputs and config); used torch.export")
        if result is None:
            located = [failure_location(exc)[0] for exc in failures]
            cache = cache_advice(errors, cache_request(model, args, kwargs))
            raise CaptureError(errors, advice=advice or cache, location=next((loc for loc in located if loc), ""),
                               reason="returns a key/value cache" if cache and not advice else
                               break_reason(failures[0]) if failures else "")
        captured = _finish_capture(result, used, shapes, tracer, traced, args, kwargs, dynamic, dynamic_shapes, errors)
        captured.cache = cache or ""
        captured.user_names = rename_reserved(shell(model))  # the names trace_in_mode gave the shell it traced
        return captured


def _first_capture(order: tuple, model: torch.nn.Module, args: tuple, kwargs: dict, dynamic: bool, dynamic_shapes: Any,
                   errors: dict, failures: list) -> tuple:
    """(result of the first tracer in ``order`` that works or None, its name, its shapes, advice); each
    failure goes into ``errors`` with its reason, and its exception into ``failures``."""
    advice: Optional[str] = None
    result = used = shapes = None
    for name in order:
        shapes = Shapes(dynamic=dynamic, user_spec=dynamic_shapes)
        try:
            result = _capture_one(name, model, args, kwargs, shapes)
            used = name
            break
        except Exception as exc:  # any tracer failure is reported with its reason, then the next is tried
            failures.append(exc)
            plain = control_flow_advice(exc)
            advice = advice or plain
            errors[name] = plain or short_reason(exc)
    return result, used, shapes, advice


def _finish_capture(result: tuple, used: str, shapes: Shapes, tracer: str, model: torch.nn.Module, args: tuple,
                    kwargs: dict, dynamic: bool, dynamic_shapes: Any, errors: dict) -> Captured:
    """Annotate the captured graph(s); under ``auto``, an FX graph with opaque leaves is exported instead."""
    gm, eval_gm, modes = result
    annotate(gm, root_type=type(model).__name__)
    opaque = opaque_leaves(gm)
    if tracer == "auto" and used == "fx" and opaque:
        # FX kept modules it cannot see into (nn.MultiheadAttention, RNNs...) as fp32 leaves;
        # torch.export traces through them, so prefer it when it works.
        export_shapes = Shapes(dynamic=dynamic, user_spec=dynamic_shapes)
        try:
            exported, exported_eval, export_modes = _capture_one("export", model, args, kwargs, export_shapes)
        except Exception as exc:  # keep the FX graph; the opaque modules stay fp32 (reported)
            errors["export"] = control_flow_advice(exc) or short_reason(exc)
        else:
            annotate(exported, root_type=type(model).__name__)
            errors["fx"] = f"opaque leaf modules {', '.join(sorted(set(opaque)))}: used torch.export to convert inside them"
            gm, eval_gm, used, modes, shapes = exported, exported_eval, "export", export_modes, export_shapes
    if eval_gm is not None:
        annotate(eval_gm, root_type=type(model).__name__)
    for graph in (gm, eval_gm) if eval_gm is not None else (gm,):
        mark_kept_modules(graph, model)  # transformers' _keep_in_fp32_modules (converter.passes.intent)
    return Captured(gm=gm, tracer=used, args=args, kwargs=kwargs, errors=errors,
                    dynamic_dims=shapes.dims, shapes_note=shapes.note, modes=modes, eval_gm=eval_gm,
                    narrowed_dims=shapes.narrowed, dynamic_ranges=shapes.ranges, tied_dims=shapes.tied,
                    pinned_dims=shapes.pinned)


def _capture_one(name: str, model: torch.nn.Module, args: tuple, kwargs: dict, shapes: Shapes) -> tuple:
    """Trace with one tracer; returns (train-or-only graph, eval graph or None, modes note).

    One mode-aware graph when the eval check passes; a train graph and an eval graph when the model
    branches on ``self.training`` (the graph computes something else in eval mode, or draws random
    numbers that eval mode does not); one graph frozen in the model's own mode when train mode
    cannot be traced at all (see the module docstring)."""
    trace = trace_fx if name == "fx" else trace_export  # looked up here: tests replace them on this module
    why = skipped = ""
    try:
        gm, changed = trace_in_mode(trace, name, model, args, kwargs, shapes, training=True)
    except Exception as exc:
        # e.g. LayerDrop's `if self.training and torch.rand(()) < p`: a branch only train mode takes
        flow = control_flow_advice(exc) or isinstance(exc, RandomAtTraceTime)
        off = without_layerdrop(model) if flow else None
        if off is not None:
            try:
                gm, changed = trace_in_mode(trace, name, model, args, kwargs, shapes, training=True, config=off[0])
                skipped = off[1]
            except Exception:  # still untraceable: frozen below
                off = None
        if off is None:
            if model.training or REFUSE_FROZEN.get():
                raise
            where = failure_location(exc)[0] if flow and not isinstance(exc, RandomAtTraceTime) else ""
            cause = (exc.reason if isinstance(exc, RandomAtTraceTime) else f"a data-dependent branch{' at ' + where if where else ''}"
                     if flow else short_reason(exc))
            why = f"tracing in train mode failed ({cause})"
    if why:
        gm, _ = trace_in_mode(trace, name, model, args, kwargs, shapes)
        mode = "train" if model.training else "eval"
        return gm, None, ModesNote(f"frozen_{mode}",  # type: ignore[arg-type]
                                   f"frozen in {mode} mode: {why}; train()/eval() on the converted module change nothing")
    gm, eval_gm, note = split_modes(trace, name, model, gm, changed, args, kwargs, shapes)
    return gm, eval_gm, note.extended(skipped)
