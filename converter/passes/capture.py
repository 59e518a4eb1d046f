"""Capture: turn an ``nn.Module`` into a GraphModule whose nodes all carry :class:`NodeInfo`.

``tracer="auto"`` tries ``torch.fx.symbolic_trace`` first (fast, keeps Python-level structure) and
falls back to ``torch.export`` (training IR, ``.module()``) when symbolic tracing fails. A
transformers ``PreTrainedModel`` (recognised without importing transformers) goes to torch.export
first, since symbolic tracing fails on every Hugging Face model; ``capture_errors["fx"]`` says so.
``"fx"`` and ``"export"`` force one.

**No weight is copied, the model is left as it was.** Every trace runs on a :func:`shell` of the
model: new module objects (own modes, hooks, attribute tables, and a copy of ``config`` where
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
graphs are dynamic by construction. ``Captured.dynamic_dims`` (``report.extra["dynamic_dims"]``)
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
way ``Captured.modes`` (``report.extra["modes"]``) says what happened and why. The converted module
starts in the original's mode.

**Key/value caches.** A Hugging Face model whose ``config.use_cache`` is true (stock decoders and
encoder-decoders) would return a ``DynamicCache``, which no graph can return and training never
reads: unless the example asks for a cache, it is traced with ``use_cache=False`` on a shell's copy of
its config, and ``Captured.cache`` (``report.extra["cache"]``) says so. Decoding calls are served by
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
"""
from __future__ import annotations

import contextlib
import copy
import functools
import re
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.nn.utils.parametrize import ParametrizationList
from torch.overrides import TorchFunctionMode

from converter.ir.errors import MpconvertError
from converter.ir.graphmodule import new_graph_module
from converter.ir.meta import META_CHECKPOINT, META_INFO, META_SOURCE, META_VALUE, ModesNote, NodeInfo, TensorSpec
from converter.ir.ops import CAST_OPS, NORM_OPS, canonical_op, explicit_dtype, is_inplace
from converter.ir.state import preserved_state
from converter.passes.autograd_fns import OpaqueFunctions, restore_function_calls
from converter.passes.checkpoint import CheckpointMarks, active_tag, tag_export_graph
from converter.passes.guards import dim_ranges, narrowed_dims
from converter.passes.intent import AutocastMarks, mark_kept_modules, tag_traced
from converter.passes.modes import constant_flags, is_random, make_mode_aware, random_ops
from converter.passes.recurrent import RecurrentOps, restore_aten_ops
from converter.passes.regions import inline_regions
from converter.passes.size_budget import SizeBudget, SizesTooComplex

__all__ = ["Captured", "CaptureError", "CacheCallError", "guard_cache_calls", "guard_cache_calls_keeping",
           "CACHE_ARGUMENTS", "capture", "normalize_inputs", "annotate", "placeholder_values", "TRACED_THROUGH"]

#: nn modules the FX tracer traces into (their forward is one functional call on their parameters)
TRACED_THROUGH = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose1d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
    torch.nn.Embedding,
    torch.nn.Identity,
    torch.nn.Flatten,
)


class CaptureError(MpconvertError, RuntimeError):
    """Neither tracer could capture the model; ``reasons`` maps tracer name to a one-line reason."""

    def __init__(self, reasons: dict[str, str], *, advice: Optional[str] = None):
        self.reasons = dict(reasons)
        #: plain words on what to change in the model (data-dependent control flow), or None
        self.advice = advice
        if advice is not None:
            super().__init__(f"could not capture the model (tracer {' and '.join(reasons)}): {advice}")
            return
        detail = "; ".join(f"{name}: {why}" for name, why in reasons.items())
        hint = "try --tracer export" if "export" not in reasons else "make the model traceable by torch.export (see its error)"
        super().__init__(f"could not capture the model ({detail}); {hint}")


@dataclass
class Captured:
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
    #: whether train()/eval() work on the captured graph, and why not if they do not (None: not captured yet)
    modes: Optional[ModesNote] = None
    #: the graph of the model in eval mode, when it branches on self.training (``gm`` is then the train graph)
    eval_gm: Optional[torch.fx.GraphModule] = None
    #: why the graph returns no key/value cache (a Hugging Face model captured with use_cache=False), or ""
    cache: str = ""


def normalize_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Accept a tuple of args, an ``(args_tuple, kwargs_dict)`` pair, or a single tensor."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if (
        isinstance(example_inputs, (tuple, list))
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], dict)
    ):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tuple of positional arguments or an (args, kwargs) pair, got {type(example_inputs).__name__}"
    )


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200]


_SKIP_FRAMES = (f"{torch.__path__[0]}", str(__import__("pathlib").Path(__file__).resolve().parent.parent))


class _Tracer(torch.fx.Tracer):
    """FX tracer that traces into Linear/Conv/norm modules, with linear-time bookkeeping.

    torch's ``Tracer.getattr`` scans every parameter on each attribute access and its
    ``record_stack_traces`` formats a full traceback per node; both are quadratic or slow on big
    models. Here parameters are found through an id map and the source location is read from the
    first stack frame outside torch and this package.
    """

    def __init__(self) -> None:
        super().__init__()
        self._attr_names: dict[int, str] = {}

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, TRACED_THROUGH):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if not isinstance(attr_val, torch.nn.Parameter):
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if not self._attr_names:
            self._attr_names = {id(p): n for n, p in self.root.named_parameters(remove_duplicate=False)}
        name = self._attr_names.get(id(attr_val))
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        where = _user_location(sys._getframe(1))
        if where and hasattr(proxy, "node"):
            proxy.node.meta[META_SOURCE] = where
        tag = active_tag()  # inside a torch.utils.checkpoint call (converter.passes.checkpoint)
        if tag is not None and hasattr(proxy, "node"):
            proxy.node.meta[META_CHECKPOINT] = tag
        if hasattr(proxy, "node"):
            tag_traced(proxy.node)  # inside a torch.autocast block (converter.passes.intent)
        return proxy


class _RandomAtTraceTime(MpconvertError, RuntimeError):
    """symbolic_trace drew a random tensor eagerly (see :class:`_EagerRandom`); capture catches it."""


class _EagerRandom(TorchFunctionMode):
    """Raise when symbolic tracing draws a random tensor eagerly.

    ``torch.rand(())`` has no Proxy argument, so symbolic_trace runs it at trace time and a branch
    on it (LayerDrop) is decided once and baked into the graph: the converted model would always
    (or never) skip that layer. torch.export traces such calls, so capture falls back to it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and is_random(getattr(func, "__name__", "")):
            where = _user_location(sys._getframe(1))
            where = f" at {where}" if where else ""
            raise _RandomAtTraceTime(f"forward draws random numbers at trace time{where} (torch.{func.__name__} of no "
                               "traced tensor), which symbolic_trace would bake into the graph")
        return out


def _user_location(frame) -> str:
    """``file:line`` of the first frame from ``frame`` outwards outside torch and this package ("" if none)."""
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FRAMES):
        frame = frame.f_back
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}" if frame is not None else ""


def _trace_fx(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: _Shapes) -> torch.fx.GraphModule:
    tracer = _Tracer()
    # OpaqueFunctions: a custom autograd Function stays one call, backward included (passes.autograd_fns)
    with _EagerRandom(), CheckpointMarks(), OpaqueFunctions(tracer), AutocastMarks(tracer=tracer):
        graph = tracer.trace(model)
    gm = new_graph_module(tracer.root, graph, type(model).__name__)
    shapes.dims = {
        n.name: list(range(v.dim())) for n, v in zip(_placeholders(gm), placeholder_values(gm, args, kwargs))
        if isinstance(v, torch.Tensor)
    }
    shapes.note = "symbolic_trace records no sizes: every dimension is dynamic" + (
        "" if shapes.dynamic else " (dynamic=False fixes torch.export captures only)")
    return gm


def _trace_export(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: _Shapes) -> torch.fx.GraphModule:
    ep = _export_dynamic(model, args, kwargs, shapes)
    gm = _module_of(ep)
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
            node.meta[META_VALUE] = _spec_of(node.meta["val"])
    shapes.dims = {}
    named = list(zip(_input_names(gm, model, args, kwargs), (n.meta.get("val") for n in _placeholders(gm))))
    # dims a recorded guard pins to a few sizes are not served: the converted module would refuse others
    shapes.narrowed = narrowed_dims(named)
    # a finite range (BERT's 2..max_position_embeddings) is served: the dim stays dynamic, with its range
    shapes.ranges = {name: kept for name, dims in dim_ranges(named, gm).items()
                     if (kept := {d: r for d, r in dims.items() if d not in shapes.narrowed.get(name, {})})}
    for name, val in named:
        if isinstance(val, torch.Tensor):
            dims = [i for i, s in enumerate(val.shape) if not is_concrete_int(s) and i not in shapes.narrowed.get(name, {})]
            if dims:
                shapes.dims[name] = dims
    return gm


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
        return name + "".join(pytree.keystr([k]) for k in rest)

    names = pytree.tree_map_with_path(label, (tuple(args), dict(kwargs)))
    flat = placeholder_values(gm, *names)
    placeholders = _placeholders(gm)
    if len(flat) != len(placeholders) or not all(isinstance(n, str) for n in flat):
        return [n.name for n in placeholders]
    return flat


@dataclass
class _Shapes:
    """What the caller asked for and what capture found about dynamic dimensions."""

    dynamic: bool = True
    user_spec: Any = None
    dims: dict = field(default_factory=dict)
    #: input name -> {dim: why}: dims the graph keeps symbolic but a guard of the model narrows (not in ``dims``)
    narrowed: dict = field(default_factory=dict)
    #: input name -> {dim: {"min", "max", "why"}}: dims in ``dims`` served only within a range
    ranges: dict = field(default_factory=dict)
    note: str = ""
    #: why every-dim-dynamic export was stopped (SizesTooComplex), kept for a second trace of the model
    too_complex: Any = None


def _auto_spec(model: torch.nn.Module, args: tuple, kwargs: dict, *, unit_dims: str = "all",
               only_batch: bool = False) -> Optional[dict]:
    """``Dim.AUTO`` for the dims of every tensor input, keyed by the forward's parameter names.

    ``unit_dims``: which example dims of size 1 get it too: ``all``, or ``batch`` (dim 0 only: a
    ``(B, 1, T)`` mask keeps its broadcast dim static). ``only_batch``: dim 0 of each input only.
    """
    import inspect

    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in inspect.signature(model.forward).parameters.values()
           if p.name in bound.arguments):
        return None

    def leaf(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.dim():
            return None
        if only_batch:
            return {0: torch.export.Dim.AUTO}
        return {i: torch.export.Dim.AUTO for i, size in enumerate(value.shape)
                if size != 1 or unit_dims == "all" or i == 0} or None

    return {name: pytree.tree_map(leaf, value) for name, value in bound.arguments.items()}


def _has_unit_dims(args: tuple, kwargs: dict, *, only_batch: bool = False) -> bool:
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim()]
    return any((t.shape[0] == 1) if only_batch else (1 in tuple(t.shape)) for t in leaves)


def _run_export(model: torch.nn.Module, args: tuple, kwargs: dict, spec: Any, *, oblivious: bool = False,
                budget: bool = False):
    """One torch.export; ``budget``: stop early when size expressions blow up (SizesTooComplex)."""
    from torch.fx.experimental import _config as fx_config

    # RecurrentOps: LSTM/GRU/RNN keep their sequence dim dynamic (converter.passes.recurrent)
    with fx_config.patch(backed_size_oblivious=oblivious), RecurrentOps(), \
            (SizeBudget() if budget else contextlib.nullcontext()), CheckpointMarks(annotate=True), OpaqueFunctions(), \
            AutocastMarks(annotate=True):
        ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=spec)
    restore_aten_ops(ep.graph_module)
    return ep


def _export_dynamic(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: _Shapes):
    """torch.export with dynamic dims (see :func:`capture`); falls back to static shapes, saying why."""
    def run(spec, oblivious=False, budget=False):
        return _run_export(model, args, kwargs, spec, oblivious=oblivious, budget=budget)

    if not shapes.dynamic:
        shapes.note = "static shapes requested (dynamic=False / --static)"
        return run(None)
    if shapes.user_spec is not None:
        shapes.note = "dynamic dims from the model file's dynamic_shapes()"
        return run(shapes.user_spec)
    spec = _auto_spec(model, args, kwargs)
    if spec is None:
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
                    ep = run(_auto_spec(model, args, kwargs, unit_dims=unit_dims), oblivious=True, budget=True)
                    _check_example_guards(ep, args, kwargs)
                    which = "" if unit_dims == "all" else " but size-1 dims past dim 0 (kept static: broadcast dims)"
                    shapes.note = f"Dim.AUTO on every input dim{which}, traced size-obliviously (size-1 example dims)"
                    return ep
                except SizesTooComplex:
                    raise
                except Exception as exc:  # retried below
                    failures.append(_short(exc))
        try:
            ep = run(spec, budget=True)
            shapes.note = "Dim.AUTO on every input dim (torch.export keeps static what the model fixes" + (
                "; size-1 example dims are static: give an example with sizes >= 2 to make them dynamic)" if failures else ")")
            return ep
        except SizesTooComplex:
            raise
        except Exception as exc:  # e.g. a size check the dynamic dims cannot pass: static shapes next
            failures.append(_short(exc))
    except SizesTooComplex as exc:
        shapes.too_complex = exc
        ep = _export_batch_only(model, args, kwargs, shapes, exc, failures)
        if ep is not None:
            return ep
    ep = run(None)
    shapes.note = f"static shapes: dynamic capture failed ({failures[-1]})"
    return ep


def _export_batch_only(model: torch.nn.Module, args: tuple, kwargs: dict, shapes: _Shapes,
                       why: SizesTooComplex, failures: list) -> Any:
    """The export with only dim 0 of each input dynamic, after ``why`` stopped the full one; None if it fails."""
    oblivious = _has_unit_dims(args, kwargs, only_batch=True)
    try:
        ep = _run_export(model, args, kwargs, _auto_spec(model, args, kwargs, only_batch=True), oblivious=oblivious)
        _check_example_guards(ep, args, kwargs)
    except Exception as exc:  # static shapes next
        failures.append(f"{why}; with only the batch dims dynamic: {_short(exc)}")
        return None
    shapes.note = (f"Dim.AUTO on dim 0 of every input only: with every dim dynamic, {why} (e.g. window "
                   f"attention over a dynamic image size), so the other dims keep the example's sizes")
    return ep


def _check_example_guards(ep: Any, args: tuple, kwargs: dict) -> None:
    """Raise if the example itself fails the graph's shape guards.

    Size-oblivious tracing may unify a broadcast dim of size 1 (a ``(B, 1, T)`` mask) with the
    size it broadcasts to; the graph would then refuse the very inputs it was captured from.
    """
    gm = _module_of(ep)
    guard = getattr(gm, "_guards_fn", None)
    if guard is not None:
        guard(*placeholder_values(gm, args, kwargs))
    _UNLIFTED[ep] = gm  # the capture's graph module: ep.module() builds a new one (and its code) per call


#: ExportedProgram -> the ``ep.module()`` built for its guard check, which capture then uses
_UNLIFTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _module_of(ep: Any) -> torch.fx.GraphModule:
    """``ep.module()``, built once per program (it copies the graph and generates its code)."""
    gm = _UNLIFTED.pop(ep, None)
    return gm if gm is not None else ep.module()


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _spec_of(value: Any) -> Any:
    """A lightweight, tensor-free description of a runtime value (shape+dtype for tensors)."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(_size_hint(s) for s in value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_spec_of(v) for v in value)
    if isinstance(value, dict):
        return tuple(_spec_of(v) for v in value.values())
    if isinstance(value, torch.dtype):
        return value
    return type(value).__name__


def _size_hint(size: Any) -> int:
    """The example's size for a (possibly symbolic) dim. Never ``int(SymInt)``: that specialises it."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None) if node is not None else None
    if hint is None and node is not None and getattr(node, "expr", None) is not None and node.expr.is_number:
        hint = node.expr
    return int(hint) if hint is not None else 1  # unbacked sizes (data-dependent) have no example value


class _Propagator(torch.fx.Interpreter):
    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        n.meta[META_VALUE] = _spec_of(result)
        return result


def placeholder_values(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values of ``gm``'s placeholders for a call ``gm(*args, **kwargs)``.

    Export graphs flatten their inputs with a pytree spec; symbolic_trace keeps every forward
    parameter as a placeholder, so missing ones take their defaults.
    """
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        import torch.fx._pytree as fx_pytree

        return list(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), info.in_spec))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(args)
    for p in placeholders[len(args):]:
        if p.target in kwargs:
            values.append(kwargs[p.target])
        elif p.args:
            values.append(p.args[0])
        else:
            values.append(None)
    return values


def _propagate(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Run the example inputs once to learn every node's shapes and dtypes; leave no trace."""
    values = placeholder_values(gm, args, kwargs)
    with preserved_state(gm), torch.no_grad():
        _Propagator(gm).run(*values)


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
    if tracer not in ("auto", "fx", "export"):
        raise ValueError(f"tracer must be 'auto', 'fx' or 'export', got {tracer!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = normalize_inputs(example_inputs)
    errors: dict[str, str] = {}
    order = {"auto": ("fx", "export"), "fx": ("fx",), "export": ("export",)}[tracer]
    if tracer == "auto" and _is_hf_model(model):
        # symbolic_trace fails on every Hugging Face model: torch.export first, FX only if it fails
        order = ("export", "fx")
    # every trace runs on a shell of the model (see shell); this guard puts back any buffer a run
    # writes in place, also when a tracer raises
    with preserved_state(model):
        cache = _cache_off(model, args, kwargs)
        traced = model if cache is None else shell(model, config={"use_cache": False})
        result, used, shapes, advice = _first_capture(order, traced, args, kwargs, dynamic, dynamic_shapes, errors)
        if result is not None and used == "export" and order[0] == "export" and "fx" not in errors:
            errors["fx"] = (f"not tried: {type(model).__name__} is a Hugging Face PreTrainedModel, which "
                            "symbolic_trace cannot trace (Python control flow on inputs and config); used torch.export")
        if result is None:
            raise CaptureError(errors, advice=advice or _cache_advice(errors))
        captured = _finish_capture(result, used, shapes, tracer, traced, args, kwargs, dynamic, dynamic_shapes, errors)
        captured.cache = cache or ""
        return captured


#: forward arguments that hand a key/value cache in (transformers 5 renamed ``past_key_values`` to ``cache``)
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def _cache_off(model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
    """The note saying the training graph is captured without the key/value cache, or None.

    A Hugging Face model whose ``config.use_cache`` is true (every stock decoder and encoder-decoder)
    returns a ``DynamicCache`` from ``forward``, which no graph can return (torch.export refuses it)
    and which training never reads. Unless the example asks for a cache (``use_cache=True`` or a
    cache argument), the model is traced with ``use_cache=False`` set on a shell's copy of its
    config; the model and its config are left as they are. Calls that ask for a cache (decoding,
    ``generate``) are served by :mod:`converter.inplace` (see :class:`~converter.inplace.ConvertedForward`)."""
    if not _is_hf_model(model) or getattr(getattr(model, "config", None), "use_cache", None) is not True:
        return None
    import inspect

    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    if "use_cache" not in signature.parameters:
        return None  # an encoder (BERT's config says use_cache too): no cache to leave out
    named = dict(bound)
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
    if named.get("use_cache") is True or any(named.get(k) is not None for k in CACHE_ARGUMENTS):
        return None  # the example asks for a cache
    how = "use_cache=False in the example" if named.get("use_cache") is False else "use_cache=False"
    return (f"captured without the key/value cache ({how}; config.use_cache=True returns a cache object, "
            "which training never reads): the graph is the training forward; calls that ask for a cache "
            "(use_cache=True, a cache, generate()) run the original forward under autocast on an applied model")


class CacheCallError(MpconvertError, TypeError):
    """A call asked ``conv.module`` (a graph captured without the key/value cache) for a cache."""


def guard_cache_calls(gm: torch.nn.Module) -> None:
    """Make ``gm`` (captured without the cache, see :func:`_cache_off`) answer a call that asks for a
    cache with one clear :class:`CacheCallError` instead of "unexpected keyword argument", and serve
    ``use_cache=False``/``None``, which is what the graph computes. A forward pre-hook: the generated
    ``forward`` takes the example's arguments only."""
    gm.register_forward_pre_hook(_cache_call_hook, with_kwargs=True)


def guard_cache_calls_keeping(gm: torch.nn.Module) -> None:
    """:func:`guard_cache_calls` for a graph whose example passed ``use_cache=False``: the keyword is
    one of its inputs, so it is kept (``use_cache=True`` still gets the clear error)."""
    gm.register_forward_pre_hook(_cache_call_refusal, with_kwargs=True)


def _cache_call_refusal(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("use_cache") or any(kwargs.get(k) is not None for k in CACHE_ARGUMENTS):
        raise CacheCallError(
            "this converted module is the training graph, captured without the key/value cache (use_cache=False), "
            "so it cannot take or return one; decode with converter.apply(model, ...) (its cache calls run the "
            "original forward under autocast) or the original model, or call it without use_cache/cache")


def _cache_call_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    _cache_call_refusal(module, args, kwargs)
    if "use_cache" in kwargs:  # use_cache=False or None: what the graph computes
        return args, {k: v for k, v in kwargs.items() if k != "use_cache"}
    return None


def _cache_advice(errors: dict) -> Optional[str]:
    """Plain advice when a tracer failed because forward returned a cache object."""
    if not any("Cache" in why and "in output" in why for why in errors.values()):
        return None
    return ("forward returns a key/value cache object (the example passes use_cache=True or a cache), which a graph "
            "cannot return: leave use_cache and the cache out of the example (training does not use them; "
            "mpconvert then captures with use_cache=False)")


def _is_hf_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (never imports transformers)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


def _first_capture(order: tuple, model: torch.nn.Module, args: tuple, kwargs: dict, dynamic: bool, dynamic_shapes: Any,
                   errors: dict) -> tuple:
    """(result of the first tracer in ``order`` that works or None, its name, its shapes, advice); each
    failure goes into ``errors`` with its reason."""
    advice: Optional[str] = None
    result = used = shapes = None
    for name in order:
        shapes = _Shapes(dynamic=dynamic, user_spec=dynamic_shapes)
        try:
            result = _capture_one(name, model, args, kwargs, shapes)
            used = name
            break
        except Exception as exc:  # any tracer failure is reported with its reason, then the next is tried
            plain = _control_flow(exc)
            advice = advice or plain
            errors[name] = plain or _short(exc)
    return result, used, shapes, advice


def _finish_capture(result: tuple, used: str, shapes: _Shapes, tracer: str, model: torch.nn.Module, args: tuple,
                    kwargs: dict, dynamic: bool, dynamic_shapes: Any, errors: dict) -> Captured:
    """Annotate the captured graph(s); under ``auto``, an FX graph with opaque leaves is exported instead."""
    gm, eval_gm, modes = result
    annotate(gm, root_type=type(model).__name__)
    opaque = _opaque_leaves(gm)
    if tracer == "auto" and used == "fx" and opaque:
        # FX kept modules it cannot see into (nn.MultiheadAttention, RNNs...) as fp32 leaves;
        # torch.export traces through them, so prefer it when it works.
        export_shapes = _Shapes(dynamic=dynamic, user_spec=dynamic_shapes)
        try:
            exported, exported_eval, export_modes = _capture_one("export", model, args, kwargs, export_shapes)
        except Exception as exc:  # keep the FX graph; the opaque modules stay fp32 (reported)
            errors["export"] = _control_flow(exc) or _short(exc)
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
                    narrowed_dims=shapes.narrowed, dynamic_ranges=shapes.ranges)


def _capture_one(name: str, model: torch.nn.Module, args: tuple, kwargs: dict, shapes: _Shapes) -> tuple:
    """Trace with one tracer; returns (train-or-only graph, eval graph or None, modes note).

    One mode-aware graph when the eval check passes; a train graph and an eval graph when the model
    branches on ``self.training`` (the graph computes something else in eval mode, or draws random
    numbers that eval mode does not); one graph frozen in the model's own mode when train mode
    cannot be traced at all (see the module docstring)."""
    trace = _trace_fx if name == "fx" else _trace_export
    why = skipped = ""
    try:
        gm, changed = _trace_in_mode(trace, name, model, args, kwargs, shapes, training=True)
    except Exception as exc:
        # e.g. LayerDrop's `if self.training and torch.rand(()) < p`: a branch only train mode takes
        flow = _control_flow(exc) or isinstance(exc, _RandomAtTraceTime)
        off = _without_layerdrop(model) if flow else None
        if off is not None:
            try:
                gm, changed = _trace_in_mode(trace, name, model, args, kwargs, shapes, training=True, config=off[0])
                skipped = off[1]
            except Exception:  # still untraceable: frozen below
                off = None
        if off is None:
            if model.training:
                raise
            cause = str(exc) if isinstance(exc, _RandomAtTraceTime) else "a data-dependent branch" if flow else _short(exc)
            why = f"tracing in train mode failed ({cause})"
    if why:
        gm, _ = _trace_in_mode(trace, name, model, args, kwargs, shapes)
        mode = "train" if model.training else "eval"
        return gm, None, ModesNote(f"frozen_{mode}",  # type: ignore[arg-type]
                                   f"frozen in {mode} mode: {why}; train()/eval() on the converted module change nothing")
    gm, eval_gm, note = _split_modes(trace, name, model, gm, changed, args, kwargs, shapes)
    return gm, eval_gm, note.extended(skipped)


def _trace_in_mode(trace, name: str, model: torch.nn.Module, args: tuple, kwargs: dict, shapes: _Shapes, *,
                   training: Optional[bool] = None, config: Optional[dict] = None) -> tuple:
    """(graph, mode-dependent nodes made to read self.training) of ``model`` traced in train mode
    (``training=True``: mode-aware), eval mode (False) or its own (None), with the ``config``
    fields set. The trace runs on a :func:`shell` of ``model``: the graph shares its tensors, and
    the mode and config changes stay on the shell."""
    shelled = shell(model, config=config)
    if training is not None:
        shelled.train(training)
    gm = trace(shelled, args, kwargs, shapes)
    changed = make_mode_aware(gm) if training else []
    if name == "fx":
        _propagate(gm, args, kwargs)
    return gm, changed


#: what a module's ``__dict__`` holds per instance that a shell must not share with the original
#: (hooks, parameter/buffer/submodule tables: everything ``nn.Module.__init__`` makes a dict or set)
_OWN_TABLES = tuple(k for k, v in vars(torch.nn.Module()).items() if isinstance(v, (dict, set)))


def shell(model: torch.nn.Module, *, config: Optional[dict] = None) -> torch.nn.Module:
    """A copy of ``model``'s module tree over the same tensors: no weight is copied.

    Every submodule is a new object of its class with its own attribute, hook, parameter, buffer
    and submodule tables, so ``train()``/``eval()``, a registered hook or a replaced attribute on
    the shell leave ``model`` as it is. Each parameter is a new ``nn.Parameter`` over the same
    storage (tied weights stay tied; its ``requires_grad`` and ``.grad`` are the shell's own);
    buffers are the same tensors, so code that writes one in place (a train-mode batch norm) must
    run under :func:`~converter.ir.state.preserved_state`. ``config``: fields set on a copy of the
    model's ``config``, which every submodule of the shell that shared it reads instead (and on a copy
    of any other Hugging Face config in the tree that has the field).
    """
    original_config = getattr(model, "config", None) if config else None
    hf_config = getattr(sys.modules.get("transformers.configuration_utils"), "PretrainedConfig", None)
    configs: dict[int, Any] = {}

    def changed(value: Any) -> Any:
        """The shell's copy of a config: the root's, and any other Hugging Face config in the tree
        that has the field (T5's decoder stack reads a deep copy of the root's)."""
        if id(value) not in configs:
            new = configs[id(value)] = copy.copy(value)
            for field_name, field_value in config.items():
                if value is original_config or hasattr(value, field_name):
                    setattr(new, field_name, field_value)
        return configs[id(value)]

    def is_config(value: Any) -> bool:
        return value is original_config or (isinstance(hf_config, type) and isinstance(value, hf_config))

    params: dict[int, Any] = {}
    modules: dict[int, torch.nn.Module] = {}

    def clone(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in modules:  # a module reached by two paths stays one module
            return modules[id(module)]
        new = object.__new__(type(module))
        modules[id(module)] = new
        state = dict(vars(module))
        for key in _OWN_TABLES:
            if key in state:
                state[key] = copy.copy(state[key])
        if original_config is not None:
            state.update({k: changed(v) for k, v in state.items() if is_config(v)})
        state["_parameters"] = {k: _shared_param(p, params) for k, p in module._parameters.items()}
        state["_modules"] = {k: None if m is None else clone(m) for k, m in module._modules.items()}
        new.__dict__.update(state)
        return new

    return clone(model)


def _shared_param(param: Optional[torch.Tensor], memo: dict) -> Optional[torch.Tensor]:
    """A new ``nn.Parameter`` over ``param``'s storage (one per original: tied weights stay tied).
    Parameter subclasses (quantised weights...) are kept as they are."""
    if param is None or type(param) is not torch.nn.Parameter:
        return param
    if id(param) not in memo:
        memo[id(param)] = torch.nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    return memo[id(param)]


#: Hugging Face config fields of LayerDrop (skip a whole layer with probability p in train mode)
_LAYERDROP_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def _without_layerdrop(model: torch.nn.Module) -> Optional[tuple[dict, str]]:
    """The config fields that switch LayerDrop off, and the note saying so; None if it has none.

    LayerDrop (``if self.training and torch.rand([]) < config.layerdrop: skip the layer``) is a
    branch on a random number: no graph records it. The train graph is then captured from a copy
    without it (every layer runs; dropout and the rest still follow train()), which the report says."""
    config = getattr(model, "config", None)
    fields = {f: getattr(config, f) for f in _LAYERDROP_FIELDS
              if isinstance(getattr(config, f, None), (int, float)) and getattr(config, f) > 0}
    if not fields:
        return None
    listed = ", ".join(f"config.{k}={v:g}" for k, v in fields.items())
    return dict.fromkeys(fields, 0.0), (f"; LayerDrop is off in the train graph ({listed} is a branch on a random "
                                        "number, which no graph records): every layer runs in training, dropout "
                                        "still follows train()")


def _split_modes(trace, name: str, model: torch.nn.Module, gm: torch.fx.GraphModule, changed: list,
                 args: tuple, kwargs: dict, shapes: _Shapes) -> tuple:
    """(train graph, eval graph or None, note): one mode-aware graph when it computes in eval mode
    what the model does and draws no random numbers eval mode does not; else an eval graph too."""
    differs = _eval_mismatch_or_failure(gm, model, args, kwargs)
    eval_gm = None
    kept = ""
    random = random_ops(gm)
    if differs or random:
        eval_gm, _ = _trace_in_mode(trace, name, model, args, kwargs, shapes, training=False)
        restored = constant_flags(gm, eval_gm) if differs and changed else []
        if restored:  # literals the model passes in eval mode too (MC dropout): not the mode
            changed = [c for c in changed if c not in restored]
            kept = f"; {len(restored)} train-mode literal(s) kept, the model passes them in eval mode too (e.g. MC dropout)"
            differs = _eval_mismatch_or_failure(gm, model, args, kwargs)
        dropped = len(random) - len(random_ops(eval_gm))
        if not differs and dropped > 0:
            differs = f"{dropped} random op(s) run in train mode only (e.g. stochastic depth)"
        elif not differs:
            eval_gm = None  # the random ops run in both modes: one graph serves
    _set_modes(gm, model)
    if eval_gm is None:
        if any(t.is_meta for t in model.parameters()):
            kept += "; eval mode was run but not compared by value (the model has no weights)"
        return gm, None, ModesNote("follows", f"follows train()/eval(): traced in train mode, {len(changed)} "
                                              f"mode-dependent ops read self.training{kept}")
    _set_modes(eval_gm, model)
    return gm, eval_gm, ModesNote("two_graphs", f"follows train()/eval() with two graphs: the model branches on self.training "
                                                f"({differs}), so it was traced in each mode and the converted module runs "
                                                "the train graph in train mode and the eval graph in eval mode (the report "
                                                "describes the train graph)")


def _set_modes(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """The converted module starts in the original's mode; leaf modules keep their own."""
    gm.train(model.training)
    originals = dict(model.named_modules())
    for path, sub in gm.named_modules():
        if path in originals:
            sub.training = originals[path].training


def _eval_mismatch_or_failure(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
    """:func:`_eval_mismatch`, or why the train graph cannot run in eval mode (it then needs a graph of its own)."""
    try:
        return _eval_mismatch(gm, model, args, kwargs)
    except Exception as exc:
        return f"running the train graph in eval mode failed ({_short(exc)})"


def _buffer_versions(module: torch.nn.Module) -> dict[str, int]:
    """Each buffer's autograd version counter: it moves on every in-place write."""
    return {name: buf._version for name, buf in module.named_buffers(remove_duplicate=False)}


def _updated(module: torch.nn.Module, before: dict[str, int]) -> set[str]:
    """The buffers of ``module`` written in place since ``before`` (:func:`_buffer_versions`)."""
    return {name for name, buf in module.named_buffers(remove_duplicate=False) if before.get(name) != buf._version}


def _eval_mismatch(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
    """Why ``gm`` in eval mode does not compute what ``model`` computes in eval mode (None: it does)."""
    reference = shell(model).eval()  # the model's own modes are left as they are
    without_weights = any(t.is_meta for t in model.parameters())
    with preserved_state(gm, reference), torch.no_grad():
        torch.manual_seed(0)  # the same random numbers for both (noise a model adds in eval mode too)
        before = _buffer_versions(reference)
        try:
            want = pytree.tree_leaves(reference(*args, **kwargs))
        except Exception:
            if not without_weights:
                raise
            want = None  # eager code that reads a value (a mask check's .item()) cannot run on meta weights
        theirs = _updated(reference, before)
        gm.eval()
        torch.manual_seed(0)
        before = _buffer_versions(gm)
        got = pytree.tree_leaves(gm(*args, **kwargs))  # the graph runs in eval mode, at least
        mine = _updated(gm, before)
    # spectral_norm's power iteration: a train-only in-place update the outputs barely show (1e-4)
    updates = (f"in eval mode the graph updates buffer(s) {', '.join(sorted(mine)[:3])}, which the model leaves alone"
               if mine and not theirs else None)
    if want is None:
        return updates
    want = [t for t in want if isinstance(t, torch.Tensor)]
    got = [t for t in got if isinstance(t, torch.Tensor)]
    if len(want) != len(got):
        return f"in eval mode the graph returns {len(got)} tensors, the model {len(want)}"
    for i, (w, g) in enumerate(zip(want, got)):
        if w.shape != g.shape or w.dtype != g.dtype:
            return f"in eval mode output {i} is {tuple(g.shape)} {g.dtype}, the model's {tuple(w.shape)} {w.dtype}"
        if w.is_meta or g.is_meta:  # a model built without weights (empty_weights) has no values to compare
            continue
        if w.is_floating_point() and w.numel():
            scale = max(1.0, float(w.abs().max()))
            diff = float((w - g).abs().max())
            if not diff <= 1e-4 * scale:  # also catches NaN
                return f"in eval mode output {i} differs from the model's by {diff:.3g} (it branches on self.training)"
        elif not torch.equal(w, g):
            return f"in eval mode output {i} differs from the model's"
    return updates


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n(?: {3,}(\S[^\n]*))?')
_BRANCH = re.compile(r"^\s*(if|elif|while|assert)\b|\bif\b.*\belse\b")


def _control_flow(exc: BaseException) -> Optional[str]:
    """Plain advice for Python code that needs a tensor's value (None for any other failure)."""
    text = str(exc)
    data_dependent = (
        "GuardOnDataDependent" in type(exc).__name__
        or "data-dependent" in text
        or "data dependent" in text
        or "cannot be used as inputs to control flow" in text
    )
    if not data_dependent:
        return None
    where, code = "", ""
    found = _USER_FRAME.findall(text)
    if found:
        path, line, _, code = found[-1]
        where = f" at {path.rsplit('/', 1)[-1]}:{line}"
    else:
        frame = _user_frame(exc.__traceback__)
        if frame is not None:
            where, code = f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}", frame.line or ""
    shown = f" (`{code.strip()}`)" if code.strip() else ""
    if not code.strip() or _BRANCH.search(code):
        return (
            f"data-dependent control flow{where}{shown}: forward branches on the values inside a tensor, which a "
            "captured graph cannot record. Write the branch with torch.cond(pred, true_fn, false_fn, operands), move "
            "it out of forward (decide before calling the model), or split the model at that point and convert each part"
        )
    return (
        f"forward reads a tensor's value in Python{where}{shown} (float(), int(), .item(), .tolist()), which a "
        "captured graph cannot record. Keep it a tensor operation, move it out of forward (compute it before or "
        "after calling the model), or split the model at that point and convert each part; a branch on it needs torch.cond"
    )


def _user_frame(tb) -> Optional[Any]:
    """The innermost traceback frame outside torch, transformers and this package."""
    import traceback

    skip = _SKIP_FRAMES + ("<",)
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(skip) and "/transformers/" not in f.filename]
    return frames[-1] if frames else None


def _opaque_leaves(gm: torch.fx.GraphModule) -> list[str]:
    """Class names of leaf modules FX could not trace into and that hold parameters."""
    return [
        node.meta[META_INFO].module_type
        for node in gm.graph.nodes
        if node.op == "call_module" and node.meta.get(META_INFO) is not None and node.meta[META_INFO].opaque_leaf
    ]


# ---------------------------------------------------------------------------------------------
# annotation


def _module_stack(node: torch.fx.Node, root_type: str) -> tuple[tuple[str, str], ...]:
    raw = node.meta.get("nn_module_stack") or {}
    stack: list[tuple[str, str]] = []
    for path, cls in raw.values():
        cls_name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
        path = re.sub(r"^L\['self'\]\.?", "", str(path))
        path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")
        path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
        if stack and stack[-1][0] == path:
            stack[-1] = (path, cls_name)
            continue
        stack.append((path, cls_name))
    if not stack or stack[0][0] != "":
        stack.insert(0, ("", root_type))
    return tuple(stack)


def _source(node: torch.fx.Node) -> str:
    if node.meta.get(META_SOURCE):
        return node.meta[META_SOURCE]
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def _flat_specs(spec: Any) -> list[TensorSpec]:
    if isinstance(spec, TensorSpec):
        return [spec]
    if isinstance(spec, tuple):
        out: list[TensorSpec] = []
        for s in spec:
            out.extend(_flat_specs(s))
        return out
    return []


def input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The distinct nodes this node reads (FX keeps this list; no need to walk args again)."""
    return node.all_input_nodes


def _float_specs(node: torch.fx.Node) -> list[TensorSpec]:
    return [s for s in _flat_specs(node.meta.get(META_VALUE)) if s.dtype.is_floating_point]


_SINGLE_OP_MODULES = {
    "Linear": "linear", "Conv1d": "conv1d", "Conv2d": "conv2d", "Conv3d": "conv3d",
    "ConvTranspose1d": "conv_transpose1d", "ConvTranspose2d": "conv_transpose2d", "ConvTranspose3d": "conv_transpose3d",
    "LayerNorm": "layer_norm", "GroupNorm": "group_norm", "RMSNorm": "rms_norm", "Embedding": "embedding",
}


def _rename_module_ops(gm: torch.fx.GraphModule) -> None:
    """Name the one op of a Linear/Conv/norm/Embedding module after the module (``block.proj`` -> ``block_proj``)."""
    owners: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is None or node.op not in ("call_function", "call_module") or not info.module:
            continue
        if _SINGLE_OP_MODULES.get(info.module_type) == info.op:
            owners.setdefault(info.module, []).append(node)
    for path, nodes in owners.items():
        if len(nodes) == 1:
            candidate = re.sub(r"[^0-9a-zA-Z_]", "_", path)
            if candidate and candidate[0].isdigit():
                candidate = "m_" + candidate
            nodes[0]._rename(candidate)


def annotate(gm: torch.fx.GraphModule, *, root_type: str) -> None:
    """Write :class:`NodeInfo` on every node."""
    _annotate_nodes(gm, root_type)
    _rename_module_ops(gm)


def _annotate_nodes(gm: torch.fx.GraphModule, root_type: str) -> None:
    for node in gm.graph.nodes:
        stack = _module_stack(node, root_type)
        module, module_type = stack[-1]
        outputs = tuple(_flat_specs(node.meta.get(META_VALUE)))
        if node.op in ("placeholder", "get_attr", "output"):
            node.meta[META_INFO] = NodeInfo(op=node.op, module=module, module_type=module_type, module_stack=stack, outputs=outputs)
            continue
        op = canonical_op(node, gm)
        kind, fixed, why, opaque_leaf = _classify(gm, node, op, outputs)
        node.meta[META_INFO] = NodeInfo(
            op=op,
            module=module,
            module_type=module_type,
            module_stack=stack,
            source=_source(node),
            kind=kind,
            outputs=outputs,
            fixed_dtype=fixed,
            inplace=is_inplace(node, op),
            why=why,
            opaque_leaf=opaque_leaf,
        )


def _classify(gm, node, op, outputs) -> tuple[str, Optional[torch.dtype], str, bool]:
    """(kind, fixed dtype, why, opaque_leaf) of one node; ``opaque_leaf``: a module FX kept as a leaf whose
    floating parameters it cannot convert (NodeInfo.opaque_leaf; capture then tries torch.export)."""
    float_out = [s for s in outputs if s.dtype.is_floating_point]
    in_nodes = input_nodes(node)
    float_in = [s for n in in_nodes for s in _float_specs(n)]
    if any(s.dtype == torch.float64 for s in float_out + float_in):
        return "passive", None, "fp64 tensors are never converted", False
    if float_in and any(s.dtype.is_complex for n in [node, *in_nodes] for s in _flat_specs(n.meta.get(META_VALUE))):
        # rfft(x), view_as_complex(w), spectrum * gain: complex tensors are never converted (there is no
        # bf16 complex dtype, and the FFTs refuse half on CPU), so the real operands keep the fp32 model's dtype
        dtype = functools.reduce(torch.promote_types, [s.dtype for s in float_in])
        return "fixed", dtype, f"complex op: its real inputs stay {dtype} (complex tensors are never converted to half)", False
    if not float_out:
        return "passive", None, "produces no floating-point tensor", False
    if is_inplace(node, op):
        return "alias", None, "in-place op: runs in the dtype of the tensor it mutates", False
    if op == "getitem" and in_nodes and isinstance(in_nodes[0].meta.get(META_VALUE), tuple):
        return "alias", None, "element of a tuple output: has its producer's precision", False
    fixed = explicit_dtype(node, op)
    if fixed is not None:
        observed = float_out[0].dtype
        if isinstance(fixed, torch.fx.Node):
            return "fixed", observed, f"cast to a dtype computed at run time (observed {observed}); kept as observed", False
        kind_why = "explicit cast in the model code" if op in CAST_OPS else f"the op's own dtype argument fixes its output to {fixed}"
        return "fixed", fixed, kind_why, False
    parametrization = node.op == "call_module" and isinstance(gm.get_submodule(node.target), ParametrizationList)
    if not float_in and not parametrization:  # a parametrized weight (weight_norm...) is computed from no input
        return "fixed", float_out[0].dtype, "no floating-point input: its dtype is set by its own arguments", False
    if node.op == "call_module" and op not in NORM_OPS:
        sub = gm.get_submodule(node.target)
        if any(p.is_floating_point() for p in sub.parameters(recurse=True)):
            return (
                "fixed",
                float_out[0].dtype,
                f"opaque leaf module {type(sub).__name__} with fp32 parameters; capture with tracer='export' to convert inside it",
                True,
            )
    return "compute", None, "", False
