"""Core pass (issue 2): samples, runtime dtypes, identity, structure, TF replay."""
from __future__ import annotations

import textwrap

import pytest
import torch
from helpers import CastCounter, DtypeRecorder, first_tensor, load_sample, split_inputs, sqnr
from torch import nn

import converter

HALF_OPS = ("addmm", "mm", "bmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu", "baddbmm")
FP32_OPS = ("_softmax", "_log_softmax", "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
            "nll_loss_forward", "pow", "mean", "rsqrt")
FX_SAMPLES = ("mlp", "cnn", "tiny_transformer")


def _convert(name, precision, **kw):
    mod = load_sample(name)
    model = mod.build_model()
    example = mod.example_inputs()
    conv = converter.convert(model, example, precision=precision, **kw)
    return model, example, conv


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", FX_SAMPLES)
def test_sample_converts_runs_and_trains(name, precision):
    model, example, conv = _convert(name, precision)
    args, kwargs = split_inputs(example)
    out = first_tensor(conv.module(*args, **kwargs))
    ref = first_tensor(model(*args, **kwargs))
    assert out.dtype == ref.dtype == torch.float32, f"output dtype {out.dtype}, original {ref.dtype}"
    s = sqnr(ref, out)
    assert s > 25, f"{name} {precision}: SQNR vs fp32 {s:.1f} dB"
    out.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in conv.module.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    bad = {n: g.dtype for n, g in grads.items() if g.dtype != torch.float32}
    assert not bad, f"non-fp32 parameter gradients: {bad}"
    summary = conv.report.summary
    assert sum(summary["by_precision"].values()) == summary["compute_nodes"]
    assert summary["by_precision"][precision] > 0


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_runtime_dtypes_tiny_transformer(tracer):
    model, example, conv = _convert("tiny_transformer", "bf16", tracer=tracer)
    assert conv.tracer == tracer
    rec = DtypeRecorder()
    with rec:
        out = conv.module(*example)
    assert out.dtype == torch.float32
    half = rec.dtypes_of(*HALF_OPS)
    assert len(half) >= 2 * 2 * 3 + 1, f"too few matmul-class calls recorded: {len(half)}"
    assert all(set(d) == {torch.bfloat16} for d in half), [d for d in half if set(d) != {torch.bfloat16}]
    sdpa = rec.dtypes_of("_scaled_dot_product_flash_attention_for_cpu")
    assert sdpa and all(set(d) == {torch.bfloat16} for d in sdpa), sdpa
    fp32 = rec.dtypes_of("_softmax", "pow", "mean", "rsqrt")
    # explicit softmax in layer 1; RMSNorm (pow, mean, rsqrt) ×5
    assert len(rec.dtypes_of("_softmax")) == 1
    assert len(rec.dtypes_of("rsqrt")) == 5
    assert all(set(d) == {torch.float32} for d in fp32), fp32
    # the whole hand-written RMSNorm is fp32, its scaling mul included (module_type rule)
    rms_nodes = [r for r in conv.report.nodes if r["module_type"] == "RMSNorm"]
    assert rms_nodes and {r["precision"] for r in rms_nodes} == {"fp32"}
    assert all("RMSNorm" in r["rule"] for r in rms_nodes if r["op"] in ("pow", "mean", "rsqrt", "mul"))


def test_runtime_dtypes_cnn_and_mlp():
    _, example, conv = _convert("cnn", "bf16")
    rec = DtypeRecorder()
    with rec:
        loss = conv.module(*example)
    assert loss.dtype == torch.float32
    convs = rec.dtypes_of("convolution")
    assert len(convs) == 3 and all(set(d) == {torch.bfloat16} for d in convs), convs
    bns = rec.dtypes_of("native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update")
    assert len(bns) == 3 and all(set(d) == {torch.float32} for d in bns), bns
    for op in ("_log_softmax", "nll_loss_forward"):
        calls = rec.dtypes_of(op)
        assert len(calls) == 1 and set(calls[0]) == {torch.float32}, (op, calls)
    _, example, conv = _convert("mlp", "bf16")
    rec = DtypeRecorder()
    with rec:
        conv.module(*example)
    lns = rec.dtypes_of("native_layer_norm")
    assert len(lns) == 1 and set(lns[0]) == {torch.float32}
    mms = rec.dtypes_of("addmm")
    assert len(mms) == 3 and all(set(d) == {torch.bfloat16} for d in mms), mms


ALL_FP32 = """
[op]
"*" = "fp32"
"""


@pytest.mark.parametrize("name", FX_SAMPLES)
def test_identity_all_fp32_is_bit_identical(tmp_path, name):
    path = tmp_path / "fp32.toml"
    path.write_text(ALL_FP32)
    model, example, conv = _convert(name, "bf16", rules=[path])
    args, kwargs = split_inputs(example)
    torch.manual_seed(0)
    ref = first_tensor(model(*args, **kwargs))
    torch.manual_seed(0)
    out = first_tensor(conv.module(*args, **kwargs))
    assert torch.equal(ref, out), f"max abs diff {(ref - out).abs().max().item()}"
    casts = [n for n in conv.module.graph.nodes if "mp_cast" in n.meta]
    assert casts == [], [n.name for n in casts]
    assert conv.report.summary["casts"] == 0 and conv.report.summary["weight_casts"] == 0
    counter = CastCounter(conv.module.parameters())
    with counter:
        conv.module(*args, **kwargs)
    assert counter.casts == 0 and counter.weight_casts == 0


class ThreeConsumers(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 8))
        self.w2 = nn.Parameter(torch.randn(8, 8))
        self.w3 = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = torch.exp(x)
        return (h @ self.w1) + (h @ self.w2) + (h @ self.w3)


def test_producer_feeding_three_half_ops_gets_one_cast():
    conv = converter.convert(ThreeConsumers(), (torch.randn(4, 8),), precision="bf16")
    act = [r for r in conv.report.casts if not r["on_weight"]]
    from_exp = [r for r in act if r["src"] == "exp"]
    assert len(from_exp) == 1, act
    assert from_exp[0]["dtype"] == "bf16" and len(from_exp[0]["consumers"]) == 3, from_exp
    counter = CastCounter(conv.module.parameters())
    with counter:
        conv.module(torch.randn(4, 8))
    assert counter.casts == conv.report.summary["casts"], (counter.casts, conv.report.summary)
    assert counter.bytes == conv.report.summary["cast_bytes"]
    assert counter.weight_casts == 3 == conv.report.summary["weight_casts"]


class TFSimple(nn.Module):
    """TF's AutoMixedPrecision "Simple" test rebuilt with torch ops (reference/tf_apex.md)."""

    def forward(self, x):
        deny1 = torch.exp(x)
        clr1 = torch.relu(deny1)
        infer1 = torch.sqrt(clr1)
        clr2 = torch.relu(infer1)
        allow1 = torch.matmul(clr2, clr2)
        clr3 = torch.relu(allow1)
        infer2 = torch.log(clr3)
        clr4 = torch.relu(infer2)
        deny2 = torch.erf(clr4)  # on no list
        return torch.relu(deny2)


TF_RULES = """
[op]
exp = "fp32"      # deny
sqrt = "fp32"     # infer, upstream of a deny: stays fp32 in TF
log = "fp32"      # infer after allow with no allow downstream
matmul = "half"   # allow
relu = "follow"   # clear
"""


def test_tf_simple_case(tmp_path):
    path = tmp_path / "tf.toml"
    path.write_text(TF_RULES)
    rules = converter.load_rules(path, include_default=False)
    conv = converter.convert(TFSimple(), (torch.rand(8, 8) + 0.5,), precision="fp16", rules=rules)
    got = {r["name"]: r["precision"] for r in conv.report.nodes}
    expected = {
        "exp": "fp32", "relu": "fp32", "sqrt": "fp32",
        "relu_1": "fp16", "matmul": "fp16", "relu_2": "fp16",
        "log": "fp32", "relu_3": "fp32", "erf": "fp32", "relu_4": "fp32",
    }
    assert got == expected
    assert conv.report.summary["casts"] == 2, conv.report.casts
    assert conv.report.summary["unmatched_ops"] == ["erf"]
    erf = next(r for r in conv.report.nodes if r["op"] == "erf")
    assert "no rule" in erf["reason"]


def test_already_half_model_adds_no_casts():
    """TF's "already half" case: a model that casts to half itself gets no extra cast around it."""

    class AlreadyHalf(nn.Module):
        def forward(self, x):
            h = x.to(torch.bfloat16)
            return torch.matmul(h, h).float()

    conv = converter.convert(AlreadyHalf(), (torch.randn(4, 4),), precision="bf16")
    inserted = [n.name for n in conv.module.graph.nodes if "mp_cast" in n.meta and n.meta["mp_cast"].inserted]
    assert inserted == [], inserted


def test_fp64_int_and_bool_tensors_untouched():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, x64, idx):
            y = self.lin(x)
            z = x64 * 2.0 + x64.sum()
            mask = y > 0
            return y.masked_fill(mask, 0.0), z, idx + 1

    conv = converter.convert(Mixed(), (torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64), torch.arange(2)))
    y, z, i = conv.module(torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64), torch.arange(2))
    assert (y.dtype, z.dtype, i.dtype) == (torch.float32, torch.float64, torch.int64)
    srcs = {n.meta["mp_cast"].src for n in conv.module.graph.nodes if "mp_cast" in n.meta}
    assert not any(s.startswith(("x64", "idx", "mul", "sum")) for s in srcs), srcs


def test_user_cast_respected_and_precision_aliases():
    class UserCast(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.softmax(self.lin(x).float(), dim=-1)

    for alias, expected in (("bf16-mixed", "bf16"), ("16-mixed", "fp16"), (torch.bfloat16, "bf16")):
        conv = converter.convert(UserCast(), (torch.randn(2, 8),), precision=alias)
        assert conv.precision == expected
        float_node = next(r for r in conv.report.nodes if r["op"] == "to")
        assert float_node["precision"] == "fp32" and "explicit cast" in float_node["reason"]
    with pytest.raises(ValueError, match="unknown precision"):
        converter.convert(UserCast(), (torch.randn(2, 8),), precision="fp4")


def test_banned_rule_raises_with_message(tmp_path):
    path = tmp_path / "ban.toml"
    path.write_text(textwrap.dedent("""
        [op]
        binary_cross_entropy = { precision = "banned", message = "use binary_cross_entropy_with_logits" }
    """))

    class BCE(nn.Module):
        def forward(self, x, y):
            return nn.functional.binary_cross_entropy(torch.sigmoid(x), y)

    with pytest.raises(converter.BannedOpError, match="binary_cross_entropy_with_logits"):
        converter.convert(BCE(), (torch.randn(4), torch.rand(4)), rules=[path])


def test_decisions_mapping_and_provenance():
    _, _, conv = _convert("mlp", "bf16")
    decisions = conv.decisions
    assert decisions, "no decisions"
    for name, d in decisions.items():
        assert d.precision in ("fp32", "bf16", "fp16"), (name, d)
        assert d.rule is not None and d.reason, (name, d)
    for node in conv.module.graph.nodes:
        rec = node.meta.get("mp_cast")
        if rec is not None:
            assert rec.rule is not None and rec.reason, node.name


def test_untraceable_model_raises_capture_error():
    class Bad(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x * 2
            import os

            return x * int(os.getpid() > 0 and x.mean().item() > 100)

    with pytest.raises(converter.CaptureError) as info:
        converter.convert(Bad(), (torch.randn(3),), partial=False)
    assert set(info.value.reasons) == {"fx", "export"}
    with pytest.raises(converter.CaptureError, match="fx"):
        converter.convert(Bad(), (torch.randn(3),), tracer="fx", partial=False)
    # by default it converts: nothing in it captures (no submodule), so all of it is the glue, under autocast
    conv = converter.convert(Bad(), (torch.randn(3),))
    assert conv.partition.regions == () and [b.module for b in conv.graph_breaks] == [""], conv.graph_breaks
    assert conv.report.summary["captured_flop_fraction"] == 0.0


def test_opt_level_o2_placement_treats_weight_casts_as_free():
    """O2: weights (parameters only matmuls read) are stored in the dtype their matmuls want, so their
    casts are free; a norm's scale is no weight: it keeps fp32 storage, so O2 places the RMSNorm's
    multiplies exactly as O1 does (its cast would cost every step) and the statistics stay fp32."""
    _, example, o1 = _convert("tiny_transformer", "bf16")
    _, _, o2 = _convert("tiny_transformer", "bf16", opt_level="O2")
    scale = lambda conv: {r["name"]: r["precision"] for r in conv.report.nodes if r["module_type"] == "RMSNorm" and r["op"] == "mul"}
    assert set(scale(o1).values()) == {"fp32"} and scale(o2) == scale(o1), scale(o2)
    stats = {r["precision"] for r in o2.report.nodes if r["module_type"] == "RMSNorm" and r["op"] in ("pow", "mean", "rsqrt")}
    assert stats == {"fp32"}
    dtypes = o2.module.meta["mp_param_dtypes"]
    weights = {name for name in dtypes if name.endswith(("qkv.weight", "proj.weight", "gate.weight", "up.weight", "down.weight"))}
    assert len(weights) == 10 and {dtypes[n] for n in weights} == {torch.bfloat16}, dtypes
    assert dtypes["layers.0.attn_norm.weight"] == torch.float32 and dtypes["embed.weight"] == torch.float32
    o1_weights = o1.report.summary["weight_cast_bytes"]
    assert o1_weights > 0 and o2.report.memory["param_bytes_o2"] < o1.report.memory["param_bytes_o1"]
    ref = o1.original(*example)
    s = sqnr(ref, o2.module(*example))
    assert s > 40, f"O2 SQNR {s:.1f} dB"
    with pytest.raises(ValueError, match="opt_level"):
        _convert("mlp", "bf16", opt_level="O3")


class WithMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.norm(x + y)


def test_auto_prefers_export_over_opaque_fx_leaves():
    """symbolic_trace keeps nn.MultiheadAttention as an opaque fp32 leaf; auto then uses export,
    which traces into it so its projections run in half."""
    x = torch.randn(2, 5, 16)
    fx = converter.convert(WithMHA(), (x,), tracer="fx")
    assert fx.tracer == "fx"
    opaque = [r for r in fx.report.nodes if r["module_type"] == "MultiheadAttention"]
    assert opaque and {r["precision"] for r in opaque} == {"fp32"} and "opaque leaf module" in opaque[0]["reason"]
    auto = converter.convert(WithMHA(), (x,))
    assert auto.tracer == "export" and "opaque leaf modules MultiheadAttention" in auto.report.records.run.capture_errors["fx"]
    linears = [r for r in auto.report.nodes if r["op"] == "linear"]
    assert len(linears) >= 2 and {r["precision"] for r in linears} == {"bf16"}, linears
    model = WithMHA().eval()
    s = sqnr(model(x), converter.convert(model, (x,)).module(x))
    assert s > 35, f"SQNR {s:.1f} dB"


def test_module_is_a_plain_graphmodule_with_code_generated_once():
    """Capture builds a lazy GraphModule (no code for a graph that is rewritten anyway); convert
    hands back a plain one, generated once after the rewrite: TorchScript compiles it."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    sample = load_sample("tiny_transformer")
    conv = converter.convert(sample.build_model(), sample.example_inputs())
    assert not isinstance(conv.module, _LazyGraphModule)
    assert set(conv.timings) >= {"capture_s", "pass_s", "codegen_s"}
    assert ".to(torch.bfloat16)" in conv.module.code
    assert conv.module.meta["mp_graph"].tracer == "fx" and "mp_param_dtypes" in conv.module.meta
    scripted = torch.jit.script(conv.module)
    args, kwargs = split_inputs(sample.example_inputs())
    with torch.no_grad():
        assert torch.equal(first_tensor(scripted(*args, **kwargs)), first_tensor(conv.module(*args, **kwargs)))


def test_fp16_overflow_check_leaves_batch_norm_statistics_alone():
    """convert(precision="fp16") runs the converted graph beside its fp32 twin to find overflows; in
    train mode that must not update the batch-norm statistics of the module it hands back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).train()
    conv = converter.convert(model, (torch.randn(2, 3, 8, 8),), precision="fp16")
    buffers = dict(conv.module.named_buffers())
    stats = {name: buf for name, buf in buffers.items() if name.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    assert len(stats) == 3, sorted(buffers)
    assert int(stats["1.num_batches_tracked"]) == 0, int(stats["1.num_batches_tracked"])
    assert torch.equal(stats["1.running_mean"], torch.zeros(8)), stats["1.running_mean"]
    assert torch.equal(stats["1.running_var"], torch.ones(8)), stats["1.running_var"]
