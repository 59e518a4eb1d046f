"""Per-layer FP8 numerics (issue 34, item 3): ``measure_fp8_layers`` against an independent computation.

One Linear converted to fp8 (its gates off): the measured SQNRs equal ``sqnr_db`` of the dequantise-matmul
emulation against bf16 ``F.linear`` on the same operands and the same random-projection gradient; the
underflow share of an input with known tiny values is exact; dynamic scaling never overflows. The test
decoder of tests/test_fp8_rules.py, measured under FX and torch.export, meets torchao's per-layer floors.
"""
from __future__ import annotations

import math
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import converter
from converter.fp8.kernels import emulate_linear
from converter.numerics.common import sqnr_db
from converter.numerics.fp8_layers import Fp8LayerNumerics, measure_fp8_layers
from tests.test_fp8_rules import Decoder, _tokens

E4M3 = torch.float8_e4m3fn
#: torchao's floors (test/float8/test_base.py, _test_linear_impl): output 18 dB, weight gradient 17 dB
OUT_DB, GW_DB = 18.0, 17.0
ALL_FP8 = "[settings]\nfp8_keep_first = false\nfp8_keep_last = false\nfp8_min_flops_per_token = 0\n"


def _rules(tmp_path, text: str, name: str = "user.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


def _convert(model, example, rules, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SlowHalfWarning: this CPU has no fast bf16 math
        return converter.convert(model, example, precision="fp8", rules=rules, **kw)


def _crafted_input(tiny: int, seed: int = 1) -> torch.Tensor:
    """(2, 16, 32) values ±1 (amax 1, exact in bf16) but ``tiny`` of them ±1e-6: under tensorwise e4m3 (scale
    448) 1e-6 maps to 4.5e-4, below half the smallest subnormal 2**-10, so exactly those flush to zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.where(torch.rand(2, 16, 32, generator=gen) < 0.5, -1.0, 1.0)
    flat = x.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:tiny]] *= 1e-6
    return x


def test_one_layer_matches_an_independent_computation(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(32, 64)
    x = _crafted_input(tiny=40)
    conv = _convert(model, (x,), [_rules(tmp_path, ALL_FP8)])
    assert conv.report.extra["fp8"]["layers"] == ["linear"]
    with torch.backends.mkldnn.flags(enabled=False):  # _scaled_mm then equals the emulation bit for bit
        got = measure_fp8_layers(conv.module, [(x,)], "tensorwise", seed=7)
        # independently: the layer's operands are the bf16 casts; its grad_output is the seed's projection v
        xb, wb, bb = x.to(torch.bfloat16), model.weight.detach().to(torch.bfloat16), model.bias.detach().to(torch.bfloat16)
        v = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(7))
        g = v.to(torch.bfloat16)  # d⟨v, y.float()⟩/dy, in y's dtype
        y8, gx8, gw8 = emulate_linear(xb, wb, bb, g, "tensorwise")
        xr, wr = xb.clone().requires_grad_(), wb.clone().requires_grad_()
        yr = F.linear(xr, wr, bb)
        gxr, gwr = torch.autograd.grad(yr, (xr, wr), g)
    layer = got["linear"]
    assert isinstance(layer, Fp8LayerNumerics) and (layer.module, layer.recipe, layer.batches) == ("", "tensorwise", 1)
    want = {"output": sqnr_db(yr, y8), "grad_input": sqnr_db(gxr, gx8), "grad_weight": sqnr_db(gwr, gw8)}
    for gemm, db in want.items():
        assert layer.sqnr[gemm] == pytest.approx(db, abs=1e-9), (gemm, layer.sqnr[gemm], db)
    assert layer.flops == 2 * 32 * 32 * 64  # 2·M·K·N
    assert layer.amax == {"x": 1.0, "weight": float(wb.abs().max()), "grad_output": float(g.abs().max())}
    # exact: the 40 tiny inputs of 1024 underflow (both casts of x share one tensorwise scale); none overflows
    assert layer.underflow["x"] == 40 / 1024, layer.underflow
    w_scale = 448.0 / float(wb.float().abs().max())
    w_under = int(((wb != 0) & ((wb.float() * w_scale).to(E4M3).float() == 0)).sum())
    assert layer.underflow["weight"] == w_under / int((wb != 0).sum()), (layer.underflow, w_under)
    assert layer.overflow == {"x": 0.0, "weight": 0.0, "grad_output": 0.0}, layer.overflow
    print(f"\none layer: {', '.join(f'{k} {v:.2f} dB' for k, v in layer.sqnr.items())}")


def test_several_batches_add_energies_and_counts(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(32, 64)
    a, b = _crafted_input(tiny=40, seed=1), _crafted_input(tiny=0, seed=2)
    conv = _convert(model, (a,), [_rules(tmp_path, ALL_FP8)])
    both = measure_fp8_layers(conv.module, [(a,), (b,)], "tensorwise")["linear"]
    one = measure_fp8_layers(conv.module, [(a,)], "tensorwise")["linear"]
    assert both.batches == 2 and both.underflow["x"] == 40 / 2048, both.underflow
    assert both.sqnr_output != one.sqnr_output and math.isfinite(both.sqnr_output)
    assert measure_fp8_layers(conv.module, [(a,)], "tensorwise")["linear"] == one  # deterministic
    with pytest.raises(ValueError, match="no calibration batch"):
        measure_fp8_layers(conv.module, [], "tensorwise")


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_test_decoder_meets_torchaos_floors_per_layer(tmp_path, tracer):
    torch.manual_seed(0)
    model = Decoder()
    rules = _rules(tmp_path, "[settings]\nfp8_min_flops_per_token = 4096\n")
    conv = _convert(model, (_tokens(),), [rules], tracer=tracer)
    layers = conv.report.extra["fp8"]["layers"]
    got = measure_fp8_layers(conv.module, [(_tokens(5),), (_tokens(6),)], "tensorwise")
    assert sorted(got) == sorted(layers) and len(got) == 9
    rows = []
    for name, layer in got.items():
        db = layer.sqnr
        assert db["output"] >= OUT_DB and db["grad_input"] >= OUT_DB and db["grad_weight"] >= GW_DB, (name, db)
        assert layer.overflow == {"x": 0.0, "weight": 0.0, "grad_output": 0.0}, (name, layer.overflow)
        assert layer.module == name.replace("_", ".", 2) and layer.flops > 0
        rows.append(f"{name} {db['output']:.2f}/{db['grad_input']:.2f}/{db['grad_weight']:.2f}")
    print(f"\n{tracer}: output/grad_input/grad_weight dB: " + "; ".join(rows))
