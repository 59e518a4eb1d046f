"""FP8 GEMM kernels for training: scales, saturated casts, and a Linear whose three GEMMs run in float8.

This module imports torch and the standard library only (no numpy, no ``converter``): it is meant to be copied verbatim
into an emitted model.py, which must run where only torch is installed. Keep it that way; a test parses its
imports.

What it computes, for ``y = x @ W^T`` with ``x`` of any leading shape ``(..., K)`` and ``W`` of ``(N, K)``:

* **output**      ``y  = x   @ W^T``  (M x K  @ K x N)
* **grad_input**  ``dx = dy  @ W``    (M x N  @ N x K)
* **grad_weight** ``dW = dy^T @ x``   (N x M  @ M x K)

Each GEMM quantises its two operands along the contraction dimension and is one ``torch._scaled_mm`` call,
so a training step of one layer makes 3 calls (2 for ``rowwise_gw_hp``, whose grad_weight GEMM runs in the
input's own precision, as torchao's ``rowwise_with_gw_hp``). Scaling is dynamic ("current"): each cast takes
its amax from the tensor it casts, ``scale = fp8_max / max(amax, EPS)``, computed in float64 and stored as
float32 like torchao's ``amax_to_scale``. The GEMM receives the reciprocal (the dequantising multiplier).

Recipes (``RECIPES``):

* ``tensorwise``: one scale per tensor; e4m3 for x and W, e5m2 for grad_output in both backward GEMMs.
* ``rowwise``: one scale per row of the left operand and per column of the right one (along the contraction
  dimension), e4m3 everywhere, scales rounded down to a power of two.
* ``rowwise_gw_hp``: ``rowwise`` for output and grad_input, grad_weight as a plain matmul in high precision.
  Unlike torchao, the weight's cast for grad_input is rowwise too (torchao casts it tensorwise there).
* ``blockwise``: DeepSeek-V3's tiles: activations and gradients 1x128 along the contraction dimension,
  weights 128x128 blocks, e4m3 everywhere. CPU ``_scaled_mm`` refuses these scales (torch 2.13: "Invalid
  scaling configuration. - For TensorWise scaling ... - For RowWise scaling ..."), so this recipe is
  *emulated*: dequantise each operand to float32, then an fp32 matmul. It runs no ``_scaled_mm`` at all.

Layout: ``_scaled_mm`` wants its first operand row-major and its second column-major on CUDA (CPU accepts
both); the kernels always pass that layout.

Alignment: CUDA ``_scaled_mm`` checks that the first operand's columns (the contraction dimension) and both
dimensions of the second operand are multiples of 16, and nothing about the first operand's rows (torch's
``aten/src/ATen/native/cuda/ScaledBlas.cpp``, ``_scaled_mm_out_cuda``: ``mat1.sizes()[1] % 16 == 0`` and
``mat2.sizes()[0] % 16 == 0 && mat2.sizes()[1] % 16 == 0``, in ``Blas.cpp`` in older releases; the CUTLASS rowwise
kernel pads its row scales for any M itself). So K and N (in_features, out_features) must be multiples of
``ALIGN`` and are never padded: ``check_dims`` raises a ValueError naming them, and a rule layer asks
``misaligned_dims`` first (a list of the offending dimensions, no exception) and keeps such GEMMs in bf16. The
gate applies to every recipe, also the emulated one, so that one shape gate serves all of them. The token
count M is free: in the output and grad_input GEMMs it is the first operand's rows, and the grad_weight GEMM,
which contracts over it, zero-pads M to a multiple of ``ALIGN`` on its float8 operands after they are
quantised. That is exact: the scales come from the unpadded tensors (a tensorwise amax, or rowwise scales per
row of ``dy^T`` and per column of ``x``, none of them along M), and zero terms add nothing to the sums. So
padded and odd batches (M = batch x seq of any size) train. The padding runs on every device and in the
emulation too, so that CPU results stay bit-equal to ``emulate_linear``; the emulated ``blockwise`` recipe
calls no ``_scaled_mm`` and pads nothing. The module defines no exception class of its own: it stands outside
the converter's error hierarchy (``MpconvertError``), which it may not import.

Bias is added after the GEMM in the output dtype, as torchao does (CUDA ``_scaled_mm`` refuses a bias when the
output is float32: "Bias is not supported when out_dtype is set to Float32"). The output has the input's dtype;
CUDA's rowwise kernel writes only bf16 or fp16 on most GPUs ("Only bf16 and fp16 high precision output types
are supported for row-wise scaling"), so on a GPU feed rowwise layers bf16 inputs (the bf16 rules around an fp8
GEMM do).

torch.export: plain (non-strict) export inlines ``Fp8Linear``'s forward aten ops (one ``aten._scaled_mm``,
output equal to eager) and drops its backward; a backward through that graph fails with "derivative for
aten::_scaled_mm is not implemented". Strict export wraps the forward in a ``wrap_with_set_grad_enabled(False)``
submodule. The converter's capture keeps any user autograd Function as one call with its backward
(``converter.passes.autograd_fns.OpaqueFunctions``), which works for ``Fp8Linear`` unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = [
    "ALIGN",
    "BLOCK",
    "EPS",
    "GEMMS",
    "RECIPES",
    "Fp8Linear",
    "Fp8Recipe",
    "amax_to_scale",
    "blockwise_scale",
    "cast_to_fp8",
    "check_dims",
    "emulate_linear",
    "fp8_linear",
    "misaligned_dims",
    "operand_scale",
    "quantize_operand",
    "resolve_recipe",
    "round_down_to_power_of_2",
    "rowwise_scale",
    "tensorwise_scale",
]

#: amax floor: an all-zero tensor gets a finite scale (fp8_max / EPS) and quantises to zeros
EPS = 1e-12
#: dimensions that a scaled GEMM needs to be multiples of (CUDA ``_scaled_mm``)
ALIGN = 16
#: DeepSeek-V3 tile edge: activations 1 x BLOCK, weights BLOCK x BLOCK
BLOCK = 128
#: the three GEMMs of a Linear's training step
GEMMS = ("output", "grad_input", "grad_weight")

_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2
_GRANULARITIES = ("tensor", "row", "block")


@dataclass(frozen=True)
class Fp8Recipe:
    """How a Linear's GEMMs run in FP8: operand dtypes, scale granularity, which GEMMs are scaled.

    ``granularity`` is ``"tensor"``, ``"row"`` (per row of the left operand, per column of the right, along
    the contraction dimension) or ``"block"`` (1 x ``block`` tiles for activations and gradients,
    ``block`` x ``block`` for weights). ``native`` False means the scaled GEMMs are emulated by
    dequantise-then-fp32-matmul instead of calling ``torch._scaled_mm``. GEMMs not in ``scaled_gemms`` run
    as a plain matmul in the input's precision. ``fast_accum_output`` is the output GEMM's ``use_fast_accum``
    (torchao's default; CPU ignores it).
    """

    name: str
    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    grad_output_dtype: torch.dtype
    granularity: str
    power_of_2: bool
    scaled_gemms: tuple = GEMMS
    native: bool = True
    fast_accum_output: bool = True
    block: int = BLOCK

    def __post_init__(self) -> None:
        if self.granularity not in _GRANULARITIES:
            raise ValueError(f"Fp8Recipe {self.name!r}: granularity {self.granularity!r} is not one of {_GRANULARITIES}")
        unknown = [g for g in self.scaled_gemms if g not in GEMMS]
        if unknown:
            raise ValueError(f"Fp8Recipe {self.name!r}: unknown GEMM(s) {unknown}; the GEMMs are {GEMMS}")
        if self.granularity == "block" and self.native:
            raise ValueError(f"Fp8Recipe {self.name!r}: block scales have no native CPU kernel; set native=False")

    @property
    def scaled_mm_calls(self) -> int:
        """``torch._scaled_mm`` calls of one forward + backward (0 for an emulated recipe)."""
        return len(self.scaled_gemms) if self.native else 0


RECIPES = {
    "tensorwise": Fp8Recipe("tensorwise", _E4M3, _E4M3, _E5M2, "tensor", power_of_2=False),
    "rowwise": Fp8Recipe("rowwise", _E4M3, _E4M3, _E4M3, "row", power_of_2=True),
    "rowwise_gw_hp": Fp8Recipe(
        "rowwise_gw_hp", _E4M3, _E4M3, _E4M3, "row", power_of_2=True, scaled_gemms=("output", "grad_input")
    ),
    "blockwise": Fp8Recipe("blockwise", _E4M3, _E4M3, _E4M3, "block", power_of_2=False, native=False),
}


def resolve_recipe(recipe: Union[str, Fp8Recipe]) -> Fp8Recipe:
    """The recipe itself, or the one of ``RECIPES`` with that name (ValueError naming the choices)."""
    if isinstance(recipe, Fp8Recipe):
        return recipe
    try:
        return RECIPES[recipe]
    except KeyError:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; choose one of {sorted(RECIPES)}") from None


# --------------------------------------------------------------------------------------------- scales


def round_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Each positive float32 scale rounded down to a power of two, exactly (its exponent bits kept).

    torchao computes ``exp2(floor(log2(scale)))``, which agrees except within a rounding error below a power
    of two, where it rounds up; the saturated cast makes either safe.
    """
    if scale.dtype != torch.float32:
        raise ValueError(f"power-of-2 rounding needs float32 scales, got {scale.dtype}")
    return (scale.contiguous().view(torch.int32) & 0x7F800000).view(torch.float32)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """The quantising multiplier ``fp8_max(dtype) / max(amax, EPS)`` as float32 (computed in float64)."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return round_down_to_power_of_2(scale) if power_of_2 else scale


def tensorwise_scale(t: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """One scale (0-dim float32) for the whole tensor."""
    return amax_to_scale(torch.max(torch.abs(t)), dtype, power_of_2)


def rowwise_scale(t: torch.Tensor, dtype: torch.dtype, dim: int, power_of_2: bool = True) -> torch.Tensor:
    """One scale per slice along ``dim`` (the amax reduces ``dim``; kept as a size-1 dimension).

    For a GEMM's left operand (m x k) reduce ``dim=1``: scales (m, 1); for its right operand (k x n) reduce
    ``dim=0``: scales (1, n), the shapes ``torch._scaled_mm`` takes for rowwise scaling.
    """
    return amax_to_scale(torch.amax(torch.abs(t), dim=dim, keepdim=True), dtype, power_of_2)


def blockwise_scale(
    t: torch.Tensor, dtype: torch.dtype, tile: tuple, power_of_2: bool = False
) -> torch.Tensor:
    """One scale per ``tile`` (rows, cols) of a 2-D tensor, expanded back to ``t``'s shape (float32).

    Edge tiles may be partial: their amax covers the elements that exist.
    """
    rows, cols = t.shape
    tr, tc = tile
    pad_r, pad_c = (-rows) % tr, (-cols) % tc
    mag = torch.abs(t)
    if pad_r or pad_c:
        mag = torch.nn.functional.pad(mag, (0, pad_c, 0, pad_r))
    grid = mag.reshape((rows + pad_r) // tr, tr, (cols + pad_c) // tc, tc).amax(dim=(1, 3))
    scale = amax_to_scale(grid, dtype, power_of_2)
    return scale.repeat_interleave(tr, dim=0).repeat_interleave(tc, dim=1)[:rows, :cols]


def cast_to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` in float32, saturated to ``dtype``'s finite range, cast to ``dtype``."""
    top = torch.finfo(dtype).max
    return torch.clamp(t.to(torch.float32) * scale, min=-top, max=top).to(dtype)


def quantize_operand(
    t: torch.Tensor, dtype: torch.dtype, recipe: Fp8Recipe, contract_dim: int, is_weight: bool = False
) -> tuple:
    """One GEMM operand (2-D) cast to ``dtype``: ``(t_fp8, inverse_scale)``.

    ``contract_dim`` is the operand's contraction dimension (1 for the left operand, 0 for the right). The
    inverse scale is what ``torch._scaled_mm`` takes: 0-dim (tensor), (m, 1) or (1, n) (row), or ``t``'s full
    shape (block: tiles 1 x block along the contraction dimension, block x block for a weight).
    """
    scale = operand_scale(t, dtype, recipe, contract_dim, is_weight)
    return cast_to_fp8(t, scale, dtype), scale.reciprocal()


def operand_scale(
    t: torch.Tensor, dtype: torch.dtype, recipe: Fp8Recipe, contract_dim: int, is_weight: bool = False
) -> torch.Tensor:
    """The quantising multiplier ``quantize_operand`` casts ``t`` with (float32; shapes as its inverse scale)."""
    if recipe.granularity == "tensor":
        return tensorwise_scale(t, dtype, recipe.power_of_2)
    if recipe.granularity == "row":
        return rowwise_scale(t, dtype, contract_dim, recipe.power_of_2)
    tile = [1, 1]
    tile[contract_dim] = recipe.block
    if is_weight:
        tile = [recipe.block, recipe.block]
    return blockwise_scale(t, dtype, tuple(tile), recipe.power_of_2)


# ---------------------------------------------------------------------------------------------- GEMMs


def misaligned_dims(k: int, n: int, recipe: Union[str, Fp8Recipe]) -> list:
    """The dimensions of a Linear that a scaled GEMM cannot take, as ``[(name, size), ...]`` (empty: fits).

    ``k`` (in_features, name ``"K"``) and ``n`` (out_features, ``"N"``) must be multiples of ``ALIGN``, for every
    recipe (``recipe`` is resolved, so an unknown name raises). The token count M is not a constraint: the
    grad_weight GEMM zero-pads it (module docstring, "Alignment").
    """
    resolve_recipe(recipe)
    return [(name, size) for name, size in (("K", k), ("N", n)) if size % ALIGN]


_DIM_LABELS = {"K": "in_features K", "N": "out_features N"}


def check_dims(k: int, n: int, recipe: Union[str, Fp8Recipe]) -> None:
    """Raise a ValueError naming each dimension that ``misaligned_dims`` reports (K and N are never padded)."""
    bad = misaligned_dims(k, n, recipe)
    if bad:
        what = ", ".join(f"{_DIM_LABELS[name]}={size}" for name, size in bad)
        raise ValueError(
            f"fp8 recipe {resolve_recipe(recipe).name!r}: {what} not a multiple of {ALIGN}; scaled GEMMs need "
            f"in_features and out_features multiples of {ALIGN}: keep this GEMM in high precision"
        )


def _zero_pad(t8: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    """``t8`` (float8, 2-D) with ``extra`` zeros appended along ``dim``; the result is contiguous.

    Works on the bytes (``view(torch.uint8)``): float8's +0.0 is the all-zero byte, and ``cat`` of uint8 runs on
    every device, where float8 fills and pads may not.
    """
    shape = list(t8.shape)
    shape[dim] = extra
    zeros = torch.zeros(shape, dtype=torch.uint8, device=t8.device)
    return torch.cat([t8.view(torch.uint8), zeros], dim=dim).view(t8.dtype)


def _dequantize(t8: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return t8.contiguous().to(torch.float32) * inv


def _scaled_gemm(
    a: tuple, b: tuple, out_dtype: torch.dtype, native: bool, fast_accum: bool = False
) -> torch.Tensor:
    """``a @ b`` of two quantised operands ``(t_fp8, inverse_scale)``: one ``_scaled_mm`` or its emulation.

    The emulation is what CPU ``_scaled_mm`` computes without oneDNN: each operand dequantised to float32
    (contiguous), an fp32 matmul, one cast to ``out_dtype``.
    """
    (a8, a_inv), (b8, b_inv) = a, b
    if native:
        return torch._scaled_mm(
            a8.contiguous(),
            b8.t().contiguous().t(),  # column-major second operand
            scale_a=a_inv,
            scale_b=b_inv,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    return torch.matmul(_dequantize(a8, a_inv), _dequantize(b8, b_inv)).to(out_dtype)


def _output(x2: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, native: bool) -> torch.Tensor:
    """Forward GEMM ``x2 @ weight^T`` (M x N) in ``x2``'s dtype."""
    if "output" not in recipe.scaled_gemms:
        return torch.mm(x2, weight.to(x2.dtype).t())
    a = quantize_operand(x2, recipe.input_dtype, recipe, contract_dim=1)
    b = quantize_operand(weight.t(), recipe.weight_dtype, recipe, contract_dim=0, is_weight=True)
    return _scaled_gemm(a, b, x2.dtype, native, recipe.fast_accum_output)


def _grad_input(g2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, recipe: Fp8Recipe, native: bool):
    """Backward GEMM ``g2 @ weight`` (M x K): the gradient of the input."""
    if "grad_input" not in recipe.scaled_gemms:
        return torch.mm(g2, weight.to(g2.dtype)).to(out_dtype)
    a = quantize_operand(g2, recipe.grad_output_dtype, recipe, contract_dim=1)
    b = quantize_operand(weight, recipe.weight_dtype, recipe, contract_dim=0, is_weight=True)
    return _scaled_gemm(a, b, out_dtype, native)


def _grad_weight(g2: torch.Tensor, x2: torch.Tensor, out_dtype: torch.dtype, recipe: Fp8Recipe, native: bool):
    """Backward GEMM ``g2^T @ x2`` (N x K): the gradient of the weight; M (its contraction) zero-padded to ``ALIGN``
    when the recipe runs ``_scaled_mm`` (in the emulation too, so that both sum the same terms)."""
    if "grad_weight" not in recipe.scaled_gemms:
        return torch.mm(g2.t(), x2.to(g2.dtype)).to(out_dtype)
    a8, a_inv = quantize_operand(g2.t(), recipe.grad_output_dtype, recipe, contract_dim=1)
    b8, b_inv = quantize_operand(x2, recipe.input_dtype, recipe, contract_dim=0)
    extra = (-x2.shape[0]) % ALIGN if recipe.native else 0
    if extra:  # M is this GEMM's contraction: zero-pad it after quantising (scales unchanged, sums exact)
        a8 = _zero_pad(a8, 1, extra)  # (N, M + extra), row-major
        b8 = _zero_pad(b8.t(), 1, extra).t()  # (M + extra, K), column-major
    return _scaled_gemm((a8, a_inv), (b8, b_inv), out_dtype, native)


class Fp8Linear(torch.autograd.Function):
    """``x @ weight^T`` with forward, grad_input and grad_weight each one scaled FP8 GEMM (no bias).

    ``Fp8Linear.apply(x, weight, recipe)``: ``x`` of shape ``(..., K)``, ``weight`` ``(N, K)``, ``recipe`` a
    name in ``RECIPES`` or an ``Fp8Recipe``. The output and grad_input have ``x``'s dtype, grad_weight has
    ``weight``'s. Saves ``x`` and ``weight`` in their own precision and re-quantises them in backward along
    each GEMM's contraction dimension, as torchao does. Use ``fp8_linear`` for the bias and the shape check.
    """

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, recipe: Union[str, Fp8Recipe]) -> torch.Tensor:
        """The output GEMM on ``x`` flattened to (M, K)."""
        rec = resolve_recipe(recipe)
        check_dims(weight.shape[1], weight.shape[0], rec)
        y = _output(x.reshape(-1, x.shape[-1]), weight, rec, rec.native)
        return y if x.dim() == 2 else y.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        """Keep ``x``, ``weight`` and the recipe for backward."""
        x, weight, recipe = inputs
        ctx.save_for_backward(x, weight)
        ctx.recipe = resolve_recipe(recipe)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """grad_input and grad_weight GEMMs, each computed only when needed."""
        x, weight = ctx.saved_tensors
        rec = ctx.recipe
        g2 = grad_output.reshape(-1, grad_output.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _grad_input(g2, weight, x.dtype, rec, rec.native).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _grad_weight(g2, x.reshape(-1, x.shape[-1]), weight.dtype, rec, rec.native)
        return grad_x, grad_w, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    recipe: Union[str, Fp8Recipe] = "tensorwise",
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``Fp8Linear``; the bias is added after the GEMM in ``x``'s dtype.

    Raises a ValueError (``check_dims``) before any work when in_features or out_features is not a multiple of
    ``ALIGN``; any token count (batch x sequence) is accepted.
    """
    rec = resolve_recipe(recipe)
    check_dims(weight.shape[1], weight.shape[0], rec)
    # the Function sees x as (M, K) and returns its (M, N) GEMM output itself, the reshape is outside it: an output
    # the Function returned as a view could not be modified in place (Falcon's ``mlp_output += attention_output``)
    y = Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, rec.name if RECIPES.get(rec.name) == rec else rec)
    y = y.reshape(x.shape[:-1] + (weight.shape[0],))
    return y if bias is None else y + bias.to(y.dtype)


def emulate_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    grad_output: Optional[torch.Tensor],
    recipe: Union[str, Fp8Recipe] = "tensorwise",
) -> tuple:
    """The reference: ``(output, grad_input, grad_weight)`` by dequantise-then-fp32-matmul, same scales.

    Quantises exactly as ``Fp8Linear`` does and replaces each ``_scaled_mm`` by the float32 dequantised
    matmul, so with oneDNN off (``torch.backends.mkldnn.flags(enabled=False)``) CPU results are bit-equal.
    ``grad_output`` None skips the backward GEMMs (both grads returned as None). The bias gradient is not
    part of it (a plain sum over the leading dimensions).
    """
    rec = resolve_recipe(recipe)
    x2 = x.reshape(-1, x.shape[-1])
    y = _output(x2, weight, rec, native=False).reshape(x.shape[:-1] + (weight.shape[0],))
    if bias is not None:
        y = y + bias.to(y.dtype)
    if grad_output is None:
        return y, None, None
    g2 = grad_output.reshape(-1, grad_output.shape[-1])
    grad_x = _grad_input(g2, weight, x.dtype, rec, native=False).reshape(x.shape)
    grad_w = _grad_weight(g2, x2, weight.dtype, rec, native=False)
    return y, grad_x, grad_w
