"""Hugging Face models captured with ``labels`` (the Trainer's inputs) stay dynamic in batch and length.

The loss flattens logits and labels (``logits.view(-1, V)``, ``labels.view(-1)``), which leaves the
guard ``input_ids.numel() == labels.numel()``; capture exports the labels' dims as the input_ids' own
(converter.passes.guards.tied_dims), so one graph serves every batch size and padded length: no
re-capture. Stock configs (SDPA attention, use_cache default), captured in train mode; the numbers
are compared in eval mode (BERT's dropout draws random numbers).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import sqnr

import converter
import converter.api as api
from converter.inplace import converted_forward
from converter.passes.capture import capture

transformers = pytest.importorskip("transformers")

VOCAB = 256


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128))


def _bert_mlm() -> torch.nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64))


def _batch(size: int, length: int, pad: int, seed: int) -> dict:
    """A right-padded batch: the last row has ``pad`` padding tokens, labelled -100 (ignored by the loss)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (size, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[-1, length - pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("make", [_llama, _bert_mlm], ids=["llama", "bert_mlm"])
def test_labels_keep_batch_and_length_dynamic(make, monkeypatch):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)  # the fp32 model, for the bf16 (autocast) and fp32 references
    captures = []
    real_capture = api.capture
    monkeypatch.setattr(api, "capture", lambda *a, **k: captures.append(1) or real_capture(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SlowHalfWarning on CPUs without bf16 math
        converter.apply(model, _batch(2, 16, 4, seed=0), precision="bf16")
    capture = converter.conversion_of(model).report.records.capture
    assert "static shapes" not in capture.shapes and "labels dims 0, 1 exported as input_ids dims 0, 1" in capture.shapes, (
        capture.shapes)
    assert capture.dynamic_dims == {"input_ids": [0, 1], "attention_mask": [0, 1], "labels": [0, 1]}, (
        capture.dynamic_dims, capture.narrowed_dims)
    assert capture.narrowed_dims == {}, capture.narrowed_dims
    assert capture.tied_dims == {"labels": {0: ["input_ids", 0], 1: ["input_ids", 1]}}, capture.tied_dims
    forward = converted_forward(model)
    # labels of another length than input_ids break the tie: a shape mismatch, never a guard failure in the graph
    odd = _batch(3, 24, 5, seed=9)
    odd["labels"] = odd["labels"][:, :12]
    assert "labels of shape (3, 12) (its dim 1 is captured as input_ids's dim 1" in str(forward._mismatch((), odd))

    model.eval()
    reference.eval()
    for size, length, pad in ((3, 24, 5), (5, 9, 2)):  # another batch size and padded length, twice
        batch = _batch(size, length, pad, seed=size)
        model.zero_grad()
        reference.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = reference(**batch).loss.item()
        fp32 = reference(**batch).loss
        fp32.backward()
        # measured: |converted - autocast bf16| = 0.0; |fp32 - autocast bf16| = 1.7e-5 (llama), 7e-5..1.1e-4 (bert)
        gap, dtype_gap = abs(loss.item() - bf16), abs(fp32.item() - bf16)
        assert dtype_gap > 1e-6 and gap <= 0.25 * dtype_gap, (
            f"{size}x{length}: converted loss {loss.item():.7f}, bf16 {bf16:.7f}, fp32 {fp32.item():.7f}: "
            f"|converted - bf16| {gap:.2e} > 0.25 * |fp32 - bf16| {dtype_gap:.2e}")
        params = dict(model.named_parameters())
        # weight matrices (a key bias has a zero gradient: softmax ignores it)
        for name, ref_param in [(n, p) for n, p in reference.named_parameters() if p.dim() == 2][1::3][:4]:
            s = sqnr(ref_param.grad, params[name].grad)  # measured 41.7..47.6 dB
            assert s >= 30.0, f"{size}x{length}: grad of {name} SQNR {s:.1f} dB vs fp32 (< 30 dB)"
    assert forward.calls == {"converted": 2, "fallback": 0, "recaptured": 0} | (
        {"cache": 0} if "cache" in forward.calls else {}), forward.calls
    assert len(captures) == 1, f"{len(captures)} captures: calls of other sizes were captured again"


def test_size_one_batch_keeps_the_length_dynamic():
    """A batch-1 example is traced size-obliviously, and the loss's ``.contiguous()`` there fixes the
    labels' batch to 1: the length is still shared with input_ids and stays dynamic."""
    torch.manual_seed(0)
    example = _batch(1, 16, 0, seed=0)
    example["labels"] = example["input_ids"].clone()
    captured = capture(_llama(), example)
    assert captured.dynamic_dims == {"input_ids": [1], "attention_mask": [0, 1], "labels": [1]}, (
        captured.dynamic_dims, captured.narrowed_dims, captured.shapes_note)
    assert captured.tied_dims == {"labels": {1: ["input_ids", 1]}}, captured.shapes_note
    assert set(captured.narrowed_dims) == {"input_ids", "labels"} and "Eq(labels.size(0), 1)" in (
        captured.narrowed_dims["labels"][0]), captured.narrowed_dims
