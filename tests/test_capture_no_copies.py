"""Issue 23: conversion copies no weight and leaves the user's model exactly as it was.

Capture traces a *shell* of the model (new module objects over the same tensors), so the converted
module shares every parameter's and buffer's storage with the original, and the original's modes,
config, buffers, ``requires_grad`` flags and hooks are unchanged afterwards, also when a trace
fails. Hugging Face models go straight to torch.export under ``tracer="auto"``.
"""
from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from torch import nn

import converter
from converter.passes import capture as capture_mod
from converter.passes.capture import CaptureError, shell
from converter.train.trainer import MixedPrecisionTrainer


class _Net(nn.Module):
    """Batch norm (buffers written in train mode), dropout, a Python branch on self.training,
    HF-style LayerDrop on ``config``, a frozen parameter and a tied weight."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(layerdrop=0.25, hidden=8)
        self.inp = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(8, 8)
        self.out.weight = self.inp.weight  # tied
        self.scale = nn.Parameter(torch.ones(8), requires_grad=False)

    def forward(self, x):
        x = self.bn(self.inp(x))
        for layer in self.layers:
            if self.training and self.config.layerdrop > 0.0 and torch.rand([]) < self.config.layerdrop:
                continue
            x = x + self.drop(layer(x))
        if self.training:
            x = x * 0.5
        return self.out(x) * self.scale


def _snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "ptrs": {k: v.data_ptr() for k, v in model.state_dict(keep_vars=True).items()},
        "dtypes": {k: v.dtype for k, v in model.state_dict(keep_vars=True).items()},
        "training": {name: m.training for name, m in model.named_modules()},
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "grads": {name: p.grad for name, p in model.named_parameters()},
        "params": {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)},
        "attrs": {name: sorted(vars(m)) for name, m in model.named_modules()},
        "hooks": {name: [len(v) for k, v in sorted(vars(m).items()) if "hook" in k and isinstance(v, dict)]
                  for name, m in model.named_modules()},
        "config": dict(vars(model.config)) if hasattr(model, "config") and hasattr(model.config, "__dict__") else None,
    }


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    for key in ("ptrs", "dtypes", "training", "requires_grad", "params", "attrs", "hooks", "config"):
        assert after[key] == before[key], f"the user's model changed: {key}"
    assert after["grads"] == before["grads"], "the user's model got gradients"
    assert after["state"].keys() == before["state"].keys()
    for name, value in before["state"].items():
        assert torch.equal(after["state"][name], value), f"{name} changed"


def _assert_shares(conv, model) -> None:
    # a tied weight may be registered under either of its names (FX keeps one)
    own = dict(model.named_parameters(remove_duplicate=False))
    params = dict(conv.module.named_parameters())
    assert len(params) == len(list(model.parameters()))
    for name, p in params.items():
        assert p.data_ptr() == own[name].data_ptr(), f"{name} is a copy"
    buffers = dict(model.named_buffers())
    for name, b in conv.module.named_buffers():
        if name in buffers:
            assert b.data_ptr() == buffers[name].data_ptr(), f"buffer {name} is a copy"


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_convert_shares_weights_and_leaves_the_model_as_it_was(tracer, mode):
    torch.manual_seed(0)
    model = _Net().train(mode == "train")
    model.layers[1].eval()  # a submodule in the other mode
    x = torch.randn(4, 8)
    before = _snapshot(model)
    conv = converter.convert(model, (x,), tracer=tracer)
    assert "LayerDrop is off in the train graph" in conv.report.records.capture.modes, conv.report.records.capture.modes
    assert "two graphs" in conv.report.records.capture.modes, conv.report.records.capture.modes
    _assert_unchanged(model, before)
    _assert_shares(conv, model)
    # the converted module's modes are its own: switching them leaves the original's as they were
    conv.module.train(mode != "train")
    assert {n: m.training for n, m in model.named_modules()} == before["training"]


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
def test_a_failing_capture_leaves_the_model_as_it_was(tracer):
    class Branchy(_Net):
        def forward(self, x):
            x = super().forward(x)
            if x.sum() > 0:  # data-dependent: no tracer can capture it, in either mode
                return x
            return -x

    torch.manual_seed(0)
    model = Branchy().train()
    before = _snapshot(model)
    with pytest.raises(CaptureError):
        converter.convert(model, (torch.randn(4, 8),), tracer=tracer, partial=False)
    _assert_unchanged(model, before)


def test_a_failing_train_trace_leaves_the_model_as_it_was():
    """Train mode is untraceable (a train-only data-dependent branch): frozen in eval, model intact."""

    class TrainBranch(_Net):
        def forward(self, x):
            x = super().forward(x)
            if self.training and x.mean() > 0:
                x = x * 2
            return x

    torch.manual_seed(0)
    model = TrainBranch().eval()
    model.bn.train()
    before = _snapshot(model)
    # partial=False: the whole-graph capture, frozen (converter.convert converts it region by region)
    conv = converter.convert(model, (torch.randn(4, 8),), tracer="export", partial=False)
    assert conv.report.records.capture.modes.startswith("frozen in eval mode"), conv.report.records.capture.modes
    _assert_unchanged(model, before)
    _assert_shares(conv, model)


def test_buffers_written_by_a_raising_trace_are_restored(monkeypatch):
    """A trace that runs the model (writing batch norm statistics) and then raises leaves no trace."""
    torch.manual_seed(0)
    model = _Net().train()
    before = _snapshot(model)

    def runs_then_raises(shelled, args, kwargs, shapes):
        with torch.no_grad():
            shelled(*args, **kwargs)  # a train-mode forward: bn running stats and counter change
        raise RuntimeError("tracer failed after running the model")

    monkeypatch.setattr(capture_mod, "trace_fx", runs_then_raises)
    monkeypatch.setattr(capture_mod, "trace_export", runs_then_raises)
    with pytest.raises(CaptureError):
        converter.convert(model, (torch.randn(4, 8),), partial=False)
    _assert_unchanged(model, before)


def test_shell_shares_tensors_but_not_modules_modes_hooks_or_config():
    model = _Net().train()
    shelled = shell(model, config={"layerdrop": 0.0})
    assert shelled.config.layerdrop == 0.0 and model.config.layerdrop == 0.25
    assert shelled.inp.weight is not model.inp.weight and shelled.inp.weight.data_ptr() == model.inp.weight.data_ptr()
    assert shelled.out.weight is shelled.inp.weight, "tied weights stay tied"
    assert shelled.bn.running_mean is model.bn.running_mean
    assert not shelled.scale.requires_grad
    shelled.eval()
    shelled.inp.register_forward_hook(lambda *a: None)
    shelled.inp.weight.requires_grad_(False)
    assert model.training and model.bn.training and model.inp.weight.requires_grad
    assert not model.inp._forward_hooks


def test_two_mode_module_shares_the_originals_weights():
    torch.manual_seed(0)
    model = _Net().eval()
    conv = converter.convert(model, (torch.randn(4, 8),), tracer="fx")
    assert type(conv.module).__name__ and hasattr(conv.module, "eval_graph")
    _assert_shares(conv, model)


def test_o1_training_updates_the_original_and_o2_leaves_it_as_it_was():
    """The converted module shares the original's storage: O1 training updates both (documented);
    the O2 trainer gives every trainable parameter storage of its own, so the original stays."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    for master_weights in (False, True):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
        conv = converter.convert(model, (x,), opt_level="O2" if master_weights else "O1")
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainer = MixedPrecisionTrainer(conv.module, torch.optim.SGD(conv.module.parameters(), lr=0.1),
                                        precision="bf16", master_weights=master_weights)
        for _ in range(2):
            trainer.zero_grad()
            trainer.backward(conv.module(x).float().pow(2).mean())
            assert trainer.step()
        after = model.state_dict()
        assert all(v.dtype == torch.float32 for v in after.values())
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        if master_weights:
            assert changed == set(), f"O2 training changed the original model: {sorted(changed)}"
        else:
            assert changed == set(before), f"O1 training should update every original weight, left {set(before) - changed}"


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64)  # library defaults: SDPA, use_cache=True
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_hf_model_goes_straight_to_export_shares_weights_and_is_unchanged(monkeypatch):
    model = _tiny_llama().train()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    tried = []
    real_fx = capture_mod.trace_fx

    def recording_fx(*args, **kwargs):
        tried.append("fx")
        return real_fx(*args, **kwargs)

    monkeypatch.setattr(capture_mod, "trace_fx", recording_fx)
    before = _snapshot(model)
    conv = converter.convert(model, ((), {"input_ids": ids}))
    assert conv.tracer == "export" and tried == [], tried
    assert "not tried" in conv.report.records.run.capture_errors["fx"], conv.report.records.run.capture_errors
    _assert_unchanged(model, before)
    _assert_shares(conv, model)


def test_hf_check_does_not_import_transformers():
    code = ("import sys, torch, converter\n"
            "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
            "conv = converter.convert(m, (torch.randn(2, 4),))\n"
            "assert conv.tracer == 'fx', conv.tracer\n"
            "assert 'transformers' not in sys.modules, 'converting a plain model imported transformers'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
