"""The FP8 numeric core (issue 34): converter/fp8/kernels.py, torch only, copied later into model.py.

Dispatch-level: one forward + backward of an fp8 Linear runs exactly the recipe's ``aten._scaled_mm`` calls
(3, or 2 for rowwise_gw_hp, 0 for the emulated blockwise) with the recipe's float8 dtypes. With oneDNN off it
is bit-equal to the dequantise-then-fp32-matmul emulation of the same scales. SQNR against an fp32 Linear
meets torchao's floors with margin, and an e5m2 forward (a negative control) visibly does not.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from converter.fp8 import kernels
from converter.fp8.kernels import RECIPES, Fp8Linear, check_dims, emulate_linear, fp8_linear, misaligned_dims
from tests.helpers import sqnr

KERNELS = Path(kernels.__file__)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: the realistic shape of the brief: (B, T, K) = (4, 64, 256) @ 256 -> 512
SHAPE, OUT = (4, 64, 256), 512
#: floors: output above torchao's 18 dB with margin (an e4m3 GEMM measures ~28.6 dB), grad_weight torchao's 17 dB
OUT_DB, GW_DB = 25.0, 17.0
#: an upper bound fp8 cannot reach on these GEMMs (bf16 measures ~40-50 dB, fp32 far more)
FP8_CEILING_DB = 35.0
#: the recipes whose every GEMM is a native _scaled_mm (bit-equality with the emulation is checked on these)
NATIVE = ("tensorwise", "rowwise")


class ScaledMMCalls(TorchDispatchMode):
    """Records each ``aten._scaled_mm`` call: operand dtypes and scale shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            a, b, sa, sb = args[:4]
            self.calls.append(((a.dtype, b.dtype), (tuple(sa.shape), tuple(sb.shape))))
        return func(*args, **(kwargs or {}))


def _data(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=gen).to(dtype)
    w = (torch.randn(OUT, SHAPE[-1], generator=gen) / SHAPE[-1] ** 0.5).to(dtype)
    b = torch.randn(OUT, generator=gen).to(dtype)
    g = torch.randn(SHAPE[:-1] + (OUT,), generator=gen).to(dtype)
    return x, w, b, g


def _step(x, w, b, g, recipe, fn=fp8_linear):
    """One forward + backward: (output, grad_input, grad_weight)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, b, recipe) if fn is fp8_linear else fn(x, w, b)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _sqnrs(recipe, x, w, g):
    ref = _step(x, w, None, g, None, fn=F.linear)
    got = _step(x, w, None, g, recipe)
    return [sqnr(r, o) for r, o in zip(ref, got)]


# ------------------------------------------------------------------------------------ dispatch level


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_one_training_step_runs_the_recipes_scaled_mm_calls(name):
    recipe = RECIPES[name]
    x, w, b, g = _data(torch.bfloat16)
    with ScaledMMCalls() as seen:
        _step(x, w, b, g, name)
    assert len(seen.calls) == recipe.scaled_mm_calls, seen.calls
    expected = {"tensorwise": [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)],
                "rowwise": [(E4M3, E4M3)] * 3, "rowwise_gw_hp": [(E4M3, E4M3)] * 2, "blockwise": []}[name]
    assert [dtypes for dtypes, _ in seen.calls] == expected
    m, k, n = 4 * 64, SHAPE[-1], OUT
    if name == "tensorwise":
        assert all(shapes == ((), ()) for _, shapes in seen.calls), seen.calls
    elif name.startswith("rowwise"):  # forward (M,1)x(1,N), grad_input (M,1)x(1,K), grad_weight (N,1)x(1,K)
        assert [s for _, s in seen.calls] == [((m, 1), (1, n)), ((m, 1), (1, k)), ((n, 1), (1, k))][: len(seen.calls)]


def test_counts_follow_the_grads_asked_for():
    x, w, _, g = _data()
    with ScaledMMCalls() as seen:
        y = fp8_linear(x, w.requires_grad_(), None, "tensorwise")  # x needs no grad: no grad_input GEMM
        y.backward(g)
    assert len(seen.calls) == 2
    with ScaledMMCalls() as seen, torch.no_grad():
        fp8_linear(x, w, None, "tensorwise")
    assert len(seen.calls) == 1


def test_blockwise_is_refused_by_cpu_scaled_mm():
    # the reason blockwise is emulated: torch 2.13's CPU _scaled_mm takes tensorwise and rowwise scales only
    a = torch.randn(256, 256).to(E4M3)
    b = torch.randn(256, 256).to(E4M3)
    with pytest.raises((RuntimeError, ValueError), match="Invalid scaling configuration"):
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(256, 2), scale_b=torch.ones(2, 2), out_dtype=torch.float32)


# ---------------------------------------------------------------------------------- bit equality


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NATIVE)
def test_bit_equal_to_the_dequantise_matmul_emulation(name, dtype):
    x, w, b, g = _data(dtype)
    with torch.backends.mkldnn.flags(enabled=False):
        got = _step(x, w, b, g, name)
        want = emulate_linear(x, w, b, g, name)
    for label, o, e in zip(("output", "grad_input", "grad_weight"), got, want):
        assert o.dtype == e.dtype == dtype, (label, o.dtype, e.dtype)
        assert torch.equal(o, e), f"{name} {label}: max |diff| {(o.float() - e.float()).abs().max().item()}"


def test_fp32_master_weight_under_bf16_input_keeps_each_dtype():
    x, w, _, g = _data()
    x, g = x.bfloat16().requires_grad_(), g.bfloat16()
    w = w.requires_grad_()
    y = fp8_linear(x, w, None, "rowwise")
    y.backward(g)
    assert (y.dtype, x.grad.dtype, w.grad.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------- SQNR


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_sqnr_against_an_fp32_linear(name):
    x, w, _, g = _data()
    out_db, gi_db, gw_db = _sqnrs(name, x, w, g)
    assert out_db >= OUT_DB, f"{name}: output SQNR {out_db:.2f} dB < {OUT_DB}"
    assert gw_db >= GW_DB, f"{name}: grad_weight SQNR {gw_db:.2f} dB < {GW_DB}"
    assert gi_db >= GW_DB, f"{name}: grad_input SQNR {gi_db:.2f} dB < {GW_DB}"
    # and float8 ran in each scaled GEMM: an fp32 (or bf16) GEMM gives far more than fp8's ~25-29 dB
    # (rowwise_gw_hp's grad_weight is a plain fp32 matmul: exact here)
    scaled = [db for gemm, db in zip(("output", "grad_input", "grad_weight"), (out_db, gi_db, gw_db))
              if gemm in RECIPES[name].scaled_gemms]
    assert len(scaled) == len(RECIPES[name].scaled_gemms) and max(scaled) < FP8_CEILING_DB, (
        f"{name}: {out_db:.1f} / {gi_db:.1f} / {gw_db:.1f} dB: as if no fp8 ran")


def test_sqnr_negative_control_e5m2_forward_fails_the_floor():
    x, w, _, g = _data()
    e5m2_fwd = dataclasses.replace(RECIPES["tensorwise"], name="e5m2_fwd", input_dtype=E5M2, weight_dtype=E5M2)
    good = _sqnrs("tensorwise", x, w, g)[0]
    bad = _sqnrs(e5m2_fwd, x, w, g)[0]
    assert bad < OUT_DB, f"e5m2 forward measured {bad:.2f} dB: the SQNR floor {OUT_DB} cannot tell it from e4m3"
    assert good - bad >= 3.0, f"e4m3 {good:.2f} dB vs e5m2 {bad:.2f} dB"


def test_blockwise_tiles_isolate_an_outlier():
    # one huge 1x128 tile: per-tensor scaling crushes every other value, 1x128 tiles keep them
    x, w, _, g = _data()
    x = x.clone()
    x[0, 0, :128] *= 1e6  # the rest falls under e4m3's smallest subnormal (2**-9) after a tensorwise scale
    ref = F.linear(x, w)[1:]
    tensorwise = sqnr(ref, fp8_linear(x, w, None, "tensorwise")[1:])
    blockwise = sqnr(ref, fp8_linear(x, w, None, "blockwise")[1:])
    assert blockwise > tensorwise + 10, (blockwise, tensorwise)


# ---------------------------------------------------------------------------- scales and shapes


def test_power_of_2_scales_are_powers_of_two():
    x, w, _, _ = _data()
    for t, dim in ((x.reshape(-1, SHAPE[-1]), 1), (w.t(), 0)):
        t8, inv = kernels.quantize_operand(t, E4M3, RECIPES["rowwise"], contract_dim=dim)
        mantissa, _ = torch.frexp(inv)
        assert inv.shape == ((t.shape[0], 1) if dim == 1 else (1, t.shape[1]))
        assert torch.all(mantissa == 0.5), inv.flatten()[:8]
        scale = inv.reciprocal()  # rounded down: the scaled amax stays within e4m3's range
        assert torch.all(t.abs().amax(dim=dim, keepdim=True) * scale <= torch.finfo(E4M3).max)
    s = torch.tensor([1.0, 3.0, 1023.9, 1024.0, 0.3])
    assert kernels.round_down_to_power_of_2(s).tolist() == [1.0, 2.0, 512.0, 1024.0, 0.25]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_all_zero_input_gives_finite_zero_output(name):
    x, w, _, g = _data()
    y, gi, gw = _step(torch.zeros_like(x), w, None, g, name)
    assert torch.all(y == 0) and torch.isfinite(gi).all() and torch.all(gw == 0)


def test_saturation_clamps_instead_of_overflowing():
    t = torch.tensor([1.0, -2.0, 1e6])
    out = kernels.cast_to_fp8(t, torch.tensor(1.0), E4M3).float()
    assert out.tolist() == [1.0, -2.0, 448.0]


def test_misaligned_dims_raise_naming_them():
    x = torch.randn(2, 8, 40)
    w = torch.randn(24, 40, requires_grad=True)
    assert misaligned_dims(40, 24, "tensorwise") == [("K", 40), ("N", 24)]
    with pytest.raises(ValueError, match=r"in_features K=40, out_features N=24"):
        fp8_linear(x, w, None, "tensorwise")
    with pytest.raises(ValueError, match=r"out_features N=24"):
        Fp8Linear.apply(torch.randn(2, 8, 32), torch.randn(24, 32), "rowwise")
    # tokens M = 2*7 = 14 are not a dimension to report: the grad_weight GEMM zero-pads them (test_fp8_training.py)
    x, w = torch.randn(2, 7, 32), torch.randn(48, 32, requires_grad=True)
    assert misaligned_dims(32, 48, "rowwise") == [] and misaligned_dims(32, 48, "rowwise_gw_hp") == []
    fp8_linear(x, w, None, "rowwise").sum().backward()
    check_dims(32, 48, "blockwise")
    with pytest.raises(ValueError, match="unknown fp8 recipe 'nope'"):
        check_dims(32, 48, "nope")


# ----------------------------------------------------------------------------- export and imports


class _Fp8Module(torch.nn.Module):
    def __init__(self, recipe: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)
        self.recipe = recipe

    def forward(self, x):
        return fp8_linear(x, self.lin.weight, self.lin.bias, self.recipe)


@pytest.mark.parametrize("name", NATIVE)
def test_torch_export_inlines_the_forward(name):
    # plain torch.export (non-strict) inlines the Function's forward aten ops: one _scaled_mm, the same output;
    # the backward is NOT kept, and running backward through the exported graph fails loudly
    model, x = _Fp8Module(name), torch.randn(2, 16, 64)
    ep = torch.export.export(model, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten._scaled_mm.default) == 1
    assert torch.equal(ep.module()(x), model(x))
    with pytest.raises(RuntimeError, match="derivative for aten::_scaled_mm is not implemented"):
        ep.module()(x.clone().requires_grad_()).sum().backward()


def test_capture_keeps_the_function_with_its_backward():
    # what the converter's capture does with any user autograd Function: one call node, backward included
    from converter.passes.autograd_fns import OpaqueFunctions, autograd_function, restore_function_calls

    model, x = _Fp8Module("tensorwise"), torch.randn(2, 16, 64)
    with OpaqueFunctions():
        gm = torch.export.export(model, (x,)).module()
    assert restore_function_calls(gm) == 1
    assert [autograd_function(n) for n in gm.graph.nodes if autograd_function(n)] == [Fp8Linear]
    xg = x.clone().requires_grad_()
    with ScaledMMCalls() as seen:
        out = gm(xg)
        out.sum().backward()
    assert torch.equal(out, model(x))
    assert len(seen.calls) == 3 and gm.lin.weight.grad is not None and xg.grad is not None


def test_kernels_import_only_torch_and_the_standard_library():
    tree = ast.parse(KERNELS.read_text(encoding="utf-8"))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports: the module is copied verbatim into model.py"
            roots.add(node.module.split(".")[0])
    assert roots <= {"__future__", "dataclasses", "typing", "torch"}, roots


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_a_verbatim_copy_runs_on_its_own(tmp_path):
    # what model.py will hold: the file's text under another module name, outside the package
    copy = tmp_path / "fp8_model_copy.py"
    copy.write_text(KERNELS.read_text(encoding="utf-8"), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("fp8_model_copy", copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        x, w, b, g = _data()
        with torch.backends.mkldnn.flags(enabled=False):
            got = _step(x, w, b, g, "rowwise", fn=lambda *a: module.fp8_linear(*a, recipe="rowwise"))
            want = _step(x, w, b, g, "rowwise")
    finally:
        del sys.modules[spec.name]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
