"""Verification of a written ONNX file with onnxruntime: its outputs against ``conv.module``'s.

:func:`verify_with_ort` runs the file on onnxruntime's CPU provider (CUDA for bf16, which the CPU
provider has no kernels for: without it the run is skipped, :data:`BF16_CPU_REASON`), runs the
converted module in eval mode on the same inputs and compares the floating outputs with
:func:`tolerance_for`: :data:`TOLERANCE_ULPS` ulps of the half dtype at the output's largest magnitude.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, cast

import torch
import torch.fx

from converter.export.onnx_exporter import quiet_deepcopy, set_eval
from converter.numerics.common import output_tensors, sqnr_db

__all__ = ["BF16_CPU_REASON", "MANTISSA_BITS", "TOLERANCE_ULPS", "REFERENCE_MIN_SQNR_DB",
           "tolerance_for", "Verified", "verify_with_ort", "verify_with_reference", "run_ort"]

#: why a bf16 model is not run on onnxruntime's CPU provider
BF16_CPU_REASON = (
    "onnxruntime's CPU execution provider has no bf16 compute kernels "
    "(MatMul/Gemm/Add in bf16 fail with NOT_IMPLEMENTED, onnxruntime#26311)"
)

#: explicit mantissa bits of each half dtype (an ulp at 1.0 is 2**-bits)
MANTISSA_BITS = {"fp16": 10, "bf16": 7}
#: the ORT-vs-torch tolerance, in ulps of the half dtype at the output's largest magnitude
TOLERANCE_ULPS = 3
#: the SQNR that the reference evaluator's outputs of an fp8 export must reach against ``conv.module``
#: (:func:`verify_with_reference`). Not ulps: the file's bf16 ops round differently from torch's (MatMul then
#: Add where torch fuses addmm, attention decomposed), about one bf16 ulp as for any bf16 export (a bf16
#: export matches at 47-49 dB), and each fp8 linear's quantisation turns such a one-ulp difference of its
#: input into a one-ulp float8 difference (16x larger) wherever it sits near a rounding boundary; norms
#: amplify both. Measured: 35.6-36.8 dB on the zoo's llama, 46.3-46.5 dB on a two-block decoder, and
#: bit-equal where every linear runs fp8 (no bf16 op upstream of a quantisation); the fp8 conversion itself
#: is 24-40 dB from the bf16 one. A float8 Q/DQ that quantised differently (another scale, e5m2, no
#: saturation) falls below it; Q/DQ dropped altogether is caught by the ``fp8_qdq`` check.
REFERENCE_MIN_SQNR_DB = 30.0


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
    bits = MANTISSA_BITS[precision]
    scale = max(float(reference_scale), 2.0 ** -14)
    return TOLERANCE_ULPS * 2.0 ** (math.floor(math.log2(scale)) - bits)


def _feeds(names: list[str], args: tuple, kwargs: dict) -> dict:
    """The example inputs by the model's input names: keyword arguments by name, the rest in order."""
    positional = [a for a in output_tensors(args)]
    feeds = {}
    for name in names:
        if name in kwargs and isinstance(kwargs[name], torch.Tensor):
            tensor = kwargs[name]
        elif positional:
            tensor = positional.pop(0)
        else:
            remaining = [v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in feeds]
            if not remaining:
                raise ValueError(f"no example input for the ONNX input {name!r}")
            tensor = remaining[0]
        feeds[name] = tensor.detach().cpu().numpy()
    return feeds


def run_ort(path: Path, args, kwargs, provider: str) -> list:
    """Run the written file (external weights included) on ``provider``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=[provider])
    return session.run(None, _feeds([i.name for i in session.get_inputs()], args, kwargs))


def _reference(conv_module: torch.fx.GraphModule, args, kwargs) -> list[torch.Tensor]:
    ref = quiet_deepcopy(conv_module)
    set_eval(ref)
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


@dataclass
class Verified:
    """The onnxruntime comparison: its check, the error, the tolerance, and whether it matched."""

    checks: dict = field(default_factory=dict)
    max_err: Optional[float] = None
    tol: Optional[float] = None
    verified: bool = False
    sqnr_db: Optional[float] = None


def verify_with_ort(path: Path, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, target: str, notes: list[str]) -> Verified:
    """Run the written file on onnxruntime and compare with ``gm`` (skipped for bf16 without a GPU provider)."""
    provider = "CPUExecutionProvider"
    if target == "bf16":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            why = _bf16_cpu_failure(path)
            notes.append(f"CPU verification skipped for the bf16 export: {BF16_CPU_REASON}"
                         + (f"; onnxruntime says: {why}" if why else "")
                         + ". Run it with a GPU provider (CUDAExecutionProvider), or export precision='fp16' to verify on CPU")
            return Verified()
        provider = "CUDAExecutionProvider"
    out = Verified()
    try:
        got = run_ort(path, args, kwargs, provider)
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


def verify_with_reference(path: Path, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, target: str,
                          notes: list[str]) -> Verified:
    """Run the written file with ``onnx.reference.ReferenceEvaluator`` and compare with ``gm`` (check
    ``reference_match``): for an fp8 conversion's file, which onnxruntime's CPU provider cannot run (its bf16
    ops; the provider's error is quoted in the notes). The verdict is :data:`REFERENCE_MIN_SQNR_DB` (see there
    why an SQNR and not ulps); the max abs error is reported."""
    from onnx.reference import ReferenceEvaluator

    why = _bf16_cpu_failure(path) if target == "bf16" else ""
    if why:
        notes.append(f"onnxruntime's CPU provider cannot run this file ({why}); verified with onnx.reference."
                     "ReferenceEvaluator instead")
    out = Verified()
    try:
        evaluator = ReferenceEvaluator(str(path))
        got = cast(list[Any], evaluator.run(None, _feeds(evaluator.input_names, args, kwargs)))  # (all outputs: a list)
        ref = _reference(gm, args, kwargs)
        out.max_err, scale = _compare(got, ref)
        out.sqnr_db = _outputs_db(got, ref)
    except Exception as exc:  # a failed run is a failed check, with its reason
        out.checks["reference_match"] = False
        notes.append(f"onnx.reference run failed: {type(exc).__name__}: {str(exc)[:300]}")
        return out
    out.verified = out.checks["reference_match"] = math.isfinite(out.max_err) and out.sqnr_db >= REFERENCE_MIN_SQNR_DB
    verdict = "match" if out.verified else "MISMATCH"
    notes.append(f"onnx.reference.ReferenceEvaluator vs conv.module: {verdict}, SQNR {out.sqnr_db:.1f} dB (at least "
                 f"{REFERENCE_MIN_SQNR_DB:g} dB), max abs error {out.max_err:.3g} at max|ref| = {scale:.3g}")
    return out


def _outputs_db(outputs: list, reference: list[torch.Tensor]) -> float:
    """SQNR in dB of the floating outputs against the reference, all outputs together (the one
    :func:`converter.numerics.common.sqnr_db` over their concatenation)."""
    pairs = [(ref, torch.as_tensor(got)) for got, ref in zip(outputs, reference) if ref.is_floating_point()]
    if not pairs:
        return math.inf
    return sqnr_db(torch.cat([r.double().reshape(-1) for r, _ in pairs]), torch.cat([g.double().reshape(-1) for _, g in pairs]))
