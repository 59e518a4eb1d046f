"""CPU GEMM kernels: half GEMMs through fp32 kernels where this CPU's half GEMM is the slower one.

A lowering of ``convert(device="cpu")``, run after *rewrite* (and the fp8 stage), before *simplify*. On a
CPU without AMX, oneDNN's bf16 GEMM is slower than its fp32 GEMM (this project's 2-core Xeon with
AVX512-BF16: 1.6-1.8x on the benchmark encoders' large shapes, 4.5x on a 128x128 probe), so a bf16 model runs
its GEMMs slower than fp32 does, and so does torch.autocast. Each linear and matmul the conversion runs in
that half dtype becomes a call of :func:`converter.kernels.upcast.upcast_linear` /
:func:`~converter.kernels.upcast.upcast_matmul`: the same half operands in, the same half result out
(the product of two half numbers is exact in fp32, so an fp32 GEMM with fp32 accumulation computes what
the half GEMM computes, up to summation order), the half operands saved for backward, an fp32 GEMM in
between. On the large benchmark encoder (d512, B8xT128, O2 bf16) the step goes from 0.90x to 0.67x autocast's
(``benchmarks/run.py --ablate``: ``O2-native-gemm``). GEMMs below :data:`MIN_GEMM_FLOPS` per matrix product
(the small encoder's, and batched attention matmuls) stay native: there the kernel's fixed cost wins.

**The choice** is measured, not guessed: the conversion's device profile
(:class:`~converter.numerics.profile.DeviceProfile`, ``ConvertOptions.device_profile``) holds a 128x128 matmul
timed in the half dtype and in fp32 (by default measured in this process; a saved profile for another machine).
The stage applies when the half GEMM is at least :data:`MIN_SLOWDOWN` times slower.
``ConvertOptions.upcast_half_gemms`` forces it either way (tests, benchmarks), and without a profile
(``device_profile=None``: no measurement) the stage does not apply. The
choice, with the measured factor, is one entry of ``report.json["lowering"]`` per graph
(``lowering: "upcast_gemm"``), and each rewritten node's decision gains a ``lower`` note saying why.

The kernels are torch-only; model.py carries their source (``converter.export.functions``), so the emitted
model runs where only torch is installed.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

from converter.ir.graphmodule import retarget_calls
from converter.ir.meta import META_DECISION, META_VALUE, Decision, TensorSpec
from converter.kernels.upcast import (
    DEFAULT_MIN_GEMM_FLOPS,
    MIN_SLOWDOWN,
    dispatch_attention,
    dispatch_linear,
    dispatch_matmul,
    upcast_attention,
    upcast_linear,
    upcast_matmul,
)
from converter.passes.lower import LoweringChoice
from converter.vocab import HALF_PRECISIONS

__all__ = ["MIN_SLOWDOWN", "MIN_GEMM_FLOPS", "UPCAST_TARGETS", "DISPATCH_TARGETS", "upcast_wanted",
           "gemm_flops", "profile_gate", "upcast_gemms", "gemm_choice", "native_gemms"]
#: a GEMM call whose one matrix product (2·M·K·N at the example's shapes) is below this stays native: the
#: kernel's fixed cost (an autograd Function, the upcasts) outweighs the faster fp32 GEMM. Measured on the 2-core
#: Xeon, forward + backward of one linear, upcast / native: 1.72 at 1 MFLOP (32x128x128), 1.49 at 4 MFLOP,
#: 1.00 at 17 MFLOP (128x128x512), 0.77 at 34 MFLOP, 0.60-0.67 from 268 MFLOP; a batched attention matmul
#: (64 x 128x64x128, 2 MFLOP per matrix) 1.30
MIN_GEMM_FLOPS = DEFAULT_MIN_GEMM_FLOPS
_aten = torch.ops.aten
#: the call targets the stage replaces, and by what
UPCAST_TARGETS = {
    F.linear: upcast_linear,
    _aten.linear.default: upcast_linear,
    torch.matmul: upcast_matmul,
    _aten.matmul.default: upcast_matmul,
    torch.bmm: upcast_matmul,
    _aten.bmm.default: upcast_matmul,
    torch.mm: upcast_matmul,
    _aten.mm.default: upcast_matmul,
}
#: the same calls in a portable graph: kernels that choose per device at run time (:mod:`converter.passes.dispatch`)
DISPATCH_TARGETS = {target: dispatch_linear if kernel is upcast_linear else dispatch_matmul
                    for target, kernel in UPCAST_TARGETS.items()}
_LINEAR_KERNELS = (upcast_linear, dispatch_linear)
_HALF = HALF_PRECISIONS


def upcast_wanted(slowdown: Optional[float], forced: Optional[bool] = None) -> tuple[bool, str]:
    """Whether to apply the stage, and why in words, from the profile's half/fp32 GEMM time ratio
    (None: no profile) and ``forced`` (``ConvertOptions.upcast_half_gemms``)."""
    if forced is not None:
        return forced, f"forced {'on' if forced else 'off'} (ConvertOptions.upcast_half_gemms={forced})"
    if slowdown is None:
        return False, "not measured (device_profile=None): the half GEMMs stay native"
    if slowdown >= MIN_SLOWDOWN:
        return True, (f"this CPU's half GEMM measured {slowdown:.1f}x the fp32 GEMM's time (>= {MIN_SLOWDOWN}): the "
                      "half GEMMs run as fp32 GEMMs on upcast operands, half results, half operands saved")
    return False, f"this CPU's half GEMM measured {slowdown:.2f}x the fp32 GEMM's time (< {MIN_SLOWDOWN}): native half GEMMs"


def _operands(node: torch.fx.Node, kernel) -> Optional[tuple]:
    """The call's operands by position, ``(input, weight, bias)`` or ``(input, other)``; None when it passes
    anything else (``out=``) or too few."""
    names = ("input", "weight", "bias") if kernel in _LINEAR_KERNELS else ("input", "other", "mat2")
    if set(node.kwargs) - set(names):
        return None
    args = list(node.args)
    found = [node.kwargs.get(name, args[i] if i < len(args) else None) for i, name in enumerate(names[:2])]
    if kernel in _LINEAR_KERNELS:
        found.append(node.kwargs.get("bias", args[2] if len(args) > 2 else None))
    elif found[1] is None:
        found[1] = node.kwargs.get("mat2")
    return None if found[0] is None or found[1] is None else tuple(found)


def gemm_flops(node: torch.fx.Node, args: tuple) -> Optional[int]:
    """``2·M·K·N`` of one matrix product of the call at the example's shapes (a batched matmul: of one of its
    matrices), from the shapes capture recorded; None when they are not known."""
    out, first = node.meta.get(META_VALUE), getattr(args[0], "meta", {}).get(META_VALUE)
    if not (isinstance(out, TensorSpec) and isinstance(first, TensorSpec) and out.shape and first.shape):
        return None
    k = first.shape[-1]
    if node.target in (F.linear, _aten.linear.default):
        return 2 * out.numel * k
    if len(out.shape) < 2:
        return None
    return 2 * out.shape[-2] * out.shape[-1] * k


def profile_gate(profile, precision: str) -> Optional[int]:
    """The smallest GEMM (2·M·K·N) the stage rewrites: the device profile's measured crossover for ``precision``
    (:meth:`~converter.numerics.profile.DeviceProfile.min_gemm_flops`); None (:data:`MIN_GEMM_FLOPS`) without a
    profile, or where it measured none."""
    return None if profile is None else profile.min_gemm_flops(precision)


def upcast_gemms(gm: torch.fx.GraphModule, precision: str, why: str, targets: Optional[dict] = None,
                 min_flops: Optional[int] = None) -> tuple[list[str], int]:
    """Replace each linear/matmul call decided ``precision`` (fp16 or bf16) whose one matrix product is at least
    ``min_flops`` (the device profile's measured crossover; None: :data:`MIN_GEMM_FLOPS`) by its upcast kernel (``targets``: by its kernel there, e.g. :data:`DISPATCH_TARGETS`).
    Returns the names of the nodes replaced and how many GEMM calls stayed native for their size. ``why``: the
    reason (:func:`upcast_wanted`), for each node's note."""
    targets = UPCAST_TARGETS if targets is None else targets
    min_flops = MIN_GEMM_FLOPS if min_flops is None else min_flops
    if precision not in _HALF:
        raise ValueError(f"upcast_gemms: precision must be fp16 or bf16, got {precision!r}")
    done: list[str] = []
    small = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets:
            continue
        decision: Optional[Decision] = node.meta.get(META_DECISION)
        if decision is None or decision.precision != precision:
            continue
        kernel = targets[node.target]
        args = _operands(node, kernel)
        if args is None:
            continue
        flops = gemm_flops(node, args)
        if flops is None or flops < min_flops:
            small += 1
            continue
        node.target, node.args, node.kwargs = kernel, tuple(args), {}
        node.meta[META_DECISION] = decision.noted(
            "lower", f"runs {kernel.__name__} ({flops / 1e6:.3g} MFLOP per matrix product >= {min_flops / 1e6:.3g}; {why})")
        done.append(node.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done, small


def gemm_choice(lowering: str, precision: str, nodes: list[str], small: int, why: str,
                min_flops: Optional[int] = None) -> dict:
    """The ``report.json["lowering"]`` entry of one graph's GEMM kernels (``upcast_gemm`` for ``device="cpu"``,
    ``dispatch_gemm`` for a portable graph): how many calls :func:`upcast_gemms` rewrote, why, and how many stayed
    native for their size."""
    if small:
        gate = MIN_GEMM_FLOPS if min_flops is None else min_flops
        why += f"; {small} smaller GEMM call(s) (< {gate / 1e6:g} MFLOP per matrix product) stay native"
    return LoweringChoice(node=f"{len(nodes)} {precision} GEMM call(s)", lowering=lowering, chosen=bool(nodes),
                          why=why).to_dict()


def native_gemms(gm: torch.fx.GraphModule) -> int:
    """The reverse, on an export copy: each upcast or dispatching kernel call back to ``F.linear``/``torch.matmul``
    /``F.scaled_dot_product_attention`` (the same arguments, the same math up to summation order); returns how
    many. The ONNX export writes plain half MatMuls and attention (an ONNX runtime picks its own kernels)
    instead of tracing the kernels' upcasts into Casts or one device's branch into the file."""
    return retarget_calls(gm, {upcast_linear: F.linear, upcast_matmul: torch.matmul, dispatch_linear: F.linear,
                               dispatch_matmul: torch.matmul, dispatch_attention: F.scaled_dot_product_attention,
                               upcast_attention: F.scaled_dot_product_attention})
