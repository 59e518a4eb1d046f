"""Constants that half cannot hold (issue 14 item 4), and convert's final example forward.

Hugging Face fills attention masks with ``torch.finfo(torch.float32).min``: -3.4028e38, beyond
bf16's largest finite value (3.3895e38) and far beyond fp16's (65504). ``masked_fill`` refuses such
a value in half; the arithmetic ops turn it into -inf, which makes a fully masked softmax row NaN
(fp32 gives a uniform row). Such nodes stay fp32, and so do the follow nodes that read their output.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from helpers import DtypeRecorder, sqnr
from torch import nn

import converter
from converter.passes.decide import CONSTANT_RANGE_RULE
from converter.passes.verify import ForwardCheckError

MIN32 = torch.finfo(torch.float32).min


class MaskedAttention(nn.Module):
    """Causal attention whose mask is a masked_fill with finfo(fp32).min (the HF idiom)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) * 32 ** -0.5
        causal = torch.ones_like(scores, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
        return self.out(scores.softmax(-1) @ v)


class AdditiveMaskAttention(nn.Module):
    """BERT's extended mask: (1 - mask) * finfo(fp32).min added to the scores."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32)
        self.k = nn.Linear(32, 32)
        self.v = nn.Linear(32, 32)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        extended = (1.0 - mask[:, None, :].float()) * torch.finfo(torch.float32).min
        return (scores + extended).softmax(-1) @ self.v(x)


class Clamped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).clamp(min=-1e5, max=1e5) * 3.0


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, 32, generator=g)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_masked_fill_with_finfo_min_stays_fp32_runs_and_matches(precision, one_thread):
    torch.manual_seed(0)
    model = MaskedAttention().eval()
    x = _inputs()
    conv = converter.convert(model, (x,), precision=precision)
    with torch.no_grad():
        ref, out = model(x), conv.module(x)
    s = sqnr(ref, out)
    floor = 35 if precision == "bf16" else 55
    assert out.dtype == torch.float32 and s >= floor, f"{precision}: SQNR {s:.1f} dB < {floor}"
    decision = conv.decisions["masked_fill"]
    assert decision.precision == "fp32" and decision.rule == CONSTANT_RANGE_RULE, decision
    assert f"the constant {MIN32:.6g} does not fit in {precision}" in decision.reason, decision.reason
    # the linears still run in half: only the mask's node was kept
    assert conv.decisions["qkv"].precision == precision and conv.decisions["matmul"].precision == precision
    row = next(n for n in conv.report.to_dict()["nodes"] if n["name"] == "masked_fill")
    assert row["precision"] == "fp32" and row["rule"] == str(CONSTANT_RANGE_RULE) and row["reason"] == decision.reason
    assert "does not fit in" in conv.report.to_markdown()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_additive_finfo_mask_with_a_fully_masked_row_is_not_nan(precision, one_thread):
    """The constant reaches the scores through a follow add: that add stays fp32 by the
    constant-range rule (not by the chance of placement), so a fully masked row is uniform as in
    fp32 instead of softmax(-inf...) = NaN."""
    torch.manual_seed(0)
    model = AdditiveMaskAttention().eval()
    x = _inputs(1)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1] = 0  # the second sequence is all padding: every key of its rows is masked
    conv = converter.convert(model, (x, mask), precision=precision)
    with torch.no_grad():
        ref, out = model(x, mask), conv.module(x, mask)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all(), f"{precision}: NaN/inf in {(~torch.isfinite(out)).sum().item()} outputs"
    s = sqnr(ref, out)
    assert s >= (35 if precision == "bf16" else 55), f"{precision}: SQNR {s:.1f} dB"
    keep = {n: d for n, d in conv.decisions.items() if d.rule == CONSTANT_RANGE_RULE}
    assert set(keep) == {"mul", "add"}, {n: d.reason for n, d in keep.items()}
    assert "holds the constant" in keep["add"].reason and "'mul'" in keep["add"].reason, keep["add"].reason
    rec = DtypeRecorder()
    with torch.no_grad(), rec:
        conv.module(x, mask)
    mats = rec.dtypes_of("bmm", "addmm")
    assert mats and all(set(d) == {torch.bfloat16 if precision == "bf16" else torch.float16} for d in mats), mats


def test_a_constant_only_fp16_cannot_hold_keeps_bf16():
    torch.manual_seed(0)
    model = Clamped().eval()
    x = torch.randn(4, 16)
    bf16 = converter.convert(model, (x,), precision="bf16")
    fp16 = converter.convert(model, (x,), precision="fp16")
    assert bf16.decisions["clamp"].precision == "bf16", bf16.decisions["clamp"]
    clamp = fp16.decisions["clamp"]
    assert clamp.precision == "fp32" and "the constant -100000 does not fit in fp16 (largest finite 65504)" in clamp.reason
    # the multiply reads the clamp's output, which may hold the constant
    assert fp16.decisions["mul"].precision == "fp32" and fp16.decisions["mul"].rule == CONSTANT_RANGE_RULE
    with torch.no_grad():
        s = sqnr(model(x), fp16.module(x))
    assert s >= 55, f"fp16 SQNR {s:.1f} dB"


def test_shape_arguments_are_not_constants():
    """A view/reshape size beyond 65504 is not a value: the op is decided by its rule as usual."""

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(70000, 4)

        def forward(self, x):
            return self.lin(x.reshape(1, 70000))

    x = torch.randn(70000)
    conv = converter.convert(Wide().eval(), (x,), precision="fp16")
    assert all(d.rule != CONSTANT_RANGE_RULE for d in conv.decisions.values()), conv.decisions


class Inverse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.linalg.inv(self.lin(x) + 4 * torch.eye(4))


def test_convert_raises_naming_the_node_when_the_example_forward_fails(tmp_path):
    """A rule puts linalg_inv (no bf16 kernel on CPU) in half: convert refuses to return the module."""
    rules = tmp_path / "inv.toml"
    rules.write_text(textwrap.dedent("""
        [op]
        linalg_inv = "half"
    """))
    torch.manual_seed(0)
    x = torch.randn(2, 4, 4)
    with pytest.raises(ForwardCheckError) as info:
        converter.convert(Inverse().eval(), (x,), precision="bf16", rules=rules)
    text = str(info.value)
    assert "fails on the example inputs at node 'linalg_inv' (op linalg_inv, bf16 by " in text, text
    assert 'add `linalg_inv = "fp32"` under [node]' in text, text
    assert "\n" not in text and info.value.node == "linalg_inv" and info.value.exit_code == 1
    assert isinstance(info.value.__cause__, RuntimeError)
    # without the rule it converts and runs
    conv = converter.convert(Inverse().eval(), (x,), precision="bf16")
    assert torch.isfinite(conv.module(x)).all()


def test_the_example_check_leaves_batch_norm_statistics_alone():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).train()
    x = torch.randn(2, 3, 8, 8)
    before = model[1].running_mean.clone()
    conv = converter.convert(model, (x,), precision="bf16")
    stats = [b for n, b in conv.module.named_buffers() if n.endswith("running_mean")]
    assert stats and torch.equal(stats[0], before), "convert's example forward changed the running statistics"
