"""A parameter that several nodes read adds its reads' gradients: calibration measures each read's part,
and where the sum would overflow fp16 at the loss scale every other half gradient allows, the
parameter is cast once per read (the parts add in fp32) and O2 stores it in fp32, with the reason.

The model is an Elman cell unrolled in Python with a per-step readout (a decoder's loop written out):
torch.export and symbolic_trace turn each of its 32 steps into its own nodes reading the same three
weights, so each weight's gradient is the sum of 32 parts.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import converter
from converter.ir.meta import GM_CALIBRATION, GM_PARAM_DTYPES, GM_PARAM_STORAGE, GM_READ_CASTS

STEPS = 16
#: the parameters whose summed gradient overflows at the calibrated scale (``_read_parts`` checks it);
#: ``inp.weight`` is read 16 times too, but its gradient sums to less: it keeps one shared cast
SHARED = {"inp.bias", "cell.weight", "cell.bias", "head.weight", "head.bias"}


class Unrolled(nn.Module):
    """An Elman cell unrolled over ``steps`` with a readout per step: every weight is read ``steps`` times."""

    def __init__(self, dim: int = 32, steps: int = STEPS):
        super().__init__()
        self.inp, self.cell, self.head = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.steps = steps

    def forward(self, x):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(self.steps):
            h = torch.tanh(self.inp(x[:, t]) + self.cell(h))
            ys.append(self.head(h))
        return torch.stack(ys, 1)


class OneRead(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _data(seed: int = 0, batch: int = 64, n: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, STEPS, 32, generator=g) for _ in range(n)]


def _convert(model, batches, **kw):
    return converter.convert(model, (batches[0],), precision="fp16", calibration=batches, **kw)


def _read_parts(model: Unrolled, batches) -> tuple[dict[str, float], dict[str, float]]:
    """max |gradient| of one read of each parameter, and of the whole gradient, computed apart from the
    converter: every call of a layer reads its own view of the weight, and autograd gives each view's
    gradient; the sum of a parameter's views' gradients is its gradient."""
    out: dict[str, float] = {}
    whole: dict[str, float] = {}
    for x in batches:
        views: dict[str, list] = {}

        def read(layer, name, arg, views=views):
            w, b = layer.weight.view_as(layer.weight), layer.bias.view_as(layer.bias)
            views.setdefault(f"{name}.weight", []).append(w)
            views.setdefault(f"{name}.bias", []).append(b)
            return nn.functional.linear(arg, w, b)

        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(model.steps):
            h = torch.tanh(read(model.inp, "inp", x[:, t]) + read(model.cell, "cell", h))
            ys.append(read(model.head, "head", h))
        loss = torch.stack(ys, 1).sum()  # calibration's loss without loss_fn: the sum of the outputs
        names = list(views)
        flat = [v for n in names for v in views[n]]
        grads = torch.autograd.grad(loss, flat)
        i = 0
        for n in names:
            k = len(views[n])
            out[n] = max(out.get(n, 0.0), max(float(g.abs().max()) for g in grads[i:i + k]))
            whole[n] = max(whole.get(n, 0.0), float(sum(grads[i:i + k]).abs().max()))
            i += k
    return out, whole


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_calibration_measures_each_read(tracer):
    torch.manual_seed(0)
    model = Unrolled()
    batches = _data()
    conv = _convert(model, batches, tracer=tracer)
    calibration = conv.module.meta[GM_CALIBRATION]
    rows = {r["param"]: r for r in calibration["shared_reads_in_fp32"]}
    expected, whole = _read_parts(model, batches)
    scale, margin = calibration["loss_scale"]["recommended_initial_scale"], calibration["margin"]
    # every read of every weight fits at the scale; exactly the weights whose sum does not are chosen
    assert all(v * scale * margin < 65504 for v in expected.values()), (scale, expected)
    assert set(rows) == {n for n, v in whole.items() if v * scale * margin > 65504} == SHARED, (sorted(rows), scale, whole)
    for name, row in rows.items():
        assert row["reads"] == STEPS, row
        got, want = row["read_grad_absmax"], expected[name]
        assert abs(got - want) <= 1e-4 * want, f"{name}: calibration measured {got}, one read's gradient is {want}"
        assert abs(row["grad_absmax"] - whole[name]) <= 1e-4 * whole[name], (name, row["grad_absmax"], whole[name])
        # the whole gradient is larger than any part, and overflows at the scale: that is why it was chosen
        assert row["grad_absmax"] * row["loss_scale"] * row["margin"] > 65504 >= want * row["loss_scale"] * row["margin"], row


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_shared_weight_cast_per_read_and_kept_in_fp32_with_the_reason(tracer):
    torch.manual_seed(0)
    model = Unrolled()
    batches = _data()
    conv = _convert(model, batches, tracer=tracer, opt_level="O2")
    gm = conv.module
    assert set(gm.meta[GM_READ_CASTS]) == SHARED
    # one cast per read of each shared parameter (a shared cast would add the reads' parts in half)
    for name in SHARED:
        casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"
                 and n.args[0].op == "get_attr" and str(n.args[0].target) == name]
        assert len(casts) == STEPS, (name, len(casts))
        assert all(n.args[1] == torch.float16 and len(n.users) == 1 for n in casts), name
    assert {n for n, d in gm.meta[GM_PARAM_DTYPES].items() if d == torch.float32} == SHARED
    kept = gm.meta[GM_PARAM_STORAGE]
    assert set(kept) == SHARED and all(kept[n].startswith(f"calibration: its gradient adds {STEPS} reads") for n in SHARED), kept
    report = conv.report.to_dict()
    assert report["memory"]["o2_fp32_params"] == kept
    assert report["calibration"]["shared_reads_in_fp32"][0]["param"] in SHARED
    markdown = conv.report.to_markdown()
    assert "calibration: its gradient adds" in markdown and "| cast once per read, fp32 under O2" in markdown
    # and the casts carry the rule that made them
    for rec in (n.meta["mp_cast"] for n in gm.graph.nodes if "mp_cast" in n.meta):
        assert rec.rule is not None and rec.reason


def _first_step(conv, x, scale: float) -> tuple[bool, torch.Tensor]:
    module = conv.module
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    trainer = converter.MixedPrecisionTrainer(module, optimizer, precision="fp16", master_weights=True,
                                              loss_scale=scale)
    trainer.zero_grad()
    trainer.backward(module(x).float().sum())
    return trainer.step(), trainer.stats


def test_o2_steps_at_the_calibrated_scale_where_half_storage_overflows():
    """At the recommended loss scale, fp16 O2 takes the step with per-read casts and fp32 storage; the
    same conversion without them (one shared cast, half storage: what the graph gets with no
    calibration) overflows in the summed gradient and the step is skipped."""
    torch.manual_seed(0)
    model = Unrolled()
    batches = _data()
    calibrated = _convert(model, batches, opt_level="O2", tracer="export")
    scale = calibrated.module.meta[GM_CALIBRATION]["loss_scale"]["recommended_initial_scale"]
    assert scale is not None and scale >= 64, scale
    took, stats = _first_step(calibrated, batches[0], scale)
    assert took and stats.skipped == 0, stats
    plain = converter.convert(model, (batches[0],), precision="fp16", opt_level="O2", tracer="export")
    assert all(d == torch.float16 for d in plain.module.meta[GM_PARAM_DTYPES].values())
    took, stats = _first_step(plain, batches[0], scale)
    assert not took and stats.skipped == 1, f"half storage should overflow at scale {scale}: {stats}"


def test_no_per_read_casts_where_nothing_is_read_twice_or_for_bf16():
    torch.manual_seed(0)
    model = OneRead()
    x = [torch.randn(64, 32) for _ in range(2)]
    conv = converter.convert(model, (x[0],), precision="fp16", opt_level="O2", calibration=x)
    assert conv.module.meta[GM_READ_CASTS] == {} and conv.module.meta[GM_CALIBRATION]["shared_reads_in_fp32"] == []
    assert all(d == torch.float16 for d in conv.module.meta[GM_PARAM_DTYPES].values())
    unrolled = Unrolled()
    batches = _data()
    bf16 = converter.convert(unrolled, (batches[0],), precision="bf16", opt_level="O2", calibration=batches)
    assert bf16.module.meta[GM_READ_CASTS] == {}  # bf16 has fp32's range: one shared cast per weight
    assert all(d == torch.bfloat16 for d in bf16.module.meta[GM_PARAM_DTYPES].values())
