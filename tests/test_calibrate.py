"""Calibration: statistics against direct computation, the overflow fallback and its provenance."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import converter
from converter.numerics.calibrate import ToleranceNotMet, calibrate_and_redecide, recommend_loss_scale
from converter.numerics.common import sqnr_db
from converter.numerics.options import CalibrationOptions
from converter.numerics.ranges import FP16_MAX, TensorStats, tensor_stats
from converter.numerics.redecide import PlaceSettings
from converter.numerics.stats import NodeStats, collect_statistics
from converter.passes.capture import capture
from converter.passes.decide import decide
from converter.passes.place.stage import place
from converter.rules.loader import Rules, load_rules

# ---------------------------------------------------------------------------------------------
# helpers


def _calibrate(gm, batches, *, rules, target, **options):
    """The calibrate stage with the placement settings convert uses by default and ``options``."""
    return calibrate_and_redecide(gm, batches, rules=rules, settings=PlaceSettings(target=target),
                                  options=CalibrationOptions(**options))


def direct_stats(tensors) -> TensorStats:
    """The statistics computed the obvious way, for comparison."""
    a = torch.cat([t.detach().reshape(-1).float() for t in tensors]).abs()
    nan = torch.isnan(a)
    finite_or_inf = a[~nan]
    nonzero = finite_or_inf[finite_or_inf > 0]
    return TensorStats(
        count=a.numel(),
        absmax=float(finite_or_inf.max()) if finite_or_inf.numel() else 0.0,
        min_nonzero=float(nonzero.min()) if nonzero.numel() else math.inf,
        n_zero=int((a == 0).sum()),
        n_below_subnormal=int(((a > 0) & (a < 2.0**-24)).sum()),
        n_below_normal=int(((a > 0) & (a < 2.0**-14)).sum()),
        n_over_fp16=int(((a > 65504) & ~torch.isinf(a)).sum()),
        n_inf=int(torch.isinf(a).sum()),
        n_nan=int(nan.sum()),
        absmax_finite=float(a[torch.isfinite(a)].max()) if bool(torch.isfinite(a).any()) else 0.0,
    )


def decided(model, example, *, precision="fp16", rules=None):
    rule_set = rules if isinstance(rules, Rules) else load_rules(rules)
    gm = capture(model, example).gm
    decide(gm, rule_set, precision=precision)
    place(gm, target=precision)
    return gm, rule_set


class PlantedOverflow(nn.Module):
    """fc1 → relu → fc2 (outputs ~1e5) → LayerNorm → fc3: only fc2 overflows fp16."""

    def __init__(self, scale_input: torch.Tensor):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.fc3 = nn.Linear(32, 8)
        with torch.no_grad():
            peak = self.fc2(torch.relu(self.fc1(scale_input))).abs().max()
            self.fc2.weight.mul_(1e5 / peak)
            self.fc2.bias.mul_(1e5 / peak)

    def forward(self, x):
        return self.fc3(self.norm(self.fc2(torch.relu(self.fc1(x)))))


@pytest.fixture(scope="module")
def planted():
    gen = torch.Generator().manual_seed(1)
    example = torch.randn(4, 16, generator=gen)
    model = PlantedOverflow(example)
    calibration = [(torch.randn(4, 16, generator=gen),) for _ in range(3)]
    return model, example, calibration


def _node_value(gm, name, *args):
    """The value node ``name`` takes when ``gm`` runs on ``args``."""
    seen = {}

    class Grab(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.name == name:
                seen["v"] = out
            return out

    with torch.no_grad():
        Grab(gm).run(*args)
    return seen["v"]


# ---------------------------------------------------------------------------------------------
# planted overflow (acceptance)


def test_plain_fp16_conversion_overflows(planted):
    # fc2 runs in fp16 and overflows to inf (then NaN after the LayerNorm): convert() says so (issue 15)
    model, example, _ = planted
    with pytest.raises(converter.api.Fp16OverflowError, match=r"node 'fc2' \(op linear.*--calibrate") as err:
        converter.convert(model, (example,), precision="fp16")
    assert err.value.node == "fc2"


def test_autocast_cpu_fp16_overflows_too(planted):
    model, example, _ = planted
    seen = {}
    handle = model.fc2.register_forward_hook(lambda m, i, o: seen.setdefault("fc2", o))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            out = model(example)
    finally:
        handle.remove()
    # torch 2.13: CPU autocast runs linear in fp16, so fc2 overflows exactly as the plain conversion
    assert seen["fc2"].dtype == torch.float16 and bool(torch.isinf(seen["fc2"]).any())
    assert not bool(torch.isfinite(out).all())


def test_calibration_redecides_exactly_the_overflowing_node(planted):
    model, example, calibration = planted
    conv = converter.convert(model, (example,), precision="fp16", calibration=calibration,
                             calibration_options={"progress": False})
    changed = {name for name, d in conv.decisions.items() if d.rule.table == "calibration"}
    assert changed == {"fc2"}
    assert conv.decisions["fc2"].precision == "bf16"
    with torch.no_grad():
        ref = model(example)
        out = conv.module(example)
    assert bool(torch.isfinite(out).all())
    q = sqnr_db(ref, out)
    assert q >= 30.0, f"SQNR {q:.1f} dB"
    print(f"\nplanted overflow: SQNR with calibration {q:.1f} dB")
    rows = {r["name"]: r for r in conv.report.nodes}
    assert "calibration" in rows["fc2"]["reason"]
    assert "65504" in rows["fc2"]["reason"] and "× margin 2" in rows["fc2"]["reason"]
    assert rows["fc2"]["rule"] == "<calibration>:[calibration].overflow_fallback"
    assert all("calibration" not in r["reason"] for n, r in rows.items() if n != "fc2")
    report = conv.module.meta["mp_calibration"]
    assert [r["name"] for r in report["risky_nodes"]] == ["fc2"]
    assert report["risky_nodes"][0]["absmax"] > 65504 / 2
    assert report["loss_scale"]["recommended_initial_scale"] >= 1
    assert 0.0 <= report["underflow"]["frac_below_fp16_subnormal"] <= 1.0
    # the explain trail keeps the rule that had decided fc2 before calibration
    assert conv.decisions["fc2"].matches[0].level_name == "calibration"
    assert any(m.rule.pattern == "linear" for m in conv.decisions["fc2"].matches)


def test_overflow_fallback_setting_fp32_and_its_file(planted, tmp_path):
    model, example, calibration = planted
    path = tmp_path / "fallback.toml"
    path.write_text('[settings]\noverflow_fallback = "fp32"\n')
    conv = converter.convert(model, (example,), precision="fp16", rules=[str(path)], calibration=calibration,
                             calibration_options={"progress": False})
    d = conv.decisions["fc2"]
    assert d.precision == "fp32"
    assert d.rule.file == str(path) and d.rule.table == "calibration"
    assert "→ fp32" in d.reason
    assert bool(torch.isfinite(conv.module(example)).all())


def test_bf16_target_needs_no_fallback(planted):
    model, example, calibration = planted
    conv = converter.convert(model, (example,), precision="bf16", calibration=calibration,
                             calibration_options={"progress": False})
    assert not any(d.rule.table == "calibration" for d in conv.decisions.values())
    report = conv.module.meta["mp_calibration"]
    assert report["risky_nodes"] == []
    assert report["loss_scale"]["recommended_initial_scale"] is None
    assert "fc2" in report["nodes"]


# ---------------------------------------------------------------------------------------------
# margin, inputs, neighbours


class Scaled(nn.Module):
    """x → linear → ×s → (fp32 layer_norm): the mul's output absmax is controlled exactly."""

    def __init__(self, peak: float):
        super().__init__()
        self.peak = peak
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        z = y / y.detach().abs().amax() * self.peak
        return F.layer_norm(z, (4,))


def test_margin_comes_from_the_rules_setting():
    torch.manual_seed(0)
    model = Scaled(40000.0)
    example = torch.randn(2, 4)
    rules = load_rules()
    gm, _ = decided(model, (example,), rules=rules)
    mul_like = [n.name for n in gm.graph.nodes if n.meta.get("mp") is not None and n.meta["mp_info"].op == "mul"]
    _calibrate(gm, [(example,)], rules=rules, target="fp16", progress=False)
    # 40000 × 2 > 65504: the node producing it (placed fp16) falls back
    assert {n.name for n in gm.graph.nodes if n.meta.get("mp") and n.meta["mp"].rule.table == "calibration"} >= set(mul_like)
    # with overflow_margin = 1.5 (40000 × 1.5 = 60000 < 65504) nothing moves
    loose = rules + Rules.from_dict({"settings": {"overflow_margin": 1.5}}, file="loose.toml")
    gm2, _ = decided(model, (example,), rules=loose)
    result = _calibrate(gm2, [(example,)], rules=loose, target="fp16", progress=False)
    assert result["margin"] == 1.5 and result["risky_nodes"] == []


class InputOverflow(nn.Module):
    """A half node whose output is small but whose input overflows fp16 once cast."""

    def forward(self, x):
        big = torch.exp(x) * 1e6  # exp: fp32 by rule; mul follows
        return F.linear(big, torch.full((3, 3), 1e-6))


def test_an_overflowing_input_is_evidence_too():
    example = torch.zeros(2, 3)
    rules = load_rules()
    gm, _ = decided(InputOverflow(), (example,), rules=rules)
    result = _calibrate(gm, [(example,)], rules=rules, target="fp16", progress=False)
    linear = next(n for n in gm.graph.nodes if n.meta.get("mp_info") is not None and n.meta["mp_info"].op == "linear")
    rows = {r["name"]: r for r in result["risky_nodes"]}
    assert linear.meta["mp"].precision == "bf16"
    assert rows[linear.name]["evidence"] == "input"
    assert "input" in linear.meta["mp"].reason and "absmax 1e+06" in linear.meta["mp"].reason


class FollowAfter(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        with torch.no_grad():
            self.lin.bias.fill_(1e5)

    def forward(self, x):
        return F.layer_norm(torch.relu(self.lin(x)), (8,))


def test_follow_neighbours_of_a_fallback_node_stay_consistent():
    example = torch.randn(2, 8)
    conv = converter.convert(FollowAfter(), (example,), precision="fp16", calibration=[(example,)],
                             calibration_options={"progress": False})
    d = conv.decisions
    # relu carries the same 1e5 values: placement must not put it in fp16
    assert d["lin"].precision == "bf16" and d["relu"].precision != "fp16"
    assert bool(torch.isfinite(conv.module(example)).all())


class Masked(nn.Module):
    """Causal attention scores: the -inf of the mask is inf in fp32 already, not an fp16 overflow."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x):
        scores = self.q(x) @ x.transpose(-2, -1)
        mask = torch.ones_like(scores, dtype=torch.bool).triu(diagonal=1)
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


def test_infinities_already_in_fp32_are_not_an_overflow():
    torch.manual_seed(0)
    example = torch.randn(2, 5, 4)
    conv = converter.convert(Masked(), (example,), precision="fp16", calibration=[(example,)],
                             calibration_options={"progress": False})
    report = conv.module.meta["mp_calibration"]
    assert report["risky_nodes"] == []
    assert [r["name"] for r in report["nonfinite_in_fp32"]] == ["masked_fill"]
    stats = report["nodes"]["masked_fill"]["forward"]
    assert stats["inf"] == 2 * 10 and stats["absmax"] == "inf" and stats["frac_over_fp16"] == 0.0


# ---------------------------------------------------------------------------------------------
# statistics


class Known(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        edge = [0.0, 2.0**-25, 2.0**-24, 2.0**-14 * 0.75, 2.0**-14, 65504.0, 65505.0, 1e-40]
        self.register_buffer("edge", torch.tensor(edge))

    def forward(self, x):
        a = self.lin(x)
        b = a * 1e5
        c = torch.relu(b)
        d = c * 1e-12
        e = x * 0.0 + self.edge
        t = a.view(-1, 2).transpose(0, 1)
        q, k = a.split(4, dim=-1)
        return d + e, t, q * k


def _replica(model: Known, x: torch.Tensor):
    """The same computation by hand, every intermediate kept with its gradient."""
    w = model.lin.weight.detach().clone().requires_grad_(True)
    bias = model.lin.bias.detach().clone().requires_grad_(True)
    v = {"x": x}
    v["lin"] = F.linear(x, w, bias)
    v["mul"] = v["lin"] * 1e5
    v["relu"] = torch.relu(v["mul"])
    v["mul_1"] = v["relu"] * 1e-12
    v["mul_2"] = x * 0.0
    v["add"] = v["mul_2"] + model.edge
    v["view"] = v["lin"].view(-1, 2)
    v["transpose"] = v["view"].transpose(0, 1)
    v["getitem"], v["getitem_1"] = v["lin"].split(4, dim=-1)
    v["add_1"] = v["mul_1"] + v["add"]
    v["mul_3"] = v["getitem"] * v["getitem_1"]
    for t in v.values():
        if t.requires_grad:
            t.retain_grad()
    loss = v["add_1"].sum() + v["transpose"].sum() + v["mul_3"].sum()
    loss.backward()
    v["lin_weight"], v["lin_bias"], v["edge"] = w, bias, model.edge
    return v


def test_statistics_equal_a_direct_computation():
    model = Known()
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 8, generator=gen),) for _ in range(3)]
    gm = capture(model, batches[0]).gm
    cal = collect_statistics(gm, batches, progress=False)
    replicas = [_replica(model, b[0]) for b in batches]
    names = ["x", "lin", "mul", "relu", "mul_1", "mul_2", "add", "view", "transpose", "getitem", "getitem_1", "add_1", "mul_3"]
    for name in names:
        want = direct_stats([r[name] for r in replicas])
        assert cal.stats[name].forward == want, name
        grads = [r[name].grad for r in replicas]
        if all(g is not None for g in grads):
            assert cal.stats[name].grad == direct_stats(grads), name
            assert sum(c for _, c in cal.stats[name].grad_log2_hist) == want.count - direct_stats(grads).n_zero
            g_all = torch.cat([g.reshape(-1).abs() for g in grads])
            for e, c in cal.stats[name].grad_log2_hist:
                assert c == int(((g_all >= 2.0**e) & (g_all < 2.0 ** (e + 1))).sum()), (name, e)
        else:
            assert cal.stats[name].grad is None, name
    # the split node holds both halves; parameters are constant, their gradients add up per batch
    assert cal.stats["split"].forward == direct_stats([r[n] for r in replicas for n in ("getitem", "getitem_1")])
    assert cal.stats["lin_weight"].forward == direct_stats([model.lin.weight])
    assert cal.stats["lin_weight"].grad == direct_stats([r["lin_weight"].grad for r in replicas])
    assert cal.stats["edge"].grad is None
    # spot checks against the planted edge values
    edge = cal.stats["add"].forward  # 3 batches × 3 rows of the 8 edge values
    assert edge.n_zero == 9 and edge.n_below_subnormal == 9 * 2 and edge.n_below_normal == 9 * 4
    assert edge.n_over_fp16 == 9 and edge.absmax == 65505.0 and edge.min_nonzero == pytest.approx(1e-40, rel=1e-2)
    assert cal.stats["mul"].forward.absmax == float(torch.cat([r["mul"].detach().abs().reshape(-1) for r in replicas]).max())
    assert all(isinstance(n.meta["mp_stats"], NodeStats) for n in gm.graph.nodes if n.name in names)
    assert model.lin.weight.grad is None, "calibration must not leave .grad on the model"


def test_edge_values_and_nonfinite():
    values = torch.tensor([0.0, -0.0, 2.0**-25, -(2.0**-24), 2.0**-14 - 2.0**-30, 2.0**-14, 65504.0, -65505.0,
                           math.inf, -math.inf, math.nan, 1.0])
    s = tensor_stats([values])
    assert s == direct_stats([values])
    assert (s.n_zero, s.n_below_subnormal, s.n_below_normal, s.n_over_fp16, s.n_inf, s.n_nan) == (2, 1, 3, 1, 2, 1)
    assert s.absmax == math.inf and s.absmax_finite == 65505.0 and s.min_nonzero == 2.0**-25
    assert s.frac_over_fp16 == 1 / 12


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 2.0**-24, 2.0**-14, 65504.0, 65520.0, 1e-45, -1e-38])), max_size=20), min_size=1, max_size=4))
def test_vectorised_statistics_match_direct(chunks):
    tensors = [torch.tensor(c, dtype=torch.float32) for c in chunks]
    assert tensor_stats(tensors) == direct_stats(tensors)


def test_calibration_leaves_no_trace():
    class WithBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.bn(self.lin(x)))

    model = WithBN().train()
    example = torch.randn(5, 4)
    gm, rules = decided(model, (example,), precision="bf16")
    batches = [(torch.randn(5, 4),) for _ in range(2)]
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    rng = torch.random.get_rng_state()
    calibrate_and_redecide(gm, batches, rules=rules, settings=PlaceSettings(target="bf16"),
                           options=CalibrationOptions(progress=False))
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(p.grad is None for p in gm.parameters())


def test_loss_fn_is_used_and_a_failing_one_is_reported():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    example = torch.randn(3, 4)
    gm, rules = decided(model, (example,), precision="bf16")
    used = []

    def loss_fn(output, batch):
        used.append(batch)
        return (output ** 2).mean()

    result = _calibrate(gm, [(example,)], rules=rules, target="bf16", loss_fn=loss_fn, progress=False)
    assert result["loss"] == "loss_fn(output, batch)" and len(used) == 1 and used[0][0] is example

    def broken(output, batch):
        _, target = batch  # written for train_batches(), not for calibration inputs
        return output.sum()

    with pytest.warns(UserWarning, match="loss_fn"):
        result = _calibrate(gm, [(example,)], rules=rules, target="bf16", loss_fn=broken, progress=False)
    assert result["loss"].startswith("sum of the floating outputs (loss_fn(output, batch) failed")
    assert result["backward"] is True


def test_kwargs_inputs_and_backward_off():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x, scale=1.0):
            return self.lin(x) * scale

    example = ((torch.randn(2, 3),), {"scale": 2.0})
    gm, rules = decided(KW(), example, precision="bf16")
    result = _calibrate(gm, [example, example], rules=rules, target="bf16", backward=False, progress=False)
    assert result["batches"] == 2 and result["backward"] is False
    assert result["nodes"]["lin"]["grad"] is None and result["nodes"]["lin"]["forward"]["count"] == 12


def test_recommended_loss_scale():
    # largest power of two s with max|g| × s × margin < 65504
    assert recommend_loss_scale(1.0, 2.0) == 16384.0  # 1 × 16384 × 2 = 32768 < 65504; ×2 would be 65536
    assert recommend_loss_scale(0.5, 2.0) == 32768.0
    assert recommend_loss_scale(65504.0 / 2 / 1024, 2.0) == 512.0  # exactly at the boundary: strictly below
    assert recommend_loss_scale(1e-12, 2.0) == 2.0**24  # clamped to LossScaler's max_scale
    assert recommend_loss_scale(1e6, 2.0) == 1.0
    assert recommend_loss_scale(0.0, 2.0) is None


def test_underflow_risk_and_loss_scale_from_the_gradients():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    example = torch.randn(4, 8)
    gm, rules = decided(model, (example,))
    result = _calibrate(gm, [(example,)], rules=rules, target="fp16", progress=False,
                                    loss_fn=lambda out, batch: out.sum() * 1e-9)
    # every gradient an fp16 node produces (the output's, the weight's, the bias's) is below 2**-24
    x = example
    grads = [torch.full((4, 8), 1e-9), (torch.full((4, 8), 1e-9).t() @ x), torch.full((8,), 4e-9)]
    g_max = max(float(g.abs().max()) for g in grads)
    scale = result["loss_scale"]["recommended_initial_scale"]
    assert scale == recommend_loss_scale(g_max, 2.0) == 2.0**24
    assert result["loss_scale"]["max_abs_grad"] == pytest.approx(g_max, rel=1e-5)
    under = result["underflow"]
    tiny = sum(int(((g != 0) & (g.abs() < 2.0**-24)).sum()) for g in grads)
    assert under["frac_below_fp16_subnormal"] == pytest.approx(tiny / under["nonzero_values"]) and tiny > 0
    assert under["frac_below_fp16_subnormal_at_recommended_scale"] == 0.0


def test_bad_options_are_rejected(planted):
    model, example, calibration = planted
    gm, rules = decided(model, (example,))
    with pytest.raises(ValueError, match="overflow_fallback"):
        calibrate_and_redecide(gm, calibration, rules=rules, settings=PlaceSettings(target="fp16"),
                           options=CalibrationOptions(fallback="fp16", progress=False))
    with pytest.raises(ValueError, match="margin"):
        calibrate_and_redecide(gm, calibration, rules=rules, settings=PlaceSettings(target="fp16"),
                           options=CalibrationOptions(margin=0, progress=False))
    with pytest.raises(ValueError, match="no batches"):
        calibrate_and_redecide(gm, [], rules=rules, settings=PlaceSettings(target="fp16"),
                           options=CalibrationOptions(progress=False))
    assert issubclass(ToleranceNotMet, ValueError)
    assert FP16_MAX == 65504.0
