"""Zoo families of issue 43 (Deliver 5, part C): each pattern's numerics against ``torch.autocast``.

* **M2M100** (encoder-decoder with dropout and LayerDrop as shipped: LayerDrop off in the train graph);
* **GPT-OSS** (attention sinks, MoE with top-k routing);
* **TimesFM** (a forecaster: left-padded series whose padded patches are fully masked rows, huge pad values,
  per-series mean/std scaling);
* **ViTMAE** pretraining in **fp16** (random masking, its noise given as an input);
* **VQ-VAE** with an EMA codebook (``tests/test_stock_seams.py``'s model: buffers written in train mode).

For each, in eval mode, on its example and :data:`BATCHES` - 1 more batches of the same shapes: the output SQNR vs
fp32 of the bf16 (ViTMAE: fp16) conversion and of autocast, and the parameter-gradient SQNR (one fixed fp32 loss per batch), each
the **median over the batches**; ours must be at least autocast's minus the margin (1 dB, 0.5 dB where issue 43
asks: TimesFM and GPT-OSS outputs); and half precision really ran (the report's half-FLOP share, and every GEMM
node's decision).

Why a median: one batch's parameter-gradient SQNR of these two-layer models moves by up to 9 dB from batch to batch
and projection to projection, for autocast as for us (TimesFM, 16 draws: 31 to 45 dB for both, and the sign of our
difference to autocast flips from +7 to -9 dB), so one batch cannot tell a lost dB from luck; and a router flip
(GPT-OSS: 2 of 8 batches at 24 dB, for autocast and us alike) would dominate a pooled figure.
"""
from __future__ import annotations

import copy
import functools
import math
import statistics

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

    def batch(g):
        return {"input_ids": torch.randint(3, 96, (2, 10), generator=g),
                "decoder_input_ids": torch.randint(3, 96, (2, 7), generator=g)}
    return model, batch(torch.Generator().manual_seed(0)), batch


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()

    def batch(g):
        return {"input_ids": torch.randint(0, 128, (2, 12), generator=g)}
    return model, batch(torch.Generator().manual_seed(0)), batch


def _timesfm():
    from transformers import TimesFmConfig, TimesFmModel

    cfg = TimesFmConfig(patch_length=8, context_length=64, horizon_length=16, hidden_size=32, intermediate_size=64,
                        head_dim=8, num_attention_heads=4, num_hidden_layers=2)
    torch.manual_seed(0)
    model = TimesFmModel(cfg).eval()
    pad = torch.zeros(2, 64)
    pad[0, :24], pad[1, :9] = 1.0, 1.0  # left padding: the first patches are fully masked rows

    def batch(g):
        past = torch.randn(2, 64, generator=g) * torch.tensor([[5.0], [0.2]]) + torch.tensor([[30.0], [-2.0]])  # per-series scales
        past = torch.where(pad.bool(), torch.full_like(past, cfg.pad_val), past)  # huge pad values where masked
        return {"past_values": past, "past_values_padding": pad, "freq": torch.zeros(2, 1, dtype=torch.long)}
    return model, batch(torch.Generator().manual_seed(0)), batch


def _vitmae():
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    cfg = ViTMAEConfig(image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, decoder_hidden_size=32, decoder_num_hidden_layers=2,
                       decoder_num_attention_heads=4, decoder_intermediate_size=64, mask_ratio=0.75)
    torch.manual_seed(0)
    model = ViTMAEForPreTraining(cfg).eval()

    def batch(g):  # the masking noise is an input: the same masks for the model, autocast and us
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "noise": torch.rand(2, 64, generator=g)}
    return model, batch(torch.Generator().manual_seed(0)), batch


def _vqvae():
    torch.manual_seed(0)
    model = VQVAE().eval()

    def batch(g):
        return {"x": torch.randn(4, 3, 16, 16, generator=g)}
    return model, batch(torch.Generator().manual_seed(0)), batch


FAMILIES = {"m2m100": _m2m100, "gpt_oss": _gpt_oss, "timesfm": _timesfm, "vitmae": _vitmae, "vqvae": _vqvae}
#: how far under autocast's output SQNR ours may be (issue 43: 0.5 dB for TimesFM, GPT-OSS and ViTMAE in fp16)
OUTPUT_MARGIN = {"m2m100": 1.0, "gpt_oss": 0.5, "timesfm": 0.5, "vitmae": 0.5, "vqvae": 1.0}
#: the conversion's precision and autocast's dtype (bf16 unless named)
PRECISION = {"vitmae": "fp16"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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


#: batches each figure is the median over: the conversion's example and this many - 1 more of its shapes
BATCHES = 6


@functools.cache
def _measured(name: str) -> dict:
    model, kwargs, batch = FAMILIES[name]()
    reference = copy.deepcopy(model)  # the conversion shares the model's tensors: gradients on a copy
    precision = PRECISION.get(name, "bf16")
    dtype = DTYPES[precision]
    conv = converter.convert(model, ((), kwargs), precision=precision)
    rows = []  # per batch: output SQNR ours, autocast; gradient SQNR ours, autocast
    for i in range(BATCHES):
        inputs = kwargs if i == 0 else batch(torch.Generator().manual_seed(i))
        with torch.no_grad():
            ref = _out(reference, inputs)
            ours = _out(conv.module, inputs)
            with torch.autocast("cpu", dtype=dtype):
                amp = _out(reference, inputs)
        torch.manual_seed(i + 1)
        proj = torch.randn_like(ref)
        g_ref = _grads(reference, inputs, proj)
        g_amp = _grads(reference, inputs, proj, autocast=dtype)
        g_ours = _grads(conv.module, inputs, proj)
        rows.append((sqnr(ref, ours), sqnr(ref, amp), sqnr(g_ref, g_ours), sqnr(g_ref, g_amp)))
    med = [statistics.median(column) for column in zip(*rows)]
    return {"conv": conv, "precision": precision, "out": (med[0], med[1]), "grad": (med[2], med[3]),
            "rows": " ".join(f"{o:.1f}/{a:.1f}" for o, a, _, _ in rows),
            "grad_rows": " ".join(f"{o:.1f}/{a:.1f}" for _, _, o, a in rows)}


#: measured gaps still open (strict xfails, so that a fix turns them into failures to remove from here): none.
#: GPT-OSS's output was 0.6 dB under autocast's: on the CPU autocast runs the MoE experts in fp32 (``aten._grouped_mm``
#: is not on its CPU list), half of the model's FLOPs, where we run them in bf16 (half-FLOP share 1.0 against 0.49);
#: with the expert results kept fp32 (:mod:`converter.passes.grouped_gemm`) it is 0.3 dB under (49.5 against 49.8).
OPEN: set[tuple[str, str]] = set()


def _open(kind: str) -> list:
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=f"issue 43: {name} {kind} gap still open"))
            if (kind, name) in OPEN else name for name in FAMILIES]


#: above what a half conversion reaches (bf16, 8 significant bits: 40 to 60 dB; fp16, 11: 55 to 70 dB), below fp32 everywhere
HALF_CEILING_DB = 90.0


@pytest.mark.parametrize("name", _open("out"))
def test_output_sqnr_against_autocast(name):
    measured = _measured(name)
    ours, amp = measured["out"]
    margin = OUTPUT_MARGIN[name]
    assert ours >= amp - margin, (f"{name}: median output SQNR vs fp32 {ours:.1f} dB, autocast {amp:.1f} dB (margin {margin} dB); "
                                  f"per batch, ours/autocast: {measured['rows']}")
    assert ours < HALF_CEILING_DB, f"{name}: output SQNR vs fp32 {ours:.1f} dB: did half precision run? (autocast {amp:.1f} dB)"


@pytest.mark.parametrize("name", _open("grad"))
def test_parameter_gradient_sqnr_against_autocast(name):
    measured = _measured(name)
    ours, amp = measured["grad"]
    assert ours >= amp - 1.0, (f"{name}: median parameter-gradient SQNR vs fp32 {ours:.1f} dB, autocast {amp:.1f} dB; "
                               f"per batch, ours/autocast: {measured['grad_rows']}")
    assert ours < HALF_CEILING_DB, f"{name}: parameter-gradient SQNR vs fp32 {ours:.1f} dB: did half precision run?"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_half_precision_ran(name):
    conv = _measured(name)["conv"]
    share = conv.report.summary["half_flop_fraction"]
    assert conv.partition is None, f"{name}: converted region by region"
    assert share > 0.8, f"{name}: {100 * share:.1f}% of the FLOPs in half"
    gemms = [n for n in conv.module.graph.nodes if n.meta.get(META_INFO) is not None
             and n.meta[META_INFO].op in GEMMS and n.meta.get(META_DECISION) is not None]
    half = [n for n in gemms if n.meta[META_DECISION].precision == _measured(name)["precision"]]
    assert gemms and len(half) >= 0.8 * len(gemms), (name, len(half), len(gemms))


#: fp16 O2 training steps per family, ours and autocast + GradScaler's
STEPS = 8


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_trains_fp16_o2_as_often_as_gradscaler(name):
    """fp16 O2 training (MixedPrecisionTrainer: fp32 master weights, dynamic loss scale) takes at least as many of
    its :data:`STEPS` steps as autocast + GradScaler on the same batches and starting weights, with finite losses
    that fall as autocast's do."""
    model, kwargs, batch = FAMILIES[name]()
    reference = copy.deepcopy(model).train()
    conv = converter.convert(model, ((), kwargs), precision="fp16", opt_level="O2")
    module = conv.module.train()
    batches = [kwargs] + [batch(torch.Generator().manual_seed(100 + i)) for i in range(STEPS - 1)]
    with torch.no_grad():
        target = torch.randn_like(_out(copy.deepcopy(model).eval(), kwargs))
    trainer = converter.MixedPrecisionTrainer(module, torch.optim.SGD(module.parameters(), lr=0.05), precision="fp16",
                                              master_weights=True)
    assert any(p.dtype == torch.float16 for p in module.parameters()), f"{name}: O2 stored no parameter in fp16"
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    ours, theirs, taken, reference_taken = [], [], 0, 0
    for inputs in batches:
        torch.manual_seed(0)  # the same dropout masks for both, where the graphs draw them alike
        trainer.zero_grad()
        loss = _loss(_out(module, inputs), target)
        trainer.backward(loss)
        taken += int(trainer.step())
        ours.append(float(loss))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            amp_loss = _loss(_out(reference, inputs), target)
        scale = scaler.get_scale()
        scaler.scale(amp_loss).backward()
        scaler.step(opt)
        scaler.update()
        reference_taken += int(scaler.get_scale() >= scale)
        theirs.append(float(amp_loss))
    assert all(math.isfinite(x) for x in ours), (name, ours)
    assert taken >= reference_taken, f"{name}: {taken} of {STEPS} steps taken, autocast + GradScaler took {reference_taken}"
    assert ours[-1] < ours[0] and abs(ours[-1] - theirs[-1]) <= 0.05 * abs(theirs[-1]) + 1e-3, (name, ours, theirs)
