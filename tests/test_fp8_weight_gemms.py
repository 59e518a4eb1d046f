"""fp8 for weight GEMMs that are not ``F.linear`` calls (issue 34): Falcon's ``x @ W.T`` and GPT-2's Conv1D addmm.

transformers' Falcon (``FalconLinear``: ``input @ self.weight.T``) and GPT-2 (``Conv1D``: ``torch.addmm(bias, x,
weight)``, weight (K, N)), small configs with the library's defaults, converted fp8 with the size gate lowered:
capture gives their projections the op alias ``weight_matmul`` and rules/fp8.toml's ``[op].weight_matmul`` marks
them fp8, the first/last gates apply in graph order with the linears, each fp8 layer runs exactly 3
``aten._scaled_mm`` per training step, the weight gradients land in the parameters' own shapes within
torchao's floors of the bf16 conversion, the per-layer numerics and report.json count them, and the bf16
conversion decides every node as it did before the alias existed.
"""
from __future__ import annotations

import warnings
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import converter
from converter.ir.meta import META_DECISION, META_INFO
from converter.ir.weight_gemm import gemm_operands, weight_parameter
from converter.numerics.fp8_layers import measure_fp8_layers
from tests.helpers import assert_half_ran, sqnr
from tests.test_fp8_rules import TENSORWISE, ScaledMMCalls

#: torchao's float8 floors: output 18 dB, weight gradient 17 dB
OUT_DB, GW_DB = 18.0, 17.0
#: per model: its weight GEMM op, the GEMM kept bf16 as the first of the graph, the fp8 layers (the other 7)
MODELS = {
    "falcon": ("matmul", "matmul", [f"matmul_{i}" for i in range(1, 8)]),
    "gpt2": ("addmm", "addmm", [f"addmm_{i}" for i in range(1, 8)]),
}
FP8_RULE = "fp8.toml:[op].weight_matmul"


def _decisions(gm: torch.fx.GraphModule) -> dict:
    return {n.name: n.meta[META_DECISION] for n in gm.graph.nodes if META_DECISION in n.meta}


def _convert(model, inputs, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SlowHalfWarning: this CPU has no fast bf16 math
        return converter.convert(model, inputs, **kwargs)


@pytest.fixture(scope="module", params=sorted(MODELS))
def zoo(request, tmp_path_factory):
    from tests.zoo_models import build

    name = request.param
    model, inputs = build(name, batch=2, length=16)
    rules = tmp_path_factory.mktemp(name) / "small.toml"
    rules.write_text("[settings]\nfp8_min_flops_per_token = 1024\n", encoding="utf-8")
    fp8 = _convert(model, inputs, precision="fp8", rules=[str(rules)])
    bf16 = _convert(model, inputs, precision="bf16")
    return SimpleNamespace(name=name, model=model, inputs=inputs, fp8=fp8, bf16=bf16, tokens=inputs[1]["input_ids"])


def _train_step(gm, tokens) -> torch.Tensor:
    gm.zero_grad(set_to_none=True)
    logits = gm(input_ids=tokens)["logits"]
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    return logits.detach().float()


def _weight_params(gm: torch.fx.GraphModule, names: list[str]) -> dict:
    """node -> the weight parameter its GEMM reads (through the casts and the stage's (N, K) view)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    found = {}
    for name in names:
        node = nodes[name]
        operand = node.args[1] if node.meta[META_INFO].op_alias and node.target.__name__ == "fp8_linear" else (
            gemm_operands(node, node.meta[META_INFO].op)[1])
        found[name] = weight_parameter(operand, gm)
    return found


def test_the_weight_gemms_are_fp8_layers_with_their_rule(zoo):
    op, first, layers = MODELS[zoo.name]
    section = zoo.fp8.report.records.fp8.to_dict()
    assert section["layers"] == layers and section["count"] == 7, section["layers"]
    decisions = _decisions(zoo.fp8.module)
    for name in layers:
        decision = decisions[name]
        assert (decision.requested, decision.precision, str(decision.rule)) == ("fp8", "bf16", FP8_RULE), (name, decision)
        assert "a linear by another name" in decision.reason and f"runs fp8_linear in place of its {op}" in decision.reason
        assert [m.rule.pattern for m in decision.matches[:2]] == ["weight_matmul", op], decision.matches
    kept = decisions[first]  # the first GEMM of the graph reads the embeddings: kept bf16 by the gate, with the rule it overrode
    assert (kept.requested, str(kept.rule)) == ("bf16", "fp8.toml:[settings].fp8_keep_first"), kept
    assert FP8_RULE in kept.reason and "first linear or weight GEMM" in kept.reason
    assert str(decisions["lm_head"].rule) == "fp8.toml:[module].lm_head"
    # the attention core stays bf16 (sdpa) and no other matmul of the graph is a weight GEMM
    assert all(d.requested != "fp8" for n, d in decisions.items() if n not in layers)


def test_each_fp8_layer_runs_three_scaled_mm_per_training_step(zoo):
    gm, tokens = zoo.fp8.module, zoo.tokens
    _train_step(gm, tokens)  # warm-up
    with ScaledMMCalls() as seen:
        _train_step(gm, tokens)
    assert Counter(seen.calls) == Counter(TENSORWISE * 7), seen.calls
    with ScaledMMCalls() as seen, torch.no_grad():
        gm(input_ids=tokens)
    assert len(seen.calls) == 7, seen.calls


def test_gradients_land_in_the_parameter_shapes_within_the_floors(zoo):
    layers = MODELS[zoo.name][2]
    fp8_params, ref_params = _weight_params(zoo.fp8.module, layers), _weight_params(zoo.bf16.module, layers)
    assert zoo.fp8.report.records.fp8.layers == layers, zoo.fp8.report.records.fp8.layers  # fp8 ran on them
    assert_half_ran(zoo.bf16, min_share=0.9, label=f"{zoo.name} bf16 reference")
    out = _train_step(zoo.fp8.module, zoo.tokens)
    got = {n: p.grad.clone() for n, p in fp8_params.items()}
    ref_out = _train_step(zoo.bf16.module, zoo.tokens)
    want = {n: p.grad.clone() for n, p in ref_params.items()}
    out_db = sqnr(ref_out, out)
    assert out_db >= OUT_DB, f"{zoo.name}: output SQNR {out_db:.2f} dB < {OUT_DB} dB"
    for name in layers:
        param = fp8_params[name]
        assert param is not ref_params[name] and got[name].shape == param.shape == want[name].shape, name
    if zoo.name == "gpt2":  # Conv1D stores (K, N): the gradient comes back through the (N, K) view in that layout
        assert tuple(fp8_params["addmm_2"].shape) == (64, 256), fp8_params["addmm_2"].shape
    worst = min((sqnr(want[n].float(), got[n].float()), n) for n in layers)
    assert worst[0] >= GW_DB, f"{zoo.name}: weight-gradient SQNR {worst[0]:.2f} dB < {GW_DB} dB ({worst[1]})"


def test_the_report_and_the_per_layer_numerics_count_them(zoo):
    layers = MODELS[zoo.name][2]
    tokens = zoo.tokens.numel()
    expected = {n: 2 * tokens * p.numel() for n, p in _weight_params(zoo.fp8.module, layers).items()}
    section = zoo.fp8.report.records.fp8.to_dict()
    assert section["flops"] == sum(expected.values()), (section["flops"], expected)
    assert 0.5 < section["flops_share"] < 1 and section["flops_share"] == section["flops"] / section["gemm_flops"], section
    numerics = measure_fp8_layers(zoo.fp8.module, [zoo.inputs], "tensorwise")
    assert list(numerics) == layers
    assert {n: r.flops for n, r in numerics.items()} == expected
    worst = min((r.sqnr_output, n) for n, r in numerics.items())
    assert worst[0] >= OUT_DB, f"{zoo.name}: per-layer output SQNR {worst[0]:.2f} dB < {OUT_DB} dB ({worst[1]})"
    assert all(r.sqnr_grad_weight is not None for r in numerics.values())


def test_the_bf16_conversion_is_unchanged(zoo, monkeypatch):
    op = MODELS[zoo.name][0]
    decisions = _decisions(zoo.bf16.module)
    gemms = [n for n in zoo.bf16.module.graph.nodes if getattr(n.meta.get(META_INFO), "op_alias", "")]
    assert len(gemms) == 8, [n.name for n in gemms]  # capture marks them in every conversion; no bf16 rule names the alias
    for node in gemms:
        decision = decisions[node.name]
        assert (decision.precision, decision.requested, str(decision.rule)) == ("bf16", "half", f"default.toml:[op].{op}")
        assert all(m.rule.pattern != "weight_matmul" for m in decision.matches)
    # the same conversion with the alias switched off (capture as before it existed): every decision identical
    monkeypatch.setattr("converter.passes.capture.annotation.op_alias", lambda node, op, root: "")
    before = _decisions(_convert(zoo.model, zoo.inputs, precision="bf16").module)
    now = {n: (d.precision, d.requested, str(d.rule), d.reason) for n, d in decisions.items()}
    assert now == {n: (d.precision, d.requested, str(d.rule), d.reason) for n, d in before.items()}


class _Projections(torch.nn.Module):
    """FX-captured weight GEMMs written three ways (``x @ W.t()``, ``torch.matmul(x, W.T)``, Conv1D's
    ``addmm(b, x, W)`` with W (K, N)) around an activation x activation matmul, between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.w1 = torch.nn.Parameter(torch.randn(128, 64) / 8)  # (N, K)
        self.w2 = torch.nn.Parameter(torch.randn(64, 128) / 11)  # (N, K)
        self.w3 = torch.nn.Parameter(torch.randn(64, 64) / 8)  # (K, N), as GPT-2's Conv1D stores it
        self.b3 = torch.nn.Parameter(torch.zeros(64))

    def forward(self, x):
        h = self.inp(x)
        h = torch.relu(h @ self.w1.t())
        h = torch.matmul(h, self.w2.T)
        scores = torch.softmax(h @ h.transpose(-1, -2), dim=-1) @ h  # activations only: stays bf16
        flat = torch.addmm(self.b3, scores.reshape(-1, 64), self.w3)
        return self.out(flat.reshape(h.shape))


def test_fx_weight_gemms_and_a_user_override(tmp_path):
    torch.manual_seed(0)
    model, x = _Projections(), torch.randn(2, 8, 32)
    rules = tmp_path / "small.toml"
    rules.write_text("[settings]\nfp8_min_flops_per_token = 1024\n", encoding="utf-8")
    conv = _convert(model, (x,), precision="fp8", rules=[str(rules)], tracer="fx")
    decisions = _decisions(conv.module)
    layers = conv.report.records.fp8.layers
    assert len(layers) == 3 and all(str(decisions[n].rule) == FP8_RULE for n in layers), layers
    assert sorted(decisions[n].reason.rsplit("in place of its ", 1)[1].split()[0] for n in layers) == ["addmm", "matmul", "matmul"]
    ops = {n.name: n.meta[META_INFO].op for n in conv.module.graph.nodes if META_DECISION in n.meta}
    first, last = [n for n in ops if ops[n] == "linear"]
    assert [str(decisions[n].rule) for n in (first, last)] == ["fp8.toml:[settings].fp8_keep_first",
                                                               "fp8.toml:[settings].fp8_keep_last"]
    core = [n for n in ops if ops[n] == "matmul" and n not in layers]
    assert len(core) == 2 and {str(decisions[n].rule) for n in core} == {"fp8.toml:[op].matmul"}
    x.requires_grad_(True)
    with ScaledMMCalls() as seen:
        conv.module(x).float().square().sum().backward()
    assert Counter(seen.calls) == Counter(TENSORWISE * 3), seen.calls
    assert model.w3.grad is None and dict(conv.module.named_parameters())["w3"].grad.shape == (64, 64)
    # a user file layered on top: its [op] matmul rule wins over fp8.toml's weight_matmul (the later file wins)
    user = tmp_path / "user.toml"
    user.write_text('[op]\nmatmul = { precision = "bf16", reason = "mine" }\n', encoding="utf-8")
    kept = _convert(model, (x.detach(),), precision="fp8", rules=[str(rules), str(user)], tracer="fx")
    assert [d for n, d in _decisions(kept.module).items() if str(d.rule) == f"{user}:[op].matmul"
            and n in layers] and len(kept.report.records.fp8.layers) == 1
