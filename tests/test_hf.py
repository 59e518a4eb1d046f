"""HF transformers models from small configs (nothing downloaded): export fallback and numerics."""
from __future__ import annotations

import pytest
import torch
from helpers import DtypeRecorder, first_tensor, load_sample, sqnr

import converter

transformers = pytest.importorskip("transformers")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # use_cache=True as shipped
    cfg._attn_implementation = "eager"  # this test counts the eager attention's softmax (the zoo runs SDPA)
    model = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    return model, ((), {"input_ids": torch.randint(0, 128, (2, 16))})


def _sample(name):
    mod = load_sample(name)
    return mod.build_model(), mod.example_inputs()


MODELS = {"gpt2": lambda: _sample("hf_gpt2"), "bert": lambda: _sample("hf_bert"), "llama": _llama}


@pytest.fixture(scope="module", params=sorted(MODELS))
def hf_case(request):
    model, example = MODELS[request.param]()
    conv = converter.convert(model, example, precision="bf16")
    return request.param, model, example, conv


def test_falls_back_to_export_and_matches_autocast(hf_case):
    name, model, (args, kwargs), conv = hf_case
    assert conv.tracer == "export", f"{name} was captured by {conv.tracer}"
    assert "fx" in conv.report.records.run.capture_errors, conv.report.records.run.capture_errors
    with torch.no_grad():
        ref = first_tensor(model(*args, **kwargs))
        out = first_tensor(conv.module(*args, **kwargs))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = first_tensor(model(*args, **kwargs)).float()
    ours, theirs = sqnr(ref, out), sqnr(ref, amp)
    print(f"{name}: SQNR converted {ours:.2f} dB, autocast {theirs:.2f} dB")
    assert out.dtype == torch.float32
    assert ours >= theirs - 1.0, f"{name}: converted {ours:.2f} dB < autocast {theirs:.2f} dB - 1"
    assert conv.report.summary["half_flop_fraction"] > 0.5, conv.report.summary


def test_hf_matmuls_in_bf16_and_softmax_norms_in_fp32(hf_case):
    name, model, (args, kwargs), conv = hf_case
    rec = DtypeRecorder()
    with torch.no_grad(), rec:
        conv.module(*args, **kwargs)
    mats = rec.dtypes_of("addmm", "mm", "bmm", "baddbmm")
    assert mats, f"{name}: no matmul recorded"
    assert all(set(d) == {torch.bfloat16} for d in mats), [d for d in mats if set(d) != {torch.bfloat16}]
    soft = rec.dtypes_of("_softmax")
    assert soft and all(set(d) == {torch.float32} for d in soft), soft
    norms = rec.dtypes_of("native_layer_norm", "pow", "rsqrt", "mean")
    assert norms and all(set(d) == {torch.float32} for d in norms), norms
    out = first_tensor(conv.module(*args, **kwargs))
    out.float().sum().backward()
    bad = [n for n, p in conv.module.named_parameters() if p.grad is not None and p.grad.dtype != torch.float32]
    assert not bad, bad


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert"])
def test_hf_samples_convert_to_fp16_and_train(name, one_thread):
    model, (args, kwargs) = _sample(name)
    conv = converter.convert(model, (args, kwargs), precision="fp16")
    assert conv.tracer == "export" and conv.precision == "fp16"
    ref = first_tensor(model(*args, **kwargs))
    out = first_tensor(conv.module(*args, **kwargs))
    s = sqnr(ref, out)
    assert out.dtype == torch.float32 and s > 40, f"{name} fp16 SQNR {s:.1f} dB"
    rec = DtypeRecorder()
    with torch.no_grad(), rec:
        conv.module(*args, **kwargs)
    mats = rec.dtypes_of("addmm", "mm", "bmm")
    assert mats and all(set(d) == {torch.float16} for d in mats), mats
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in conv.module.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
