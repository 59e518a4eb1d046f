"""Zoo families of issue 43 (Deliver 5, part C): each pattern's numerics against ``torch.autocast``.

* **M2M100** (encoder-decoder with dropout and LayerDrop as shipped: LayerDrop off in the train graph);
* **GPT-OSS** (attention sinks, MoE with top-k routing);
* **TimesFM** (a forecaster: left-padded series whose padded patches are fully masked rows, huge pad values,
  per-series mean/std scaling);
* **VQ-VAE** with an EMA codebook (``tests/test_stock_seams.py``'s model: buffers written in train mode).

For each, in eval mode on its example: the output SQNR vs fp32 of the bf16 conversion and of autocast, and the
parameter-gradient SQNR (one fixed fp32 loss); ours must be at least autocast's minus the margin (1 dB, 0.5 dB
where issue 43 asks: TimesFM and GPT-OSS outputs); and half precision really ran (the report's half-FLOP share,
and every GEMM node's decision).
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers import first_tensor, sqnr
from test_stock_seams import VQVAE

import converter
from converter.ir.meta import META_DECISION, META_INFO

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

GEMMS = {"linear", "matmul", "bmm", "mm", "conv2d", "conv_transpose2d", "baddbmm", "einsum", "weight_matmul"}


def _m2m100():
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    cfg = M2M100Config(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(cfg).eval()
    return model, {"input_ids": torch.randint(3, 96, (2, 10)), "decoder_input_ids": torch.randint(3, 96, (2, 7))}


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()
    return model, {"input_ids": torch.randint(0, 128, (2, 12))}


def _timesfm():
    from transformers import TimesFmConfig, TimesFmModel

    cfg = TimesFmConfig(patch_length=8, context_length=64, horizon_length=16, hidden_size=32, intermediate_size=64,
                        head_dim=8, num_attention_heads=4, num_hidden_layers=2)
    torch.manual_seed(0)
    model = TimesFmModel(cfg).eval()
    past = torch.randn(2, 64) * torch.tensor([[5.0], [0.2]]) + torch.tensor([[30.0], [-2.0]])  # per-series scales
    pad = torch.zeros(2, 64)
    pad[0, :24], pad[1, :9] = 1.0, 1.0  # left padding: the first patches are fully masked rows
    past = torch.where(pad.bool(), torch.full_like(past, cfg.pad_val), past)  # huge pad values where masked
    return model, {"past_values": past, "past_values_padding": pad, "freq": torch.zeros(2, 1, dtype=torch.long)}


def _vqvae():
    torch.manual_seed(0)
    return VQVAE().eval(), {"x": torch.randn(4, 3, 16, 16)}


FAMILIES = {"m2m100": _m2m100, "gpt_oss": _gpt_oss, "timesfm": _timesfm, "vqvae": _vqvae}
#: how far under autocast's output SQNR ours may be (issue 43: 0.5 dB for TimesFM and GPT-OSS)
OUTPUT_MARGIN = {"m2m100": 1.0, "gpt_oss": 0.5, "timesfm": 0.5, "vqvae": 1.0}


def _out(module, kwargs) -> torch.Tensor:
    out = module(**kwargs)
    if hasattr(out, "last_hidden_state") and not hasattr(out, "logits"):
        return out.last_hidden_state.float()
    return first_tensor(out).float()


def _grads(module, kwargs, proj, *, autocast=None) -> torch.Tensor:
    """All parameter gradients of ``(out * proj).sum()`` (fp32 loss), flattened in the parameters' order."""
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        out = _out(module, kwargs)
    (out * proj).sum().backward()
    grads = [p.grad.float().flatten() if p.grad is not None else torch.zeros(p.numel()) for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return torch.cat(grads)


@functools.cache
def _measured(name: str) -> dict:
    model, kwargs = FAMILIES[name]()
    reference = copy.deepcopy(model)  # the conversion shares the model's tensors: gradients on a copy
    conv = converter.convert(model, ((), kwargs), precision="bf16")
    with torch.no_grad():
        ref = _out(reference, kwargs)
        ours = _out(conv.module, kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = _out(reference, kwargs)
    torch.manual_seed(1)
    proj = torch.randn_like(ref)
    g_ref = _grads(reference, kwargs, proj)
    g_amp = _grads(reference, kwargs, proj, autocast=torch.bfloat16)
    g_ours = _grads(conv.module, kwargs, proj)
    return {"conv": conv, "out": (sqnr(ref, ours), sqnr(ref, amp)), "grad": (sqnr(g_ref, g_ours), sqnr(g_ref, g_amp))}


#: measured gaps issue 43 still has open (part C did not close them): strict, so a fix turns them into failures
#: to remove from here. GPT-OSS output: 49.3 dB vs autocast 50.0 (0.7 under, wanted 0.5); TimesFM parameter
#: gradients: 38.7 dB vs autocast 43.2
OPEN = {("out", "gpt_oss"), ("grad", "timesfm")}


def _open(kind: str) -> list:
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=f"issue 43: {name} {kind} gap still open"))
            if (kind, name) in OPEN else name for name in FAMILIES]


#: above what a bf16 conversion reaches (about 8 bits of mantissa: 40 to 60 dB), below what fp32 everywhere gives
BF16_CEILING_DB = 90.0


@pytest.mark.parametrize("name", _open("out"))
def test_output_sqnr_against_autocast(name):
    ours, amp = _measured(name)["out"]
    margin = OUTPUT_MARGIN[name]
    assert ours >= amp - margin, f"{name}: output SQNR vs fp32 {ours:.1f} dB, autocast {amp:.1f} dB (margin {margin} dB)"
    assert ours < BF16_CEILING_DB, f"{name}: output SQNR vs fp32 {ours:.1f} dB: did bf16 run? (autocast {amp:.1f} dB)"


@pytest.mark.parametrize("name", _open("grad"))
def test_parameter_gradient_sqnr_against_autocast(name):
    ours, amp = _measured(name)["grad"]
    assert ours >= amp - 1.0, f"{name}: parameter-gradient SQNR vs fp32 {ours:.1f} dB, autocast {amp:.1f} dB"
    assert ours < BF16_CEILING_DB, f"{name}: parameter-gradient SQNR vs fp32 {ours:.1f} dB: did bf16 run?"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_half_precision_ran(name):
    conv = _measured(name)["conv"]
    share = conv.report.summary["half_flop_fraction"]
    assert conv.partition is None, f"{name}: converted region by region"
    assert share > 0.8, f"{name}: {100 * share:.1f}% of the FLOPs in half"
    gemms = [n for n in conv.module.graph.nodes if n.meta.get(META_INFO) is not None
             and n.meta[META_INFO].op in GEMMS and n.meta.get(META_DECISION) is not None]
    half = [n for n in gemms if n.meta[META_DECISION].precision == "bf16"]
    assert gemms and len(half) >= 0.8 * len(gemms), (name, len(half), len(gemms))
