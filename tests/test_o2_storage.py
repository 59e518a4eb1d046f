"""O2 stores in half only the weights of matmuls and convolutions; tokens, positional tables, scales
and norms keep fp32 storage, with the reason in the report.

A ViT-MAE's ``cls_token`` and position embeddings were stored in fp16 under O2 because the graph cast
them for a half ``expand``/``mul``; their gradients sum over the whole batch, overflowed once scaled,
and the trainer skipped most steps.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import converter
from converter.ir.meta import GM_PARAM_DTYPES, GM_PARAM_STORAGE


class TokenModel(nn.Module):
    """ViT-MAE's parameter kinds: a cls token (expand + cat), a position table and a scale (pointwise),
    linear weights read directly and through ``.t()``."""

    def __init__(self, dim: int = 32, patch: int = 16, tokens: int = 16):
        super().__init__()
        self.patch = nn.Linear(patch, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.mix = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))
        self.head = nn.Linear(dim, patch, bias=False)

    def forward(self, x):
        h = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), self.patch(x)], 1)
        h = self.mix(h * self.pos) * self.scale
        return x + self.head(h @ self.mix.weight.t())[:, 1:]


WEIGHTS = {"patch.weight", "patch.bias", "mix.weight", "mix.bias", "head.weight"}
KEPT = {"cls_token": ("expand", "expand"), "pos": ("mul", "mul"), "scale": ("mul", "mul_1")}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_o2_stores_only_weights_in_half_and_says_why(tracer):
    torch.manual_seed(0)
    model = TokenModel()
    x = torch.randn(4, 16, 16)
    conv = converter.convert(model, (x,), opt_level="O2", tracer=tracer)
    dtypes = conv.module.meta[GM_PARAM_DTYPES]
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == WEIGHTS, dtypes
    assert {n for n, d in dtypes.items() if d == torch.float32} == set(KEPT), dtypes
    kept = conv.module.meta[GM_PARAM_STORAGE]
    assert set(kept) == set(KEPT), kept
    for name, (op, node) in KEPT.items():
        assert kept[name].startswith(f"cast to bf16 for {op} ({node}), not read by a matmul or convolution"), kept[name]
    memory = conv.report.to_dict()["memory"]
    assert memory["o2_fp32_params"] == kept
    # the report's O2 bytes count exactly the half weights
    params = dict(model.named_parameters())
    half = sum(params[n].numel() for n in WEIGHTS)
    assert memory["param_bytes_o2"] == memory["param_bytes_o1"] - 2 * half, memory
    assert "stored in fp32 under O2" in conv.report.to_markdown() and "`cls_token`" in conv.report.to_markdown()


def test_o2_fp16_trainer_keeps_tokens_in_fp32_and_steps():
    """fp16 O2 training of the token model: the kept parameters stay fp32 on the module, the weights
    are fp16, and every step is taken (no overflow skips)."""
    torch.manual_seed(0)
    model = TokenModel()
    x = torch.randn(8, 16, 16)
    conv = converter.convert(model, (x,), precision="fp16", opt_level="O2", tracer="export")
    optimizer = torch.optim.AdamW(conv.module.parameters(), lr=1e-3)
    trainer = converter.MixedPrecisionTrainer(conv.module, optimizer, precision="fp16", master_weights=True)
    params = dict(conv.module.named_parameters())
    assert {n for n, p in params.items() if p.dtype == torch.float16} == WEIGHTS
    # the summary line says what O2 does: the casts of the half-stored weights are the ones the trainer drops
    summary = conv.report.summary
    assert trainer.dropped_weight_casts == summary["weight_casts_dropped_in_o2"] == 5, (trainer.dropped_weight_casts, summary)
    assert summary["weight_casts"] == 3 and "O2: 5 weights stored in half, no cast; +3 weight casts" in conv.report.line, conv.report.line
    assert {n for n, p in params.items() if p.dtype == torch.float32} == set(KEPT)
    losses = []
    for _ in range(6):
        trainer.zero_grad()
        loss = (conv.module(x) - x).pow(2).mean()
        trainer.backward(loss)
        assert trainer.step(), trainer.stats
        losses.append(float(loss.detach()))
    assert trainer.stats.skipped == 0 and losses[-1] < losses[0], (trainer.stats, losses)
