"""Models that branch on ``self.training`` in Python (issue 14 item 2): stochastic depth.

timm/HF ``drop_path`` returns its input untouched in eval mode and multiplies by a random per-sample
mask in train mode; no single graph records both. Capture traces such a model in each mode and the
converted module (a :class:`TwoModeGraphModule`), the emitted model.py and ``converter.apply`` run the
train graph in train mode and the eval graph in eval mode, on the same parameters and buffers.
"""
from __future__ import annotations

import copy
import importlib.util
import pickle
import sys

import pytest
import torch
from helpers import assert_half_ran, sqnr
from torch import nn

import converter
from converter.ir.graphmodule import TwoModeGraphModule


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask / keep


class Block(nn.Module):
    def __init__(self, d: int, p: float):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)
        self.p = p

    def forward(self, x):
        return x + drop_path(self.fc2(self.drop(torch.relu(self.fc1(self.norm(x))))), self.p, self.training)


class StochasticDepthNet(nn.Module):
    """Two residual blocks with stochastic depth, dropout and a BatchNorm1d head."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, 0.0), Block(d, 0.5)])
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.bn(x))


def _model() -> StochasticDepthNet:
    torch.manual_seed(0)
    return StochasticDepthNet().eval()


def _run(module, x, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        return module(x).float()


@pytest.fixture(scope="module", params=["fx", "export"])
def case(request):
    model = _model()
    x = torch.randn(6, 32)
    conv = converter.convert(model, (x,), tracer=request.param, precision="bf16")
    return model, x, conv


def test_two_graphs_are_captured_and_reported(case):
    _, _, conv = case
    assert isinstance(conv.module, TwoModeGraphModule), type(conv.module).__mro__
    modes = conv.report.records.capture.modes
    assert modes.startswith("follows train()/eval() with two graphs"), modes
    assert "random op(s) run in train mode only" in modes or "differs" in modes, modes
    random = {"bernoulli_", "bernoulli"}
    names = lambda graph: [str(getattr(getattr(n.target, "_overloadpacket", n.target), "__name__", n.target))  # noqa: E731
                           for n in graph.nodes if n.op in ("call_function", "call_method")]
    assert sum(n in random for n in names(conv.module.graph)) == 1, names(conv.module.graph)
    assert sum(n in random for n in names(conv.module.eval_graph)) == 0, names(conv.module.eval_graph)
    assert conv.module.training is False  # the original's mode


def test_eval_is_deterministic_and_matches_the_original(case):
    model, x, conv = case
    assert_half_ran(conv)
    module = copy.deepcopy(conv.module).eval()
    e1, e2 = _run(module, x, 1), _run(module, x, 2)
    assert torch.equal(e1, e2), "eval(): two forwards differ"
    db = sqnr(_run(model.eval(), x, 1), e1)
    assert db >= 30, f"eval output vs fp32 original eval: {db:.1f} dB (bf16 gives ~40)"


def test_train_drops_paths_like_the_original(case):
    model, x, conv = case
    assert_half_ran(conv)
    module = copy.deepcopy(conv.module).train()
    original = copy.deepcopy(model).train()
    outputs = [_run(module, x, seed) for seed in (1, 2, 3)]
    assert any(not torch.equal(outputs[0], o) for o in outputs[1:]), "train(): not stochastic"
    # same seed, same random ops in the same order: the masks agree and the outputs match closely
    for seed, out in zip((1, 2, 3), outputs):
        db = sqnr(_run(original, x, seed), out)
        assert db >= 25, f"train output vs fp32 original train, seed {seed}: {db:.1f} dB"
    # the eval graph is no stand-in: in train mode with the drop-path block dropped for a sample, the
    # output is far from eval's
    assert sqnr(_run(copy.deepcopy(module).eval(), x, 1), outputs[0]) < 25


def test_batch_norm_statistics_update_only_in_train(case):
    _, x, conv = case
    module = copy.deepcopy(conv.module)
    before = module.bn.running_mean.clone()
    _run(module.eval(), x, 0)
    assert torch.equal(module.bn.running_mean, before), "eval(): running statistics changed"
    _run(module.train(), x, 0)
    assert not torch.equal(module.bn.running_mean, before), "train(): running statistics did not update"


def test_state_dict_is_the_originals_and_parameters_are_shared(case):
    model, x, conv = case
    state = conv.module.state_dict()
    assert set(state) == set(model.state_dict()), sorted(set(state) ^ set(model.state_dict()))
    fresh = StochasticDepthNet()
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh.eval()(x), model.eval()(x))
    # both graphs read the same parameter objects: a trainer step moves the eval output too
    module = copy.deepcopy(conv.module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    trainer = converter.MixedPrecisionTrainer(module, optimizer, precision="bf16", master_weights=True)
    before = _run(module.eval(), x, 0)
    module.train()
    trainer.zero_grad()
    torch.manual_seed(0)
    trainer.backward(module(x).float().pow(2).mean())
    assert trainer.step()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trainer.master_params)
    after = _run(module.eval(), x, 0)
    assert not torch.equal(before, after), "the eval graph does not see the trained parameters"


def test_deepcopy_keeps_both_graphs_and_pickle_is_refused(case):
    _, x, conv = case
    clone = copy.deepcopy(conv.module)
    assert isinstance(clone, TwoModeGraphModule)
    assert clone.eval_graph is not conv.module.eval_graph
    assert torch.equal(_run(clone.eval(), x, 0), _run(copy.deepcopy(conv.module).eval(), x, 0))
    with pytest.raises(TypeError, match="cannot be pickled; save its state_dict"):
        pickle.dumps(conv.module)


def test_emitted_model_dispatches_on_the_mode(case, tmp_path):
    _, x, conv = case
    conv.save(tmp_path / "out")
    source = (tmp_path / "out" / "model.py").read_text()
    assert "def _forward_train(" in source and "def _forward_eval(" in source, source[:2000]
    spec = importlib.util.spec_from_file_location(f"emitted_two_modes_{conv.tracer}", tmp_path / "out" / "model.py")
    emitted_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = emitted_module
    spec.loader.exec_module(emitted_module)
    emitted = emitted_module.load()
    module = copy.deepcopy(conv.module)
    assert emitted.training is False
    assert torch.equal(_run(emitted.eval(), x, 0), _run(module.eval(), x, 0))
    assert torch.equal(_run(emitted.train(), x, 5), _run(module.train(), x, 5))


def test_apply_in_place_follows_the_mode():
    model = _model()
    x = torch.randn(6, 32)
    reference = copy.deepcopy(model)
    converter.apply(model, (x,), tracer="export", precision="bf16")
    assert_half_ran(converter.conversion_of(model))
    assert isinstance(converter.conversion_of(model).module, TwoModeGraphModule)
    e1, e2 = _run(model.eval(), x, 1), _run(model.eval(), x, 2)
    assert torch.equal(e1, e2)
    assert sqnr(_run(reference.eval(), x, 1), e1) >= 30
    db = sqnr(_run(reference.train(), x, 3), _run(model.train(), x, 3))
    assert db >= 25, f"in-place train output vs original train: {db:.1f} dB"
    from converter.inplace import converted_forward

    assert converted_forward(model).calls["fallback"] == 0


class Noisy(nn.Module):
    """Draws random numbers in both modes: one graph serves."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x + 0.01 * torch.randn_like(x))


def test_random_ops_in_both_modes_keep_one_graph():
    conv = converter.convert(Noisy().eval(), (torch.randn(4, 8),), tracer="export")
    assert not isinstance(conv.module, TwoModeGraphModule)
    assert conv.report.records.capture.modes.startswith("follows train()/eval(): traced in train mode")


def test_onnx_export_runs_the_eval_graph(case, tmp_path):
    pytest.importorskip("onnxruntime")
    _, x, conv = case
    result = conv.export_onnx(tmp_path / "model.onnx")
    assert result.checks["ort_match"], f"onnxruntime vs conv.module (eval): max abs error {result.max_abs_error:.3g}"
    # what torch.export sees of a GraphModule is its `graph` (the train graph): for_mode gives the eval one
    eval_only = conv.module.for_mode(False)
    assert not eval_only.training and set(eval_only.state_dict()) == set(conv.module.state_dict())
    assert torch.equal(_run(eval_only, x, 0), _run(copy.deepcopy(conv.module).eval(), x, 0))


@pytest.mark.slow
def test_compiles_without_graph_breaks_in_both_modes():
    """torch.compile follows the dispatch on self.training (a guard on the flag), with no graph break."""
    model = _model()
    x = torch.randn(6, 32)
    conv = converter.convert(model, (x,), tracer="export", precision="bf16")
    module = copy.deepcopy(conv.module)
    for training in (False, True):
        module.train(training)
        explained = torch._dynamo.explain(module)(x)
        assert explained.graph_break_count == 0, (training, explained.break_reasons)
    compiled = torch.compile(module.eval())
    with torch.no_grad():
        got, want = compiled(x).float(), module(x).float()
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max().item()
