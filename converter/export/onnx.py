"""ONNX export of a converted model, with its casts verified.

::

    result = conv.export_onnx("model.onnx")            # fp16 (the fp16 variant for a bf16 conversion)
    result = conv.export_onnx("model.onnx", precision="bf16")   # bf16 for GPU providers, not verified on CPU
    print(result.summary)

What is exported
    A copy of ``conv.module`` in eval mode whose parameters are stored in the dtype
    ``gm.meta["mp_param_dtypes"]`` gives them (O2 storage: half wherever every consumer is a cast to
    that half dtype). The in-graph ``.to(half)`` on such a parameter becomes a no-op and disappears,
    so the weight is a half initializer and no Cast runs on it. Any Cast on an initializer that is
    still left (a parameter shared by a half and an fp32 op, e.g. tied embeddings) is folded into
    a half initializer of its own after export. Graph inputs and outputs keep their fp32 dtype
    (``keep_io_types``); every node and every Cast has a unique name, and the Casts that match
    the FX casts one to one are named after them (``mp/<fx cast name>``).

Exporter
    ``torch.onnx.export(..., dynamo=True)``; when it fails, the TorchScript exporter
    (``dynamo=False``) with a notice in ``notes`` and a ``UserWarning``.

Opset
    :data:`DEFAULT_OPSET` = 20: the dynamo exporter's native opset in torch 2.13 (no version
    conversion pass runs), ``Gelu`` is a native op from 20, ``LayerNormalization`` from 17 and bf16
    ``Cast`` from 13; onnxruntime ≥ 1.16 runs it.

Verification (``verify=True``)
    The verdict (``ok``) is numeric: an onnxruntime CPU session runs the example inputs and its
    outputs are compared with ``conv.module`` (eval mode): the max abs error must stay below a
    tolerance scaled to the half dtype's precision and the output magnitude (:func:`tolerance_for`).
    A file that ``onnx.checker.check_model(full_check=True)`` rejects, or that onnxruntime cannot
    run, fails too (:data:`VERDICT_CHECKS`). The structural checks below are *information*: they
    are recorded in ``checks`` and explained in ``notes`` and the summary, but never fail an export
    whose numbers match:

    * the Cast count equals the expected count: the casts on activations in the FX graph (the
      inserted ones and the model's own casts that now change dtype) plus the model's own casts of
      integer/bool tensors (they are in the fp32 export too); weight casts are folded into half
      initializers and so are not Casts. When the counts differ, the note says why, as far as the
      FX graph tells: e.g. the exporter's optimizer folded Casts of values computed from constants
      only (rotary-embedding tables at the example's fixed length), or the exporter added Casts;
    * no Cast reads the output of another Cast (no round trip);
    * graph inputs and outputs stay fp32, node names are unique, weights are half initializers;
    * the file size is compared with an export of the fp32 original.

bf16
    onnxruntime's CPU provider has no bf16 compute kernels (MatMul/Gemm/Add in bf16 fail with
    NOT_IMPLEMENTED, onnxruntime#26311). For a bf16 conversion the default is therefore the fp16
    variant of the same decisions, verified on CPU, with a notice: :func:`choose_precision` picks
    the dtype and :meth:`converter.api.Conversion.variant` re-converts (same rules, tracer, options
    and calibration batches); the exporter receives the variant as ``source`` and never converts
    anything itself. ``precision="bf16"`` exports bf16 for GPU providers: the static checks run,
    CPU verification is skipped and the notes say why (``verified=False``).
"""
from __future__ import annotations

import collections
import copy
import math
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.fx

from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError
from converter.ir.graphmodule import TwoModeGraphModule
from converter.ir.meta import DTYPES, GM_PARAM_DTYPES, META_CAST, META_DECISION, META_INFO, META_VALUE, TensorSpec, name_of
from converter.ir.ops import CAST_OPS
from converter.numerics.common import output_tensors, to_json

__all__ = [
    "DEFAULT_OPSET",
    "OnnxResult",
    "OnnxExportError",
    "export_onnx",
    "expected_casts",
    "onnx_casts",
    "cast_pairs",
    "tolerance_for",
    "TOLERANCE_ULPS",
    "BF16_CPU_REASON",
    "VERDICT_CHECKS",
    "choose_precision",
    "variant_notes",
]

#: the opset written by default (see the module docstring for why)
DEFAULT_OPSET = 20

#: why a bf16 model is not run on onnxruntime's CPU provider
BF16_CPU_REASON = (
    "onnxruntime's CPU execution provider has no bf16 compute kernels "
    "(MatMul/Gemm/Add in bf16 fail with NOT_IMPLEMENTED, onnxruntime#26311)"
)

# ONNX TensorProto element types
_FLOAT, _FLOAT16, _BFLOAT16, _DOUBLE = 1, 10, 16, 11
_ONNX_DTYPE_NAMES = {_FLOAT: "fp32", _FLOAT16: "fp16", _BFLOAT16: "bf16", _DOUBLE: "fp64"}
_ONNX_TYPE_NAMES = {**_ONNX_DTYPE_NAMES, 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool"}
_TORCH_TO_ONNX = {
    torch.float32: _FLOAT, torch.uint8: 2, torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 7,
    torch.bool: 9, torch.float16: _FLOAT16, torch.float64: _DOUBLE, torch.bfloat16: _BFLOAT16,
}
# explicit mantissa bits of each half dtype (an ulp at 1.0 is 2**-bits)
_MANTISSA_BITS = {"fp16": 10, "bf16": 7}
#: the ORT-vs-torch tolerance, in ulps of the half dtype at the output's largest magnitude
TOLERANCE_ULPS = 3
#: the checks that decide ``OnnxResult.ok``: a valid file whose onnxruntime outputs match
#: ``conv.module``; every other check is information (see the module docstring)
VERDICT_CHECKS = ("checker", "ort_match")


class OnnxExportError(MpconvertError, RuntimeError):
    """Neither exporter could export the model; the message gives both reasons."""

    exit_code = EXIT_CHECK_FAILED  # the requested --onnx check could not be done


@dataclass
class OnnxResult:
    """What :func:`export_onnx` wrote and what its verification found.

    ``ok`` is True when every check of :data:`VERDICT_CHECKS` that ran passed: the file is valid
    and, when onnxruntime ran it, its outputs match ``conv.module``. The structural checks (Cast
    count, Cast dtypes, round trips, fp32 I/O, half initializers) are in ``checks`` too, and a
    difference there is listed in ``differences`` with its cause, as information. ``verified`` is
    True when onnxruntime ran the model and its outputs matched ``conv.module``; it is False for a
    bf16 export (CPU has no bf16 kernels) or when ``verify=False``.
    """

    path: Path
    precision: str
    opset: int
    exporter: str  # "dynamo" | "torchscript"
    cast_count: int
    expected_casts: int
    cast_pairs: list[tuple[str, str]]
    max_abs_error: Optional[float]
    fp32_size: Optional[int]
    size: int
    size_ratio: Optional[float]
    ok: bool
    notes: list[str] = field(default_factory=list)
    verified: bool = False
    conversion_precision: str = ""
    tolerance: Optional[float] = None
    cast_breakdown: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    fp32_cast_count: Optional[int] = None
    differences: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        status = "OK" if self.ok else "FAILED"
        parts = [f"ONNX {status}: {self.path.name}", f"{self.precision}", f"opset {self.opset}", f"{self.exporter} exporter"]
        if self.cast_count == self.expected_casts:
            parts.append(f"{self.cast_count} Casts (expected {self.expected_casts})")
        else:
            parts.append(f"{self.cast_count} Casts (expected {self.expected_casts}; information, not a failure: "
                         + " ".join(d for d in self.differences if d.startswith("Cast count")) + ")")
        parts.append(f"{len(self.cast_pairs)} Cast pairs")
        if self.max_abs_error is not None:
            parts.append(f"max abs error {self.max_abs_error:.3g} (tol {self.tolerance:.3g})")
        elif self.precision == "bf16":
            parts.append("CPU verification skipped: onnxruntime's CPU provider has no bf16 kernels (use a GPU provider)")
        elif not self.verified:
            parts.append("not verified with onnxruntime")
        if self.size_ratio is not None:
            parts.append(f"size {self.size_ratio:.2f}x fp32 ({_mib(self.size)} vs {_mib(self.fp32_size)})")
        else:
            parts.append(f"size {_mib(self.size)}")
        if self.conversion_precision and self.conversion_precision != self.precision:
            why = " (onnxruntime's CPU provider has no bf16 kernels)" if self.conversion_precision == "bf16" else ""
            parts.append(f"{self.precision} variant of the {self.conversion_precision} conversion{why}")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["path"] = str(self.path)
        out["cast_pairs"] = [list(p) for p in self.cast_pairs]
        out["summary"] = self.summary
        return to_json(out)


def _mib(n: Optional[int]) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# ---------------------------------------------------------------------------------------------
# expected casts (read from the FX graph's meta only)


class _FxCast(NamedTuple):
    """One cast of the FX graph that the ONNX export should contain as a Cast."""

    name: str
    kind: str  # inserted | model | implicit | model-nonfloat | weight
    src: torch.dtype
    dst: torch.dtype
    constant: bool  # the value cast depends on no graph input: an exporter may constant-fold it


def _input_dependent(gm: torch.fx.GraphModule) -> set:
    """The nodes whose value depends on a graph input (the others are computed from constants and weights)."""
    dependent: set = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _cast_nodes_in_order(gm: torch.fx.GraphModule) -> list[_FxCast]:
    """What in the FX graph becomes an ONNX Cast, in graph order (see :class:`_FxCast`).

    kind is

    * ``inserted``: a cast the rewrite inserted on an activation (a :class:`CastRecord`);
    * ``model``: the model's own cast that now converts between float dtypes (a CastRecord with
      ``inserted=False``), or a float cast of the model's own that converts in fp32 already;
    * ``implicit``: a ``promote`` node whose op promotes mixed float inputs natively, so the
      rewrite inserted no cast (``x_fp32 + y_fp16``); ONNX ops take one dtype, so the exporter's
      type promotion writes a Cast for each narrower activation input;
    * ``model-nonfloat``: the model's own cast of an integer/bool tensor or to one (the fp32 model
      has it too);
    * ``weight``: a cast of a parameter/buffer: the weight is stored in the target dtype (folded
      into a half initializer), so it is not an ONNX Cast.
    """
    from converter.passes.rewrite import runtime_dtype

    cache: dict = {}
    dependent = _input_dependent(gm)
    out: list[_FxCast] = []
    for node in gm.graph.nodes:
        rec = node.meta.get(META_CAST)
        if rec is not None:
            kind = "weight" if rec.on_weight else ("inserted" if rec.inserted else "model")
            source = node.args[0] if node.args else None
            out.append(_FxCast(node.name, kind, DTYPES[rec.src_dtype], DTYPES[rec.dtype], source not in dependent))
            continue
        info = node.meta.get(META_INFO)
        decision = node.meta.get(META_DECISION)
        if info is None or node.op not in ("call_method", "call_function", "call_module"):
            continue
        if info.kind == "compute" and decision is not None and decision.requested == "promote" and decision.precision in DTYPES:
            want = DTYPES[decision.precision]
            seen: set = set()
            for arg in node.all_input_nodes:
                value = arg.meta.get(META_VALUE)
                if arg in seen or not (isinstance(value, TensorSpec) and value.is_convertible):
                    continue
                seen.add(arg)
                have = runtime_dtype(arg, cache)
                if have is not None and have.is_floating_point and have != want:
                    kind = "weight" if arg.op == "get_attr" else "implicit"
                    out.append(_FxCast(f"{arg.name}_to_{name_of(want)}_in_{node.name}", kind, have, want,
                                       arg not in dependent))
            continue
        if info.op not in CAST_OPS or node.op == "call_module":
            continue
        src = node.args[0] if node.args else None
        have = src.meta.get(META_VALUE) if isinstance(src, torch.fx.Node) else None
        got = node.meta.get(META_VALUE)
        if not (isinstance(have, TensorSpec) and isinstance(got, TensorSpec)) or have.dtype == got.dtype:
            continue
        if src.op == "get_attr":
            kind = "weight"
        elif have.is_convertible and got.is_convertible:
            kind = "model"
        else:
            kind = "model-nonfloat"
        out.append(_FxCast(node.name, kind, have.dtype, got.dtype, src not in dependent))
    return out


def expected_casts(gm: torch.fx.GraphModule) -> dict:
    """The number of ONNX Casts the export of ``gm`` must contain, and its breakdown by kind."""
    nodes = _cast_nodes_in_order(gm)
    counts = {"inserted": 0, "model": 0, "implicit": 0, "model-nonfloat": 0, "weight": 0}
    for entry in nodes:
        counts[entry.kind] += 1
    counts["recorded"] = sum(
        1 for n in gm.graph.nodes if META_CAST in n.meta and not n.meta[META_CAST].on_weight
    )
    counts["expected"] = counts["inserted"] + counts["model"] + counts["implicit"] + counts["model-nonfloat"]
    counts["order"] = [entry for entry in nodes if entry.kind != "weight"]
    return counts


# ---------------------------------------------------------------------------------------------
# ONNX graph inspection


def _all_graphs(graph) -> list:
    """The graph and every subgraph (If/Loop/Scan bodies)."""
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                found.extend(_all_graphs(attr.g))
            for sub in attr.graphs:
                found.extend(_all_graphs(sub))
    return found


def onnx_casts(model) -> list:
    """Every Cast/CastLike node of ``model`` (subgraphs included)."""
    return [n for g in _all_graphs(model.graph) for n in g.node if n.op_type in ("Cast", "CastLike")]


def cast_pairs(model) -> list[tuple[str, str]]:
    """(producer, consumer) for every Cast whose input is produced by another Cast."""
    pairs: list[tuple[str, str]] = []
    for g in _all_graphs(model.graph):
        producer = {out: n for n in g.node for out in n.output}
        for n in g.node:
            if n.op_type in ("Cast", "CastLike") and n.input and n.input[0] in producer:
                p = producer[n.input[0]]
                if p.op_type in ("Cast", "CastLike"):
                    pairs.append((p.name, n.name))
    return pairs


def _cast_to(node) -> Optional[int]:
    for attr in node.attribute:
        if attr.name == "to":
            return int(attr.i)
    return None


def _fold_initializer_casts(model) -> int:
    """Replace Cast(initializer or Constant) by an initializer of the target dtype. Returns the count."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    constants = {}
    for n in graph.node:
        if n.op_type == "Constant" and len(n.output) == 1:
            for attr in n.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    constants[n.output[0]] = (n, attr.t)
    graph_inputs = {i.name for i in graph.input}
    folded = 0
    keep = []
    new_inits = []
    for n in graph.node:
        source = n.input[0] if n.op_type == "Cast" and n.input else None
        tensor = None
        if source is not None and source not in graph_inputs:
            tensor = inits[source] if source in inits else (constants[source][1] if source in constants else None)
        to = _cast_to(n) if tensor is not None else None
        if tensor is None or to is None:
            keep.append(n)
            continue
        array = numpy_helper.to_array(tensor)
        new = numpy_helper.from_array(_np_cast(array, to), name=n.output[0])
        new_inits.append(new)
        folded += 1
    if not folded:
        return 0
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(new_inits)
    # drop initializers and Constants nothing reads any more
    used = {i for g in _all_graphs(graph) for n in g.node for i in n.input} | {o.name for o in graph.output}
    alive = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(alive)
    nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] not in used)]
    del graph.node[:]
    graph.node.extend(nodes)
    return folded


def _np_cast(array, to: int):
    import numpy as np
    from onnx import helper

    if to == _BFLOAT16:
        import ml_dtypes  # onnx depends on it

        return np.asarray(array).astype(ml_dtypes.bfloat16)
    return np.asarray(array).astype(helper.tensor_dtype_to_np_dtype(to))


def _onnx_type(dtype: torch.dtype) -> Optional[int]:
    return _TORCH_TO_ONNX.get(dtype)


def _value_types(model) -> dict[str, int]:
    """Element type of every value of the main graph (inputs, initializers, inferred values)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # type inference is best effort; the Casts' sources then stay unknown
        inferred = model
    types = {t.name: t.data_type for t in model.graph.initializer}
    for v in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    return types


def _match_casts(model, fx_order: list) -> dict:
    """Compare the ONNX Casts with the casts the FX graph implies.

    * ``dtypes_match``: the multisets of (source dtype, target dtype) are equal — every Cast
      converts what the FX graph says, whatever order the exporter wrote them in;
    * ``in_order``: they also pair up one to one in graph order, and are then named after the FX
      casts (``mp/<cast>``, ``mp_promote/<src>_to_<dtype>_in_<node>``, ``model/<node>``).
    """
    types = _value_types(model)
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    got = [(types.get(c.input[0]) if c.input else None, _cast_to(c)) for c in casts]
    want = [(_onnx_type(entry.src), _onnx_type(entry.dst)) for entry in fx_order]
    dtypes_match = collections.Counter(got) == collections.Counter(want)
    in_order = len(got) == len(want) and all(g == w for g, w in zip(got, want))
    if in_order:
        prefix = {"inserted": "mp/", "implicit": "mp_promote/", "model": "model/", "model-nonfloat": "model/"}
        for c, entry in zip(casts, fx_order):
            c.name = prefix[entry.kind] + entry.name
    return {"dtypes_match": dtypes_match, "in_order": in_order, "onnx": got, "fx": want}


def _drop_identity_casts(model) -> int:
    """Remove Casts to the type their input already has (the TorchScript exporter writes some)."""
    types = _value_types(model)
    graph = model.graph
    outputs = {o.name for o in graph.output}
    replace: dict[str, str] = {}
    keep = []
    for n in graph.node:
        if (n.op_type == "Cast" and n.input and n.output[0] not in outputs
                and types.get(n.input[0]) is not None and types.get(n.input[0]) == _cast_to(n)):
            replace[n.output[0]] = replace.get(n.input[0], n.input[0])
            continue
        keep.append(n)
    if not replace:
        return 0
    for g in _all_graphs(graph):
        for n in g.node:
            for i, name in enumerate(n.input):
                if name in replace:
                    n.input[i] = replace[name]
    del graph.node[:]
    graph.node.extend(keep)
    return len(replace)


def _strip_debug_metadata(model) -> None:
    """Drop the exporter's per-node debug metadata (FX node text, stack traces, module names).

    It is ~40% of a small model's file; the Casts keep their provenance in their names."""
    for g in _all_graphs(model.graph):
        for n in g.node:
            del n.metadata_props[:]


def _set_model_metadata(model, entries: dict) -> None:
    import onnx

    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **entries})


def _unique_node_names(model) -> int:
    """Make every node name in the model (subgraphs included) unique and non-empty."""
    taken: set[str] = set()
    renamed = 0
    for g in _all_graphs(model.graph):
        for i, n in enumerate(g.node):
            base = n.name or f"{n.op_type}_{i}"
            name = base
            k = 1
            while name in taken:
                name = f"{base}__{k}"
                k += 1
            if name != n.name:
                renamed += 1
                n.name = name
            taken.add(name)
    return renamed


def _io_dtypes(model) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    def elem(v):
        return _ONNX_DTYPE_NAMES.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type))

    return [(v.name, elem(v)) for v in model.graph.input], [(v.name, elem(v)) for v in model.graph.output]


def _half_initializers(model) -> tuple[int, int, list[str]]:
    """(#half initializers, #fp32 initializers, fp32 initializers that only half ops consume)."""
    graph = model.graph
    consumers: dict[str, list] = {}
    for g in _all_graphs(graph):
        for n in g.node:
            for i in n.input:
                consumers.setdefault(i, []).append(n)
    half = sum(1 for t in graph.initializer if t.data_type in (_FLOAT16, _BFLOAT16))
    fp32 = [t for t in graph.initializer if t.data_type == _FLOAT]
    only_cast = [
        t.name for t in fp32
        if consumers.get(t.name) and all(n.op_type == "Cast" and _cast_to(n) in (_FLOAT16, _BFLOAT16) for n in consumers[t.name])
    ]
    return half, len(fp32), only_cast


# ---------------------------------------------------------------------------------------------
# export


def _deepcopy(module: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():  # torch.export's pytree specs warn on deepcopy (LeafSpec deprecation)
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module)


def _export_copy(conv_module: torch.fx.GraphModule, param_dtypes: dict) -> torch.nn.Module:
    """A copy of the converted module in eval mode with parameters stored per ``mp_param_dtypes``."""
    gm = _deepcopy(conv_module)
    if isinstance(gm, TwoModeGraphModule):  # torch.export interprets `graph`, the train graph: give it eval's
        gm = gm.for_mode(False)
    with torch.no_grad():
        for name, param in gm.named_parameters():
            dtype = param_dtypes.get(name)
            if dtype is not None and param.dtype != dtype:
                param.data = param.data.to(dtype)
    _eval(gm)
    return gm


def _eval(module: torch.nn.Module) -> None:
    try:
        module.eval()
    except Exception:  # exported GraphModules of some torch versions refuse eval(); they were captured in eval
        pass


def _input_names(module: torch.nn.Module, args: tuple, kwargs: dict) -> list[str]:
    names = []
    if isinstance(module, torch.fx.GraphModule):
        names = [n.target for n in module.graph.nodes if n.op == "placeholder"]
    names = [str(n) for n in names[: len(args)]] if names else [f"input_{i}" for i in range(len(args))]
    return names + [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


def _export(module: torch.nn.Module, args: tuple, kwargs: dict, *, opset: int, exporter: str, notes: list[str]):
    """Export to an in-memory ModelProto; returns (model, exporter used)."""
    import onnx

    errors: dict[str, str] = {}
    order = {"auto": ("dynamo", "torchscript"), "dynamo": ("dynamo",), "torchscript": ("torchscript",)}[exporter]
    for which in order:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if which == "dynamo":
                    program = torch.onnx.export(module, args, kwargs=kwargs or None, dynamo=True, opset_version=opset,
                                                verbose=False, optimize=True)
                    model = program.model_proto
                else:
                    with tempfile.TemporaryDirectory() as tmp:
                        f = os.path.join(tmp, "ts.onnx")
                        torch.onnx.export(module, args, f, kwargs=kwargs or None, dynamo=False, opset_version=opset,
                                          input_names=_input_names(module, args, kwargs), do_constant_folding=True)
                        model = onnx.load(f)
            if errors:
                msg = f"the dynamo exporter failed ({errors['dynamo']}); fell back to the TorchScript exporter"
                notes.append(msg)
                warnings.warn(msg, UserWarning, stacklevel=3)
            return model, which
        except Exception as exc:  # the reason is kept and reported; the next exporter is tried
            errors[which] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    raise OnnxExportError("ONNX export failed: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))


def _save(model, path: Path) -> int:
    """Write ``model``; weights go to an external ``.data`` file past the 2 GiB protobuf limit."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    big = model.ByteSize() > 1_800_000_000 if _byte_size_ok(model) else True
    if big:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data")
    else:
        onnx.save_model(model, str(path))
    size = path.stat().st_size
    data = path.with_name(path.name + ".data")
    if big and data.exists():
        size += data.stat().st_size
    return size


def _byte_size_ok(model) -> bool:
    try:
        model.ByteSize()
        return True
    except Exception:
        return False


def _fp32_size(conv, args, kwargs, *, opset: int, exporter: str, notes: list[str],
               keep_debug_metadata: bool) -> tuple[Optional[int], Optional[int]]:
    """Size in bytes (and Cast count) of the export of the fp32 original."""
    original = _deepcopy(conv.original)
    _eval(original)
    try:
        model, _ = _export(original, args, kwargs, opset=opset, exporter=exporter, notes=[])
    except OnnxExportError as exc:
        notes.append(f"the fp32 original could not be exported for the size comparison: {exc}")
        return None, None
    if not keep_debug_metadata:
        _strip_debug_metadata(model)
    with tempfile.TemporaryDirectory() as tmp:
        size = _save(model, Path(tmp) / "fp32.onnx")
    return size, len(onnx_casts(model))


# ---------------------------------------------------------------------------------------------
# verification


def tolerance_for(precision: str, reference_scale: float) -> float:
    """Max abs error allowed between onnxruntime and ``conv.module``: :data:`TOLERANCE_ULPS` units
    in the last place of the half dtype at the output's largest magnitude.

    onnxruntime and torch round the same half ops at slightly different points, so they differ by
    about one ulp of the output (measured on the samples: 0.4 to 1.3 fp16 ulps). The same
    decisions run in bf16 instead of fp16 differ by 4.5 to 7 fp16 ulps, so a wrong half dtype
    fails. (An all-fp32 run cannot be told apart at the output: ``conv.module``'s output is
    itself rounded to fp16; the Cast check, which compares each Cast's source and target dtype
    with the FX graph, is what catches it.)
    """
    bits = _MANTISSA_BITS[precision]
    scale = max(float(reference_scale), 2.0 ** -14)
    return TOLERANCE_ULPS * 2.0 ** (math.floor(math.log2(scale)) - bits)


def _feeds(session, args: tuple, kwargs: dict) -> dict:
    positional = [a for a in output_tensors(args)]
    feeds = {}
    for inp in session.get_inputs():
        if inp.name in kwargs and isinstance(kwargs[inp.name], torch.Tensor):
            tensor = kwargs[inp.name]
        elif positional:
            tensor = positional.pop(0)
        else:
            remaining = [v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in feeds]
            if not remaining:
                raise ValueError(f"no example input for the ONNX input {inp.name!r}")
            tensor = remaining[0]
        feeds[inp.name] = tensor.detach().cpu().numpy()
    return feeds


def _run_ort(path: Path, args, kwargs, provider: str) -> list:
    """Run the written file (external weights included) on ``provider``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=[provider])
    return session.run(None, _feeds(session, args, kwargs))


def _reference(conv_module: torch.fx.GraphModule, args, kwargs) -> list[torch.Tensor]:
    ref = _deepcopy(conv_module)
    _eval(ref)
    with torch.no_grad():
        return output_tensors(ref(*args, **kwargs))


def _compare(outputs: list, reference: list[torch.Tensor]) -> tuple[float, float]:
    """(max abs error, max |reference|) over all floating outputs."""
    if len(outputs) != len(reference):
        raise ValueError(f"onnxruntime returned {len(outputs)} outputs, conv.module {len(reference)}")
    err, scale = 0.0, 0.0
    for got, ref in zip(outputs, reference):
        got_t = torch.as_tensor(got)
        if tuple(got_t.shape) != tuple(ref.shape):
            raise ValueError(f"output shape {tuple(got_t.shape)} != {tuple(ref.shape)}")
        if not ref.is_floating_point():
            if not torch.equal(got_t.to(ref.dtype), ref):
                return math.inf, scale
            continue
        ref64, got64 = ref.double(), got_t.double()
        finite = torch.isfinite(ref64)
        if not torch.equal(finite, torch.isfinite(got64)):
            return math.inf, scale
        if finite.any():
            err = max(err, float((got64 - ref64)[finite].abs().max()))
            scale = max(scale, float(ref64[finite].abs().max()))
    return err, scale


# ---------------------------------------------------------------------------------------------
# the public entry point


def choose_precision(conversion_precision: str, requested: Optional[str]) -> tuple[str, list[str]]:
    """The dtype to export, and a note when it is not the conversion's own.

    ``requested``: ``"fp16"``, ``"bf16"`` or None (already normalised: aliases are read by
    :func:`converter.api.normalize_precision`). None exports the conversion's dtype, except that a
    bf16 conversion exports its fp16 variant (onnxruntime's CPU provider has no bf16 kernels).
    """
    if requested is not None:
        if requested not in _MANTISSA_BITS:
            raise ValueError(f"unknown precision {requested!r}; use fp16 or bf16")
        return requested, []
    if conversion_precision != "bf16":
        return conversion_precision, []
    return "fp16", [
        f"the conversion is bf16 but {BF16_CPU_REASON}: exported the fp16 variant of the same decisions and "
        "verified it on CPU; pass precision='bf16' (--onnx-precision bf16) to export bf16 for GPU providers"
    ]


def variant_notes(before: Mapping[str, Any], after: Mapping[str, Any], precision: str, target: str, *,
                  calibrated: bool) -> list[str]:
    """Notes comparing the decisions (node name -> Decision) of a conversion and of its ``target`` variant."""
    mapping = {precision: target}
    was = {k: mapping.get(d.precision, d.precision) for k, d in before.items()}
    now = {k: d.precision for k, d in after.items()}
    differ = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    again = "; calibration ran again on the same batches for it" if calibrated else ""
    if differ:
        return [f"the {target} re-conversion decided {len(differ)} node(s) differently from the {precision} one "
                f"(e.g. {', '.join(differ[:5])}){again}"]
    return [f"the {target} variant has the same decisions as the {precision} conversion "
            f"({len(now)} nodes, {target} in place of {precision}){again}"]


def export_onnx(
    conv,
    path,
    *,
    source=None,
    notes: Sequence[str] = (),
    opset: int = DEFAULT_OPSET,
    verify: bool = True,
    exporter: str = "auto",
    compare_size: bool = True,
    keep_debug_metadata: bool = False,
) -> OnnxResult:
    """Export ``source`` (default: ``conv``, a :class:`~converter.api.Conversion`) to ONNX at ``path`` and verify it.

    ``source``: the conversion to export, in the dtype to export: ``conv`` itself, or the variant
    :meth:`converter.api.Conversion.export_onnx` made for another dtype (``notes`` say why). The
    exporter reads the module, example inputs and original model from them and converts nothing.
    ``opset``: :data:`DEFAULT_OPSET`. ``verify``: run onnxruntime and compare with the module (the
    static checks always run). ``exporter``: ``auto`` (dynamo, then TorchScript), ``dynamo`` or
    ``torchscript``. ``compare_size``: also export the fp32 original and report the size ratio.
    ``keep_debug_metadata``: keep the exporter's per-node debug metadata (dropped by default, from
    both exports, so that the size comparison measures the weights).
    """
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise ValueError(f"exporter must be 'auto', 'dynamo' or 'torchscript', got {exporter!r}")
    source = conv if source is None else source
    target = source.precision
    if target not in _MANTISSA_BITS:
        raise ValueError(f"unknown precision {target!r}; use fp16 or bf16")
    path = Path(path)
    notes = list(notes)
    gm = source.module
    args, kwargs = source.example_inputs  # (args, kwargs), normalised by capture
    model, used = _export(_export_copy(gm, gm.meta.get(GM_PARAM_DTYPES, {})), args, kwargs, opset=opset,
                          exporter=exporter, notes=notes)
    written = _postprocess(model, gm, target=target, conversion_precision=conv.precision,
                           keep_debug_metadata=keep_debug_metadata)
    size = _save(model, path)
    checks, differences = _static_checks(model, path, written, notes)
    run = _verify(path, gm, args, kwargs, target, notes) if verify else _Verified()
    if not verify:
        notes.append("verification with onnxruntime not requested (verify=False)")
    checks.update(run.checks)
    fp32_size = fp32_casts = ratio = None
    if compare_size:
        fp32_size, fp32_casts = _fp32_size(source, args, kwargs, opset=opset, exporter=used, notes=notes,
                                           keep_debug_metadata=keep_debug_metadata)
        ratio = _size_notes(size, fp32_size, fp32_casts, written.expected, notes)
    expected = written.expected
    breakdown = {k: v for k, v in expected.items() if k != "order"}
    breakdown.update({"folded_weight_casts": written.folded, "half_initializers": written.n_half,
                      "fp32_initializers": written.n_fp32, "identity_casts_removed": written.identity,
                      "named_after_fx": written.matched["in_order"]})
    return OnnxResult(
        path=path, precision=target, opset=opset, exporter=used, cast_count=written.cast_count,
        expected_casts=expected["expected"], cast_pairs=written.pairs, max_abs_error=run.max_err, fp32_size=fp32_size,
        size=size, size_ratio=ratio, ok=all(checks[k] for k in VERDICT_CHECKS if k in checks), notes=notes,
        verified=run.verified, conversion_precision=conv.precision, tolerance=run.tol, cast_breakdown=breakdown,
        checks=checks, fp32_cast_count=fp32_casts, differences=differences,
    )


@dataclass
class _Written:
    """What post-processing did to the exported model, and the Casts the FX graph implies."""

    expected: dict
    matched: dict
    folded: int
    identity: int
    renamed: int
    cast_count: int = 0
    pairs: list = field(default_factory=list)
    n_half: int = 0
    n_fp32: int = 0
    target: str = ""


def _postprocess(model, gm: torch.fx.GraphModule, *, target: str, conversion_precision: str,
                 keep_debug_metadata: bool) -> _Written:
    """Fold weight casts, drop identity casts, name the Casts after the FX casts, set the metadata."""
    folded = _fold_initializer_casts(model)
    identity = _drop_identity_casts(model)
    expected = expected_casts(gm)
    matched = _match_casts(model, expected["order"])
    renamed = _unique_node_names(model)
    if not keep_debug_metadata:
        _strip_debug_metadata(model)
    _set_model_metadata(model, {
        "mpconvert.precision": target,
        "mpconvert.conversion_precision": conversion_precision,
        "mpconvert.expected_casts": str(expected["expected"]),
    })
    n_half, n_fp32, _ = _half_initializers(model)
    return _Written(expected=expected, matched=matched, folded=folded, identity=identity, renamed=renamed,
                    cast_count=len(onnx_casts(model)), pairs=cast_pairs(model), n_half=n_half, n_fp32=n_fp32,
                    target=target)


def _static_checks(model, path: Path, written: _Written, notes: list[str]) -> tuple[dict[str, bool], list[str]]:
    """The checker (a verdict check) and the structural checks (information), with their notes."""
    import onnx

    checks: dict[str, bool] = {}
    differences: list[str] = []
    try:
        onnx.checker.check_model(str(path), full_check=True)  # the written file, external data included
        checks["checker"] = True
    except Exception as exc:  # reported as a failed check
        checks["checker"] = False
        notes.append(f"onnx.checker failed: {exc}")
    inputs, outputs = _io_dtypes(model)
    half_io = [f"{n} ({d})" for n, d in inputs + outputs if d in ("fp16", "bf16")]
    checks["io_fp32"] = not half_io
    if half_io:
        differences.append(f"graph inputs/outputs in half precision: {', '.join(half_io)}")
    names = [n.name for g in _all_graphs(model.graph) for n in g.node]
    checks["unique_names"] = len(names) == len(set(names)) and all(names)
    casts = onnx_casts(model)
    castlike = [c.name for c in casts if c.op_type == "CastLike"]
    if castlike:
        notes.append(f"{len(castlike)} CastLike node(s) counted as casts: {', '.join(castlike[:5])}")
    expected, matched = written.expected, written.matched
    checks["cast_count"] = len(casts) == expected["expected"]
    checks["no_cast_pairs"] = not written.pairs
    if written.pairs:
        differences.append("Cast→Cast round trips: " + ", ".join(f"{a}→{b}" for a, b in written.pairs))
    checks["cast_dtypes_match_fx"] = matched["dtypes_match"]
    if not checks["cast_count"] or not matched["dtypes_match"]:
        differences.append(_cast_difference(len(casts), expected, matched))
    elif not matched["in_order"]:
        notes.append("the Casts convert what the FX graph says but not in its order; they keep the exporter's names")
    if written.renamed:
        notes.append(f"{written.renamed} node(s) renamed to make every node name unique")
    _, _, only_half_use = _half_initializers(model)
    checks["half_initializers"] = not only_half_use
    if only_half_use:
        differences.append(f"fp32 initializers consumed only through half casts: {', '.join(only_half_use[:5])}")
    notes.append(_cast_explanation(len(casts), expected, written.folded, written.n_half, written.n_fp32, written.target))
    notes.extend(f"information (not a failure): {d}" for d in differences)
    return checks, differences


def _type_name(t: Optional[int]) -> str:
    return _ONNX_TYPE_NAMES.get(t, f"type {t}")


def _cast_difference(count: int, expected: dict, matched: dict) -> str:
    """Why the Casts of the export differ from the FX graph's, as far as the FX graph tells.

    A Cast the FX graph has and the export lacks is put down to the exporter's constant folding
    when the value it casts depends on no graph input (rotary-embedding tables, masks built from
    the example's fixed shape); any other difference is reported as added or dropped by the exporter.
    """
    order = expected["order"]
    got = collections.Counter(matched["onnx"])
    want = collections.Counter((_onnx_type(e.src), _onnx_type(e.dst)) for e in order)
    parts = []
    for pair, n in sorted((want - got).items(), key=str):
        what = f"{_type_name(pair[0])}→{_type_name(pair[1])}"
        entries = [e for e in order if (_onnx_type(e.src), _onnx_type(e.dst)) == pair]
        constant = [e.name for e in entries if e.constant]
        folded = min(n, len(constant))
        if folded:
            parts.append(f"the exporter's optimizer folded {folded} {what} Cast(s) of values computed from constants "
                         f"only ({', '.join(constant[:4])}{', ...' if len(constant) > 4 else ''})")
        if n > folded:
            others = [e.name for e in entries if not e.constant]
            parts.append(f"the exporter dropped or merged {n - folded} {what} Cast(s) of the FX graph "
                         f"(among {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})")
    for pair, n in sorted((got - want).items(), key=str):
        parts.append(f"the exporter added {n} {_type_name(pair[0])}→{_type_name(pair[1])} Cast(s) the FX graph does not have")
    head = (f"Cast count {count} differs from the {expected['expected']} the FX graph implies"
            if count != expected["expected"] else "Cast dtypes differ from the FX graph's")
    return f"{head}: {'; '.join(parts) or 'the exporter reordered them'}"


@dataclass
class _Verified:
    """The onnxruntime comparison: its check, the error, the tolerance, and whether it matched."""

    checks: dict = field(default_factory=dict)
    max_err: Optional[float] = None
    tol: Optional[float] = None
    verified: bool = False


def _verify(path: Path, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, target: str, notes: list[str]) -> _Verified:
    """Run the written file on onnxruntime and compare with ``gm`` (skipped for bf16 without a GPU provider)."""
    provider = "CPUExecutionProvider"
    if target == "bf16":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            why = _bf16_cpu_failure(path)
            notes.append(f"CPU verification skipped for the bf16 export: {BF16_CPU_REASON}"
                         + (f"; onnxruntime says: {why}" if why else "")
                         + ". Run it with a GPU provider (CUDAExecutionProvider), or export precision='fp16' to verify on CPU")
            return _Verified()
        provider = "CUDAExecutionProvider"
    out = _Verified()
    try:
        got = _run_ort(path, args, kwargs, provider)
        ref = _reference(gm, args, kwargs)
        out.max_err, scale = _compare(got, ref)
        out.tol = tolerance_for(target, scale)
    except Exception as exc:  # a failed run is a failed check, with its reason
        out.checks["ort_match"] = False
        notes.append(f"onnxruntime run failed: {type(exc).__name__}: {str(exc)[:300]}")
        return out
    out.verified = out.checks["ort_match"] = out.max_err <= out.tol
    verdict = "match" if out.verified else "MISMATCH"
    notes.append(f"onnxruntime ({provider}) vs conv.module: {verdict}, max abs error {out.max_err:.3g} "
                 f"(tolerance {out.tol:.3g} = {TOLERANCE_ULPS} {target} ulps at max|ref| = {scale:.3g})")
    return out


def _size_notes(size: int, fp32_size: Optional[int], fp32_casts: Optional[int], expected: dict,
                notes: list[str]) -> Optional[float]:
    """The size ratio to the fp32 export (None when it could not be exported), with notes."""
    ratio = None
    if fp32_size:
        ratio = size / fp32_size
        notes.append(f"file size {_mib(size)} = {ratio:.3f}× the fp32 export ({_mib(fp32_size)})")
    if fp32_casts is not None and fp32_casts != expected["model-nonfloat"]:
        notes.append(f"the fp32 export has {fp32_casts} Cast(s) where the FX graph has "
                     f"{expected['model-nonfloat']} non-float cast(s) of the model's own")
    return ratio


def _cast_explanation(count: int, expected: dict, folded: int, n_half: int, n_fp32: int, target: str) -> str:
    text = (f"{count} Cast node(s), expected {expected['expected']}: {expected['inserted']} inserted on activations"
            f" + {expected['model']} of the model's own that change float dtype"
            f" + {expected['implicit']} implicit promotion(s) (a promote op such as a residual add with an fp32 and a "
            f"half input: the rewrite inserts no cast because torch promotes natively, ONNX needs one)"
            f" + {expected['model-nonfloat']} of the model's own on integer/bool tensors (in the fp32 model too); "
            f"the {expected['weight']} weight cast(s) of the FX graph are not Casts: the weights are stored as "
            f"{n_half} {target} initializer(s) ({n_fp32} stay fp32: norms, embeddings and other fp32 consumers)")
    if folded:
        text += f"; {folded} Cast(s) on initializers were folded into {target} initializers after export"
    return text


def _bf16_cpu_failure(path: Path) -> str:
    """The error onnxruntime's CPU provider gives for the bf16 model ('' if it loads)."""
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # the message is the point
        return str(exc).strip().splitlines()[0][:300]
    return ""
