"""Half GEMMs through fp32 kernels: bf16/fp16 operands in, half out, an fp32 GEMM in between.

This module imports torch and the standard library only (no ``converter``): it is copied verbatim into an
emitted model.py, which must run where only torch is installed. Keep it that way; a test parses its imports.

**Why.** On a CPU without AMX, oneDNN's bf16 GEMM is slower than its fp32 GEMM: measured on this project's
2-core Xeon (AVX512-BF16, no AMX, torch 2.13, one thread), a 1024x512 @ 512x2048 matmul takes 28.3 ms in
bf16 and 15.9 ms in fp32, and upcasting both bf16 operands, multiplying in fp32 and rounding the product to
bf16 takes 16.9 ms. torch.autocast runs the slow kernel; a conversion for the CPU
(``convert(device="cpu")``, :mod:`converter.passes.cpu_gemm`) calls these functions instead where it measured
the half GEMM slower.

**Numerics.** The product of two bf16 (or fp16) numbers is exact in fp32 (8 + 8 or 11 + 11 significant bits
fit in 24), so an fp32 GEMM on upcast operands computes what a half GEMM with fp32 accumulation computes (the
CPU and CUDA half GEMMs accumulate in fp32), up to the order of the sum; the result is rounded to the half
dtype once, as the half kernel rounds it. The bias is added in fp32 before that rounding, as a fused
epilogue does. Gradients likewise: each backward GEMM in fp32 on upcast operands, rounded once to the
operand's dtype.

**Memory.** Each Function saves its operands in their own (half) dtype, as the half GEMM does; the fp32
copies exist only while a GEMM runs. So saved activations are those of the half model.

Operands that are not both of one half dtype (an fp32 call, a mixed call, an integer call) run the plain
``torch.nn.functional.linear`` / ``torch.matmul``, unchanged, so the functions can stand wherever those
calls stood.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["UPCAST_DTYPES", "UpcastLinear", "UpcastMatmul", "upcast_linear", "upcast_matmul"]

#: the operand dtypes these functions upcast (anything else runs the plain op)
UPCAST_DTYPES = (torch.bfloat16, torch.float16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 2-D (rows, last dim) matrix: one GEMM over every leading dimension. A 3-D operand
    that is not contiguous would make ``F.linear`` broadcast the weight over a batched GEMM instead (measured
    4-5x slower on the CPU: the attention output's reshape reaches the next linear that way)."""
    return t.contiguous().reshape(-1, t.shape[-1])


class UpcastLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for half ``x`` and ``weight``: fp32 GEMMs, half results, half saved.

    ``x`` of shape ``(..., K)``, ``weight`` ``(N, K)``, ``bias`` ``(N,)`` or None. The output and grad_input
    have ``x``'s dtype, grad_weight ``weight``'s, grad_bias ``bias``'s (its sum over the leading dimensions
    in fp32, rounded once).
    """

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The fp32 GEMM on upcast operands (bias added in fp32), rounded to ``x``'s dtype."""
        b32 = None if bias is None else bias.to(torch.float32)
        x2 = _rows(x.to(torch.float32, memory_format=torch.contiguous_format))
        y = torch.nn.functional.linear(x2, weight.to(torch.float32), b32)
        return y.to(x.dtype).reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        """Keep ``x`` and ``weight`` in their own dtype, and the bias's dtype."""
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """grad_input ``dy @ W``, grad_weight ``dy^T @ x`` and grad_bias, each in fp32 and rounded once."""
        x, weight = ctx.saved_tensors
        g32 = grad_output.to(torch.float32)
        grad_x = grad_w = grad_b = None
        g2 = _rows(g32)
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g2, weight.to(torch.float32)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = _rows(x.to(torch.float32, memory_format=torch.contiguous_format))
            grad_w = torch.mm(g2.t(), x2).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b


class UpcastMatmul(torch.autograd.Function):
    """``torch.matmul(a, b)`` for half ``a`` and ``b`` of two or more dimensions each (batch dimensions may
    broadcast): fp32 GEMMs, half results, half saved. Gradients are summed back over broadcast dimensions."""

    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The fp32 product of the upcast operands, rounded to ``a``'s dtype."""
        return torch.matmul(a.to(torch.float32), b.to(torch.float32)).to(a.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        """Keep both operands in their own dtype."""
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """``dy @ b^T`` and ``a^T @ dy`` in fp32, each summed to its operand's shape and rounded once."""
        a, b = ctx.saved_tensors
        g32 = grad_output.to(torch.float32)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.matmul(g32, b.to(torch.float32).mT).sum_to_size(a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = torch.matmul(a.to(torch.float32).mT, g32).sum_to_size(b.shape).to(b.dtype)
        return grad_a, grad_b


def _half_pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.dtype in UPCAST_DTYPES


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` through :class:`UpcastLinear` when ``x`` and ``weight`` share a half dtype; else plain."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and _half_pair(x, weight)):
        return torch.nn.functional.linear(x, weight, bias)
    return UpcastLinear.apply(x, weight, bias)


def upcast_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul`` through :class:`UpcastMatmul` when both operands share a half dtype and have two or more
    dimensions (a 1-D operand's matmul is a matrix-vector product: plain); else plain."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _half_pair(a, b)
            and a.dim() >= 2 and b.dim() >= 2):
        return torch.matmul(a, b)
    return UpcastMatmul.apply(a, b)
