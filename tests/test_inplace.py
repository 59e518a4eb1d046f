"""converter.apply: convert in place (issue 16 item 1).

Real models, real training: HF Llama/GPT-2 from small configs (nothing is downloaded), a BatchNorm CNN,
transformers' Trainer, save_pretrained/from_pretrained, generate().
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import converter
from converter.inplace import ConvertedForward, converted_forward

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, use_cache=False,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return transformers.GPT2LMHeadModel(cfg)


def _batch(batch=2, length=8, seed=1):
    ids = torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def test_loop_with_optimizer_built_before_apply():
    model = _llama()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    keys = list(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built BEFORE the conversion
    model.eval()
    with torch.no_grad():
        reference = model(**_batch(3, 10, seed=5)).logits

    returned = converter.apply(model, _batch(), precision="bf16")

    assert returned is model and type(model) is transformers.LlamaForCausalLM
    assert isinstance(model.forward, ConvertedForward)
    assert dict(model.named_parameters()) == params and all(params[n] is p for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys
    conv = converter.conversion_of(model)
    gm = conv.module
    assert all(gm.get_parameter(name) is p for name, p in params.items()), "the graph must read the user's parameters"
    assert all(gm.get_buffer(name) is b for name, b in buffers.items())
    assert conv.report.summary["by_precision"]["bf16"] > 0 and conv.report.summary["casts"] > 0
    # another batch size and length than the example (dynamic dims), eval mode: bf16 numerics, not fp32 ones
    with torch.no_grad():
        converted = model(**_batch(3, 10, seed=5)).logits
    diff = _max_diff(converted, reference)
    assert converted.dtype == torch.float32 and 0 < diff < 0.05, f"converted vs fp32 logits differ by {diff}"

    model.train()
    batch = _batch(4, 12, seed=2)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, f"loss did not go down: {losses}"
    assert model.forward.calls == {"converted": 9, "fallback": 0, "recaptured": 0}
    assert all(p.grad is not None for p in params.values() if p.requires_grad)
    assert all(params[n] is p and p.dtype == torch.float32 for n, p in model.named_parameters())
    # an optimizer built AFTER the conversion holds the same parameter objects
    later = torch.optim.SGD(model.parameters(), lr=0.1)
    assert [id(p) for p in later.param_groups[0]["params"]] == [id(p) for p in optimizer.param_groups[0]["params"]]


def test_save_pretrained_gives_the_trained_fp32_weights(tmp_path):
    model = converter.apply(_llama(), _batch(), precision="bf16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        optimizer.zero_grad()
        model(**_batch(2, 8, seed=3)).loss.backward()
        optimizer.step()
    trained = model.state_dict()
    changed = [k for k in trained if not torch.equal(trained[k], before[k])]
    assert len(changed) >= 10, f"training changed only {changed}"
    model.save_pretrained(tmp_path / "ckpt")
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert "forward" not in plain.__dict__
    loaded = plain.state_dict()
    assert sorted(loaded) == sorted(trained)
    bad = [k for k in trained if loaded[k].dtype != torch.float32 or not torch.equal(loaded[k], trained[k])]
    assert not bad, f"reloaded weights differ from the trained fp32 weights: {bad}"


@pytest.mark.slow
def test_hf_trainer_bf16_cpu_trains_and_checkpoint_reloads(tmp_path):
    pytest.importorskip("accelerate")
    model = converter.apply(_gpt2(), _batch(), precision="bf16")
    batch = _batch(8, 16, seed=7)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(8)]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True, max_steps=10, per_device_train_batch_size=4,
        learning_rate=5e-3, logging_steps=1, save_steps=10, report_to=[], seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows())
    assert trainer.model is model
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.2, f"loss did not go down: {losses}"
    calls = converted_forward(model).calls  # Trainer (accelerate) wrapped the forward in autocast
    assert converted_forward(model) is not model.forward
    assert calls["fallback"] == 0 and calls["converted"] >= 10, calls
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out" / "checkpoint-10")
    final = model.state_dict()
    bad = [k for k, v in reloaded.state_dict().items() if not torch.equal(v, final[k])]
    assert not bad, f"checkpoint-10 differs from the trained model: {bad}"


def test_generate_returns_tokens_with_a_fallback_warning():
    model = converter.apply(_gpt2(), _batch(), precision="bf16").eval()
    reference = copy.deepcopy(model)
    converter.restore(reference)
    prompt = _batch(2, 5, seed=9)["input_ids"]
    with pytest.warns(converter.FallbackWarning, match="not captured with"):
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    assert tokens.shape == (2, 11) and torch.equal(tokens[:, :5], prompt)
    expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, expected)
    assert model.forward.calls["fallback"] == 6


def test_autocast_does_not_override_the_decisions():
    model = converter.apply(_llama(), _batch(), precision="bf16").eval()
    batch = _batch(2, 8, seed=4)
    with torch.no_grad():
        plain = model(**batch).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = model(**batch).logits
    assert torch.equal(plain, under), f"autocast changed the converted forward by {_max_diff(plain, under)}"


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 4),
    )


def test_train_eval_buffers_and_to_follow_the_model():
    model = _cnn()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    running = model[1].running_mean
    converter.apply(model, (x,), precision="bf16")
    assert converter.conversion_of(model).module.get_buffer("1.running_mean") is running
    model.train()
    with torch.no_grad():
        model(x)
    assert running.abs().sum() > 0, "a train-mode forward must update the user's BatchNorm running stats"
    assert int(model[1].num_batches_tracked) == 1
    torch.manual_seed(0)
    first = model(x)
    torch.manual_seed(1)
    assert not torch.equal(first, model(x)), "dropout must be active in train mode"
    model.eval()
    stats = model[1].running_mean.clone()
    reference = copy.deepcopy(model)
    converter.restore(reference)
    with torch.no_grad():
        probe = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
        out, want = model(probe), reference(probe)
    assert torch.equal(model[1].running_mean, stats), "eval mode must not update running stats"
    diff = _max_diff(out, want)
    assert out.shape == (2, 4) and 0 < diff < 0.05, f"eval output differs from fp32 eval by {diff}"
    # load_state_dict(assign=True) (like .to() to another device) replaces the tensors: the graph follows
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["1.running_mean"] += 1.0
    model.load_state_dict(state, assign=True)
    assert model[1].running_mean is not running
    reference.load_state_dict(state)
    with torch.no_grad():
        shifted, shifted_want = model(probe), reference(probe)
    diff = _max_diff(shifted, shifted_want)
    assert not torch.equal(shifted, out) and diff < 0.05, f"after assign the outputs differ from fp32 by {diff}"
    assert model.forward.calls["fallback"] == 0
    assert converter.conversion_of(model).module.get_buffer("1.running_mean") is model[1].running_mean


def test_to_another_device_retargets_the_graph_constants():
    model = converter.apply(_llama(), _batch(), precision="bf16").eval()
    model.to("meta")  # no GPU here: the meta device stands for any device other than the capture device
    batch = {k: v.to("meta") for k, v in _batch(3, 6).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", converter.FallbackWarning)
        out = model(**batch)
    assert out.logits.device.type == "meta" and out.logits.shape == (3, 6, VOCAB)
    assert model.forward.calls == {"converted": 1, "fallback": 0, "recaptured": 0}


def test_other_calls_fall_back_and_restore_undoes_apply():
    model = converter.apply(_llama(), _batch(), precision="bf16").eval()
    ids = _batch()["input_ids"]
    with pytest.warns(converter.FallbackWarning, match="attention_mask=None"):
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
    assert model.forward.calls == {"converted": 0, "fallback": 1, "recaptured": 0}
    with pytest.warns(converter.FallbackWarning, match="input_ids as torch.int32"):
        model(input_ids=ids.int(), attention_mask=torch.ones_like(ids), labels=ids)
    converted = model.forward
    again = converter.apply(model, _batch(), precision="fp16")
    assert again is model and model.forward is not converted
    assert converter.conversion_of(model).precision == "fp16"
    assert model.forward.original.__func__ is transformers.LlamaForCausalLM.forward
    converter.restore(model)
    assert "forward" not in model.__dict__ and converter.conversion_of(model) is None
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, labels=ids).logits, out.logits)


def test_deepcopy_of_an_applied_model_is_independent():
    model = converter.apply(_cnn(), (torch.randn(2, 3, 8, 8),), precision="bf16").eval()
    twin = copy.deepcopy(model)
    assert twin.forward.model is twin
    gm = converter.conversion_of(twin).module
    assert all(gm.get_parameter(n) is p for n, p in twin.named_parameters())
    with torch.no_grad():
        twin[0].weight.add_(1.0)
        x = torch.randn(2, 3, 8, 8)
        assert not torch.equal(model(x), twin(x))


@pytest.mark.parametrize("opt_level, master_weights", [("O1", False), ("O2", True)])
def test_fp16_loss_scaling_and_master_weights_with_mixed_precision_trainer(opt_level, master_weights):
    batch = _batch(4, 12, seed=2)
    model = converter.apply(_llama(), batch, precision="fp16", opt_level=opt_level)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    trainer = converter.MixedPrecisionTrainer(model, optimizer, precision="fp16", master_weights=master_weights)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", converter.FallbackWarning)
        for _ in range(6):
            trainer.zero_grad()
            loss = model(**batch).loss
            trainer.backward(loss)
            assert trainer.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, f"loss did not go down: {losses}"
    assert trainer.stats.steps == 6 and trainer.stats.skipped == 0 and trainer.stats.scale > 1
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == ({torch.float32, torch.float16} if master_weights else {torch.float32}), dtypes
    assert converted_forward(model).calls == {"converted": 6, "fallback": 0, "recaptured": 0}


def test_accelerate_prepare_keeps_the_applied_model():
    accelerate = pytest.importorskip("accelerate")
    batch = _batch(4, 12, seed=2)
    model = converter.apply(_llama(), batch, precision="bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    prepared, optimizer = accelerator.prepare(model, optimizer)
    assert prepared is model
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = prepared(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, f"loss did not go down: {losses}"
    assert converted_forward(model).calls == {"converted": 6, "fallback": 0, "recaptured": 0}


def test_a_graph_that_does_not_read_the_model_parameters_is_refused():
    conv = converter.convert(_cnn(), (torch.randn(2, 3, 8, 8),), precision="bf16")
    other = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(converter.InPlaceError, match="cannot convert Sequential in place: the converted graph.s parameters"):
        ConvertedForward(other, conv)
    assert "forward" not in other.__dict__


def test_replaced_modules_are_followed_and_a_changed_structure_falls_back():
    model = converter.apply(_cnn(), (torch.randn(2, 3, 8, 8),), precision="bf16").eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    model[9] = nn.Linear(8, 4)  # same names: the graph reads the new module's parameters
    with torch.no_grad():
        out = model(x)
        want = nn.Sequential.forward(model, x)
    diff = _max_diff(out, want)
    assert converted_forward(model).calls["converted"] == 1 and diff < 0.05, f"differs from fp32 by {diff}"
    model[9] = nn.Sequential(nn.Linear(8, 4))  # "9.weight" is now "9.0.weight"
    with pytest.warns(converter.FallbackWarning, match=r"structure changed since apply\(\) \(it has no 9\.weight"):
        with torch.no_grad():
            out = model(x)
    assert torch.equal(out, nn.Sequential.forward(model, x))
    assert converted_forward(model).calls == {"converted": 1, "fallback": 1, "recaptured": 0}
