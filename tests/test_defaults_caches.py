"""Stock Hugging Face models, with the library's defaults (SDPA attention, ``use_cache`` as shipped).

A stock decoder or encoder-decoder has ``config.use_cache=True`` and returns a ``DynamicCache``,
which no graph can return: capture traces it with ``use_cache=False`` (the training graph) and says
so in ``report.records.capture.cache``; in place, calls that ask for a cache (``generate()``) run the
original forward under autocast; ``conv.module`` refuses them in one line. Before this, every one of
these models failed to convert with ``CaptureError ... DynamicCache in output``.
"""
from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch
from helpers import first_tensor, sqnr

import converter
from converter.inplace import FallbackWarning, converted_forward

transformers = pytest.importorskip("transformers")

VOCAB = 128
NO_CACHE = "captured without the key/value cache (use_cache=False"


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0))


def _bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64))


#: name -> (builder, whether it has a cache to leave out)
STOCK = {"llama": (_llama, True), "gpt2": (_gpt2, True), "t5": (_t5, True), "bart": (_bart, True),
         "bert": (_bert, False)}


def _ids(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _example(name: str, ids: torch.Tensor) -> dict:
    if name in ("t5", "bart"):
        return {"input_ids": ids, "decoder_input_ids": ids[:, :8].contiguous()}
    return {"input_ids": ids}


def _stock(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = STOCK[name][0]()
    # the library's defaults: nothing set by hand
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    assert model.config.use_cache is True
    return model


def test_stock_llama_converts_as_a_training_graph_without_the_cache():
    """Failed before: ``CaptureError ... DynamicCache in output`` (convert, audit, apply alike)."""
    model = _stock("llama")
    example = _example("llama", _ids())
    conv = converter.convert(model, example, precision="bf16")
    from converter.passes.capture import CacheCallError

    assert conv.report.records.capture.cache.startswith(NO_CACHE), conv.report.records.capture.cache
    assert model.config.use_cache is True  # the user's config is left as it was
    assert "| key/value cache | captured without the key/value cache (use_cache=False" in conv.report.to_markdown()
    out = conv.module(**example)
    assert out.past_key_values is None and out.logits.dtype == torch.float32
    # use_cache=False is what the graph computes: served; use_cache=True: one clear line
    torch.testing.assert_close(conv.module(**example, use_cache=False).logits, out.logits, rtol=0, atol=0)
    with pytest.raises(CacheCallError, match=r"captured without the key/value cache \(use_cache=False\), so it "
                                             r"cannot take or return one; decode with converter.apply"):
        conv.module(**example, use_cache=True)
    report = converter.audit(model, example, precision="bf16")
    assert report.records.capture.cache.startswith(NO_CACHE)
    assert report.summary["half_flop_fraction"] > 0.9, report.summary


def test_stock_llama_without_weights_converts():
    """``empty_weights()`` + ``convert`` on a default config (docs/scale.md's larger-than-memory recipe)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with converter.empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert all(p.is_meta for p in model.parameters())
    conv = converter.convert(model, {"input_ids": _ids()}, precision="bf16")
    assert conv.report.records.capture.cache.startswith(NO_CACHE)
    assert conv.report.summary["by_precision"]["bf16"] > 0, conv.report.summary


def test_an_example_with_use_cache_false_is_served_with_and_without_the_keyword():
    """The old way (use_cache=False in the example): before, a call without the keyword fell back to
    fp32 and ``conv.module(use_cache=True)`` failed with ``AssertionError: Guard failed: use_cache == False``."""
    model = _stock("llama")
    ids = _ids()
    converter.apply(model, {"input_ids": ids, "use_cache": False}, precision="bf16")
    conv = converter.conversion_of(model)
    assert conv.report.records.capture.cache.startswith(
        "captured without the key/value cache (use_cache=False in the example"), conv.report.records.capture
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        without = model(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, without, rtol=0, atol=0)
    with pytest.warns(FallbackWarning, match="use_cache=True"):
        model(input_ids=ids, use_cache=True)
    assert converted_forward(model).calls == {"converted": 2, "fallback": 0, "recaptured": 0, "cache": 1}
    from converter.passes.capture import CacheCallError

    with pytest.raises(CacheCallError, match="captured without the key/value cache"):
        conv.module(input_ids=ids, use_cache=True)
    torch.testing.assert_close(conv.module(input_ids=ids, use_cache=False).logits, without, rtol=0, atol=0)


def test_an_example_that_asks_for_the_cache_gets_advice():
    model = _stock("llama")
    with pytest.raises(converter.CaptureError, match="forward returns a key/value cache object .* leave use_cache"):
        converter.convert(model, {"input_ids": _ids(), "use_cache": True}, precision="bf16", partial=False)


def _forward_backward(model: torch.nn.Module, example: dict, weights: torch.Tensor, *, amp: bool = False):
    """(logits, every parameter's gradient by name) of ``sum(logits * weights)`` in fp32 or under autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = first_tensor(model(**example)).float()
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[n].flatten() for n in sorted(grads)])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STOCK))
def test_stock_model_applied_in_bf16_matches_autocast_in_outputs_and_gradients(name):
    model = _stock(name)
    reference = copy.deepcopy(model).eval()
    example = _example(name, _ids())
    converter.apply(model, example, precision="bf16")
    conv = converter.conversion_of(model)
    cache = conv.report.records.capture.cache
    assert cache.startswith(NO_CACHE) if STOCK[name][1] else cache == "", (name, cache)
    assert conv.report.summary["half_flop_fraction"] > 0.9, conv.report.summary
    model.eval()
    weights = torch.randn(first_tensor(reference(**example)).shape, generator=torch.Generator().manual_seed(2))
    ref, ref_grads = _forward_backward(reference, example, weights)
    amp, amp_grads = _forward_backward(reference, example, weights, amp=True)
    out, grads = _forward_backward(model, example, weights)
    # "cache" counts decoding calls of models captured without their cache (BERT has none)
    assert converted_forward(model).calls == {"converted": 1, "fallback": 0, "recaptured": 0, **({"cache": 0} if STOCK[name][1] else {})}
    assert set(grads) == set(ref_grads), set(ref_grads) ^ set(grads)
    ours, theirs = sqnr(ref, out), sqnr(ref, amp)
    g_ours, g_theirs = sqnr(_flat(ref_grads), _flat(grads)), sqnr(_flat(ref_grads), _flat(amp_grads))
    print(f"{name}: output SQNR converted {ours:.1f} dB, autocast {theirs:.1f} dB; "
          f"gradient SQNR converted {g_ours:.1f} dB, autocast {g_theirs:.1f} dB")
    # bf16 has 8 bits of mantissa: a converted model lands near 45 dB, fp32 would be exact
    assert 25.0 < ours < 100.0 and ours >= theirs - 1.0, f"{name}: output {ours:.2f} dB vs autocast {theirs:.2f} dB"
    assert 25.0 < g_ours < 100.0 and g_ours >= g_theirs - 1.0, \
        f"{name}: gradients {g_ours:.2f} dB vs autocast {g_theirs:.2f} dB"
    # the GraphModule gives what the in-place forward gives (with grad, as above: SDPA's CPU kernel differs without)
    torch.testing.assert_close(first_tensor(conv.module(**example)).float().detach(), out, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_generate_on_an_applied_stock_model_decodes_under_autocast(name):
    model = _stock(name)
    reference = copy.deepcopy(model).eval()
    ids = _ids(2, 8)
    converter.apply(model, _example(name, ids), precision="bf16")
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    ours = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(ours) == 1 and "use_cache=True (decoding, generate())" in ours[0] \
        and "torch.autocast(bf16)" in ours[0], ours
    calls = converted_forward(model).calls
    assert calls["cache"] == 5 and calls["fallback"] == 0, calls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert tokens.shape[1] == expected.shape[1] >= 5 and torch.equal(tokens, expected), (tokens, expected)
    # after decoding, a training call runs the converted graph again
    model.train()
    model(**_example(name, ids))
    assert converted_forward(model).calls["converted"] == 1


class _Counting(torch.utils.data.Dataset):
    """Sequences that count up from a random start: a pattern a tiny Llama learns in a few steps."""

    def __init__(self, n: int = 64, length: int = 16):
        starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(1))
        self.ids = (starts + torch.arange(length)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.slow
def test_stock_llama_trains_through_apply_and_hf_trainer():
    """The loss is computed in the graph: the example carries ``labels``, as Trainer's batches do, so
    HF's shifted cross-entropy is captured (fp32 by the rules) and ``outputs.loss`` is what Trainer reads."""
    model = _stock("llama")
    data = _Counting()
    converter.apply(model, {"input_ids": data.ids[:4], "labels": data.ids[:4]}, precision="bf16")
    forward = converted_forward(model)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # any fallback fails the test
        args = transformers.TrainingArguments(output_dir=tmp, max_steps=8, per_device_train_batch_size=4, report_to=[],
                                              use_cpu=True, save_strategy="no", logging_steps=1, learning_rate=3e-3,
                                              disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.3, losses
    assert converted_forward(model) is forward
    assert forward.calls == {"converted": 8, "fallback": 0, "recaptured": 0, "cache": 0}, forward.calls
