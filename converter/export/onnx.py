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

fp8
    An fp8 conversion (``options.fp8_recipe`` set) exports itself, bf16, with each fp8 linear as float8e4m3fn
    QuantizeLinear/DequantizeLinear around an fp32 MatMul (:mod:`~converter.export.onnx_fp8`; dynamo
    exporter only). onnxruntime's CPU provider cannot run its bf16 ops, so it is verified with
    ``onnx.reference.ReferenceEvaluator`` (:func:`~converter.export.onnx_verify.verify_with_reference`:
    verdict check ``reference_match``, an SQNR floor), and ``fp8_qdq`` (a verdict check too) asks for the
    Q/DQ chain of every fp8 linear and no other Q/DQ. What it cannot write (``blockwise``, an fp16 export,
    TorchScript, opset < 20) is refused with :class:`~converter.export.onnx_fp8.Fp8OnnxRefused` (exit 2)
    before anything is written.

Modules
    This module is the entry point (:func:`export_onnx`, :class:`OnnxResult`) and runs the steps;
    :mod:`~converter.export.onnx_exporter` calls ``torch.onnx.export`` (with the fallback) and writes
    the file, :mod:`~converter.export.onnx_graph` inspects and post-processes the ONNX graph,
    :mod:`~converter.export.onnx_fx_casts` reads the expected Casts from the FX graph and compares,
    :mod:`~converter.export.onnx_verify` runs onnxruntime and compares with ``conv.module``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.fx

from converter.export.onnx_exporter import OnnxExportError, export_copy, export_model, fp32_export, save_model
from converter.export.onnx_fp8 import (
    Fp8OnnxRefused,
    check_fp8_export,
    fp8_checks,
    name_fp8_nodes,
    prepare_fp8,
    translation_table,
)
from converter.export.onnx_fx_casts import cast_difference, cast_explanation, expected_casts, match_casts
from converter.export.onnx_graph import (
    all_graphs,
    cast_pairs,
    drop_identity_casts,
    fold_initializer_casts,
    half_initializers,
    io_dtypes,
    onnx_casts,
    set_model_metadata,
    strip_debug_metadata,
    unique_node_names,
)
from converter.export.onnx_verify import (
    BF16_CPU_REASON,
    MANTISSA_BITS,
    REFERENCE_MIN_SQNR_DB,
    TOLERANCE_ULPS,
    Verified,
    tolerance_for,
    verify_with_ort,
    verify_with_reference,
)
from converter.ir.meta import GM_PARAM_DTYPES
from converter.numerics.common import to_json
from converter.passes.cpu_gemm import native_gemms
from converter.vocab import HALF_PRECISIONS, precision

__all__ = [
    "DEFAULT_OPSET",
    "OnnxResult",
    "OnnxExportError",
    "Fp8OnnxRefused",
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

#: the checks that decide ``OnnxResult.ok``: a valid file whose onnxruntime outputs (the reference
#: evaluator's, for an fp8 conversion) match ``conv.module``, and for an fp8 conversion exactly the float8
#: Q/DQ nodes of its fp8 linears; every other check is information (see the module docstring)
VERDICT_CHECKS = ("checker", "ort_match", "reference_match", "fp8_qdq")


@dataclass
class OnnxResult:
    """What :func:`export_onnx` wrote and what its verification found.

    ``ok`` is True when every check of :data:`VERDICT_CHECKS` that ran passed: the file is valid
    and, when onnxruntime ran it, its outputs match ``conv.module``. The structural checks (Cast
    count, Cast dtypes, round trips, fp32 I/O, half initializers) are in ``checks`` too, and a
    difference there is listed in ``differences`` with its cause, as information. ``verified`` is
    True when onnxruntime ran the model and its outputs matched ``conv.module``; it is False for a
    bf16 export (CPU has no bf16 kernels) or when ``verify=False``. For an fp8 conversion the
    reference evaluator runs it instead (``verified`` as for onnxruntime); ``fp8`` holds its recipe,
    layers and Q/DQ counts, ``sqnr_db`` the reference evaluator's SQNR against ``conv.module``.
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
    fp8: dict = field(default_factory=dict)
    sqnr_db: Optional[float] = None

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
        if self.fp8:
            parts.append(f"fp8 {self.fp8['recipe']}: {self.fp8['layers']} linear(s) as float8e4m3fn Q/DQ "
                         f"({self.fp8['QuantizeLinear']} QuantizeLinear, {self.fp8['DequantizeLinear']} DequantizeLinear)")
        if "reference_match" in self.checks and self.sqnr_db is not None:
            parts.append(f"onnx.reference vs conv.module: SQNR {self.sqnr_db:.1f} dB (at least {REFERENCE_MIN_SQNR_DB:g}), "
                         f"max abs error {self.max_abs_error:.3g}")
        elif self.max_abs_error is not None:
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
# the public entry point


def choose_precision(conversion_precision: str, requested: Optional[str]) -> tuple[str, list[str]]:
    """The dtype to export, and a note when it is not the conversion's own.

    ``requested``: ``"fp16"``, ``"bf16"`` or None (already normalised: aliases are read by
    :func:`converter.vocab.precision`). None exports the conversion's dtype, except that a
    bf16 conversion exports its fp16 variant (onnxruntime's CPU provider has no bf16 kernels).
    """
    if requested is not None:
        return precision(requested, allowed=HALF_PRECISIONS), []
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
    both exports, so that the size comparison measures the weights). An fp8 ``source`` is written with
    float8 Q/DQ GEMMs and verified with the reference evaluator (module docstring, "fp8").
    """
    if exporter not in ("auto", "dynamo", "torchscript"):
        raise ValueError(f"exporter must be 'auto', 'dynamo' or 'torchscript', got {exporter!r}")
    source = conv if source is None else source
    target = source.precision
    if target not in MANTISSA_BITS:
        raise ValueError(f"unknown precision {target!r}; use fp16 or bf16")
    path = Path(path)
    notes = list(notes)
    gm = source.module
    fp8 = source.options.fp8_recipe is not None
    check_fp8_export(gm, fp8=fp8, precision=None, exporter=exporter, opset=opset,  # before anything is written
                     example_inputs=source.example_inputs)
    args, kwargs = source.example_inputs  # (args, kwargs), normalised by capture
    module = export_copy(gm, gm.meta.get(GM_PARAM_DTYPES, {}))
    native_gemms(module)  # a CPU conversion's upcast GEMM kernels: plain half MatMuls in the file
    layers = prepare_fp8(module) if fp8 else []
    model, used = export_model(module, args, kwargs, opset=opset, exporter="dynamo" if layers else exporter, notes=notes,
                               translations=translation_table() if layers else None)
    roles = name_fp8_nodes(model, layers)
    written = _postprocess(model, gm, target=target, conversion_precision=conv.precision,
                           keep_debug_metadata=keep_debug_metadata, fp8=layers[0].recipe if layers else None)
    size = save_model(model, path)
    checks, differences = _static_checks(model, path, written, notes)
    fp8_info = fp8_checks(model, layers, roles, checks, notes) if layers else {}
    if not verify:
        run = Verified()
        notes.append("verification with onnxruntime not requested (verify=False)")
    elif fp8:
        run = verify_with_reference(path, gm, args, kwargs, target, notes)
    else:
        run = verify_with_ort(path, gm, args, kwargs, target, notes)
    checks.update(run.checks)
    fp32_size = fp32_casts = ratio = None
    if compare_size:
        fp32_size, fp32_casts = fp32_export(source, args, kwargs, opset=opset, exporter=used, notes=notes,
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
        checks=checks, fp32_cast_count=fp32_casts, differences=differences, fp8=fp8_info, sqnr_db=run.sqnr_db,
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
                 keep_debug_metadata: bool, fp8: Optional[str] = None) -> _Written:
    """Fold weight casts, drop identity casts, name the Casts after the FX casts, set the metadata.

    ``fp8``: the recipe of the model's fp8 linears (None: none). A Cast pair with an fp8 linear's own Cast
    is not a round trip: its input Cast to fp32 reads the bf16 Cast placement put before it (the kernel
    quantises the bf16-rounded input), and a Cast after it reads its output, which the kernel rounds to bf16."""
    folded = fold_initializer_casts(model)
    identity = drop_identity_casts(model)
    expected = expected_casts(gm)
    matched = match_casts(model, expected["order"])
    renamed = unique_node_names(model)
    if not keep_debug_metadata:
        strip_debug_metadata(model)
    set_model_metadata(model, {
        "mpconvert.precision": target,
        "mpconvert.conversion_precision": conversion_precision,
        "mpconvert.expected_casts": str(expected["expected"]),
        **({"mpconvert.fp8_recipe": fp8} if fp8 else {}),
    })
    n_half, n_fp32, _ = half_initializers(model)
    pairs = [p for p in cast_pairs(model) if not (fp8 and (p[1].endswith("/x_to_fp32") or p[0].endswith("/to_half"))
                                                   and (p[0] + p[1]).count("fp8/") == 1)]
    return _Written(expected=expected, matched=matched, folded=folded, identity=identity, renamed=renamed,
                    cast_count=len(onnx_casts(model)), pairs=pairs, n_half=n_half, n_fp32=n_fp32,
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
    inputs, outputs = io_dtypes(model)
    half_io = [f"{n} ({d})" for n, d in inputs + outputs if d in HALF_PRECISIONS]
    checks["io_fp32"] = not half_io
    if half_io:
        differences.append(f"graph inputs/outputs in half precision: {', '.join(half_io)}")
    names = [n.name for g in all_graphs(model.graph) for n in g.node]
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
        differences.append(cast_difference(len(casts), expected, matched))
    elif not matched["in_order"]:
        notes.append("the Casts convert what the FX graph says but not in its order; they keep the exporter's names")
    if written.renamed:
        notes.append(f"{written.renamed} node(s) renamed to make every node name unique")
    _, _, only_half_use = half_initializers(model)
    checks["half_initializers"] = not only_half_use
    if only_half_use:
        differences.append(f"fp32 initializers consumed only through half casts: {', '.join(only_half_use[:5])}")
    notes.append(cast_explanation(len(casts), expected, written.folded, written.n_half, written.n_fp32, written.target))
    notes.extend(f"information (not a failure): {d}" for d in differences)
    return checks, differences


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
