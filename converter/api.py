"""The Python API: ``convert`` and ``audit``.

::

    conv = converter.convert(model, example_inputs, precision="bf16")
    conv.module          # torch.fx.GraphModule with the casts inserted: runnable and trainable
    conv.report.summary  # the report.json summary
    conv.decisions       # node name -> Decision (precision, rule, reason)
    conv.save("out/")    # model.py, weights, train.py and the reports (docs/export.md)

Stages (one module each, talking only through ``node.meta``): capture → decide → lower → place
→ rewrite → fp32_math → check (one forward on the example inputs; a failure names the node) →
report. They are one declared table, :data:`STAGES` (end of this module; each stage with what it reads
and writes, docs/architecture.md "Stage table"), which ``convert``, ``audit`` and ``pipeline`` run through
:func:`converter.stages.run_stages`. When a stage fails, the error names it and the stages that ran before it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.fx

from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError
from converter.ir.graphmodule import TwoModeGraphModule, materialize, with_eval_graph
from converter.ir.meta import (
    GM_GRAPH,
    GM_PARAM_DTYPES,
    HALF_NAMES,
    META_DECISION,
    META_INFO,
    Decision,
    GraphMeta,
    set_graph_facts,
)
from converter.ir.ops import library_op
from converter.ir.records import CaptureFacts, DeviceAdvice, LoweringFacts, OptionalInputs, RunFacts, StageRecords
from converter.ir.state import preserved_state
from converter.numerics.device import half_gemm_slowdown, half_speed_advice
from converter.numerics.optional_inputs import find_optional_inputs
from converter.numerics.optional_inputs import install as install_optional_inputs
from converter.numerics.options import CalibrationOptions
from converter.numerics.overflow import first_overflow
from converter.numerics.profile import resolve_profile
from converter.numerics.redecide import PlaceSettings
from converter.options import FIELDS, ConvertOptions, build_options
from converter.passes import cpu_gemm
from converter.passes.capture import Captured, capture, guard_cache_calls, guard_cache_calls_keeping, keep_user_names
from converter.passes.capture.annotation import scope_module_paths
from converter.passes.checkpoint import checkpoint_regions, regions_in
from converter.passes.decide import decide
from converter.passes.dispatch import dispatch_attention_calls, dispatch_kernels
from converter.passes.fp8 import apply_fp8, check_patterns, fp8_floors, fp8_rule_set, gate_fp8, resolved_recipe
from converter.passes.fp32_math import DEFAULT_FP32_MATH, fp32_math
from converter.passes.grouped_gemm import grouped_gemm_stage, half_wanted
from converter.passes.lower import lower
from converter.passes.rewrite import rewrite
from converter.passes.simplify import fold_counts, simplify
from converter.passes.verify import check_forward
from converter.report.build import Report, build_report
from converter.rules.loader import Rules, load_rules
from converter.stages import STAGE_DEPTH, PassError, Stage, State, declare, run_stages
from converter.vocab import ALIASES, HALF_PRECISIONS, precision

__all__ = ["convert", "audit", "pipeline", "STAGES", "place_settings", "Conversion", "ConvertOptions", "PassError", "Fp16OverflowError", "FrozenModeError", "SlowHalfWarning",
           "normalize_precision", "PRECISION_ALIASES"]

#: the half-precision spellings ``convert`` accepts (see :mod:`converter.vocab`)
PRECISION_ALIASES = {name: value for name, value in ALIASES.items() if value in HALF_NAMES}
#: ``fp16``/``bf16`` for their aliases (``float16``, ``16-mixed``, ``bf16-mixed``, torch dtypes): the one
#: normaliser, :func:`converter.vocab.precision`, with the half precisions allowed
normalize_precision = functools.partial(precision, allowed=HALF_PRECISIONS)


class Fp16OverflowError(MpconvertError, ValueError):
    """The fp16 conversion gives inf/NaN on the example inputs where fp32 is finite (CLI exit 1).

    The message names the first node that overflowed and suggests ``calibration=`` (CLI
    ``--calibrate``), which re-decides overflowing nodes, or bf16, which has fp32's range.
    """

    exit_code = EXIT_CHECK_FAILED  # a failed check, not bad input

    def __init__(self, message: str, *, node: str = ""):
        super().__init__(message)
        self.node = node


class SlowHalfWarning(MpconvertError, UserWarning):
    """The chosen half dtype has no fast math on the device the model will train on (measured; a warning,
    derived from :class:`MpconvertError` like every mpconvert exception class)."""


class FrozenModeError(MpconvertError, ValueError):
    """``strict_modes=True`` (CLI ``--strict-modes``) and the model could only be captured frozen in one
    mode: ``train()``/``eval()`` would change nothing on the converted module (CLI exit 2)."""


def _check_fp16_overflow(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Raise :class:`Fp16OverflowError` when the fp16 graph overflows where fp32 does not."""
    found = first_overflow(gm, args, kwargs)
    if found is None:
        return
    node, peak = found
    info = node.meta.get(META_INFO)
    op = info.op if info is not None else str(node.target)
    where = f", module {info.module!r}" if info is not None and info.module else ""
    raise Fp16OverflowError(
        f"fp16 overflow: node {node.name!r} (op {op}{where}) gives inf/NaN on the example inputs while fp32 "
        f"stays finite (largest fp32 magnitude there {peak:.4g}; fp16 holds up to 65504); convert with "
        "calibration= (CLI: --calibrate) to re-decide the overflowing nodes, or use bf16 (fp32's range)",
        node=node.name,
    )


@dataclass
class Conversion:
    """The result of :func:`convert`."""

    module: torch.fx.GraphModule
    report: Report
    tracer: str
    rules: Rules
    original: torch.nn.Module
    example_inputs: tuple
    options: ConvertOptions = field(default_factory=ConvertOptions)  # what it was converted with: to redo it
    timings: dict = field(default_factory=dict)
    calibration: Optional[list] = None  # the calibration batches, kept so that a variant is calibrated the same way
    #: the regions, glue and graph breaks of a model converted region by region (:mod:`converter.partition`);
    #: None when it was captured whole
    partition: Optional[Any] = None
    #: where this conversion sits in a larger model: (module path, ((path, class), ...) of its ancestors), or None
    scope: Optional[tuple] = None

    @property
    def graph_breaks(self) -> list:
        """The :class:`~converter.partition.GraphBreak` records ([] when captured whole)."""
        return list(self.partition.breaks) if self.partition is not None else []

    @property
    def precision(self) -> str:
        """The half dtype, ``fp16`` or ``bf16`` (``options.precision``)."""
        return self.options.precision

    @property
    def calibration_options(self) -> Optional[CalibrationOptions]:
        """How the calibration ran (None: not calibrated)."""
        if self.calibration is None:
            return None
        return self.options.calibration_options or CalibrationOptions()

    @property
    def decisions(self) -> Mapping[str, Decision]:
        """Node name -> decision, for every compute node (``region/node`` for a model converted region by region)."""
        if self.partition is not None:
            return {f"{r.path}/{name}": d for r in self.partition.regions for name, d in r.conversion.decisions.items()}
        return {n.name: n.meta[META_DECISION] for n in self.module.graph.nodes if META_DECISION in n.meta and n.meta.get(META_INFO) and n.meta[META_INFO].kind != "passive"}

    def save(self, out_dir: Union[str, Path], *, force: bool = False, model_file: Optional[str] = None,
             max_shard_size: Union[int, str, None] = None) -> Path:
        """Write model.py, the weights, train.py and the reports (docs/export.md) atomically.

        ``max_shard_size``: bytes (or ``"500MB"``, ``"2GiB"``) above which the safetensors weights are
        split into shards with an index (docs/export.md); None: 2 GiB.
        """
        from converter.export.emit import DEFAULT_MAX_SHARD_SIZE, emit

        return emit(self, Path(out_dir), force=force, model_file=model_file,
                    max_shard_size=DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)

    def _one_graph(self, what: str) -> None:
        """Refuse ``what`` for a model converted region by region, in one line naming its first graph break."""
        if self.partition is None:
            return
        from converter.passes.capture import CaptureError

        first = self.partition.breaks[0]
        raise CaptureError({"partial": "converted region by region"}, advice=(
            f"the model has {len(self.partition.breaks)} graph break(s) (first: {first.module or 'the root'} at "
            f"{first.location or '?'}: {first.reason}), so it is not one graph, which {what} needs: remove the break "
            "(the report says where), or convert a submodule that captures whole"))

    def redo_options(self, **changes: Any) -> ConvertOptions:
        """This conversion's options with ``changes``, traced with the tracer that captured it."""
        return dataclasses.replace(self.options, tracer=self.tracer, **changes)

    def variant(self, precision: Union[str, torch.dtype]) -> "Conversion":
        """The same conversion in another half dtype: same model, inputs, rules, tracer and options,
        calibrated again on the same batches when this one was (so the overflow fallback and the
        accuracy search hold for the variant's dtype). ``self`` when the precision is its own."""
        options = self.redo_options(precision=precision)
        if options.precision == self.precision:
            return self
        self._one_graph("a variant in another dtype")
        return convert(self.original, self.example_inputs, rules=self.rules, calibration=self.calibration, options=options,
                       scope=self.scope)

    def export_onnx(self, path: Union[str, Path], *, precision: Union[None, str, torch.dtype] = None, **kwargs) -> Any:
        """Export to ONNX and verify it (:func:`converter.export.onnx.export_onnx`).

        ``precision``: None exports this conversion's dtype, except that a bf16 conversion exports
        its fp16 :meth:`variant` (onnxruntime's CPU provider has no bf16 kernels), with a notice. An fp8
        conversion exports itself: bf16 with its fp8 linears as float8 Q/DQ (:mod:`converter.export.onnx_fp8`,
        verified with onnx's reference evaluator); what that cannot write is refused (``Fp8OnnxRefused``, exit 2)
        before anything is written.
        """
        from converter.export.onnx import choose_precision, export_onnx, variant_notes
        from converter.export.onnx_fp8 import check_fp8_export

        self._one_graph("ONNX")
        requested = None if precision is None else normalize_precision(precision)
        if self.options.fp8_recipe is not None:
            check_fp8_export(self.module, fp8=True, precision=requested, example_inputs=self.example_inputs,
                             **{k: v for k, v in kwargs.items() if k in ("exporter", "opset")})
            return export_onnx(self, Path(path), **kwargs)
        target, notes = choose_precision(self.precision, requested)
        source = self.variant(target)
        if source is not self:
            notes += variant_notes(self.decisions, source.decisions, self.precision, target,
                                   calibrated=self.calibration is not None)
        return export_onnx(self, Path(path), source=source, notes=notes, **kwargs)


#: how many calibration batches are read when ``max_batches`` does not say (the CLI's bound too)
MAX_CALIBRATION_BATCHES = 256


def read_batches(calibration: Optional[Iterable], options: ConvertOptions) -> Optional[list]:
    """The calibration batches as a list (kept for variants; an endless iterator is read up to ``max_batches`` only)."""
    if calibration is None:
        return None
    limit = (options.calibration_options or CalibrationOptions()).max_batches
    if limit is not None:
        return list(itertools.islice(calibration, limit))
    batches = list(itertools.islice(calibration, MAX_CALIBRATION_BATCHES + 1))
    if len(batches) > MAX_CALIBRATION_BATCHES:  # an endless generator would be read until memory runs out
        warnings.warn(f"mpconvert: calibration gave more than {MAX_CALIBRATION_BATCHES} batches; the first "
                      f"{MAX_CALIBRATION_BATCHES} are used (set calibration_options={{'max_batches': N}} to choose)",
                      UserWarning, stacklevel=3)
        batches = batches[:MAX_CALIBRATION_BATCHES]
    return batches


def place_settings(options: ConvertOptions) -> PlaceSettings:
    """The placement settings of a conversion with ``options`` (what calibration re-places with)."""
    return PlaceSettings(target=options.precision, strategy=options.placement, keep_io_types=options.keep_io_types,
                         opt_level=options.opt_level)


def pipeline(model: torch.nn.Module, example_inputs: Any, options: ConvertOptions, *,
             rules: Union[None, str, Path, Iterable, Rules] = None, calibration: Optional[list] = None,
             codegen: bool = True, simplify_graph: bool = True, scope: Optional[tuple] = None) -> tuple[Captured, Rules, dict]:
    """capture → decide → lower → place → (calibrate) → rewrite → simplify → fp32_math → (codegen) with
    ``options``: the stages of :data:`STAGES` up to *combine*; returns the capture (its ``gm`` converted), the
    rules and the stage timings. ``simplify_graph=False`` keeps the no-op nodes (benchmarks/graph_step.py times
    both). ``scope``: the module path (and ancestors) of ``model`` inside a larger model, which its module paths
    get (partial capture).

    A model captured as a train graph and an eval graph (it branches on ``self.training``) has both
    converted with the same rules and combined into one :class:`TwoModeGraphModule`."""
    state = run_stages(State(model, example_inputs, options, rule_files=rules, calibration=calibration, scope=scope,
                             codegen=codegen, simplify_graph=simplify_graph), STAGES)
    return state.capture, state.rule_set, state.timings


# ---------------------------------------------------------------------------------------------
# the stages: each reads and writes what STAGES (end of the module) declares for it


def _load_rules(state: State) -> None:
    rules = state.rule_files
    state.rules = fp8_rule_set(rules) if state.options.fp8_recipe is not None else load_rules(rules)


def _capture(state: State) -> None:
    options = state.options
    captured: Captured = capture(state.model, state.example_inputs, tracer=options.tracer, dynamic=options.dynamic,
                                 dynamic_shapes=options.dynamic_shapes)
    state.captured = captured
    state.graphs = [captured.gm] if captured.eval_gm is None else [captured.gm, captured.eval_gm]


def _strict_modes(state: State) -> None:
    captured = state.capture
    if captured.modes is not None and captured.modes.frozen:
        raise FrozenModeError(f"the converted module would be {captured.modes}; make the model's train mode traceable "
                              "(see the cause), or convert without strict_modes (CLI: without --strict-modes) to accept it")


def _scope(state: State) -> None:
    assert state.scope is not None
    for graph in state.graphs:
        scope_module_paths(graph, *state.scope)


def _graph_facts(state: State) -> None:
    captured, options = state.capture, state.options
    state.gm.meta[GM_GRAPH] = GraphMeta(tracer=captured.tracer, precision=options.precision,
                                        capture_errors=tuple(f"{k}: {v}" for k, v in captured.errors.items()),
                                        rule_files=state.rule_set.files,
                                        pinned=dict(captured.pinned_dims))
    state.fp8_recipe = state.fp8_search = None  # this graph's


def _decide(state: State) -> None:
    decide(state.gm, state.rule_set, precision=state.options.precision)


def _fp8_gate(state: State) -> None:
    """The shape gates, before placement: the casts name the gate."""
    fp8 = state.options.fp8_recipe
    state.fp8_recipe = resolved_recipe(state.rule_set, None if fp8 == "auto" else fp8)
    gate_fp8(state.gm, state.rule_set, state.fp8_recipe)


def _lower(state: State) -> None:
    options = state.options
    lowered = lower(state.gm, device=options.device, opt_level=options.opt_level, fp32_attention=_fp32_attention(options),
                    recompute_attention=options.recompute_attention)
    set_graph_facts(state.gm, device=options.device, lowered=tuple(lowered))


def _place(state: State) -> None:
    place_settings(state.options).run(state.gm)


def _calibration_options(state: State) -> CalibrationOptions:
    return state.options.calibration_options or CalibrationOptions()


def _calibrate(state: State) -> None:
    from converter.numerics.calibrate import calibrate_and_redecide

    calibrate_and_redecide(state.gm, state.batches, rules=state.rule_set, settings=place_settings(state.options),
                           options=_calibration_options(state))


def _fp8_reference(state: State) -> None:
    """The fp32 outputs, before rewrite, for the fp8 search."""
    from converter.numerics.fp8_search import prepare_fp8_search

    state.fp8_search = prepare_fp8_search(state.gm, state.batches, _calibration_options(state))


def _rewrite(state: State) -> None:
    rewrite(state.gm, keep_io_types=state.options.keep_io_types, check=state.options.check_graph)


def _fp8(state: State) -> None:
    """The fp8 stage (graph facts fp8_*)."""
    gm, recipe = state.gm, state.recipe
    layers = tuple(apply_fp8(gm, recipe))
    floors = {gemm: {"min_db": db, "rule": str(ref)} for gemm, (db, ref) in fp8_floors(state.rule_set).items()}
    set_graph_facts(gm, fp8_recipe=recipe, fp8_layers=layers, fp8_thresholds=floors,
                    fp8_numerics=None if state.calibration is None else ())


def _fp8_numerics(state: State) -> None:
    """With calibration: the per-layer numerics and the SQNR fallback."""
    from converter.numerics.fp8_layers import measure_and_fall_back

    gm = state.gm
    set_graph_facts(gm, **measure_and_fall_back(gm, state.batches, state.recipe, state.rule_set,
                                                loss_fn=_calibration_options(state).loss_fn,
                                                aten=gm.meta[GM_GRAPH].tracer == "export"))


def _fp8_search(state: State) -> None:
    """The fewest fp8 layers back in bf16 for the tolerance (numerics/fp8_search.py)."""
    gm = state.gm
    set_graph_facts(gm, fp8_layers=tuple(state.fp8_search.run(gm, gm.meta[GM_GRAPH].fp8_layers)))


def _fp32_attention(options: ConvertOptions) -> bool:
    """``device="cpu"`` on a CPU whose half GEMM measured slow: attention in fp32 arithmetic, not lowered in bf16
    (``options.fp32_attention`` forces it)."""
    if options.device != "cpu":
        return False
    if options.fp32_attention is not None:
        return options.fp32_attention
    return _gemm_choice(options)[0]


def _gemm_choice(options: ConvertOptions) -> tuple[bool, str, Optional[int]]:
    """Whether ``device="cpu"``'s half GEMMs run as fp32 GEMMs, and why: the profile's figures, or the option; and
    from which size (the profile's measured crossover; None: the default)."""
    profile = resolve_profile(options.device_profile)
    slowdown = half_gemm_slowdown(options.precision, profile)
    return (*cpu_gemm.upcast_wanted(slowdown, options.upcast_half_gemms), cpu_gemm.profile_gate(profile, options.precision))


def _dispatch(state: State) -> None:
    """A portable conversion: kernels that choose per device at run time (:mod:`converter.passes.dispatch`)."""
    _, choices = dispatch_kernels(state.gm, state.options.precision, _gemm_choice(state.options)[2])  # the same ops
    set_graph_facts(state.gm, lowering=state.gm.meta[GM_GRAPH].lowering + tuple(choices))


def _cpu_gemm_kernels(state: State) -> None:
    """``device="cpu"``: the half GEMMs as fp32 GEMMs on upcast operands where this CPU's half GEMM measured
    slower (:mod:`converter.passes.cpu_gemm`); the choice is one ``upcast_gemm`` entry of the graph's lowering."""
    gm, options = state.gm, state.options
    graph_meta = gm.meta[GM_GRAPH]
    wanted, why, gate = _gemm_choice(options)
    nodes, small = cpu_gemm.upcast_gemms(gm, options.precision, why, min_flops=gate) if wanted else ([], 0)
    # lower(fp32_attention=True) left the attention calls: fp32 arithmetic, as measured (no run-time measurement)
    attention = dispatch_attention_calls(gm, options.precision, measured=False)[1] if _fp32_attention(options) else []
    choice = cpu_gemm.gemm_choice("upcast_gemm", options.precision, nodes, small, why, gate)
    set_graph_facts(gm, lowered=graph_meta.lowered + tuple(nodes), lowering=graph_meta.lowering + (choice,) + tuple(attention))


def _simplify(state: State) -> None:
    set_graph_facts(state.gm, simplified=simplify(state.gm))


def _fp32_math(state: State) -> None:
    math_setting = state.rule_set.setting("fp32_math", DEFAULT_FP32_MATH)
    regions = fp32_math(state.gm, setting=math_setting, check=state.options.check_graph)
    set_graph_facts(state.gm, fp32_math=math_setting, fp32_math_regions=regions)


def _checkpoint(state: State) -> None:
    """torch.utils.checkpoint regions run under checkpoint in the generated code (conv.module, model.py)."""
    set_graph_facts(state.gm, checkpoint=checkpoint_regions(state.gm))


def _codegen(state: State) -> None:
    state.gm = materialize(state.gm)


def _check(state: State) -> None:
    """Never hand back a module whose example forward fails: the error names the node."""
    gm, captured, two = state.gm, state.capture, len(state.graphs) > 1
    with preserved_state(gm) if two else contextlib.nullcontext():
        if two:  # each graph of a two-mode conversion in its own mode
            gm.train(state.index == 0)
        check_forward(gm, captured.args, captured.kwargs)


def _fp8_patterns(state: State) -> None:
    """Each user pattern must have decided a node of some graph (fp8 exclusions)."""
    check_patterns(state.rule_set, [g.graph for g in state.graphs])


def _combine(state: State) -> None:
    """One module: the graph, or a two-mode conversion's train and eval graphs over the model's tensors."""
    captured, graphs = state.capture, state.graphs
    # audit (no codegen) reports the train graph and needs no runnable module
    captured.gm = graphs[0] if len(graphs) == 1 or not state.codegen else _two_modes(state.model, *graphs,
                                                                                      renamed=captured.user_names)
    keep_user_names(captured.gm, captured.user_names)  # state_dict in the model's names (graph_ -> graph)
    if state.codegen and captured.cache:  # captured with use_cache=False: a call asking for a cache gets one clear error
        (guard_cache_calls_keeping if "use_cache" in captured.kwargs else guard_cache_calls)(captured.gm)


def _device_advice(state: State) -> None:
    """A half dtype with no fast math where the model will train (measured): :class:`SlowHalfWarning`."""
    lowering = state.capture.gm.meta[GM_GRAPH].lowering
    upcast = any(c.get("lowering") in ("upcast_gemm", "dispatch_gemm") and c.get("chosen") for c in lowering)
    # the GEMMs run as fp32 GEMMs when this CPU's half GEMM is slow (passes.cpu_gemm, passes.dispatch): nothing to advise
    state.advice = None if upcast else half_speed_advice(state.options.precision, state.options.device,
                                                          resolve_profile(state.options.device_profile))
    if state.advice is not None:  # said where convert was called
        warnings.warn(state.advice, SlowHalfWarning, stacklevel=STAGE_DEPTH + 2)


def _fp16_wanted(state: State) -> bool:
    without_weights = any(p.is_meta for p in state.capture.gm.parameters())  # nothing to run: no values
    return (state.purpose == "convert" and state.options.precision == "fp16" and state.calibration is None
            and not without_weights)


def _fp16_check(state: State) -> None:
    captured = state.capture
    _check_fp16_overflow(captured.gm, captured.args, captured.kwargs)
    if isinstance(captured.gm, TwoModeGraphModule):  # the check interprets `graph`: the eval graph too
        _check_fp16_overflow(captured.gm.for_mode(False), captured.args, captured.kwargs)


def _optional_inputs(state: State) -> None:
    """The original's optional arguments stay optional (numerics.optional_inputs)."""
    captured = state.capture
    state.optional, state.required = (find_optional_inputs(state.model, captured.gm, captured.args, captured.kwargs)
                                      if state.scope is None else ((), {}))
    install_optional_inputs(captured.gm, state.optional)


def _two_modes(model: torch.nn.Module, train_gm: torch.fx.GraphModule, eval_gm: torch.fx.GraphModule, *,
               renamed: Optional[dict] = None) -> TwoModeGraphModule:
    """One module over both graphs, sharing the original model's parameters, buffers and modules
    (``renamed``: {graph name: model name} of root names that are GraphModule's own).

    A parameter stays in half storage for O2 only where both graphs agree."""
    paths = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    paths |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    paths |= {name for name, _ in model.named_modules(remove_duplicate=False) if name}
    back = {old: new for new, old in (renamed or {}).items()}
    paths |= {back[p.split(".", 1)[0]] + p[len(p.split(".", 1)[0]):] for p in paths if p.split(".", 1)[0] in back}
    train_dtypes = dict(train_gm.meta.get(GM_PARAM_DTYPES) or {})
    eval_dtypes = dict(eval_gm.meta.get(GM_PARAM_DTYPES) or {})
    module = with_eval_graph(train_gm, eval_gm, shared=paths.__contains__)
    if train_dtypes:
        params = dict(module.named_parameters())
        module.meta[GM_PARAM_DTYPES] = {
            name: dtype if eval_dtypes.get(name, dtype) == dtype else params[name].dtype
            for name, dtype in train_dtypes.items()}
    return module


def _library_ops(gm: torch.fx.GraphModule) -> list[dict]:
    """The custom ops of other libraries the graph calls: what model.py needs imported to run."""
    found: dict[str, dict] = {}
    for node in gm.graph.nodes:
        op = library_op(node)
        if op is not None:
            entry = found.setdefault(op[0], {"op": op[0], "module": op[1], "package": op[1].split(".")[0], "nodes": 0})
            entry["nodes"] += 1
    return list(found.values())


def _checkpoint_facts(gm: torch.fx.GraphModule) -> dict:
    """The report's ``checkpoint`` section: the torch.utils.checkpoint regions kept (train graph; the eval graph's too)."""
    found = dict(gm.meta[GM_GRAPH].checkpoint or {"regions": [], "count": 0, "notes": []})
    if isinstance(gm, TwoModeGraphModule):
        found["eval_count"] = sum(1 for _ in regions_in(gm.eval_graph))
    return found


def _report(captured: Captured, rule_set: Rules, timings: dict, options: ConvertOptions, *,
            advice: Optional[DeviceAdvice] = None, optional_inputs: Optional[OptionalInputs] = None) -> Report:
    gm = captured.gm
    graph_meta = gm.meta[GM_GRAPH]
    records = StageRecords(
        run=RunFacts(capture_errors=captured.errors, timings=timings, opt_level=options.opt_level, device=options.device),
        capture=CaptureFacts(dynamic_dims=captured.dynamic_dims, shapes=captured.shapes_note,
                             narrowed_dims=captured.narrowed_dims, dynamic_ranges=captured.dynamic_ranges,
                             tied_dims=captured.tied_dims, modes=str(captured.modes or ""), cache=captured.cache),
        lowering=LoweringFacts(lowered=list(graph_meta.lowered), lowering=list(graph_meta.lowering),
                               library_ops=_library_ops(gm), checkpoint=_checkpoint_facts(gm),
                               simplified=fold_counts(graph_meta.simplified)),
        advice=advice, optional_inputs=optional_inputs)
    report = build_report(gm, precision=options.precision, tracer=captured.tracer, rules=rule_set.to_dict(),
                          modes=captured.modes, records=records)
    report.device_profile = resolve_profile(options.device_profile)  # the figures the kernel choices read
    return report


def _build_report(state: State) -> None:
    converting = state.purpose == "convert"
    optional = OptionalInputs(optional=[o.to_dict() for o in state.optional], required=state.required) if converting else None
    state.report = _report(state.capture, state.rule_set, state.timings, state.options,
                           advice=DeviceAdvice(state.advice) if converting else None, optional_inputs=optional)


def convert(model: torch.nn.Module, example_inputs: Any, *, rules: Union[None, str, Path, Iterable, Rules] = None,
            calibration: Optional[Iterable] = None, options: Optional[ConvertOptions] = None,
            scope: Optional[tuple] = None, **keywords: Any) -> Conversion:
    """Convert ``model`` to mixed precision.

    ``options``: a :class:`~converter.options.ConvertOptions` (``precision``, ``tracer``, ``placement``,
    ``keep_io_types``, ``opt_level``, ``device``, ``dynamic``, ``dynamic_shapes``, ``strict_modes``,
    ``calibration_options``; each field is documented there), or the same fields as keywords
    (``convert(model, x, precision="fp16", opt_level="O2")``), not both. Each is checked once, and
    ``conv.options`` keeps them. ``precision`` (default bf16: fp32's range, no loss scaling) is the half
    dtype that ``half`` rules mean. ``rules``: rule files layered over the defaults. ``calibration``: an
    iterable of inputs used to find and fix nodes that would overflow fp16 (kept on the result, so that
    :meth:`Conversion.variant` calibrates the same way; ``calibration_options`` says how, e.g. a
    ``tolerance`` for the accuracy search). ``opt_level="O2"`` treats weight casts as free in placement
    (half storage with fp32 masters in :class:`MixedPrecisionTrainer`); ``conv.module`` keeps fp32
    parameters either way. ``device`` enables that device's lowerings (:mod:`converter.passes.lower`).
    ``report.records.capture.dynamic_dims`` lists the dims that are dynamic and ``report.modes`` whether
    ``train()``/``eval()`` work (see :mod:`converter.passes.capture`); ``strict_modes=True`` raises
    :class:`FrozenModeError` instead of converting a model frozen in one mode.
    A half dtype with no fast math where the model will train (measured) gives a :class:`SlowHalfWarning`,
    also in ``report.records.advice``. fp16 without ``calibration``: the converted graph runs
    once on the example inputs beside its fp32 twin, and :class:`Fp16OverflowError` names the first
    node that gives inf/NaN where fp32 is finite.

    **Weights are shared, not copied.** ``conv.module`` holds its own parameter objects over the *same
    storage* as ``model``'s parameters, and ``model``'s buffers: as with ``torch.compile``, training
    ``conv.module`` (O1) updates ``model``'s weights in place; ``copy.deepcopy(conv.module)`` gives an
    independent module. The O2 :class:`~converter.train.trainer.MixedPrecisionTrainer` gives the
    parameters storage of their own. ``model`` itself is left exactly as it was by conversion: its
    modes, ``config``, buffers, parameters and hooks, also when it fails.

    This converts the model as one graph (a model no tracer captures raises :class:`CaptureError`);
    ``converter.convert`` (:func:`converter.partition.convert`) converts such a model region by region unless
    ``partial=False``. ``scope``: (module path, ancestors) of ``model`` inside a larger model (set by partial
    capture: its module paths become the model's).
    """
    options = build_options(options, keywords, caller="convert")
    batches = read_batches(calibration, options)
    state = run_stages(State(model, example_inputs, options, rule_files=rules, calibration=batches, scope=scope,
                             purpose="convert"), STAGES)
    captured, report = state.capture, state.report
    assert report is not None
    return Conversion(module=captured.gm, report=report, tracer=captured.tracer, rules=state.rule_set, original=model,
                      example_inputs=(captured.args, captured.kwargs), options=options, timings=state.timings,
                      calibration=batches, scope=scope)


#: the options :func:`audit` takes as keywords: no calibration runs there
AUDIT_FIELDS = FIELDS - {"calibration_options"}


def audit(model: torch.nn.Module, example_inputs: Any, *, rules: Union[None, str, Path, Iterable, Rules] = None,
          options: Optional[ConvertOptions] = None, **keywords: Any) -> Report:
    """The report of what :func:`convert` would do; the model is untouched.

    Runs capture, decide, lower, place and rewrite on the traced copy (the rewrite is what puts
    the casts the report counts on the graph), but no calibration and no code generation, and
    returns only the report. ``options`` (or its fields as keywords, not both) as in :func:`convert`
    (``opt_level="O2"``: weight casts are free in placement; ``strict_modes=True`` refuses a model
    frozen in one mode, as convert would); ``calibration_options`` are not used.
    """
    options = build_options(options, keywords, caller="audit", allowed=AUDIT_FIELDS)
    state = run_stages(State(model, example_inputs, options, rule_files=rules, codegen=False, purpose="audit"), STAGES)
    assert state.report is not None
    return state.report


# the stage table, run in this order by convert, audit and pipeline (stages.run_stages); docs/architecture.md lists its rows


def _converting(state: State) -> bool:
    return state.purpose == "convert"


def _fp8_on(state: State) -> bool:
    return state.options.fp8_recipe is not None


STAGES: tuple[Stage, ...] = declare(
    Stage("rules", ("rule_files", "options"), ("rules",), "rules/loader.py", _load_rules, wrap=False),
    Stage("capture", ("model", "example_inputs", "options"), ("captured", "graphs", "node_info"), "passes/capture/",
          _capture, timing="capture_s", wrap=False),
    Stage("strict_modes", ("captured", "options"), (), "api.py", _strict_modes,
          when=lambda s: s.options.strict_modes, timing="capture_s", wrap=False),
    Stage("scope", ("graphs", "scope"), ("node_info",), "passes/capture/annotation.py", _scope,
          when=lambda s: s.scope is not None, timing="capture_s", wrap=False),
    # graph by graph (a two-mode capture: the train graph, then the eval graph)
    Stage("graph_facts", ("captured", "rules", "options"), ("graph_facts",), "ir/meta.py", _graph_facts,
          per_graph=True, wrap=False),
    Stage("decide", ("graphs", "node_info", "rules", "options"), ("decisions",), "passes/decide.py", _decide,
          per_graph=True, timing="pass_s"),
    Stage("fp8_gate", ("decisions", "rules", "options"), ("fp8_recipe", "decisions"), "passes/fp8.py", _fp8_gate,
          when=_fp8_on, per_graph=True, timing="pass_s"),
    Stage("lower", ("decisions", "options"), ("lowered", "graph_facts"), "passes/lower.py", _lower,
          per_graph=True, timing="pass_s"),
    Stage("place", ("decisions", "node_info", "options"), ("placement",), "passes/place/", _place,
          per_graph=True, timing="pass_s"),
    Stage("calibrate", ("placement", "calibration", "rules", "options"), ("ranges", "decisions", "placement"),
          "numerics/calibrate.py", _calibrate, when=lambda s: s.calibration is not None, per_graph=True, timing="pass_s"),
    Stage("fp8_reference", ("placement", "fp8_recipe", "calibration", "options"), ("fp8_reference",),
          "numerics/fp8_search.py", _fp8_reference, per_graph=True, timing="pass_s",
          when=lambda s: s.fp8_recipe is not None and s.calibration is not None and _calibration_options(s).tolerance is not None),
    Stage("rewrite", ("placement", "options"), ("casts",), "passes/rewrite.py", _rewrite, per_graph=True, timing="pass_s"),
    Stage("fp8", ("casts", "fp8_recipe", "rules"), ("fp8_layers", "graph_facts"), "passes/fp8.py", _fp8,
          when=lambda s: s.fp8_recipe is not None, per_graph=True, timing="pass_s"),
    Stage("fp8_numerics", ("fp8_layers", "calibration", "rules", "options"), ("fp8_numerics", "fp8_layers"),
          "numerics/fp8_layers.py", _fp8_numerics, per_graph=True, timing="pass_s",
          when=lambda s: s.fp8_recipe is not None and s.calibration is not None and bool(s.gm.meta[GM_GRAPH].fp8_layers)),
    Stage("fp8_search", ("fp8_layers", "fp8_reference"), ("fp8_layers",), "numerics/fp8_search.py", _fp8_search,
          when=lambda s: s.fp8_recipe is not None and s.fp8_search is not None, per_graph=True, timing="pass_s"),
    Stage("grouped_gemm", ("casts", "options"), ("lowering",), "passes/grouped_gemm.py", grouped_gemm_stage, when=half_wanted,
          per_graph=True, timing="pass_s"),
    Stage("dispatch", ("casts", "options"), ("lowering",), "passes/dispatch.py", _dispatch,
          when=lambda s: s.options.device is None and s.options.dispatch_kernels, per_graph=True, timing="pass_s"),
    Stage("cpu_gemm", ("casts", "lowered", "options"), ("lowered", "lowering"), "passes/cpu_gemm.py", _cpu_gemm_kernels,
          when=lambda s: s.options.device == "cpu", per_graph=True, timing="pass_s"),
    Stage("simplify", ("casts",), ("simplified",), "passes/simplify.py", _simplify,
          when=lambda s: s.simplify_graph, per_graph=True, timing="pass_s"),
    Stage("fp32_math", ("decisions", "node_info", "rules"), ("math",), "passes/fp32_math.py", _fp32_math,
          per_graph=True, timing="pass_s"),
    Stage("checkpoint", ("node_info",), ("checkpoint",), "passes/checkpoint.py", _checkpoint, per_graph=True,
          timing="pass_s"),
    Stage("codegen", ("casts", "math", "checkpoint"), ("code",), "ir/graphmodule.py", _codegen,
          when=lambda s: s.codegen, per_graph=True, timing="codegen_s"),
    Stage("check", ("code", "example_inputs"), (), "passes/verify.py", _check,
          when=lambda s: s.codegen, per_graph=True, timing="check_s"),
    # the whole model again
    Stage("fp8_patterns", ("decisions", "rules"), (), "passes/fp8.py", _fp8_patterns, when=_fp8_on, wrap=False),
    Stage("combine", ("graphs", "captured", "model"), ("module",), "api.py", _combine, wrap=False),
    # convert only
    Stage("device_advice", ("module", "options"), ("advice",), "numerics/device.py", _device_advice,
          when=_converting, wrap=False),
    Stage("fp16_check", ("module", "example_inputs", "options", "calibration"), (), "numerics/overflow.py", _fp16_check,
          when=_fp16_wanted, wrap=False),
    Stage("optional_inputs", ("module", "model", "scope"), ("optional_inputs", "module"), "numerics/optional_inputs.py",
          _optional_inputs, when=_converting, wrap=False),
    # convert and audit
    Stage("report", ("module", "captured", "rules", "options"), ("report",), "report/build.py", _build_report,
          when=lambda s: s.purpose in ("convert", "audit"), wrap=False),
)
