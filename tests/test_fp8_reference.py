"""An independent reference for the fp8 kernels (converter/fp8/kernels.py): float64 arithmetic written here.

``test_fp8_kernels.py`` checks the kernels bit for bit against ``emulate_linear``, which shares their
quantisation code (scales, saturated casts, tiles): a bug there would sit on both sides. Here each recipe is
re-derived from its description (the kernels' module docstring) in float64: the amax of each scale group, the
scale ``fp8_max / amax`` (a power of two rounded down where the recipe says so), e4m3/e5m2 rounding to nearest
even with saturation and subnormals, dequantisation and the GEMM, all in float64, with no call into
``converter`` and no float8 cast of torch. The rounding itself is checked against torch's float8 casts first,
an independent implementation.

The kernels' results (float32 GEMMs of float32 scales) must match the float64 reference far more closely than
they match an fp32 Linear: a wrong format, a scale on the wrong axis or a missing saturation moves them by the
size of fp8 rounding (~28 dB), which these floors cannot miss.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import sqnr

from converter.fp8.kernels import fp8_linear

#: (exponent bits, mantissa bits, largest finite value) of the two formats; e4m3fn has no infinities and uses
#: the top exponent for finite values (largest 448 = 1.75 * 2**8), e5m2 is IEEE-like (largest 57344 = 1.75 * 2**15)
FORMATS = {"e4m3": (4, 3, 448.0), "e5m2": (5, 2, 57344.0)}
TORCH_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
AMAX_FLOOR = 1e-12

#: the recipes as their description states them: (input, weight, grad_output) formats, scale granularity,
#: power-of-two scales, and which GEMMs are scaled (the others run as a plain matmul)
RECIPE = {
    "tensorwise": (("e4m3", "e4m3", "e5m2"), "tensor", False, ("output", "grad_input", "grad_weight")),
    "rowwise": (("e4m3", "e4m3", "e4m3"), "row", True, ("output", "grad_input", "grad_weight")),
    "rowwise_gw_hp": (("e4m3", "e4m3", "e4m3"), "row", True, ("output", "grad_input")),
    "blockwise": (("e4m3", "e4m3", "e4m3"), "block", False, ("output", "grad_input", "grad_weight")),
}
BLOCK = 128
#: the kernels (float32 scales, products and GEMMs) against the float64 reference, and the reference against an
#: fp32 Linear: fp8 rounding costs ~25-29 dB, float32 arithmetic on the same quantised values leaves 130+ dB
MATCH_DB, FP8_BELOW_DB = 100.0, 40.0  # measured: 131-162 dB and 24.6-28.9 dB


def round_to_format(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """``v`` (float64) rounded to the nearest value of ``fmt``, ties to even, saturated to its finite range."""
    exp_bits, man_bits, top = FORMATS[fmt]
    bias = 2 ** (exp_bits - 1) - 1
    min_exp = 1 - bias  # smallest normal exponent; below it the spacing stays 2**(min_exp - man_bits)
    v = v.clamp(-top, top)
    mag = v.abs()
    exp = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag))))
    exp = torch.clamp(exp, min=min_exp)
    quantum = torch.pow(2.0, exp - man_bits)
    return torch.round(v / quantum) * quantum  # torch.round: half to even; v / quantum is exact (a power of two)


def _groups_amax(t: torch.Tensor, tile: tuple) -> torch.Tensor:
    """The amax of each ``tile`` (rows, cols) of ``t``, expanded to ``t``'s shape (edge tiles partial)."""
    rows, cols = t.shape
    out = torch.empty_like(t)
    for r in range(0, rows, tile[0]):
        for c in range(0, cols, tile[1]):
            out[r:r + tile[0], c:c + tile[1]] = t[r:r + tile[0], c:c + tile[1]].abs().max()
    return out


def _tile(t: torch.Tensor, granularity: str, contract_dim: int, is_weight: bool) -> tuple:
    rows, cols = t.shape
    if granularity == "tensor":
        return rows, cols
    if granularity == "row":  # one scale per row of the left operand / column of the right, along the contraction
        return (1, cols) if contract_dim == 1 else (rows, 1)
    if is_weight:
        return BLOCK, BLOCK
    return (1, BLOCK) if contract_dim == 1 else (BLOCK, 1)


def dequantized(t: torch.Tensor, fmt: str, granularity: str, power_of_2: bool, contract_dim: int,
                is_weight: bool = False) -> torch.Tensor:
    """One GEMM operand (2-D, float64) as the GEMM sees it: scaled, rounded to ``fmt``, scaled back."""
    amax = _groups_amax(t, _tile(t, granularity, contract_dim, is_weight)).clamp(min=AMAX_FLOOR)
    scale = FORMATS[fmt][2] / amax
    if power_of_2:
        _mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
        scale = torch.pow(2.0, (exponent - 1).to(torch.float64))
    return round_to_format(t * scale, fmt) / scale


def reference_step(x, w, g, recipe: str) -> tuple:
    """(output, grad_input, grad_weight) of ``y = x @ w^T`` with loss gradient ``g``, in float64."""
    (f_in, f_w, f_g), granularity, p2, scaled = RECIPE[recipe]
    x, w, g = x.double().reshape(-1, x.shape[-1]), w.double(), g.double().reshape(-1, g.shape[-1])

    def q(t, fmt, contract_dim, is_weight=False):
        return dequantized(t, fmt, granularity, p2, contract_dim, is_weight)

    out = q(x, f_in, 1) @ q(w.t(), f_w, 0, True) if "output" in scaled else x @ w.t()
    grad_input = q(g, f_g, 1) @ q(w, f_w, 0, True) if "grad_input" in scaled else g @ w
    grad_weight = q(g.t(), f_g, 1) @ q(x, f_in, 0) if "grad_weight" in scaled else g.t() @ x
    return out, grad_input, grad_weight


def _data(shape=(2, 48, 256), out=384, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[0, 3, 17] = 40.0  # an outlier: tensorwise scales crush the rest, tiles and rows keep them
    w = torch.randn(out, shape[-1], generator=gen) / shape[-1] ** 0.5
    g = torch.randn(shape[:-1] + (out,), generator=gen) * 1e-3  # gradients far below 1: the scales must lift them
    return x, w, g


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_reference_rounding_agrees_with_torchs_float8_casts(fmt):
    """The float64 rounder (written above) against torch's own float8 cast: every finite code point maps to
    itself, and random values across the whole range (subnormals, ties, saturation) round the same way."""
    dtype = TORCH_DTYPE[fmt]
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype).to(torch.float64)
    codes = codes[torch.isfinite(codes)]
    assert torch.equal(round_to_format(codes, fmt), codes), fmt
    gen = torch.Generator().manual_seed(1)
    top = FORMATS[fmt][2]
    values = torch.cat([
        torch.randn(20000, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-8, 5, (20000,), generator=gen),
        (codes[:-1] + codes[1:]) / 2,  # exact midpoints between neighbours: ties to even
    ])
    values = values.clamp(-top, top)  # torch's cast does not saturate (e4m3fn: NaN past 464); the kernels clamp first
    want = values.to(torch.float32).to(dtype).to(torch.float64)  # the midpoints are exact in float32
    got = round_to_format(values, fmt)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{fmt}: {bad.numel()} values differ, e.g. {values[bad[:3]].tolist()} -> {got[bad[:3]].tolist()} " \
                             f"vs torch {want[bad[:3]].tolist()}"
    assert round_to_format(torch.tensor([1e9, -1e9], dtype=torch.float64), fmt).tolist() == [top, -top]


@pytest.mark.parametrize("recipe", sorted(RECIPE))
def test_kernels_match_the_float64_reference(recipe):
    """fp8_linear's output, grad_input and grad_weight against the float64 reference of the same recipe: within
    MATCH_DB, while the reference itself sits below FP8_BELOW_DB against exact float64 (fp8 rounding happened)."""
    x, w, g = _data()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xr, wr, None, recipe)
    y.backward(g)
    got = (y.detach().reshape(-1, y.shape[-1]), xr.grad.reshape(-1, x.shape[-1]), wr.grad)
    ref = reference_step(x, w, g, recipe)
    x64, w64, g64 = x.double().reshape(-1, x.shape[-1]), w.double(), g.double().reshape(-1, g.shape[-1])
    exact = (x64 @ w64.t(), g64 @ w64, g64.t() @ x64)
    scaled = RECIPE[recipe][3]
    for gemm, o, r, e in zip(("output", "grad_input", "grad_weight"), got, ref, exact):
        match, fp8_cost = sqnr(r, o.double()), sqnr(e, r)
        label = f"{recipe} {gemm}: kernels vs float64 reference {match:.1f} dB, reference vs exact {fp8_cost:.1f} dB"
        assert match >= MATCH_DB, label
        if gemm in scaled:  # fp8 ran: the reference is fp8-far from exact, the kernels fp8-far from exact too
            assert fp8_cost < FP8_BELOW_DB, f"{label}: the reference did not quantise"
            assert sqnr(e, o.double()) < FP8_BELOW_DB, f"{label}: the kernels vs exact {sqnr(e, o.double()):.1f} dB"


def test_a_wrong_format_misses_the_reference():
    """Negative control: the tensorwise kernels against a reference whose forward uses e5m2 differ by fp8
    rounding, far below MATCH_DB (the reference can tell formats apart)."""
    x, w, g = _data()
    y = fp8_linear(x, w, None, "tensorwise").reshape(-1, w.shape[0]).double()
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    wrong = dequantized(x64, "e5m2", "tensor", False, 1) @ dequantized(w64.t(), "e5m2", "tensor", False, 0, True)
    assert sqnr(wrong, y) < MATCH_DB - 30, f"{sqnr(wrong, y):.1f} dB"
    assert sqnr(F.linear(x, w).double().reshape(-1, w.shape[0]), y) < FP8_BELOW_DB
