"""Portable graphs: kernels that choose per device at run time (a conversion that names no device).

``convert(model, x)`` (the CLI's default) does not know where the model will run. The device lowerings of
``convert(device="cpu")`` (:mod:`converter.passes.lower`, :mod:`converter.passes.cpu_gemm`) would be wrong on a
GPU: they replace fused attention and tensor-core GEMMs. Without them, a bf16 graph on a CPU runs the slow
fused bf16 attention and, without AMX, half GEMMs slower than fp32's (the large benchmark encoder: 1.01x
autocast's step). This stage, run after *rewrite* (and the fp8 stage) for a portable conversion, points
the calls whose best kernel depends on the device at torch-only kernels that decide per call, from the
tensors they get:

* each half ``scaled_dot_product_attention`` calls :func:`converter.kernels.upcast.dispatch_attention`: on a
  CPU whose half GEMM measures slower than fp32's, the attention in fp32 arithmetic on the upcast operands
  (faster than the fused half kernel there, at least as accurate, saving what it saves); the fused op
  elsewhere;
* each half linear/matmul of at least :data:`converter.passes.cpu_gemm.MIN_GEMM_FLOPS` per matrix product calls
  :func:`converter.kernels.upcast.dispatch_linear` / :func:`~converter.kernels.upcast.dispatch_matmul`: the
  upcast kernels on a CPU whose half GEMM measures slower than fp32's, the native GEMM elsewhere.

The kernels take the original call's arguments, so a node keeps its arguments, decision and report row;
its decision gains a ``lower`` note, and each choice is one entry of ``report.json["lowering"]``
(``dispatch_attention``, ``dispatch_gemm``). The ONNX export points them back at the plain ops
(:func:`converter.passes.cpu_gemm.native_gemms`); model.py carries their source.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

from converter.ir.meta import META_DECISION, META_INFO
from converter.kernels.upcast import dispatch_attention, upcast_attention
from converter.passes.cpu_gemm import DISPATCH_TARGETS, gemm_choice, upcast_gemms
from converter.passes.lower import LoweringChoice
from converter.vocab import HALF_PRECISIONS

__all__ = ["dispatch_kernels", "dispatch_attention_calls"]

_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_ATTENTION_WHY = ("runs dispatch_attention: on a CPU whose half GEMM measures slower than fp32's (no AMX) the fused half "
                  "kernel is 2-4x slower, so it runs in fp32 arithmetic on the exactly upcast operands (rounded once; "
                  "q, k, v saved, less than the fused kernel saves); the fused op elsewhere")
_UPCAST_ATTENTION_WHY = ("runs upcast_attention: this CPU's half GEMM measured slower than its fp32 GEMM, where the fused "
                         "half kernel is 2-4x slower: in fp32 arithmetic on the exactly upcast operands (rounded once; "
                         "q, k, v saved, less than the fused kernel saves)")
_GEMM_WHY = ("a portable graph: on a CPU whose half GEMM measures slower than its fp32 GEMM (no AMX) it runs as fp32 "
             "GEMMs on upcast operands, half results, half operands saved; on CUDA and fast-half CPUs the native GEMM")


def dispatch_kernels(gm: torch.fx.GraphModule, precision: str,
                     min_flops: Optional[int] = None) -> tuple[list[str], list[dict[str, Any]]]:
    """Point the device-dependent calls of a portable graph at the dispatching kernels (module docstring).
    Returns the names of the nodes changed and the choices for ``report.json["lowering"]``. Not run when
    ``ConvertOptions.dispatch_kernels`` is False (the plain calls stay: benchmarks' ablation). ``min_flops``: the
    smallest GEMM that gets a dispatching kernel (the device profile's measured crossover; None:
    :data:`~converter.passes.cpu_gemm.MIN_GEMM_FLOPS`); at run time each call also checks the running CPU's own."""
    changed: list[str] = []
    choices: list[dict[str, Any]] = []
    if precision in HALF_PRECISIONS:
        changed, choices = dispatch_attention_calls(gm, precision)
        gemms, small = upcast_gemms(gm, precision, _GEMM_WHY, targets=DISPATCH_TARGETS, min_flops=min_flops)
        changed += gemms
        choices.append(gemm_choice("dispatch_gemm", precision, gemms, small, _GEMM_WHY, min_flops))
    return changed, choices


def dispatch_attention_calls(gm: torch.fx.GraphModule, precision: str, *,
                             measured: bool = True) -> tuple[list[str], list[dict[str, Any]]]:
    """Point each ``precision`` (fp16/bf16) ``scaled_dot_product_attention`` call at ``dispatch_attention`` (the same
    arguments). ``measured=False``: at ``upcast_attention`` (no run-time measurement), for ``convert(device="cpu")``
    on a CPU whose half GEMM measured slow. Returns the names of the nodes changed and their choices
    (``dispatch_attention`` / ``upcast_attention``)."""
    kernel, why = (dispatch_attention, _ATTENTION_WHY) if measured else (upcast_attention, _UPCAST_ATTENTION_WHY)
    changed, choices = [], []
    for node in gm.graph.nodes:
        info, decision = node.meta.get(META_INFO), node.meta.get(META_DECISION)
        if (node.op != "call_function" or node.target not in _SDPA or info is None or decision is None
                or decision.precision != precision or len(node.args) > len(_SDPA_PARAMS)
                or set(node.kwargs) - set(_SDPA_PARAMS)):
            continue
        node.target = kernel  # the same arguments
        node.meta[META_DECISION] = decision.noted("lower", why)
        changed.append(node.name)
        choices.append(LoweringChoice(node.name, kernel.__name__, True, why).to_dict())
    if changed:  # the same arguments: nothing for lint to find
        gm.recompile()
    return changed, choices
