"""Per-layer FP8 numerics and the SQNR fallback (issue 34, items 3 and 4).

* ``measure_fp8_layers`` against an independent computation: one Linear converted to fp8 (its gates off), the
  measured SQNRs equal ``sqnr_db`` of the dequantise-matmul emulation against bf16 ``F.linear`` on the same
  operands and the same random-projection gradient; the underflow share of an input with known tiny values is
  exact; dynamic scaling never overflows.
* The fallback: a layer whose weight has an outlier that flushes every other weight to zero under tensorwise
  scaling is kept bf16 with the rule setting and the measured dB in its reason, and runs no ``_scaled_mm``;
  a user's rule file moves the floors (provenance: that file).
* The test decoder of tests/test_fp8_rules.py, converted with calibration under FX and torch.export, keeps all
  its fp8 layers, each over torchao's floors; report.json's ``fp8`` section is consistent with its node rows.
"""
from __future__ import annotations

import math
import textwrap
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import converter
from converter.fp8.kernels import emulate_linear, fp8_linear
from converter.ir.meta import META_DECISION
from converter.numerics.common import sqnr_db
from converter.numerics.fp8_layers import Fp8LayerNumerics, measure_fp8_layers
from converter.report.flops import GEMM_OPS
from converter.rules.loader import RulesError, load_rules
from tests.test_fp8_rules import Decoder, ScaledMMCalls, _tokens

E4M3 = torch.float8_e4m3fn
#: torchao's floors (test/float8/test_base.py, _test_linear_impl): output 18 dB, weight gradient 17 dB
OUT_DB, GW_DB = 18.0, 17.0
ALL_FP8 = "[settings]\nfp8_keep_first = false\nfp8_keep_last = false\nfp8_min_flops_per_token = 0\n"


def _rules(tmp_path, text: str, name: str = "user.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


def _convert(model, example, rules, **kw):
    if "calibration" in kw:
        kw["calibration_options"] = {"progress": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SlowHalfWarning: this CPU has no fast bf16 math
        return converter.convert(model, example, precision="fp8", rules=rules, **kw)


def _batches(n: int, shape: tuple = (2, 16, 32)) -> list:
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(*shape, generator=gen),) for _ in range(n)]


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
    assert conv.report.records.fp8.layers == ["linear"]
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
        assert layer.by_gemm[gemm] == pytest.approx(db, abs=1e-9), (gemm, layer.by_gemm[gemm], db)
    assert layer.flops == 2 * 32 * 32 * 64  # 2·M·K·N
    assert layer.amax == {"x": 1.0, "weight": float(wb.abs().max()), "grad_output": float(g.abs().max())}
    # exact: the 40 tiny inputs of 1024 underflow (both casts of x share one tensorwise scale); none overflows
    assert layer.underflow["x"] == 40 / 1024, layer.underflow
    w_scale = 448.0 / float(wb.float().abs().max())
    w_under = int(((wb != 0) & ((wb.float() * w_scale).to(E4M3).float() == 0)).sum())
    assert layer.underflow["weight"] == w_under / int((wb != 0).sum()), (layer.underflow, w_under)
    assert layer.overflow == {"x": 0.0, "weight": 0.0, "grad_output": 0.0}, layer.overflow
    print(f"\none layer: {', '.join(f'{k} {v:.2f} dB' for k, v in layer.by_gemm.items())}")


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




# ----------------------------------------------------------------------------------------------- fallback


def _mlp(broken: bool) -> nn.Sequential:
    """32 -> 64 -> 96 -> 32 with ReLUs. ``broken``: hidden unit 5 of the first layer is dead (always 0 after
    its ReLU), and the middle layer's weight has an outlier 1e6 on that input: it never reaches an output, but
    sets the tensorwise scale so that every other weight (|w| <= 1/8) maps below 2**-10 and flushes to zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))
    if broken:
        with torch.no_grad():
            model[0].weight[5], model[0].bias[5] = 0.0, -1.0
            model[2].weight[0, 5] = 1e6
    return model


def _train_step(gm, x):
    gm.zero_grad(set_to_none=True)
    gm(x).float().pow(2).mean().backward()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_layer_that_quantises_badly_is_kept_bf16_with_the_rule(tmp_path, tracer):
    x = _batches(1)[0][0]
    conv = _convert(_mlp(broken=True), (x,), [_rules(tmp_path, ALL_FP8)], tracer=tracer, calibration=_batches(2))
    fp8 = conv.report.to_dict()["fp8"]
    assert fp8["layers"] == ["m_0", "m_4"] and fp8["count"] == 2, fp8["layers"]
    [row] = fp8["fallback"]
    db = row["sqnr_db"]
    assert (row["node"], row["gemm"], row["min_db"]) == ("m_2", "output", 18.0) and db < 18.0, row
    assert row["rule"] == "fp8.toml:[settings].fp8_min_sqnr_output", row
    node = next(n for n in conv.module.graph.nodes if n.name == "m_2")
    decision = node.meta[META_DECISION]
    assert (decision.requested, decision.precision, str(decision.rule)) == ("bf16", "bf16", row["rule"])
    assert f"output SQNR {db:.2f} dB < fp8_min_sqnr_output = 18 dB" in decision.reason, decision.reason
    assert "the fp8 rule was fp8.toml:[op].linear" in decision.reason, decision.reason
    assert node.target is (torch.ops.aten.linear.default if tracer == "export" else F.linear), node.target
    layer = {r["node"]: r for r in fp8["numerics"]}["m_2"]
    assert layer["underflow"]["weight"] == 6143 / 6144 and not layer["fp8"], layer  # all but the outlier flush
    assert "output" in layer["below"] and all(r["below"] == [] for r in fp8["numerics"] if r["node"] != "m_2")
    # the kept layer runs no _scaled_mm (it would add (32,96) forward, (32,64) grad_input, (96,64) grad_weight);
    # m_0: (32,64) forward, (64,32) grad_weight (no grad_input: the model input needs none); m_4: (32,32) forward,
    # (32,96) grad_input, (32,96) grad_weight
    with ScaledMMCalls() as seen:
        _train_step(conv.module, x)
    assert Counter(seen.shapes) == {(32, 64): 1, (64, 32): 1, (32, 32): 1, (32, 96): 2}, seen.shapes
    html, md = conv.report.to_html(), conv.report.to_markdown()
    assert html.count('fp8-below') == len(layer["below"]) and 'id="fp8-table"' in html
    assert f"**{db:.1f} dB < 18.0 dB**" in md and "| m_2 | 2 | bf16 (fallback) |" in md, md[md.index("## FP8"):][:1500]


def test_a_users_rule_file_moves_the_floors(tmp_path):
    x = _batches(1)[0][0]
    rules = _rules(tmp_path, ALL_FP8 + "fp8_min_sqnr_grad_weight = 30.0\n", "strict.toml")
    conv = _convert(_mlp(broken=False), (x,), [rules], calibration=_batches(1))
    fp8 = conv.report.to_dict()["fp8"]
    assert fp8["layers"] == [] and [r["node"] for r in fp8["fallback"]] == ["m_0", "m_2", "m_4"], fp8["fallback"]
    assert {(r["gemm"], r["rule"]) for r in fp8["fallback"]} == {("grad_weight", f"{rules}:[settings].fp8_min_sqnr_grad_weight")}
    assert fp8["thresholds"]["grad_weight"] == {"min_db": 30.0, "rule": f"{rules}:[settings].fp8_min_sqnr_grad_weight"}
    with ScaledMMCalls() as seen:
        _train_step(conv.module, x)
    assert seen.calls == []
    never = _rules(tmp_path, ALL_FP8 + "fp8_min_sqnr_output = -inf\nfp8_min_sqnr_grad_input = -inf\n", "never.toml")
    conv = _convert(_mlp(broken=True), (x,), [never], calibration=_batches(1))
    assert conv.report.records.fp8.fallback == [] and conv.report.records.fp8.count == 3
    for bad in ('"18"', "nan", "inf", "true"):
        with pytest.raises(RulesError, match=r"fp8_min_sqnr_output: must be a number of dB"):
            load_rules([_rules(tmp_path, f"[settings]\nfp8_min_sqnr_output = {bad}\n", "bad.toml")])


# ----------------------------------------------------------------------------------------------- decoder


def _fp8_flops_share(data: dict) -> float:
    gemm = sum(r["flops"] for r in data["nodes"] if r["op"] in GEMM_OPS)
    return sum(r["flops"] for r in data["nodes"] if r.get("gemm") == "fp8") / gemm


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_test_decoder_keeps_every_fp8_layer_over_torchaos_floors(tmp_path, tracer):
    torch.manual_seed(0)
    rules = _rules(tmp_path, "[settings]\nfp8_min_flops_per_token = 4096\n")
    calibration = [(_tokens(5),), (_tokens(6),)]
    conv = _convert(Decoder(), (_tokens(),), [rules], tracer=tracer, calibration=calibration)
    data = conv.report.to_dict()
    fp8 = data["fp8"]
    assert fp8["fallback"] == [] and fp8["count"] == 9 and len(fp8["numerics"]) == 9
    assert fp8["layers"] == [r["name"] for r in data["nodes"] if r.get("gemm") == "fp8"]
    assert all(r["precision"] == "bf16" for r in data["nodes"] if r.get("gemm") == "fp8")
    assert fp8["flops_share"] == pytest.approx(_fp8_flops_share(data), rel=1e-12) and 0 < fp8["flops_share"] < 1
    rows = []
    for layer in fp8["numerics"]:
        db = layer["sqnr"]
        assert db["output"] >= OUT_DB and db["grad_input"] >= GW_DB and db["grad_weight"] >= GW_DB, layer
        assert layer["fp8"] and layer["below"] == [] and layer["batches"] == 2 and layer["flops"] > 0, layer
        assert layer["overflow"] == {"x": 0.0, "weight": 0.0, "grad_output": 0.0}, layer
        assert layer["flops"] == next(r["flops"] for r in data["nodes"] if r["name"] == layer["node"])
        rows.append(f"{layer['node']} {db['output']:.1f}/{db['grad_input']:.1f}/{db['grad_weight']:.1f}")
    assert all(n.target is fp8_linear for n in conv.module.graph.nodes if n.name in fp8["layers"])
    html = conv.report.to_html()
    assert 'id="fp8-table"' in html and "fp8-below" not in html and all(f">{n}<" in html for n in fp8["layers"])
    print(f"\n{tracer}: output/grad_input/grad_weight dB: " + "; ".join(rows))


def test_without_calibration_the_report_has_the_flops_share_and_no_numerics():
    torch.manual_seed(0)
    conv = _convert(_mlp(broken=False), (_batches(1)[0][0],), None)
    data = conv.report.to_dict()
    fp8 = data["fp8"]
    assert fp8["numerics"] is None and fp8["fallback"] == [] and fp8["layers"] == []  # the built-in gates: tiny
    assert fp8["flops_share"] == 0.0 and fp8["thresholds"]["output"]["rule"] == "fp8.toml:[settings].fp8_min_sqnr_output"
    assert "not measured: convert with calibration batches" in conv.report.to_markdown()
