"""Partial capture: convert a model that no tracer captures whole, region by region.

Research code is not written to be exported: a patience-based early exit (``torch.equal(pred, last)``
in the layer loop), a ponder loop (``while (halt < 1 - eps).any()``), MoE token dispatch
(``if tok.numel() == 0: continue``), ``pack_padded_sequence(x, lengths.tolist())``, ``.item()``,
numpy in forward, asserts, Python's ``random``. ``torch.autocast`` runs all of it, and so does this.

:func:`convert_partial` (what :func:`converter.convert` does when the whole model does not capture, or
when capturing it would bake something in, see :mod:`converter.passes.capture.probe`, or when its train mode
cannot be traced and a whole graph would be frozen in one mode: :data:`~converter.passes.capture.REFUSE_FROZEN`):

1. **Probe.** One eager forward on a shell of the model records each submodule's first-call inputs,
   its FLOPs (``torch.utils.flop_counter``) and whether it draws Python-side random numbers or
   writes its own attributes.
2. **Regions.** The module tree is walked top-down; each submodule that ran and does work is
   converted through the whole pipeline (its own capture, rules, placement, numerics and report
   rows, its module paths those of the model): the largest submodules that capture are the
   **regions**. One that does not capture is a **graph break** (module, class, the user's
   ``file:line``, the reason in one phrase, how it runs), and its children are tried in turn.
3. **Glue.** The code between regions (the broken modules' ``forward`` as the user wrote it) runs
   eagerly under ``torch.autocast`` in the conversion's dtype. Each region runs its converted graph
   with autocast off (its casts are explicit), through the same
   :class:`~converter.inplace.ConvertedForward` that :func:`converter.apply` installs: it follows
   ``train()``/``eval()``, re-captures a call of sizes (or of Python scalars) its graph was not
   captured for, bounded, with a :class:`~converter.inplace.RecaptureWarning`, and runs any other
   call as the original code. At a region's entry a floating input of another dtype than its capture
   (bf16 made by the glue's autocast) is cast back exactly, so the region's decisions hold
   (``keep_io_types``: its outputs keep their dtypes).

``conv.module`` is the model's own structure (a shell over the same tensors: ``state_dict`` keys,
tied parameters and submodule paths are the original's) whose region submodules run converted
GraphModules (``conv.partition.regions[i].conversion.module``). The :class:`Partition` record is what
the report (``graph_breaks``, ``summary.captured_flop_fraction``, ``summary.break_count``), emit
(model.py) and the trainer read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import torch

from converter import api
from converter.api import Conversion, SlowHalfWarning
from converter.ir.errors import MpconvertError
from converter.ir.meta import GM_PARAM_DTYPES
from converter.ir.precision import half_dtype
from converter.numerics.profile import resolve_profile
from converter.options import ConvertOptions, build_options
from converter.passes.capture import REFUSE_FROZEN, CaptureError, normalize_inputs
from converter.passes.capture.probe import Impurity, ModuleProbe, Probe, probe
from converter.passes.capture.shells import shell
from converter.passes.fp8 import fp8_rule_set
from converter.report.build import merge_reports
from converter.rules.loader import load_rules

__all__ = ["convert", "audit", "apply", "GraphBreak", "Region", "Partition", "convert_partial", "impure_root",
           "GlueForward"]


@dataclass(frozen=True)
class GraphBreak:
    """Where capture broke: the module, its class, the user's ``file:line``, why, and how that part runs."""

    module: str
    module_type: str
    location: str
    reason: str
    runs: str
    flops: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Region:
    """A submodule converted as one graph: its path, class, conversion, and the FLOPs its calls ran on the example."""

    path: str
    module_type: str
    conversion: Conversion
    flops: int
    calls: int

    def to_dict(self) -> dict:
        conv = self.conversion
        capture = conv.report.records.capture
        return {"module": self.path, "module_type": self.module_type, "tracer": conv.tracer, "flops": self.flops,
                "calls": self.calls, "summary_line": conv.report.line,
                "dynamic_dims": dict(capture.dynamic_dims) if capture is not None else {},
                "modes": capture.modes if capture is not None else ""}


@dataclass(frozen=True)
class Partition:
    """How a model was split: converted regions, glue modules (run eagerly under autocast) and graph breaks."""

    regions: tuple[Region, ...]
    breaks: tuple[GraphBreak, ...]
    glue: tuple[str, ...]
    total_flops: int
    precision: str

    @property
    def captured_flops(self) -> int:
        return sum(r.flops for r in self.regions)

    @property
    def captured_flop_fraction(self) -> float:
        if not self.total_flops:
            return 1.0 if self.regions else 0.0
        return min(1.0, self.captured_flops / self.total_flops)


def _one_graph(model: torch.nn.Module, example_inputs: Any, whole: Callable[[], Any]) -> tuple[Any, Any]:
    """(``whole()``'s result, None) when the model is one graph; else (None, why not): the probe that found a
    Python-side draw or a state write, or the :class:`CaptureError` of the whole model."""
    cause: Any = impure_root(model, example_inputs)
    if cause is None:
        try:
            with _refuse_frozen():
                return whole(), None
        except CaptureError as exc:
            cause = exc
    return None, cause


@contextlib.contextmanager
def _refuse_frozen():
    """A part whose train mode cannot be traced fails to capture (its smaller parts are tried) instead of freezing."""
    token = REFUSE_FROZEN.set(True)
    try:
        yield
    finally:
        REFUSE_FROZEN.reset(token)


def convert(model: torch.nn.Module, example_inputs: Any, *, rules: Any = None, calibration: Any = None,
            options: Optional[ConvertOptions] = None, scope: Optional[tuple] = None, **keywords: Any) -> Conversion:
    """``converter.convert``: :func:`converter.api.convert` (arguments and result as there), and, when the model is
    not one graph (no tracer captures it, or a capture would bake in a Python-side draw or a state write its forward
    makes), :func:`convert_partial` unless ``partial=False``."""
    options = build_options(options, keywords, caller="convert")
    from converter.serving import serve_every_call

    if scope is not None:
        return api.convert(model, example_inputs, rules=rules, calibration=calibration, options=options, scope=scope)
    if not options.partial:
        return serve_every_call(api.convert(model, example_inputs, rules=rules, calibration=calibration, options=options))
    batches = api.read_batches(calibration, options)  # read once: both paths see the same batches
    done, cause = _one_graph(model, example_inputs,
                             lambda: api.convert(model, example_inputs, rules=rules, calibration=batches, options=options))
    if done is not None:
        return serve_every_call(done)
    return convert_partial(model, example_inputs, rules=rules, calibration=batches, options=options, cause=cause)


def audit(model: torch.nn.Module, example_inputs: Any, *, rules: Any = None, options: Optional[ConvertOptions] = None,
          **keywords: Any) -> Any:
    """``converter.audit``: :func:`converter.api.audit`; a model that is not one graph gets the report of its partial
    conversion (its regions converted as :func:`convert` would)."""
    options = build_options(options, keywords, caller="audit", allowed=api.AUDIT_FIELDS)
    if not options.partial:
        return api.audit(model, example_inputs, rules=rules, options=options)
    done, cause = _one_graph(model, example_inputs, lambda: api.audit(model, example_inputs, rules=rules, options=options))
    if done is not None:
        return done
    return convert_partial(model, example_inputs, rules=rules, calibration=None, options=options, cause=cause).report


def apply(model: torch.nn.Module, example_inputs: Any, *, rules: Any = None, calibration: Any = None,
          options: Optional[ConvertOptions] = None, **keywords: Any) -> torch.nn.Module:
    """``converter.apply``: :func:`converter.inplace.apply`; a model that is not one graph is converted region by
    region in place: its own region submodules run their converted graphs (over its own tensors), its glue modules
    run under autocast. Returns ``model``."""
    from converter import inplace

    max_recaptures = keywords.pop("max_recaptures", inplace.DEFAULT_MAX_RECAPTURES)
    options = build_options(options, keywords, caller="apply")

    def whole() -> torch.nn.Module:
        return inplace.apply(model, example_inputs, rules=rules, calibration=batches, options=options,
                             max_recaptures=max_recaptures)

    batches = api.read_batches(calibration, options)
    if not options.partial:
        return whole()
    done, cause = _one_graph(model, example_inputs, whole)
    if done is not None:
        return done
    conv = convert_partial(model, example_inputs, rules=rules, calibration=batches, options=options, cause=cause)
    assert conv.partition is not None  # (convert_partial's)
    install(model, conv.partition, storage_plan=False)  # the plan is conv.module.meta's: the model's own meta is left
    setattr(model.forward, "conversion", conv)  # noqa: B010 (the GlueForward install put): conversion_of(model) finds it
    return model


def _runs(precision: str) -> str:
    return f"eager under autocast({precision})"


class GlueForward:
    """The forward of a glue module: the user's own code, run under ``torch.autocast`` in the conversion's dtype."""

    def __init__(self, module: torch.nn.Module, precision: str):
        self.module = module
        self.precision = precision
        #: the Conversion, on the root's glue of a model converted in place (converter.conversion_of reads it)
        self.conversion: Optional[Conversion] = None
        self.original = type(module).forward.__get__(module)
        self.__signature__ = inspect.signature(self.original)
        self.__doc__ = getattr(self.original, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = next((t.device for t in self.module.parameters()), None)
        device_type = device.type if device is not None and device.type in ("cuda", "cpu", "xpu", "mps") else "cpu"
        with torch.autocast(device_type=device_type, dtype=half_dtype(self.precision)):
            return self.original(*args, **kwargs)


def impure_root(model: torch.nn.Module, example_inputs: Any) -> Optional[Probe]:
    """The probe of ``model`` when capturing it whole would bake in a draw or a state write, else None."""
    if not isinstance(model, torch.nn.Module):
        return None
    args, kwargs = normalize_inputs(example_inputs)
    found = probe(model, args, kwargs)
    return found if found is not None and found.impure("") is not None else None


def _ancestors(model: torch.nn.Module, path: str) -> tuple[tuple[str, str], ...]:
    out = [("", type(model).__name__)]
    parts = path.split(".")
    for i in range(1, len(parts)):
        sub = ".".join(parts[:i])
        out.append((sub, type(model.get_submodule(sub)).__name__))
    return tuple(out)


def _children(model: torch.nn.Module, path: str) -> list[str]:
    module = model.get_submodule(path) if path else model
    return [f"{path}.{name}" if path else name for name, child in module.named_children() if child is not None]


_WRITE = re.compile(r"\bself\.(\w+)\s*(?:[-+*/|&]|//)?=(?!=)")
_RANDOM = re.compile(r"\b(random\.|np\.random|numpy\.random)")


def _source_location(model: torch.nn.Module, impurity: Impurity) -> str:
    """``file:line`` of the draw or write in the forward of the module that makes it (its ``def`` line if the source
    does not show it)."""
    forward = type(model.get_submodule(impurity.origin) if impurity.origin else model).forward
    try:
        lines, start = inspect.getsourcelines(forward)
        path = inspect.getsourcefile(forward) or "?"
    except (OSError, TypeError):
        return ""
    for offset, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if impurity.kind == "random" and _RANDOM.search(code):
            return f"{path.rsplit('/', 1)[-1]}:{start + offset}"
        if any(m.group(1) in impurity.written for m in _WRITE.finditer(code)):
            return f"{path.rsplit('/', 1)[-1]}:{start + offset}"
    return f"{path.rsplit('/', 1)[-1]}:{start}"


def _root_break(model: torch.nn.Module, cause: Any, probed: Probe, precision: str) -> GraphBreak:
    if isinstance(cause, CaptureError):
        location, reason = cause.location, cause.reason
    else:
        impurity = probed.impure("")
        assert impurity is not None  # (the root broke the capture: the probe saw why)
        reason, location = impurity.reason(""), _source_location(model, impurity)
    return GraphBreak("", type(model).__name__, location, reason, _runs(precision), probed.total_flops)


def _shapes(module: torch.nn.Module) -> list:
    return [(name, tuple(t.shape), t.dtype) for name, t in [*module.named_parameters(), *module.named_buffers()]]


def _twin(model: torch.nn.Module, path: str, probed: Probe) -> Optional[ModuleProbe]:
    """For a module the example never called (the layers after an early exit), a called module of the same class
    and tensor shapes whose inputs it can be converted on (its FLOPs those of one such call), or None."""
    module = model.get_submodule(path)
    if not any(True for _ in module.parameters()):
        return None
    shapes = _shapes(module)
    for other, entry in probed.modules.items():
        if (entry.inputs is not None and entry.module_type == type(module).__name__ and other != path
                and _shapes(model.get_submodule(other)) == shapes):
            return dataclasses.replace(entry, path=path, calls=0, flops=0,
                                       eval_flops=(entry.flops or entry.eval_flops) // max(entry.calls, 1),
                                       impurity=probed.impure(path) or entry.impurity)
    return None


def _region_options(options: ConvertOptions) -> ConvertOptions:
    return dataclasses.replace(options, partial=False)


def convert_partial(model: torch.nn.Module, example_inputs: Any, *, rules: Any, calibration: Optional[list],
                    options: ConvertOptions, cause: Any) -> Conversion:
    """Convert ``model`` region by region (see the module docstring). ``cause``: the :class:`CaptureError` of the
    whole model, or the :class:`~converter.passes.capture.probe.Probe` that found it impure."""
    t0 = time.perf_counter()
    args, kwargs = normalize_inputs(example_inputs)
    batches = [normalize_inputs(b) for b in calibration] if calibration is not None else None
    probed = probe(model, args, kwargs, record=True, batches=batches)
    if probed is None:  # it does not even run eagerly here: the whole model's error stands
        if isinstance(cause, CaptureError):
            raise cause
        raise CaptureError({"eager": "the model's forward failed when run eagerly"})
    rule_set = fp8_rule_set(rules) if options.fp8_recipe is not None else load_rules(rules)  # as api.pipeline loads them
    precision = ConvertOptions(precision=options.precision).precision
    breaks = [_root_break(model, cause, probed, precision)]
    regions: list[Region] = []
    glue = [""]
    queue = _children(model, "")
    region_options = _region_options(options)
    while queue:
        path = queue.pop(0)
        entry = probed.modules.get(path)
        if entry is not None and entry.inputs is None:  # the example did not reach it (an early exit): a twin's inputs
            entry = _twin(model, path, probed) or entry
        if entry is None or entry.inputs is None:  # a container (ModuleList) or unused: its children
            queue[:0] = _children(model, path)
            continue
        flops = entry.flops or entry.eval_flops
        if not flops:
            continue  # does no arithmetic: it runs eagerly where its parent calls it
        sub = model.get_submodule(path)
        why, location = "", ""
        if entry.impurity is not None:
            why, location = entry.impurity.reason(path), _source_location(model, entry.impurity)
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", SlowHalfWarning)  # said once, for the whole model
                    with _refuse_frozen():
                        conv = api.convert(sub, entry.inputs, rules=rule_set, calibration=entry.batch_inputs or None,
                                           options=region_options, scope=(path, _ancestors(model, path)))
            except CaptureError as exc:  # where torch's own code failed (nn.LSTM on a PackedSequence): the user's call
                why, location = exc.reason, exc.location or entry.call_site
            except MpconvertError:
                raise  # the user's to fix (rules, an fp16 overflow...), as for a whole model
            except Exception as exc:  # noqa: BLE001 - this part runs eagerly, and the report says why
                why = f"conversion failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
            else:
                regions.append(Region(path, type(sub).__name__, conv, entry.flops, entry.calls))
                continue
        breaks.append(GraphBreak(path, type(sub).__name__, location, why, _runs(precision), flops))
        glue.append(path)
        queue[:0] = _children(model, path)
    advice = next((a.text for a in (r.conversion.report.records.advice for r in regions) if a is not None and a.text), None)
    if advice:  # each region's conversion measured it; said once here
        warnings.warn(advice, SlowHalfWarning, stacklevel=3)
    partition = Partition(tuple(regions), tuple(breaks), tuple(glue), probed.total_flops, precision)
    module = build_module(model, partition)
    timings = {"partition_s": round(time.perf_counter() - t0, 3)}
    report = merge_reports([(r.path, r.conversion.report) for r in regions], partition=partition,
                           precision=precision, rules=rule_set.to_dict(), opt_level=options.opt_level,
                           device=options.device, timings=timings,
                           capture_errors=dict(cause.reasons) if isinstance(cause, CaptureError) else {})
    report.device_profile = resolve_profile(options.device_profile)  # the one each region's conversion read
    tracers = sorted({r.conversion.tracer for r in regions})
    # a partial conversion's module is the model's shell over its converted regions, not one GraphModule
    return Conversion(module=cast(torch.fx.GraphModule, module), report=report, tracer="+".join(tracers) or "eager", rules=rule_set, original=model,
                      example_inputs=(args, kwargs), options=options, timings=timings, calibration=calibration,
                      partition=partition)


def build_module(model: torch.nn.Module, partition: Partition) -> torch.nn.Module:
    """The model's structure over the same tensors, its regions running their converted graphs, its glue under autocast."""
    root = shell(model)
    install(root, partition)
    root.train(model.training)
    return root


def install(root: torch.nn.Module, partition: Partition, *, storage_plan: bool = True) -> None:
    """Put the partition on ``root`` (a shell, or the user's model for ``apply``): regions, glue, and (``storage_plan``)
    the O2 storage plan as ``root.meta``."""
    from converter.inplace import ConvertedForward

    for region in partition.regions:
        sub = root.get_submodule(region.path)
        sub.forward = ConvertedForward(sub, region.conversion, cast_inputs=True, recapture_values=True)
    for path in partition.glue:
        sub = root.get_submodule(path) if path else root
        sub.forward = GlueForward(sub, partition.precision)
    # O2's storage plan for MixedPrecisionTrainer: each region's, under the model's names (parameter objects are shared)
    if storage_plan:
        setattr(root, "meta", {GM_PARAM_DTYPES: {  # noqa: B010 (a plain attribute: nn.Module's __setattr__ is typed for tensors)
            f"{r.path}.{name}": dtype for r in partition.regions
            for name, dtype in (r.conversion.module.meta.get(GM_PARAM_DTYPES) or {}).items()}})

