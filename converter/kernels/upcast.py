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

**Portable graphs** (a conversion that names no device) call :func:`dispatch_linear` /
:func:`dispatch_matmul` instead: the same choice made at run time, per call, from the operands' device. On a
CPU whose half GEMM is at least :data:`MIN_SLOWDOWN` times slower than its fp32 GEMM (measured once per
process and dtype by :func:`matmul_seconds`, a few milliseconds) they run the upcast kernels; on CUDA, and on
a CPU with fast half math (AMX), the native half GEMM. :data:`UPCAST_ON_CPU` = False, or
``MPCONVERT_NO_DEVICE_ADVICE=1`` in the environment of the process that *runs* the model, keeps them native.
That switch is the emitted model's run-time choice only: no conversion reads it (a conversion's choices are
its ``ConvertOptions``, device figures included: :mod:`converter.numerics.profile`); the test suite sets it so
that the converted modules, fresh model.py copies and child processes all run the same kernels.

**Attention.** PyTorch's CPU flash-attention kernel is slow in half precision, above all its backward (one
call, forward + backward, 2-core Xeon without AMX, one thread: B8 H8 T128 E64 25.1 ms in bf16, 13.0 ms in
fp32). A portable graph's half ``scaled_dot_product_attention`` calls :func:`dispatch_attention`, which on
such a CPU runs :class:`UpcastAttention`: the whole attention in fp32 arithmetic on the exactly upcast half
q, k and v, rounded once to half at the output (and each gradient once), so it is at least as accurate as
the fused half kernel (which keeps q·kᵀ and the softmax in fp32 too, and rounds the probabilities to half
before P·V) and cannot overflow fp16. It saves q, k, v and the mask (the fused kernel also keeps its output
and a log-sum-exp per row), and its backward recomputes the probabilities with one more GEMM. Measured
(forward + backward, one thread, bf16 in): B8 H8 T128 E64 18.2 ms against the fused kernel's 38.5 ms, output
SQNR against fp32 49.5 dB against 48.8, gradients 45.2-51.7 dB against 44.4-50.2; B2 H4 T16 E32 0.30 ms
against 0.87 ms. A row the mask hides entirely gives zeros, as the fused kernel gives. Dropout runs the same
math through autograd under ``torch.utils.checkpoint`` (the same saved tensors; the RNG state is kept, so
the recomputed forward draws the same mask). Anything else (CUDA, a CPU
with fast half GEMMs, fp32, ``enable_gqa``, broadcast batch dimensions, a mask that requires grad, a mask
together with ``is_causal``, scores over :data:`MAX_UNFUSED_SCORES_BYTES`) runs the fused op with the same
arguments.

**Grouped GEMMs (MoE experts).** :func:`upcast_grouped_mm` computes transformers' ``grouped_mm_fallback(x, weight,
offs)`` for half operands with an **fp32 result**: the exact products summed in fp32 and not rounded to half (on CUDA
the native half GEMM per group, widened), half operands saved. :mod:`converter.passes.grouped_gemm` calls it where
every reader of the result reads fp32.
"""
from __future__ import annotations

import math
import os
import time
from typing import List, Optional, Tuple

import torch
import torch.utils.checkpoint

__all__ = ["UPCAST_DTYPES", "MIN_SLOWDOWN", "UPCAST_ON_CPU", "UpcastLinear", "UpcastMatmul", "upcast_linear",
           "upcast_matmul", "dispatch_linear", "dispatch_matmul", "matmul_seconds", "cpu_upcast_wanted",
           "GEMM_LADDER", "DEFAULT_MIN_GEMM_FLOPS", "gemm_crossover_flops", "cpu_upcast_min_flops", "MAX_UNFUSED_SCORES_BYTES",
           "UpcastAttention", "dispatch_attention", "upcast_attention", "UpcastGroupedMM", "upcast_grouped_mm",
           "GRAPH_KERNELS"]

#: the operand dtypes these functions upcast (anything else runs the plain op)
UPCAST_DTYPES = (torch.bfloat16, torch.float16)
#: the half GEMM must be at least this many times slower than fp32's (measured) for the upcast kernels to pay
MIN_SLOWDOWN = 1.25
#: None (default): :func:`dispatch_linear`/:func:`dispatch_matmul` measure this CPU; True/False: forced
UPCAST_ON_CPU: Optional[bool] = None
_PROBE_SIDE = 128
_PROBE_REPEATS = 5
_cpu_choice: dict = {}  # dtype -> bool, measured once per process
#: the GEMM size (2·M·K·N per matrix product) from which the upcast kernels pay where nothing was measured: the
#: crossover measured on a 2-core Xeon with AVX512-BF16 (forward + backward of one linear, upcast / native: 1.72 at
#: 1 MFLOP, 1.00 at 17 MFLOP, 0.77 at 34 MFLOP). The fixed cost (an autograd Function, the casts) is the same
#: everywhere; how slow the native half GEMM is differs by CPU, so the crossover is measured where it can be
#: (:func:`gemm_crossover_flops`)
DEFAULT_MIN_GEMM_FLOPS = 32 * 10**6
#: the (M, K, N) linears :func:`gemm_crossover_flops` times, smallest first: 0.26 to 8.4 MFLOP per matrix
#: product (past the largest, the fixed cost only shrinks against the GEMM's)
GEMM_LADDER = ((64, 32, 64), (64, 64, 64), (64, 128, 128), (128, 128, 256))
_cpu_min_flops: dict = {}  # dtype -> int, measured once per process
#: an attention call whose fp32 (…, L, S) scores would exceed this many bytes runs the fused kernel (it streams
#: them in blocks; unfused, one call holds them at once: 1 GiB at B8 H8 and 2k tokens)
MAX_UNFUSED_SCORES_BYTES = 256 * 2 ** 20


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
    """``F.linear`` through :class:`UpcastLinear` when ``x`` and ``weight`` share a half dtype; else plain (and
    under TorchScript, which compiles only this branch: ``torch.jit.script`` of a converted module works)."""
    if torch.jit.is_scripting():
        return torch.nn.functional.linear(x, weight, bias)
    else:
        if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and _half_pair(x, weight)):
            return torch.nn.functional.linear(x, weight, bias)
        return UpcastLinear.apply(x, weight, bias)


def upcast_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul`` through :class:`UpcastMatmul` when both operands share a half dtype and have two or more
    dimensions (a 1-D operand's matmul is a matrix-vector product: plain); else plain (and under TorchScript)."""
    if torch.jit.is_scripting():
        return torch.matmul(a, b)
    else:
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _half_pair(a, b)
                and a.dim() >= 2 and b.dim() >= 2):
            return torch.matmul(a, b)
        return UpcastMatmul.apply(a, b)


def matmul_seconds(dtype: torch.dtype) -> float:
    """Best-of-5 seconds of one 128x128 matmul on the CPU in ``dtype`` (after one warm-up), on one thread (the
    kernel's math, not thread wake-ups: on a busy machine those cost 100x)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(_PROBE_SIDE, _PROBE_SIDE, generator=g).to(dtype)
    b = torch.randn(_PROBE_SIDE, _PROBE_SIDE, generator=g).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)
        best = float("inf")
        for _ in range(_PROBE_REPEATS):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best


def _linear_seconds(kernel, m: int, k: int, n: int, dtype: torch.dtype) -> float:
    """Best-of-3 seconds of one forward + backward of ``kernel(x, weight, bias)`` at (M, K, N) in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(n, k, generator=g).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    kernel(x, w, b).backward(dy)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        kernel(x, w, b).backward(dy)
        best = min(best, time.perf_counter() - start)
    return best


def gemm_crossover_flops(dtype: torch.dtype) -> Optional[int]:
    """The smallest GEMM size of :data:`GEMM_LADDER` (2·M·K·N) from which :func:`upcast_linear` (forward and
    backward) is faster than the native half linear on this CPU at that size and every larger one, measured now
    on one thread; None where it is faster at none of them (the native half GEMM is the fast one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # measured the same wherever it is first asked for: under no_grad, inference mode or autocast too
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
            wins = [(2 * m * k * n, _linear_seconds(UpcastLinear.apply, m, k, n, dtype)
                     < _linear_seconds(torch.nn.functional.linear, m, k, n, dtype)) for m, k, n in GEMM_LADDER]
    finally:
        torch.set_num_threads(threads)
    crossover = None
    for flops, upcast_wins in reversed(wins):
        if not upcast_wins:
            break
        crossover = flops
    return crossover


def cpu_upcast_min_flops(dtype: torch.dtype) -> int:
    """The GEMM size from which :func:`dispatch_linear`/:func:`dispatch_matmul` run the upcast kernels on this CPU:
    :func:`gemm_crossover_flops` measured once per process (:data:`DEFAULT_MIN_GEMM_FLOPS` where it found none)."""
    if dtype not in _cpu_min_flops:
        found = gemm_crossover_flops(dtype)
        _cpu_min_flops[dtype] = DEFAULT_MIN_GEMM_FLOPS if found is None else found
    return _cpu_min_flops[dtype]


def cpu_upcast_wanted(dtype: torch.dtype) -> bool:
    """Whether half GEMMs of ``dtype`` run faster as the upcast kernels on this CPU (:data:`UPCAST_ON_CPU`, else
    the run-time switch ``MPCONVERT_NO_DEVICE_ADVICE=1`` (no), else measured once per process)."""
    if UPCAST_ON_CPU is not None:
        return UPCAST_ON_CPU
    if dtype not in UPCAST_DTYPES or os.environ.get("MPCONVERT_NO_DEVICE_ADVICE") == "1":
        return False
    if dtype not in _cpu_choice:
        _cpu_choice[dtype] = matmul_seconds(dtype) >= MIN_SLOWDOWN * matmul_seconds(torch.float32)
    return _cpu_choice[dtype]


def _upcast_here(a: torch.Tensor, b: torch.Tensor, linear: bool) -> bool:
    """Whether this call (``a``: the input; ``b``: the weight of a linear, else the matmul's other operand) runs the
    upcast kernel: half operands on a CPU whose half GEMM is the slower one, with a product (2·M·K·N) at least this
    CPU's measured crossover (any size where :data:`UPCAST_ON_CPU` forces the kernels)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device.type == "cpu"
            and _half_pair(a, b) and b.dim() >= 1 and cpu_upcast_wanted(a.dtype)):
        return False
    n = b.shape[0] if linear else b.shape[-1]
    return UPCAST_ON_CPU is True or 2 * a.numel() * n >= cpu_upcast_min_flops(a.dtype)


def dispatch_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``: :func:`upcast_linear` for half operands on a CPU whose half GEMM is the slower one, else plain
    (and under TorchScript)."""
    if torch.jit.is_scripting():
        return torch.nn.functional.linear(x, weight, bias)
    else:
        if _upcast_here(x, weight, True):
            return upcast_linear(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)


def dispatch_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul``: :func:`upcast_matmul` for half operands on a CPU whose half GEMM is the slower one, else plain
    (and under TorchScript)."""
    if torch.jit.is_scripting():
        return torch.matmul(a, b)
    else:
        if _upcast_here(a, b, False):
            return upcast_matmul(a, b)
        return torch.matmul(a, b)


def _scores(q32: torch.Tensor, k32: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool,
            scale: float) -> torch.Tensor:
    """fp32 ``q·kᵀ·scale`` with the mask applied (a bool mask: True where a key takes part; a float one added)."""
    scores = torch.matmul(q32, k32.transpose(-2, -1)).mul_(scale)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            return scores.masked_fill_(attn_mask.logical_not(), -math.inf)
        return scores.add_(attn_mask)
    if is_causal:
        above = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(above, -math.inf)
    return scores


def _probs(q32: torch.Tensor, k32: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float,
           *, inplace: bool = True) -> torch.Tensor:
    """fp32 ``softmax(q·kᵀ·scale + mask)``. A row the mask hides entirely gives zeros, as the fused kernel gives
    (softmax alone gives NaN there); a NaN that comes from the operands stays NaN. ``inplace=False`` when autograd
    records it (softmax's backward reads its output)."""
    scores = _scores(q32, k32, attn_mask, is_causal, scale)
    hidden = None if attn_mask is None else scores.amax(-1, keepdim=True) == -math.inf
    probs = torch.softmax(scores, -1)
    if hidden is None:
        return probs
    return probs.masked_fill_(hidden, 0.0) if inplace else probs.masked_fill(hidden, 0.0)


def _lse_probs(q32: torch.Tensor, k32: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool,
               scale: float) -> torch.Tensor:
    """The probabilities as the fused kernels' backward recomputes them: ``exp(s - logsumexp(s))`` in fp32.

    Equal to the softmax on every row but one kind: a row the mask fills with one huge finite value
    (``finfo(float32).min``, a left-padded patch) absorbs the scores, ``logsumexp`` rounds back to that value and
    every probability is 1, not 1/L. torch's fused attention (flash on CPU, efficient on CUDA) backpropagates
    that, in fp32 and under autocast alike, so this does too; a fully hidden row (-inf) gives zeros."""
    scores = _scores(q32, k32, attn_mask, is_causal, scale)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    probs = scores.sub_(lse).exp_()
    if attn_mask is None and not is_causal:
        return probs
    return probs.masked_fill_(lse == -math.inf, 0.0)


class UpcastAttention(torch.autograd.Function):
    """Attention of half q, k, v (the same leading dimensions) in fp32 arithmetic, rounded once to half.

    Saves q, k, v and the mask (the fused kernel also keeps its output and a log-sum-exp per row); backward
    recomputes the probabilities as the fused kernel does (:func:`_lse_probs`). ``attn_mask``: None, bool or float, broadcast over the scores, not
    differentiated. No dropout (:func:`dispatch_attention` handles it)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal: bool, scale: float):
        """Scores, probabilities and ``P·V`` in fp32; the output in ``query``'s dtype."""
        q32, k32, v32 = (t.to(torch.float32) for t in (query, key, value))
        out = torch.matmul(_probs(q32, k32, attn_mask, is_causal, scale), v32).to(query.dtype)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.save_for_backward(query, key, value, attn_mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        """``dV = Pᵀ·dO``, ``dS = P ∘ (dO·Vᵀ - rowsum(dO ∘ O))``, ``dQ = dS·K·scale``, ``dK = dSᵀ·Q·scale``, in fp32."""
        query, key, value, attn_mask = ctx.saved_tensors
        q32, k32, v32 = (t.to(torch.float32) for t in (query, key, value))
        probs = _lse_probs(q32, k32, attn_mask, ctx.is_causal, ctx.scale)
        g32 = grad_out.to(torch.float32)
        grad_v = torch.matmul(probs.transpose(-2, -1), g32).to(value.dtype)
        dp = torch.matmul(g32, v32.transpose(-2, -1))
        # rowsum(dO ∘ O), as the fused kernels take it: rowsum(P ∘ dP) / rowsum(P) (P sums to 1 but on absorbed rows)
        total = probs.sum(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
        ds = dp.sub_((dp * probs).sum(-1, keepdim=True).div_(total)).mul_(probs).mul_(ctx.scale)
        grad_q = torch.matmul(ds, k32).to(query.dtype)
        grad_k = torch.matmul(ds.transpose(-2, -1), q32).to(key.dtype)
        return grad_q, grad_k, grad_v, None, None, None


def _attention_dropout(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale: float) -> torch.Tensor:
    """The same fp32 math through autograd, with dropout on the probabilities (as the fused op applies it)."""
    q32, k32, v32 = (t.to(torch.float32) for t in (query, key, value))
    probs = _probs(q32, k32, attn_mask, is_causal, scale, inplace=False)
    return torch.matmul(torch.dropout(probs, dropout_p, True), v32).to(query.dtype)


def _attention_here(query, key, value, attn_mask, is_causal: bool, enable_gqa: bool, measured: bool) -> bool:
    """Does this call run :class:`UpcastAttention`: half operands of one shape family on a CPU (``measured``: whose
    half GEMM is slow), arguments the fp32 math takes exactly, scores in bounds?"""
    if enable_gqa or not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return False
    if query.device.type != "cpu" or not (_half_pair(query, key) and _half_pair(query, value)) or query.is_nested:
        return False
    if query.dim() < 3 or not (query.shape[:-2] == key.shape[:-2] == value.shape[:-2]):
        return False
    if attn_mask is not None and (is_causal or not isinstance(attn_mask, torch.Tensor) or attn_mask.requires_grad):
        return False
    if math.prod(query.shape[:-1]) * key.shape[-2] * 4 > MAX_UNFUSED_SCORES_BYTES:
        return False
    return cpu_upcast_wanted(query.dtype) if measured else True


def dispatch_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                       dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                       enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` with its arguments: :class:`UpcastAttention` on a CPU whose half GEMM is slow
    (dropout: the same math through autograd, recomputed in backward), else the fused op (and under TorchScript)."""
    if torch.jit.is_scripting():
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                                scale=scale, enable_gqa=enable_gqa)
    else:
        return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, True)


def upcast_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """:func:`dispatch_attention` without the run-time measurement: :class:`UpcastAttention` on any CPU (a conversion
    for the CPU measured its half GEMM slow, ``convert(device="cpu")``), the fused op elsewhere."""
    if torch.jit.is_scripting():
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                                scale=scale, enable_gqa=enable_gqa)
    else:
        return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False)


def _attention(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool, measured: bool):
    if not _attention_here(query, key, value, attn_mask, is_causal, enable_gqa, measured):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                                scale=scale, enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if dropout_p <= 0:
        return UpcastAttention.apply(query, key, value, attn_mask, is_causal, scale)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))):
        return _attention_dropout(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return torch.utils.checkpoint.checkpoint(_attention_dropout, query, key, value, attn_mask, dropout_p, is_causal, scale,
                                             use_reentrant=False, preserve_rng_state=True)


def _groups(offs: torch.Tensor) -> List[Tuple[int, int, int]]:
    """(expert, first row, end row) of each non-empty group of a grouped GEMM's cumulative row counts ``offs``."""
    ends: List[int] = offs.tolist()
    groups: List[Tuple[int, int, int]] = []
    start = 0
    for i in range(len(ends)):
        if ends[i] > start:
            groups.append((i, start, ends[i]))
        start = ends[i]
    return groups


def _grouped_mm_plain(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM in the operands' promoted dtype (fp32 at least), through autograd."""
    dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.zeros([x.shape[0], weight.shape[2]], dtype=torch.promote_types(dtype, torch.float32), device=x.device)
    for group in _groups(offs):
        i, start, end = group
        out[start:end] = torch.mm(x[start:end].to(dtype), weight[i].to(dtype))
    return out


class UpcastGroupedMM(torch.autograd.Function):
    """The grouped GEMM of mixture-of-experts layers with an **fp32 result**: rows ``start:end`` of ``x`` (S, K)
    times ``weight[i]`` (K, N) for the cumulative row counts ``offs`` (E,), as transformers'
    ``grouped_mm_fallback`` computes it, the rows past ``offs[-1]`` zero. Half ``x`` and ``weight`` in, fp32 out
    (the exact products summed in fp32, not rounded to half: the consumers read fp32), half saved. On CUDA each
    group is the native half GEMM (tensor cores), its result widened. Gradients: each GEMM in fp32 on upcast
    operands (native half on CUDA), rounded once to its operand's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The groups' products, fp32; keeps ``x`` and ``weight`` in their own (half) dtype, and the groups (read
        from ``offs`` once: on CUDA each read is a host sync)."""
        groups = _groups(offs)
        out = torch.zeros(x.shape[0], weight.shape[2], dtype=torch.float32, device=x.device)
        for i, start, end in groups:
            if x.is_cuda:
                out[start:end] = torch.mm(x[start:end], weight[i])
            else:
                torch.mm(x[start:end].to(torch.float32), weight[i].to(torch.float32), out=out[start:end])
        ctx.save_for_backward(x, weight)
        ctx.groups = groups
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """grad_x ``dy @ W[i]^T`` and grad_weight ``x^T @ dy`` per group."""
        x, weight = ctx.saved_tensors
        wide = x.dtype if x.is_cuda else torch.float32
        g = grad_output.to(wide)
        grad_x = torch.zeros(x.shape, dtype=wide, device=x.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=wide, device=x.device) if ctx.needs_input_grad[1] else None
        for i, start, end in ctx.groups:
            if grad_x is not None:
                torch.mm(g[start:end], weight[i].to(wide).t(), out=grad_x[start:end])
            if grad_w is not None:
                torch.mm(x[start:end].to(wide).t(), g[start:end], out=grad_w[i])
        return (None if grad_x is None else grad_x.to(x.dtype), None if grad_w is None else grad_w.to(weight.dtype),
                None)


def upcast_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm_fallback(x, weight, offs)`` with an fp32 result (:class:`UpcastGroupedMM`) for
    half ``x`` and ``weight`` of one dtype; other operands (and TorchScript, which compiles only that branch): the
    same products in their promoted dtype, fp32 at least."""
    if torch.jit.is_scripting():
        return _grouped_mm_plain(x, weight, offs)
    else:
        if not _half_pair(x, weight):
            return _grouped_mm_plain(x, weight, offs)
        return UpcastGroupedMM.apply(x, weight, offs)


#: the functions a converted graph calls from this module (model.py carries the module when it calls one)
GRAPH_KERNELS = (upcast_linear, upcast_matmul, upcast_attention, dispatch_linear, dispatch_matmul, dispatch_attention,
                 upcast_grouped_mm)
