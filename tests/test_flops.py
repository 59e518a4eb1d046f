"""FLOP counts (converter.flops) against hand-computed numbers on known shapes, for both tracers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from converter.passes.capture import capture
from converter.report.flops import FLOP_OPS, node_flops


def flops_by_op(model: nn.Module, *inputs, tracer: str = "fx") -> dict[str, list[int]]:
    """Capture ``model`` and return {canonical op: [FLOPs of each node]} in graph order."""
    gm = capture(model, inputs, tracer=tracer).gm
    out: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        info = node.meta.get("mp_info")
        if info is None or node.op in ("placeholder", "get_attr", "output"):
            continue
        out.setdefault(info.op, []).append(node_flops(node, info.op))
    return out


def Fn(forward) -> nn.Module:
    """A parameter-free module whose ``forward`` is ``forward`` (explicit arguments, so FX can trace it)."""
    return type("Fn", (nn.Module,), {"forward": forward})()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_linear_is_2_m_n_k(tracer):
    # (4, 7, 32) @ W(16, 32)^T: M = 4*7 = 28 rows, K = 32, N = 16 -> 2*28*16*32 = 28672 (bias not counted)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 5, bias=False))
    got = flops_by_op(model, torch.randn(4, 7, 32), tracer=tracer)
    assert got["linear"] == [2 * 28 * 16 * 32, 2 * 28 * 5 * 16]
    assert got["relu"] == [0]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_conv2d_counts_groups_stride_and_padding(tracer):
    # conv1: C_in 6 -> C_out 8, 3x3, stride 2, padding 1 on 10x10: out 5x5; per output 6*3*3 MACs
    # conv2: groups 2, 8 -> 4 channels, 1x1 on 5x5: per output (8/2)*1*1 MACs
    model = nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.Conv2d(8, 4, 1, groups=2, bias=False))
    got = flops_by_op(model, torch.randn(2, 6, 10, 10), tracer=tracer)
    assert got["conv2d"] == [2 * (2 * 8 * 5 * 5) * (6 * 3 * 3), 2 * (2 * 4 * 5 * 5) * (4 * 1 * 1)]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_conv1d_and_conv_transpose2d(tracer):
    # conv1d: (3, 4, 20) -> 5 channels, kernel 5, no padding: out length 16; per output 4*5 MACs
    # conv_transpose2d: (1, 3, 4, 4) -> 2 channels, 2x2 stride 2: each input element does C_out*k*k = 2*2*2 MACs
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv1d(4, 5, 5)
            self.ct = nn.ConvTranspose2d(3, 2, 2, stride=2)

        def forward(self, x, y):
            return self.c1(x).sum() + self.ct(y).sum()

    got = flops_by_op(M(), torch.randn(3, 4, 20), torch.randn(1, 3, 4, 4), tracer=tracer)
    assert got["conv1d"] == [2 * (3 * 5 * 16) * (4 * 5)]
    assert got["conv_transpose2d"] == [2 * (1 * 3 * 4 * 4) * (2 * 2 * 2)]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_matmul_bmm_mm_and_broadcast(tracer):
    def fn(self, a, b, c, d, e):
        x = torch.matmul(a, b)          # (2, 3, 5, 7) @ (7, 4): 2*3*5*4 outputs, K 7
        y = torch.bmm(c, d)             # (6, 8, 9) @ (6, 9, 2): 6*8*2 outputs, K 9
        z = torch.mm(e, e.t())          # (10, 3) @ (3, 10): 100 outputs, K 3
        return x.sum() + y.sum() + z.sum()

    inputs = (torch.randn(2, 3, 5, 7), torch.randn(7, 4), torch.randn(6, 8, 9), torch.randn(6, 9, 2), torch.randn(10, 3))
    got = flops_by_op(Fn(fn), *inputs, tracer=tracer)
    counted = sorted(sum((got.get(op, []) for op in ("matmul", "bmm", "mm")), []))
    assert counted == sorted([2 * (2 * 3 * 5 * 4) * 7, 2 * (6 * 8 * 2) * 9, 2 * 100 * 3])


def test_addmm_baddbmm_mv_dot():
    def fn(self, bias, m1, m2, b, b1, b2, mat, vec):
        return (torch.addmm(bias, m1, m2).sum() + torch.baddbmm(b, b1, b2).sum()
                + torch.mv(mat, vec).sum() + torch.dot(vec, vec))

    inputs = (torch.randn(4, 6), torch.randn(4, 5), torch.randn(5, 6), torch.randn(3, 2, 2), torch.randn(3, 2, 8),
              torch.randn(3, 8, 2), torch.randn(9, 5), torch.randn(5))
    got = flops_by_op(Fn(fn), *inputs)
    assert got["addmm"] == [2 * 4 * 6 * 5]
    assert got["baddbmm"] == [2 * 3 * 2 * 2 * 8]
    assert got["mv"] == [2 * 9 * 5]
    assert got["dot"] == [2 * 5]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_sdpa(tracer):
    # q (B2, H3, L5, E8), k (2, 3, S7, 8), v (2, 3, 7, Ev4): 2*B*H*L*S*E + 2*B*H*L*S*Ev
    def fn(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    got = flops_by_op(Fn(fn), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4), tracer=tracer)
    assert got["scaled_dot_product_attention"] == [2 * 2 * 3 * 5 * 7 * 8 + 2 * 2 * 3 * 5 * 7 * 4]


def test_einsum():
    def fn(self, a, b):
        return torch.einsum("bij,bjk->bik", a, b).sum() + torch.einsum("ij->ji", a[0]).sum()

    got = flops_by_op(Fn(fn), torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    assert got["einsum"] == [2 * 2 * 3 * 4 * 5, 0]  # one operand: a transpose, no arithmetic


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_norms(tracer):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.rms = nn.RMSNorm(16)
            self.gn = nn.GroupNorm(2, 4)

        def forward(self, x, y):
            return self.rms(self.ln(x)).sum() + self.gn(y).sum()

    got = flops_by_op(M(), torch.randn(3, 16), torch.randn(2, 4, 5), tracer=tracer)
    assert got["layer_norm"] == [5 * 48]
    assert got["rms_norm"] == [4 * 48]
    assert got["group_norm"] == [5 * 40]


def test_batch_norm_leaf_module_and_pointwise_zero():
    model = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU())
    got = flops_by_op(model, torch.randn(2, 3, 4, 4))
    assert got["batch_norm"] == [5 * 2 * 3 * 4 * 4]
    assert got["relu"] == [0]


def test_flop_ops_are_canonical_names():
    from converter.ir.ops import known_op_names

    assert FLOP_OPS <= known_op_names()


def test_report_flops_match_the_sample():
    """The tiny transformer's total equals the hand count over its linears, matmuls and SDPA."""
    import importlib.util
    from pathlib import Path

    import converter

    path = Path(__file__).resolve().parents[1] / "samples" / "tiny_transformer.py"
    spec = importlib.util.spec_from_file_location("flops_sample_tiny_transformer", path)
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    conv = converter.convert(sample.build_model(), sample.example_inputs())
    b, t, d, h, vocab = 2, 16, 64, 4, 128
    rows = b * t
    per_layer_linear = 2 * rows * (3 * d) * d + 2 * rows * d * d + 2 * (2 * rows * (4 * d) * d) + 2 * rows * d * (4 * d)
    attention = 2 * b * h * t * t * (d // h) * 2  # QK^T and PV, in layer 0 (SDPA) and layer 1 (two matmuls)
    expected = 2 * per_layer_linear + 2 * attention + 2 * rows * vocab * d
    assert conv.report.summary["flops"] == expected
