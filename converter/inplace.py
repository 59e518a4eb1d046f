"""Convert in place: ``converter.apply`` returns the user's own model, mixed precision.

::

    model = converter.apply(model, example_inputs, precision="bf16")   # same object, same class
    model(**batch)                       # runs the converted graph
    converter.conversion_of(model)       # the Conversion: .report, .decisions, .save(...)
    converter.restore(model)             # back to the class's own forward

:func:`apply` runs :func:`converter.convert` and then replaces the *instance's* ``forward`` by a
:class:`ConvertedForward`, a callable that runs the converted GraphModule. The GraphModule holds
the model's own ``Parameter`` and buffer objects (nothing is copied), so ``state_dict`` (same keys),
``save_pretrained``/``from_pretrained``, ``load_state_dict``, optimizers built before or after,
``.train()``/``.eval()`` and ``.to(...)`` keep working: before each call the graph is pointed at the
model's current tensors (``.to()`` replaces buffers), follows the model's train/eval flags, and, when
the model moved to another device, runs a copy of the graph whose device constants name that device.

Dynamic dims serve any size, or any size in their range (``report.records.capture.dynamic_ranges``: BERT's
sequence length ``2..max_position_embeddings``). A call with other sizes than the graph serves (another
size of a static dim, another rank, a size outside a dim's range) is converted again, like a
``torch.compile`` recompile: :func:`converter.convert` with the same options on that call's inputs, the
new graph bound to the same parameters and kept for the calls it serves, with a
:class:`RecaptureWarning`; at most ``max_recaptures`` (8) graphs besides the first. Other calls (other
keyword arguments, other non-tensor values, other dtypes, a Cache object, the other train/eval mode of
a graph frozen in one mode, or shapes past the re-capture limit) run the model's original fp32
forward instead, with a :class:`FallbackWarning` that names the difference (once per difference).

A Hugging Face model captured without its key/value cache (``report.records.capture.cache``: a stock
decoder, ``config.use_cache=True``) serves ``use_cache=False``/``None`` with the graph. A call that
asks for a cache (``use_cache=True`` or a ``cache``/``past_key_values``: every step of ``generate()``)
is a decoding step, which the training graph cannot serve: it runs the original forward under
``torch.autocast`` in the conversion's half dtype, with one :class:`FallbackWarning`, counted in
``calls["cache"]``.

The converted forward runs with autocast off: the graph already carries its casts, and an outer
``torch.autocast`` (HF ``Trainer(bf16=True)``, Lightning ``precision="bf16-mixed"``) would override
the decisions the report records. Loss scaling for fp16 and O2 master weights are not part of the
model: they need :class:`converter.MixedPrecisionTrainer` (see docs/training.md).
"""
from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.nn.modules import module as torch_module

from converter.api import Conversion, convert
from converter.ir.errors import MpconvertError
from converter.ir.graphmodule import EVAL_PREFIX, TwoModeGraphModule
from converter.ir.precision import half_dtype
from converter.ir.records import CaptureFacts
from converter.options import ConvertOptions, build_options
from converter.passes.capture.cache import CACHE_ARGUMENTS
from converter.passes.capture.reserved import USER_NAMES, user_path
from converter.passes.capture.served import ShapeNotServedError, guard_owner

__all__ = ["apply", "conversion_of", "converted_forward", "restore", "ConvertedForward", "FallbackWarning",
           "InPlaceError", "RecaptureWarning", "DEFAULT_MAX_RECAPTURES"]

#: how many graphs :class:`ConvertedForward` converts besides the first for calls of other sizes
DEFAULT_MAX_RECAPTURES = 8


class InPlaceError(MpconvertError, ValueError):
    """The converted graph cannot run on the model's own tensors."""


class FallbackWarning(MpconvertError, UserWarning):
    """A call that the converted graph was not captured for ran the model's original forward
    (a warning; it derives from :class:`MpconvertError` like every mpconvert exception class)."""


class RecaptureWarning(MpconvertError, UserWarning):
    """A call of sizes that no converted graph serves was converted again (a graph for those sizes)."""


class _ShapeMismatch(str):
    """A mismatch of sizes or rank only: another capture of the same model serves it (re-capture)."""


def apply(model: torch.nn.Module, example_inputs: Any, *, max_recaptures: int = DEFAULT_MAX_RECAPTURES,
          rules: Any = None, calibration: Any = None, options: Optional[ConvertOptions] = None,
          **keywords: Any) -> torch.nn.Module:
    """Convert ``model`` in place and return it (the same object).

    ``example_inputs``, ``rules``, ``calibration`` and ``options`` (a :class:`~converter.options.ConvertOptions`,
    or its fields as keywords: ``precision``, ``tracer``, ``opt_level``, ``device``, ``dynamic`` ...) are those
    of :func:`converter.convert`. Pass the
    arguments the training or serving code passes (for a HF model e.g. ``input_ids``,
    ``attention_mask`` and ``labels``): calls with other arguments run the original forward.
    Calls of sizes the graph does not serve are converted again, up to ``max_recaptures`` graphs
    (0: none; they then run the original forward). Applying again re-converts from the original forward.
    """
    if not isinstance(max_recaptures, int) or isinstance(max_recaptures, bool) or max_recaptures < 0:
        raise InPlaceError(f"max_recaptures must be an int >= 0, got {max_recaptures!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply() needs a torch.nn.Module, got {type(model).__name__}")
    options = build_options(options, keywords, caller="apply")
    restore(model)
    original = model.__dict__.get("forward")
    conversion = convert(model, example_inputs, rules=rules, calibration=calibration, options=options)
    model.forward = ConvertedForward(model, conversion, original=original, max_recaptures=max_recaptures)
    return model


def converted_forward(model: torch.nn.Module) -> Optional["ConvertedForward"]:
    """The :class:`ConvertedForward` of an applied model, also when another library wrapped it since
    (accelerate/HF Trainer wrap ``forward`` in autocast and keep it as ``_original_forward``)."""
    for start in (model.__dict__.get("forward"), model.__dict__.get("_original_forward")):
        seen = 0
        while start is not None and seen < 16:
            if isinstance(start, ConvertedForward):
                return start if start.model is model else None
            start = getattr(start, "__wrapped__", None)
            seen += 1
    return None


def conversion_of(model: torch.nn.Module) -> Optional[Conversion]:
    """The :class:`~converter.api.Conversion` behind an applied model (None: not applied); a model converted region by
    region in place keeps it on its root's glue forward (:class:`converter.partition.GlueForward`)."""
    forward = converted_forward(model)
    if forward is not None:
        return forward.conversion
    glue = model.__dict__.get("forward")
    return getattr(glue, "conversion", None)


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply`: the model's forward is its own again (weights as trained). Returns ``model``."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, ConvertedForward):
        del model.__dict__["forward"]
        if forward.instance_forward is not None:
            model.forward = forward.instance_forward
    elif converted_forward(model) is not None:
        raise InPlaceError(f"cannot restore {type(model).__name__}: another library wrapped its converted forward since "
                         "apply(); restore it before wrapping (e.g. before accelerate.prepare or Trainer)")
    return model


def _named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """Every forward argument by name, defaults applied, ``**kwargs`` flattened into the rest."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    named = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                named[name] = tuple(value)
        else:
            named[name] = value
    return named


def _advertised(signature: inspect.Signature, example: dict) -> inspect.Signature:
    """The forward's signature without ``**kwargs`` when the example passed nothing through it: the
    graph takes only what it was captured with, and callers that look for ``**kwargs`` (HF Trainer's
    ``num_items_in_batch``) then do not pass arguments that would make every call fall back."""
    named = set(signature.parameters)
    keep = [p for p in signature.parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD or any(name not in named for name in example)]
    return signature.replace(parameters=keep)


def _same_constant(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return False
    return a == b


class _Graphs:
    """The converted graph, and copies of it for other devices (sharing every tensor)."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device):
        self.home = device
        self.by_device = {device: gm}

    def get(self, device: torch.device) -> torch.fx.GraphModule:
        if device not in self.by_device:
            base = self.by_device[self.home]
            graph = copy.deepcopy(base.graph)
            home = self.home

            def move(value):
                return device if isinstance(value, torch.device) and value == home else value

            _move_devices(graph, move)
            moved: torch.fx.GraphModule
            if isinstance(base, TwoModeGraphModule):
                eval_graph = copy.deepcopy(base.eval_graph)
                _move_devices(eval_graph, move)
                moved = TwoModeGraphModule(base, graph, type(base).__name__, eval_graph=eval_graph)
            else:
                moved = torch.fx.GraphModule(base, graph, type(base).__name__)
            moved.meta.update(base.meta)
            self.by_device[device] = moved
        return self.by_device[device]


def _move_devices(graph: torch.fx.Graph, move) -> None:
    for node in graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, move)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, move)


class ConvertedForward:
    """The ``forward`` that :func:`apply` puts on the model instance (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, conversion: Conversion, *, original: Any = None,
                 max_recaptures: int = DEFAULT_MAX_RECAPTURES, cast_inputs: bool = False, recapture_values: bool = False):
        self.model = model
        self.conversion = conversion
        #: a region of a partial conversion (converter.partition): floating inputs of another dtype than the
        #: capture's (bf16 from the glue's autocast) are cast back at entry, exactly
        self.cast_inputs = cast_inputs
        #: a call with other Python scalars than the graph baked in (a temperature) is re-captured, not run as is
        self.recapture_values = recapture_values
        self.instance_forward = original  # an instance attribute forward the model had before, if any
        self.original = original if original is not None else type(model).forward.__get__(model)
        self._binder = inspect.signature(self.original)
        self.__doc__ = getattr(self.original, "__doc__", None)
        args, kwargs = conversion.example_inputs
        self._positional = len(args)
        self._example = _named_arguments(self._binder, args, kwargs)
        self.__signature__ = _advertised(self._binder, self._example)
        self._captured_keys = (tuple(self._example)[: self._positional], tuple(kwargs))
        #: the captured positional arguments are the forward's first parameters, in order: a call passing exactly them
        #: (and the captured keywords) needs no binding
        self._in_order = tuple(self._binder.parameters)[: self._positional] == self._captured_keys[0] and all(
            p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in tuple(self._binder.parameters.values())[: self._positional])
        capture = conversion.report.records.capture or CaptureFacts()  # a merged report: no one-graph facts
        self._dynamic = dict(capture.dynamic_dims)
        #: input -> {dim: (min, max)}: dynamic dims served only within a range (max None: no upper bound)
        self._ranges = {name: {int(d): (r["min"], r["max"]) for d, r in dims.items()}
                        for name, dims in capture.dynamic_ranges.items()}
        #: input -> {dim: (other input, its dim)}: dims captured as one size with another input's (labels)
        self._tied = {name: {int(d): (str(o[0]), int(o[1])) for d, o in dims.items()}
                      for name, dims in capture.tied_dims.items()}
        self._all_dynamic = conversion.tracer == "fx"  # symbolic_trace records no sizes
        modes = conversion.report.modes
        self._frozen = modes.frozen if modes is not None else None
        self._warned: set[str] = set()
        #: how many calls ran a converted graph, how many the original forward, how many graphs were converted again
        self.calls = {"converted": 0, "fallback": 0, "recaptured": 0}
        #: how many graphs calls of other sizes may add (re-captures); settable
        self.max_recaptures = max_recaptures
        #: the graphs converted again for calls of other sizes, in the order they were made
        self.recaptures: list[ConvertedForward] = []
        self._failed: dict[tuple, str] = {}  # sizes whose re-capture failed -> why
        self._limit_warned = False
        # captured without the key/value cache (capture's _cache_off, or use_cache=False in the example)
        self._no_cache = bool(capture.cache) or self._example.get("use_cache") is False
        if self._no_cache:  # + decoding calls (a cache asked for): the original forward under autocast
            self.calls["cache"] = 0
        gm = conversion.module
        self._guards = guard_owner(gm)  # whose ShapeNotServedError means "this graph refuses the call"
        self._graphs = _Graphs(gm, self._device() or torch.device("cpu"))
        self._plans: dict[int, tuple] = {}  # id(graph) -> _bind_plan(graph)
        #: the calls (mode, and each argument's dtype and shape or value) this graph was checked to serve
        self._served: set[tuple] = set()
        #: the graph's own tensors (tensor constants: ``_tensor_constant0``, ALiBi slopes computed in forward), which
        #: the model never had: the first bind, right after capture, finds them; no later bind counts them as missing
        self._constants: frozenset = frozenset()
        self._constants = frozenset(self._bind(gm))
        own = {id(p) for p in model.parameters()}
        foreign = [name for name, p in gm.named_parameters() if id(p) not in own]
        if foreign:
            raise InPlaceError(
                f"cannot convert {type(model).__name__} in place: the converted graph's parameters "
                f"{', '.join(foreign[:3])} have no counterpart of the same name in the model, so training would not "
                "update them; use converter.convert(...).module instead")

    # -- calling -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.cast_inputs:
            args, kwargs = self._entry_cast(args, kwargs)
        if self._no_cache:
            kwargs, cache = self._cache_call(args, kwargs)
            if cache is not None:
                return self._decode(cache, args, kwargs)
        key = _call_key(self.model.training, args, kwargs)
        if key is not None and key in self._served:  # a call like one this graph served: no check to redo
            return self._run(args, kwargs, owner=self)
        why = self._mismatch(args, kwargs)
        if why is None:
            served, out = self._try_run(args, kwargs, owner=self)
            if served:
                if key is not None and len(self._served) < _SERVED_KEYS:
                    self._served.add(key)
                return out
            why = out
        return self._serve_elsewhere(why, args, kwargs)

    def _try_run(self, args: tuple, kwargs: dict, *, owner: "ConvertedForward") -> tuple[bool, Any]:
        """(True, the output), or (False, why) when the graph's own shape guards refuse the call (nothing of it ran)."""
        try:
            return True, self._run(args, kwargs, owner=owner)
        except ShapeNotServedError as exc:
            if exc.owner not in self._guards:
                raise
            owner.calls["converted"] -= 1
            return False, _ShapeMismatch(f"sizes its graph's guard refuses ({exc.guard})")

    def _serve_elsewhere(self, why: str, args: tuple, kwargs: dict) -> Any:
        """A call this graph does not serve: a graph converted for its sizes (made before, or now), else the fallback."""
        if not isinstance(why, _ShapeMismatch):
            return self._fallback(why, args, kwargs)
        for other in self.recaptures:
            if other._mismatch(args, kwargs) is None:
                served, out = other._try_run(args, kwargs, owner=self)
                if served:
                    return out
        again = self._recaptured(why, args, kwargs)
        if again is None:
            return self._fallback(why, args, kwargs)
        served, out = again._try_run(args, kwargs, owner=self)
        return out if served else self._fallback(f"{why}, which its graph converted again refuses too", args, kwargs)

    def _entry_cast(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's floating tensors in the dtype the graph was captured with, where they differ (an exact cast up)."""
        ex_args, ex_kwargs = self.conversion.example_inputs
        if not kwargs and len(args) == len(ex_args) and all(
                not isinstance(a, torch.Tensor) or not isinstance(w, torch.Tensor) or a.dtype == w.dtype
                for a, w in zip(args, ex_args)):
            return args, kwargs  # the common case: nothing to cast

        def fix(value: Any, want: Any) -> Any:
            if (isinstance(value, torch.Tensor) and isinstance(want, torch.Tensor) and value.dtype != want.dtype
                    and value.is_floating_point() and want.is_floating_point()):
                return value.to(want.dtype)
            return value

        return (tuple(fix(a, ex_args[i] if i < len(ex_args) else None) for i, a in enumerate(args)),
                {k: fix(v, ex_kwargs.get(k)) for k, v in kwargs.items()})

    def _run(self, args: tuple, kwargs: dict, *, owner: "ConvertedForward") -> Any:
        """Run this converted graph on a call that it serves (``owner``: the model's forward, which counts it)."""
        device = self._device()
        gm = self._graphs.get(device or self._graphs.home)
        missing = self._bind(gm)
        if missing:
            return owner._fallback(f"a model whose structure changed since apply() (it has no {', '.join(missing[:3])}; "
                                   "call converter.apply again)", args, kwargs)
        owner.calls["converted"] += 1
        positional, keywords = self._captured_keys
        if len(args) == len(positional) and self._in_order and len(kwargs) == len(keywords) and all(k in kwargs for k in keywords):
            call_args, call_kwargs = args, {name: kwargs[name] for name in keywords}  # as captured: no binding to redo
        else:
            named = _named_arguments(self._binder, args, kwargs)
            call_args = tuple(named[name] for name in positional)
            call_kwargs = {name: named[name] for name in keywords}
        # the graph's own forward, without nn.Module's call machinery, unless a hook is registered on it or globally
        call = gm if gm._forward_hooks or gm._forward_pre_hooks or _global_hooks() else gm.forward
        device_type = _autocast_type(self._graphs.home if device is None else device)
        if torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type=device_type, enabled=False):
                return call(*call_args, **call_kwargs)
        return call(*call_args, **call_kwargs)

    def _recaptured(self, why: str, args: tuple, kwargs: dict) -> Optional["ConvertedForward"]:
        """A new graph converted for these sizes (None: the limit is reached or converting failed, said in a warning)."""
        if self._key(args, kwargs) in self._failed:
            return None
        if len(self.recaptures) + len(self._failed) >= self.max_recaptures:  # failed tries count: each costs a capture
            if self.max_recaptures and not self._limit_warned:
                self._limit_warned = True
                warnings.warn(
                    f"mpconvert: {self._called} was called with {why}; the re-capture limit "
                    f"of {self.max_recaptures} captures is reached, so such calls run the original fp32 forward "
                    "(raise converted_forward(model).max_recaptures, or pad the inputs to sizes a graph serves)",
                    RecaptureWarning, stacklevel=3)
            return None
        warnings.warn(
            f"mpconvert: {self._called} was called with {why}; converting it again for these "
            f"sizes (capture {len(self.recaptures) + len(self._failed) + 1} of at most {self.max_recaptures})", RecaptureWarning,
            stacklevel=3)
        try:
            other = self._recapture(args, kwargs)
            self._note_recapture(why)
        except Exception as exc:  # noqa: BLE001 - the call still runs, as the original forward, and says why
            self._failed[self._key(args, kwargs)] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"mpconvert: converting {type(self.model).__name__} again for {why} failed "
                          f"({type(exc).__name__}: {str(exc)[:300]}); such calls run the original fp32 forward",
                          RecaptureWarning, stacklevel=3)
            return None
        self.recaptures.append(other)
        self.calls["recaptured"] += 1
        return other

    @property
    def _called(self) -> str:
        """What the warnings say was called."""
        return f"{type(self.model).__name__}.forward"

    def _note_recapture(self, why: str) -> None:
        """The report line of a graph converted again (its summary warnings, which the CLI's summary line shows)."""
        self.conversion.report.summary.setdefault("warnings", []).append(
            {"kind": "recaptured", "message": f"a call with {why} was converted again for its sizes"})

    def _recapture(self, args: tuple, kwargs: dict) -> "ConvertedForward":
        """:func:`converter.convert` with this conversion's options on this call's inputs, traced
        through the model's own forward (the converted one is set aside meanwhile), with grad and
        autocast as :func:`apply` would see them; the new graph reads the same parameters."""
        named = _named_arguments(self._binder, args, kwargs)
        positional, keywords = self._captured_keys
        example = (tuple(detached(named[name]) for name in positional), {name: detached(named[name]) for name in keywords})
        missing = object()
        current = self.model.__dict__.pop("forward", missing)
        if self.instance_forward is not None:
            self.model.forward = self.instance_forward
        try:
            new = self._convert_again(self.model, example)
        finally:
            self.model.__dict__.pop("forward", None)
            if current is not missing:
                self.model.__dict__["forward"] = current
        return ConvertedForward(self.model, new, original=self.instance_forward, max_recaptures=0,
                                cast_inputs=self.cast_inputs, recapture_values=self.recapture_values)

    def _convert_again(self, model: torch.nn.Module, example: tuple) -> Conversion:
        """``model`` converted as this conversion was (rules, calibration, options, tracer), on ``example``."""
        conv = self.conversion
        device_type = _autocast_type(self._device() or self._graphs.home)
        with torch.enable_grad(), torch.autocast(device_type=device_type, enabled=False):
            return convert(model, example, rules=conv.rules, calibration=conv.calibration, options=conv.redo_options(),
                           scope=conv.scope)

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        """Which calls a failed re-capture stands for: their shapes (and Python scalars, where those re-capture)."""
        if not self.recapture_values:
            return _sizes(args, kwargs)
        return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else _short_repr(t)
                     for t in pytree.tree_leaves((args, kwargs)))

    def _fallback(self, why: str, args: tuple, kwargs: dict) -> Any:
        # weights stored in half (O2 training) cannot run the fp32 code as it is: autocast runs it with them
        half = any(p.dtype in (torch.float16, torch.bfloat16) for p in self.model.parameters())
        how = f"forward under torch.autocast({self.conversion.precision}) (its weights are stored in half)" if half \
            else "fp32 forward"
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(
                f"mpconvert: {type(self.model).__name__}.forward was called with {why}; running the original {how} "
                "for this call (pass such inputs to converter.apply to convert them)",
                FallbackWarning, stacklevel=3)
        self.calls["fallback"] += 1
        if not half:
            return self.original(*args, **kwargs)
        device_type = _autocast_type(self._device() or self._graphs.home)
        with torch.autocast(device_type=device_type, dtype=half_dtype(self.conversion.precision)):
            return self.original(*args, **kwargs)

    def _cache_call(self, args: tuple, kwargs: dict) -> tuple[dict, Optional[str]]:
        """(the call's keyword arguments, why it asks for a key/value cache or None).

        The graph was captured without the cache: ``use_cache=False``/``None`` is what it computes, so
        the keyword takes the example's value (the graph serves the call); ``use_cache=True`` or a cache
        (decoding, ``generate()``) is a call the training graph cannot serve."""
        try:
            named = _named_arguments(self._binder, args, kwargs)
        except TypeError:
            return kwargs, None  # _mismatch names it
        if named.get("use_cache"):
            return kwargs, "use_cache=True"
        given = [name for name in CACHE_ARGUMENTS if named.get(name) is not None]
        if given:
            return kwargs, f"a key/value cache ({given[0]}=...)"
        if "use_cache" in kwargs or self._example.get("use_cache") is not None:
            kwargs = {k: v for k, v in kwargs.items() if k != "use_cache"}
            if self._example.get("use_cache") is not None:  # the example passed use_cache=False
                kwargs["use_cache"] = self._example["use_cache"]
        return kwargs, None

    def _decode(self, cache: str, args: tuple, kwargs: dict) -> Any:
        """A call that asks for a cache: a decoding step, not the training graph. It runs the original
        forward under ``torch.autocast`` in the conversion's half dtype (autocast's op lists, not the
        report's decisions), with one :class:`FallbackWarning` saying so."""
        if "cache" not in self._warned:
            self._warned.add("cache")
            warnings.warn(
                f"mpconvert: {type(self.model).__name__}.forward was called with {cache} (decoding, generate()); the "
                "converted graph is the training forward, captured without the cache, so such calls run the original "
                f"forward under torch.autocast({self.conversion.precision})", FallbackWarning, stacklevel=3)
        self.calls["cache"] += 1
        device_type = _autocast_type(self._device() or self._graphs.home)
        dtype = half_dtype(self.conversion.precision)
        with torch.autocast(device_type=device_type, dtype=dtype):
            return self.original(*args, **kwargs)

    def _device(self) -> Optional[torch.device]:
        probe = self.__dict__.get("_probe")
        if probe is not None:  # the module holding the first parameter, and its name: read again on every call
            tensor = probe[0]._parameters.get(probe[1])  # (.to() across device types replaces the Parameter)
            if tensor is not None:
                return tensor.device
        for module in self.model.modules():
            for name, tensor in module._parameters.items():
                if tensor is not None:
                    self._probe = (module, name)
                    return tensor.device
        for tensor in self.model.buffers():  # .to() replaces buffers: looked up on every call
            return tensor.device
        return None

    def _bind(self, gm: torch.fx.GraphModule) -> list[str]:
        """Point ``gm`` at the model's current parameters and buffers, and copy its train/eval flags.

        Returns the graph's tensors that the model no longer has (its structure changed). Which model submodule
        owns each graph submodule is worked out once per graph, and again only when a module of the model was
        replaced or removed since (every call checks each parent-child link, a dict lookup each)."""
        plan = self._plans.get(id(gm))
        if plan is None or plan[0] is not gm or not all(parent._modules.get(name) is child for parent, name, child in plan[1]):
            plan = self._plans[id(gm)] = self._bind_plan(gm)
        _, _, pairs, missing = plan
        missing = [name for name in missing if name not in self._constants]
        renamed = gm.__dict__.get(USER_NAMES) or {}  # root names that are GraphModule's own (meta_ -> meta)
        for path, sub, owner in pairs:
            if sub.training != owner.training:  # nn.Module.__setattr__ is slow: set only what changed
                sub.training = owner.training
            for table in ("_parameters", "_buffers"):
                mine, theirs = getattr(sub, table), getattr(owner, table)
                for name, value in mine.items():
                    if not path and name.startswith(EVAL_PREFIX):
                        continue  # a tensor only the eval graph reads (TwoModeGraphModule), not the model's
                    key = renamed.get(name, name) if not path else name
                    if key not in theirs:
                        if (f"{path}.{name}" if path else name) not in self._constants:
                            missing.append(f"{path}.{name}" if path else name)
                    elif theirs[key] is not value:
                        mine[name] = theirs[key]
        if gm.training != self.model.training:
            gm.training = self.model.training
        return missing

    def _bind_plan(self, gm: torch.fx.GraphModule) -> tuple:
        """(gm, the model's (parent, name, child) links, the graph's (path, submodule, owner) triples, the tensors of
        graph submodules the model has no module for)."""
        modules = dict(self.model.named_modules(remove_duplicate=False))
        links = [(parent, name, child) for parent in modules.values() for name, child in parent._modules.items()]
        pairs: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []
        missing: list[str] = []
        renamed = gm.__dict__.get(USER_NAMES) or {}  # root names that are GraphModule's own (graph_ -> graph)
        for path, sub in gm.named_modules(remove_duplicate=False):
            owner = modules.get(user_path(renamed, path))
            if owner is None:
                missing.extend(f"{path}.{name}" for name in sub._parameters)
            else:
                pairs.append((path, sub, owner))
        return gm, links, pairs, missing

    def _mismatch(self, args: tuple, kwargs: dict) -> Optional[str]:
        """Why the captured graph cannot run this call (None: it can)."""
        if self._frozen is not None and self.model.training != (self._frozen == "train"):
            return f"the model in {'train' if self.model.training else 'eval'} mode (the graph is frozen in {self._frozen} mode)"
        try:
            named = _named_arguments(self._binder, args, kwargs)
        except TypeError as exc:
            return f"arguments the forward does not take ({exc})"
        extra = sorted(set(named) - set(self._example))
        if extra:
            return f"argument(s) {', '.join(extra)} that the graph was not captured with"
        missing = sorted(set(self._example) - set(named))
        if missing:
            return f"argument(s) {', '.join(missing)} missing"
        for name, want in self._example.items():
            why = self._value_mismatch(name, want, named[name])
            if why is not None:
                return why
        return self._tie_mismatch(named) if self._tied else None

    def _tie_mismatch(self, named: dict) -> Optional[str]:
        """Why this call's sizes break a tie of the graph (``labels`` dims exported as ``input_ids``'), or None."""
        leaves = {name + pytree.keystr(path): leaf for name, value in named.items()
                  for path, leaf in pytree.tree_flatten_with_path(value)[0]}
        for label, dims in self._tied.items():
            for dim, (other, index) in dims.items():
                got, ref = leaves.get(label), leaves.get(other)
                if isinstance(got, torch.Tensor) and isinstance(ref, torch.Tensor) and got.shape[dim] != ref.shape[index]:
                    return _ShapeMismatch(f"{label} of shape {tuple(got.shape)} (its dim {dim} is captured as {other}'s "
                                          f"dim {index}, of size {ref.shape[index]} here)")
        return None

    def _value_mismatch(self, name: str, want: Any, got: Any) -> Optional[str]:
        want_leaves, want_spec = pytree.tree_flatten_with_path(want)
        got_leaves, got_spec = pytree.tree_flatten_with_path(got)
        if want_spec != got_spec:
            return f"{name} of another structure ({type(got).__name__}) than the captured {type(want).__name__}"
        for (path, w), (_, g) in zip(want_leaves, got_leaves):
            label = name + pytree.keystr(path)
            if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor):
                if w.dtype != g.dtype:
                    return f"{label} as {g.dtype} of rank {g.dim()} (captured: {w.dtype} of rank {w.dim()})"
                if w.dim() != g.dim():
                    return _ShapeMismatch(f"{label} of rank {g.dim()} (captured: rank {w.dim()})")
                if self._all_dynamic:
                    continue
                dynamic = self._dynamic.get(label, ())  # an input it does not list is static
                fixed = [i for i in range(w.dim()) if i not in dynamic and w.shape[i] != g.shape[i]]
                if fixed:
                    return _ShapeMismatch(
                        f"{label} of shape {tuple(g.shape)} (dims {fixed} are static, captured {tuple(w.shape)})")
                for i, (low, high) in self._ranges.get(label, {}).items():
                    if g.shape[i] < low or (high is not None and g.shape[i] > high):
                        span = f"{low}..{high}" if high is not None else f">= {low}"
                        return _ShapeMismatch(f"{label} of shape {tuple(g.shape)} (dim {i} is served for sizes {span})")
            elif not _same_constant(w, g):
                why = f"{label}={_short_repr(g)} (captured with {_short_repr(w)})"
                return _ShapeMismatch(why) if self.recapture_values else why
        return None


def detached(value: Any) -> Any:
    """``value`` with every tensor in it detached: a call's inputs as the example of a conversion made again."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), value)


def _global_hooks() -> bool:
    """Whether module hooks are registered globally (torch's FLOP counter, profilers): a graph is then called as a module."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_forward_hooks_always_called)


#: how many call signatures a graph remembers as served (a workload of many sizes is checked call by call past it)
_SERVED_KEYS = 64


def _leaf_key(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.shape, value.device)
    if value is None or type(value) in (bool, int, float, str):
        return (type(value), value)
    raise TypeError  # a structure or an object: no key, the call is checked in full


def _call_key(training: bool, args: tuple, kwargs: dict) -> Optional[tuple]:
    """What decides whether a graph serves a call, when every argument is a tensor or a plain scalar: the mode,
    each tensor's dtype, shape and device, each scalar's value (None: some argument is a structure)."""
    try:
        return (training, tuple(_leaf_key(a) for a in args), tuple((k, _leaf_key(v)) for k, v in kwargs.items()))
    except TypeError:
        return None


def _sizes(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's tensors: which calls a failed or refused re-capture stands for."""
    return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves((args, kwargs)))


def _autocast_type(device: torch.device) -> str:
    return device.type if device.type in ("cuda", "cpu", "xpu", "mps", "hpu") else "cpu"


def _short_repr(value: Any) -> str:
    text = repr(value) if not isinstance(value, torch.Tensor) else f"tensor{tuple(value.shape)}"
    return text if len(text) <= 40 else type(value).__name__
