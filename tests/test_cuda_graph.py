"""converter.cuda_graph: the CUDA-graph training step, its eager fallbacks, and train.py's --cuda-graph.

Three kinds of test:

* **without a GPU** (CI): the wrapper built where CUDA is absent runs the module itself: one
  :class:`CudaGraphWarning`, bit-identical losses, gradients and weights to the unwrapped module; the
  arguments are validated; train.py ``--cuda-graph`` trains as without it;
* **emulated graphs on the CPU**: ``CudaGraphModule._capture`` is replaced by an emulation with the
  memory behaviour of a CUDA graph (static inputs, outputs and gradient buffers overwritten in place
  by each replay; a "replay" recomputes into them) and ``_device_type`` by ``"cpu"``. Everything of
  the wrapper except the CUDA calls runs: signatures, the shape fallback and ``max_graphs``,
  invalidation, the pending-backward check, fresh outputs, the gradient-alias copy, the autograd
  node's gradients, the O2 trainer on top (with an inf batch), and the eager contexts. Results are
  compared bit for bit with the eager module;
* **on a GPU** (``pytest.mark.cuda``, skipped without one): real captures of the benchmark models
  against the eager module within tolerance over several steps, including an inf batch (skipped
  step, loss scale backed off), the shape fallback, gradient accumulation, a forward that synchronises
  with the host (warm-up finds it), a capture that fails mid-way (the process stays usable), and
  train.py ``--cuda-graph --device cuda``.
"""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import converter
from converter.train import cuda_graph as cg
from converter.train.cuda_graph import CudaGraphModule, CudaGraphWarning, cuda_graph
from converter.train.trainer import MixedPrecisionTrainer

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------ models
class _Net(nn.Module):
    """Linear → LayerNorm → GELU → Linear, with an unused parameter and a batch norm (buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 8)
        self.unused = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.bn(self.norm(self.fc1(x)))))


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net().train()


def _batch(step: int, rows: int = 8, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 16, generator=gen).to(device)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _converted(precision: str, device: str = "cpu", seed: int = 0) -> torch.fx.GraphModule:
    model = _net(seed).to(device)
    return converter.convert(model, (_batch(0, device=device),), precision=precision, opt_level="O2").module


def _no_cuda_wrapper(module: nn.Module, **kwargs) -> CudaGraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphWarning)
        return cuda_graph(module, **kwargs)


# ------------------------------------------------------------------------------------------ emulation
class _FakeGraph:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.fn()


def _emulated_capture(self: CudaGraphModule, layout, leaves, device):
    """What ``_capture`` builds, with graphs whose replay recomputes into the same static tensors on the CPU."""
    module = self.module
    static_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    grad_params = [p for p in self._graph_params if p.requires_grad]
    surface = [t for t in static_inputs if t.requires_grad] + grad_params
    buffers = self._graph_buffers
    saved = [b.detach().clone() for b in buffers]
    live: dict = {}

    def run():
        args, kwargs = cg._unflatten_args(layout, iter(static_inputs))
        with torch.enable_grad():
            return module(*args, **kwargs)

    output = run()  # a real capture does not execute: the buffers it touched are put back below
    out_leaves, out_spec = pytree.tree_flatten(output)
    at = [i for i, v in enumerate(out_leaves) if isinstance(v, torch.Tensor)]
    differentiable = [out_leaves[i].requires_grad for i in at]
    if not any(differentiable):
        cg._restore(buffers, saved)
        return "no output requires grad"
    static_outputs = [out_leaves[i].detach().clone() for i in at]
    static_grad_outputs = [torch.zeros_like(t) if d else None for t, d in zip(static_outputs, differentiable)]
    grads = torch.autograd.grad([out_leaves[i] for i, d in zip(at, differentiable) if d], surface,
                                grad_outputs=[g for g in static_grad_outputs if g is not None], allow_unused=True)
    grad_bufs = [None if g is None else torch.zeros_like(g) for g in grads]
    cg._restore(buffers, saved)

    def fwd():
        out = run()
        live["out"] = out
        values = pytree.tree_leaves(out)
        for static, value in zip(static_outputs, [v for v in values if isinstance(v, torch.Tensor)]):
            static.copy_(value.detach())

    def bwd():
        values = [v for v in pytree.tree_leaves(live.pop("out")) if isinstance(v, torch.Tensor)]
        diff = [v for v, d in zip(values, differentiable) if d]
        new = torch.autograd.grad(diff, surface, grad_outputs=[g for g in static_grad_outputs if g is not None],
                                  allow_unused=True)
        for buf, g in zip(grad_bufs, new):
            if buf is not None:
                buf.copy_(g)

    grad_iter = iter(grad_bufs)
    input_grads = [next(grad_iter) if t.requires_grad else None for t in static_inputs]
    param_grads = [next(grad_iter) for _ in grad_params]
    for i in at:
        out_leaves[i] = None
    self.stats.captures += 1
    return cg._Entry(fwd=_FakeGraph(fwd), bwd=_FakeGraph(bwd), static_inputs=static_inputs, grad_params=grad_params,
                     static_outputs=static_outputs, out_leaves=out_leaves, out_tensor_at=at, out_spec=out_spec,
                     differentiable=differentiable, static_grad_outputs=static_grad_outputs, input_grads=input_grads,
                     param_grads=param_grads)


@pytest.fixture
def emulated(monkeypatch):
    """``make(module, **kw)``: a CudaGraphModule that graphs CPU tensors with the emulated capture."""
    monkeypatch.setattr(CudaGraphModule, "_capture", _emulated_capture)
    monkeypatch.setattr(CudaGraphModule, "_device_type", "cpu")

    def make(module: nn.Module, **kwargs) -> CudaGraphModule:
        wrapper = _no_cuda_wrapper(module, **kwargs)
        wrapper.enabled = True
        return wrapper

    return make


def _train(forward, trainer: MixedPrecisionTrainer, batches: list[torch.Tensor]) -> list[tuple[float, bool, float]]:
    """(loss, stepped, scale) per step."""
    log = []
    for x in batches:
        trainer.zero_grad()
        trainer.backward(_loss(forward(x)))
        stepped = trainer.step()
        log.append((trainer.stats.loss, stepped, trainer.stats.scale))
    return log


def _pair(precision: str, make, device: str = "cpu", **kwargs):
    """Two copies of the same O2 conversion with their trainers: (eager module, eager trainer, wrapper, trainer)."""
    eager = _converted(precision, device)
    graphed = copy.deepcopy(eager)
    t_eager = MixedPrecisionTrainer(eager, torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9),
                                    precision=precision, master_weights=True)
    t_graphed = MixedPrecisionTrainer(graphed, torch.optim.SGD(graphed.parameters(), lr=0.05, momentum=0.9),
                                      precision=precision, master_weights=True)
    return eager, t_eager, make(graphed, **kwargs), t_graphed


def _assert_same_state(a: nn.Module, b: nn.Module, ta: MixedPrecisionTrainer, tb: MixedPrecisionTrainer) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=name)  # an inf batch: NaN statistics
    for x, y in zip(ta.master_params, tb.master_params):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------------ without CUDA
@pytest.mark.skipif(CUDA, reason="checks the no-CUDA fallback")
def test_without_cuda_one_warning_and_bit_identical_training():
    eager = _converted("bf16")
    wrapped = copy.deepcopy(eager)
    t_eager = MixedPrecisionTrainer(eager, torch.optim.SGD(eager.parameters(), lr=0.05), precision="bf16",
                                    master_weights=True)
    t_wrapped = MixedPrecisionTrainer(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.05), precision="bf16",
                                      master_weights=True)
    batches = [_batch(i) for i in range(3)] + [_batch(3, rows=5)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = cuda_graph(wrapped)
        log = _train(graphed, t_wrapped, batches)
    ours = [w for w in caught if issubclass(w.category, CudaGraphWarning)]
    assert len(ours) == 1 and "no CUDA device" in str(ours[0].message), [str(w.message) for w in caught]
    assert graphed.enabled is False
    assert log == _train(eager, t_eager, batches)
    _assert_same_state(eager, wrapped, t_eager, t_wrapped)
    for module, forward in ((eager, eager), (wrapped, graphed)):  # one more backward, no step: the gradients
        module.zero_grad(set_to_none=True)
        _loss(forward(_batch(9))).backward()
    grads = [(n, p.grad) for n, p in wrapped.named_parameters()]
    assert sum(g is not None for _, g in grads) == 8, grads  # fc1, norm, bn and fc2 weights and biases
    for (name, g), p in zip(grads, eager.parameters()):
        assert (g is None and p.grad is None) or torch.equal(g, p.grad), name
    assert (graphed.stats.eager_calls, graphed.stats.replays, graphed.stats.captures) == (5, 0, 0)
    assert dict(graphed.stats.eager_reasons) == {"no CUDA device": 5}


def test_arguments_are_validated():
    module = _net()
    with pytest.raises(TypeError, match="must be an nn.Module, got function"):
        cuda_graph(lambda x: x)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=rf"max_graphs must be an int >= 1, got {bad!r}"):
            cuda_graph(module, max_graphs=bad)
        with pytest.raises(ValueError, match=rf"warmup_iters must be an int >= 1, got {bad!r}"):
            cuda_graph(module, warmup_iters=bad)
    with pytest.raises(ValueError, match="does not graph a DataParallel"):
        cuda_graph(nn.DataParallel(module))
    with pytest.raises(ValueError, match="already a CudaGraphModule"):
        cuda_graph(_no_cuda_wrapper(module))
    assert converter.cuda_graph is cuda_graph and converter.CudaGraphModule is CudaGraphModule


def test_trainer_built_on_the_wrapper_trains_the_module_inside():
    """The trainer unwraps a CudaGraphModule: O2's storage plan comes from the GraphModule's meta, state_dict
    keys are the module's own (no ``module.`` prefix)."""
    inner = _converted("bf16")
    reference = copy.deepcopy(inner)
    MixedPrecisionTrainer(reference, torch.optim.SGD(reference.parameters(), lr=0.1), precision="bf16",
                          master_weights=True)
    wrapper = _no_cuda_wrapper(inner)
    trainer = MixedPrecisionTrainer(wrapper, torch.optim.SGD(wrapper.parameters(), lr=0.1), precision="bf16",
                                    master_weights=True)
    dtypes = {n: p.dtype for n, p in inner.named_parameters()}
    assert dtypes == {n: p.dtype for n, p in reference.named_parameters()}
    assert dtypes["fc1.weight"] == torch.bfloat16 and dtypes["norm.weight"] == torch.float32
    assert set(trainer.state_dict()["model"]) == set(reference.state_dict())
    assert set(wrapper.state_dict()) == {f"module.{k}" for k in reference.state_dict()}


# ------------------------------------------------------------------------------------------ emulated graphs
def test_emulated_graphed_o2_training_is_bit_identical_to_eager(emulated):
    eager, t_eager, graphed, t_graphed = _pair("bf16", emulated)
    batches = [_batch(i) for i in range(5)]
    assert _train(graphed, t_graphed, batches) == _train(eager, t_eager, batches)
    _assert_same_state(eager, graphed.module, t_eager, t_graphed)  # batch norm statistics included
    stats = graphed.stats
    assert (stats.captures, stats.replays, stats.eager_calls, stats.invalidations) == (1, 5, 0, 0)
    assert graphed.graphs == 1


def test_emulated_fp16_inf_batch_is_skipped_and_backs_the_scale_off_as_eager(emulated, one_thread):
    eager, t_eager, graphed, t_graphed = _pair("fp16", emulated)
    batches = [_batch(i) for i in range(5)]
    batches[2] = batches[2].clone()
    batches[2][0, 0] = math.inf
    log = _train(graphed, t_graphed, batches)
    reference = _train(eager, t_eager, batches)
    assert [s for _, s, _ in log] == [True, True, False, True, True]
    assert [s for _, s, _ in log] == [s for _, s, _ in reference]
    assert [c for *_, c in log] == [c for *_, c in reference]
    assert log[3][2] == log[1][2] / 2, log  # backed off once
    assert [loss for loss, *_ in log if math.isfinite(loss)] == [loss for loss, *_ in reference if math.isfinite(loss)]
    assert t_graphed.stats.skipped == t_eager.stats.skipped == 1
    _assert_same_state(eager, graphed.module, t_eager, t_graphed)
    assert (graphed.stats.captures, graphed.stats.replays) == (1, 5)


def test_emulated_other_shapes_run_eagerly_once_the_cache_is_full(emulated):
    module = _net()
    reference = copy.deepcopy(module)
    graphed = emulated(module, max_graphs=1)
    sizes = [8, 8, 5, 8, 5, 3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, rows in enumerate(sizes):
            x = _batch(step, rows)
            out, ref = graphed(x), reference(x)
            assert torch.equal(out, ref), (step, rows)
            _loss(out).backward()
            _loss(ref).backward()
    full = [w for w in caught if "max_graphs" in str(w.message)]
    assert len(full) == 1, [str(w.message) for w in caught]
    assert (graphed.stats.captures, graphed.stats.replays, graphed.stats.eager_calls) == (1, 3, 3)
    assert dict(graphed.stats.eager_reasons) == {"cache full": 3}
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name

    two = emulated(_net(), max_graphs=2)
    for step, rows in enumerate(sizes):
        _loss(two(_batch(step, rows))).backward()
    assert (two.stats.captures, two.stats.replays, two.stats.eager_calls) == (2, 5, 1)


def test_emulated_gradient_accumulation_copies_aliased_gradients_out(emulated, monkeypatch):
    """Two backward passes into set_to_none gradients: autograd takes the first gradient as it is handed (the
    graph's buffer); the second replay would overwrite it. The wrapper copies it out before the replay."""
    def accumulate(forward, module) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        for step in range(3):
            _loss(forward(_batch(step))).backward()
        return [p.grad.clone() for p in (module.fc1.weight, module.fc2.bias)]

    reference = _net()
    expected = accumulate(reference, reference)
    module = _net()
    got = accumulate(emulated(module), module)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))

    # without the copy the same loop gives wrong gradients: the emulation has the hazard a real graph has
    monkeypatch.setattr(cg._Entry, "unalias_grads", lambda self: None)
    module = _net()
    wrong = accumulate(emulated(module), module)
    assert not torch.equal(wrong[0], expected[0])


def test_emulated_outputs_are_fresh_and_survive_the_next_replay(emulated):
    graphed = emulated(_net())
    first = graphed(_batch(0))
    kept = first.detach().clone()
    _loss(first).backward()
    second = graphed(_batch(1))
    assert torch.equal(first, kept) and not torch.equal(second, kept)
    assert first.data_ptr() != second.data_ptr()


def test_emulated_second_forward_before_backward_runs_eagerly(emulated):
    module = _net()
    reference = copy.deepcopy(module)
    graphed = emulated(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = graphed(_batch(0)), graphed(_batch(1))
    (_loss(a) + _loss(b)).backward()
    (_loss(reference(_batch(0))) + _loss(reference(_batch(1)))).backward()
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
    assert dict(graphed.stats.eager_reasons) == {"backward pending": 1}
    assert sum("before the previous one's backward" in str(w.message) for w in caught) == 1
    # the pending forward is done: the next call replays again; a dropped forward (no backward) blocks nothing
    graphed(_batch(2))
    _loss(graphed(_batch(3))).backward()
    assert graphed.stats.replays == 3 and graphed.stats.eager_calls == 1


class _Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_emulated_contexts_that_run_eagerly(emulated):
    graphed = emulated(_net())
    x = _batch(0)
    with torch.no_grad():
        graphed(x)
    with torch.inference_mode():
        graphed(x)
    with _Count():
        graphed(x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        graphed(x)
    with torch.autograd.detect_anomaly(check_nan=False):
        graphed(x)
    frozen = emulated(_net().requires_grad_(False))
    frozen(x)
    frozen(x)
    assert graphed.stats.captures == 0 and frozen.stats.captures == 0
    assert dict(graphed.stats.eager_reasons) == {"gradients disabled": 2, "dispatch or function mode active": 1,
                                                 "saved-tensor hooks active": 1, "anomaly detection": 1}
    assert dict(frozen.stats.eager_reasons) == {"nothing requires grad": 2}
    with torch.device("cpu"):  # a default-device context (torch.set_default_device) does not stop graphs
        graphed(x)
    assert graphed.stats.captures == 1
    frozen.module.requires_grad_(True)  # unfrozen: the remembered "nothing requires grad" no longer holds
    frozen(x)
    assert (frozen.stats.captures, frozen.stats.invalidations, frozen.stats.replays) == (1, 1, 1)


def test_emulated_moved_parameters_and_recompiled_graphs_are_captured_again(emulated):
    module = _converted("bf16")
    reference = copy.deepcopy(module)
    graphed = emulated(module)
    _loss(graphed(_batch(0))).backward()
    module.fc1.weight.data = module.fc1.weight.data.clone()  # new storage: the graph's address is stale
    out = graphed(_batch(1))
    assert torch.equal(out, reference(_batch(1)))
    assert (graphed.stats.invalidations, graphed.stats.captures) == (1, 2)
    _loss(out).backward()
    module.recompile()  # a new forward (a trainer option rewrites the graph)
    graphed(_batch(2))
    assert (graphed.stats.invalidations, graphed.stats.captures) == (2, 3)
    graphed.reset()
    assert graphed.graphs == 0 and graphed.stats.graph_bytes == 0


def test_emulated_o2_trainer_built_after_the_first_capture_is_followed(emulated):
    """An O2 trainer moves the weights into half storage: graphs captured before it are dropped and captured
    again, and training equals eager."""
    eager = _converted("bf16")
    module = copy.deepcopy(eager)
    graphed = emulated(module)
    _loss(graphed(_batch(0))).backward()
    module.zero_grad(set_to_none=True)
    t_graphed = MixedPrecisionTrainer(module, torch.optim.SGD(module.parameters(), lr=0.05), precision="bf16",
                                      master_weights=True)
    t_eager = MixedPrecisionTrainer(eager, torch.optim.SGD(eager.parameters(), lr=0.05), precision="bf16",
                                    master_weights=True)
    _loss(eager(_batch(0))).backward()  # the same batch-norm update as the first graphed call
    eager.zero_grad(set_to_none=True)
    batches = [_batch(i) for i in range(1, 4)]
    assert _train(graphed, t_graphed, batches) == _train(eager, t_eager, batches)
    assert (graphed.stats.invalidations, graphed.stats.captures) == (1, 2)


@pytest.mark.parametrize("name", ["hf_gpt2", "cnn"])
def test_emulated_benchmark_samples_train_bit_identically(emulated, name):
    """A Hugging Face ModelOutput from keyword inputs (GPT-2), a model that returns its loss with batch norms (CNN)."""
    from benchmarks.run import loss_of
    from tests.helpers import load_sample, split_inputs

    sample = load_sample(name)
    args, kwargs = split_inputs(sample.example_inputs())
    eager = converter.convert(sample.build_model(), (args, kwargs), precision="bf16", opt_level="O2").module
    module = copy.deepcopy(eager)
    trainers = [MixedPrecisionTrainer(m, torch.optim.SGD(m.parameters(), lr=1e-3), precision="bf16",
                                      master_weights=True) for m in (eager, module)]
    graphed = emulated(module)
    for _ in range(3):
        outs = []
        for forward, trainer in zip((eager, graphed), trainers):
            trainer.zero_grad()
            outs.append(forward(*args, **kwargs))
            trainer.backward(loss_of(outs[-1]))
            trainer.step()
        assert trainers[0].stats.loss == trainers[1].stats.loss
        assert type(outs[0]) is type(outs[1])
    _assert_same_state(eager, module, *trainers)
    assert (graphed.stats.captures, graphed.stats.replays, graphed.stats.eager_calls) == (1, 3, 0)


class _Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, ids, *, scale=2.0, extra=None):
        y = self.fc(x) * scale
        if extra is not None:
            y = y + extra["bias"]
        return {"y": y, "top": y.argmax(-1) + ids, "n": 3, "same": x}


def test_emulated_keyword_arguments_constants_and_structured_outputs(emulated):
    torch.manual_seed(0)
    module = _Structured()
    reference = copy.deepcopy(module)
    graphed = emulated(module, max_graphs=3)
    ids = torch.arange(8)
    extra = {"bias": torch.ones(4)}
    for scale in (2.0, 2.0, 3.0):
        out = graphed(_batch(0), ids, scale=scale, extra=extra)
        ref = reference(_batch(0), ids, scale=scale, extra=extra)
        assert set(out) == {"y", "top", "n", "same"} and out["n"] == 3
        for key in ("y", "top", "same"):
            assert torch.equal(out[key], ref[key]), key
        assert out["y"].requires_grad and not out["top"].requires_grad and out["top"].dtype == torch.int64
        _loss(out["y"]).backward()
        _loss(ref["y"]).backward()
    assert torch.equal(module.fc.weight.grad, reference.fc.weight.grad)
    assert (graphed.stats.captures, graphed.stats.replays) == (2, 3)  # scale=3.0 is another signature
    x = _batch(0).requires_grad_(True)  # an input that requires grad gets its gradient from the graph
    x_ref = x.detach().clone().requires_grad_(True)
    _loss(graphed(x, ids)["y"]).backward()
    _loss(reference(x_ref, ids)["y"]).backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert (graphed.stats.captures, graphed.stats.replays, graphed.stats.eager_calls) == (3, 4, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed(_batch(0), ids, extra={"bias": torch.ones(4), "tag": object()})  # no constant a signature holds
    assert graphed.stats.eager_reasons["unsupported argument"] == 1
    assert sum("argument of type object" in str(w.message) for w in caught) == 1


def test_a_failed_capture_warns_once_and_runs_eagerly(monkeypatch):
    """The real ``_capture`` on the CPU fails at its first CUDA call: the failure path on any machine."""
    monkeypatch.setattr(CudaGraphModule, "_device_type", "cpu")
    module = _net()
    reference = copy.deepcopy(module)
    graphed = _no_cuda_wrapper(module)
    graphed.enabled = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            out, ref = graphed(_batch(step)), reference(_batch(step))
            assert torch.equal(out, ref)
            _loss(out).backward()
            _loss(ref).backward()
    failed = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert len(failed) == 1 and failed[0].startswith("cuda_graph: capturing _Net failed"), failed
    assert graphed.capture_error is not None
    assert (graphed.stats.failed_captures, graphed.stats.captures, graphed.stats.eager_calls) == (1, 0, 3)
    assert dict(graphed.stats.eager_reasons) == {"capture failed": 3}
    for (name, a), b in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name  # batch-norm statistics: as eager, nothing left over from the attempt


# ------------------------------------------------------------------------------------------ train.py
def _emit_mlp(tmp_path: Path) -> Path:
    from converter.cli.modelfile import load_model_file
    from converter.export.emit import emit

    mf = load_model_file(ROOT / "samples" / "mlp.py")
    return emit(converter.convert(mf.model, mf.example_inputs, precision="bf16"), tmp_path / "mlp_mp",
                model_file=str(ROOT / "samples" / "mlp.py"))


def _run_train(out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(out / "train.py"), "--steps", "3", *flags], cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA fallback")
def test_train_py_cuda_graph_flag_trains_eagerly_without_cuda(tmp_path):
    out = _emit_mlp(tmp_path)
    plain, graphed = _run_train(out, "--o2"), _run_train(out, "--o2", "--cuda-graph")
    assert plain.returncode == 0 and graphed.returncode == 0, graphed.stderr[-3000:]
    steps = [line for line in graphed.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and steps == [line for line in plain.stdout.splitlines() if line.startswith("step ")]
    assert "cuda graph: 0 captured, 0 replayed, 3 eager calls (no CUDA device: 3)" in graphed.stdout
    assert "CudaGraphWarning" in graphed.stderr and "no CUDA device" in graphed.stderr
    assert "cuda graph:" not in plain.stdout


_WITHOUT_MPCONVERT = """
import runpy, sys
sys.modules["converter"] = None  # mpconvert is not installed on this machine
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_train_py_cuda_graph_flag_with_torch_alone_and_under_torchrun(tmp_path):
    """Without the package: a NOTICE and eager training; under torchrun (world > 1): a NOTICE, the model itself."""
    from converter.export.verify import import_file

    out = _emit_mlp(tmp_path)
    (tmp_path / "without.py").write_text(_WITHOUT_MPCONVERT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    alone = subprocess.run([sys.executable, "-I", str(tmp_path / "without.py"), str(out / "train.py"), "--steps", "2",
                            "--device", "cpu", "--cuda-graph"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "NOTICE: --cuda-graph needs the mpconvert package (converter.cuda_graph); training eagerly" in alone.stdout
    assert len([line for line in alone.stdout.splitlines() if line.startswith("step ")]) == 2
    assert "cuda graph:" not in alone.stdout
    train = import_file(out / "train.py")
    said: list[str] = []
    model = nn.Linear(2, 2)
    assert train._graphed(model, 2, said.append) is model
    assert said == ["NOTICE: --cuda-graph is not used under torchrun (DDP reduces gradients in hooks that a graph "
                    "replay would skip); training eagerly"]


# ------------------------------------------------------------------------------------------ on a GPU
def _encoder(precision: str):
    from benchmarks.common import encoder

    model, x = encoder(128, 4, 256, 4, 16)
    model, x = model.cuda(), x.cuda()
    conv = converter.convert(model, (x,), precision=precision, opt_level="O2", device="cuda")
    return conv.module, x


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    noise = (ref.float() - out.float()).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.float().norm().item() / noise)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_graphed_o2_steps_match_eager_with_an_inf_batch(precision):
    module, x = _encoder(precision)
    eager, graphed_module = module, copy.deepcopy(module)
    trainers = [MixedPrecisionTrainer(m, torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9), precision=precision,
                                      master_weights=True) for m in (eager, graphed_module)]
    graphed = cuda_graph(graphed_module)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randn(x.shape, device="cuda", generator=gen) for _ in range(6)]
    batches[3][0, 0, 0] = math.inf
    ref = _train(eager, trainers[0], batches)
    got = _train(graphed, trainers[1], batches)
    assert [s for _, s, _ in got] == [s for _, s, _ in ref] and got[3][1] is False, (got, ref)
    assert [c for *_, c in got] == [c for *_, c in ref], (got, ref)
    if precision == "fp16":
        assert got[3][2] == got[2][2] / 2, got  # the scale backed off on the inf batch
    for (loss, stepped, _), (ref_loss, *_) in zip(got, ref):
        if stepped:
            assert abs(loss - ref_loss) <= 1e-3 * abs(ref_loss), (got, ref)
    assert trainers[1].stats.skipped == trainers[0].stats.skipped >= 1
    for a, b in zip(trainers[0].master_params, trainers[1].master_params):
        assert _sqnr(a, b) >= 60, _sqnr(a, b)
    stats = graphed.stats
    assert graphed.capture_error is None, graphed.capture_error
    assert (stats.captures, stats.replays, stats.eager_calls) == (1, 6, 0), stats
    assert stats.graph_bytes > 0


def _sample(name: str):
    from tests.helpers import load_sample, split_inputs

    sample = load_sample(name)
    model = sample.build_model().cuda()
    args, kwargs = split_inputs(sample.example_inputs())
    to = lambda v: v.cuda() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return model, tuple(to(a) for a in args), {k: to(v) for k, v in kwargs.items()}


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["cnn", "tiny_transformer", "hf_gpt2", "hf_bert"])
def test_cuda_graph_captures_every_benchmark_sample(name):
    from benchmarks.run import loss_of

    model, args, kwargs = _sample(name)
    conv = converter.convert(model, (args, kwargs), precision="fp16", opt_level="O2", device="cuda")
    eager, graphed_module = conv.module, copy.deepcopy(conv.module)
    trainers = [MixedPrecisionTrainer(m, torch.optim.SGD(m.parameters(), lr=1e-4), precision="fp16",
                                      master_weights=True) for m in (eager, graphed_module)]
    graphed = cuda_graph(graphed_module)
    losses: list[list[float]] = [[], []]
    for _ in range(3):
        for i, (forward, trainer) in enumerate(zip((eager, graphed), trainers)):
            trainer.zero_grad()
            trainer.backward(loss_of(forward(*args, **kwargs)))
            trainer.step()
            losses[i].append(trainer.stats.loss)
    assert graphed.capture_error is None, graphed.capture_error
    assert (graphed.stats.captures, graphed.stats.replays, graphed.stats.eager_calls) == (1, 3, 0), graphed.stats
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-3 * max(abs(a), 1e-6), losses
    for (key, a), b in zip(eager.state_dict().items(), graphed_module.state_dict().values()):
        if a.is_floating_point():
            assert _sqnr(a, b) >= 50, (key, _sqnr(a, b))  # batch-norm statistics included
        else:
            assert torch.equal(a, b), key


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graph_shape_fallback_accumulation_and_fresh_outputs():
    torch.manual_seed(0)
    module = _net().cuda()
    reference = copy.deepcopy(module)
    graphed = cuda_graph(module, max_graphs=1)
    module.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    kept = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, rows in enumerate([8, 8, 5, 8]):  # accumulate over all of them, one shape eager
            x = _batch(step, rows, "cuda")
            out, ref = graphed(x), reference(x)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            if kept is None:
                kept, kept_value = out, out.detach().clone()
            _loss(out).backward()
            _loss(ref).backward()
    assert torch.equal(kept, kept_value)  # the first output was not overwritten by later replays
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert (graphed.stats.captures, graphed.stats.replays, graphed.stats.eager_calls) == (1, 3, 1)
    assert dict(graphed.stats.eager_reasons) == {"cache full": 1}
    assert sum("max_graphs" in str(w.message) for w in caught) == 1
    for name, a in module.state_dict().items():  # batch-norm statistics: one update per call, as eager
        torch.testing.assert_close(a, reference.state_dict()[name], rtol=1e-5, atol=1e-6)


class _Syncs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        y = self.fc(x)
        if y.sum().item() > 1e30:  # a host sync: a graph cannot hold it
            y = y * 0
        return y


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graph_forward_that_syncs_runs_eagerly_and_graphs_still_work():
    torch.manual_seed(0)
    module = _Syncs().cuda()
    graphed = cuda_graph(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x = _batch(step, device="cuda")
            torch.testing.assert_close(graphed(x), module(x), rtol=0, atol=0)
    messages = [str(w.message) for w in caught if issubclass(w.category, CudaGraphWarning)]
    assert len(messages) == 1 and "synchronises with the host" in messages[0], messages
    assert graphed.stats.failed_captures == 1 and graphed.stats.eager_reasons["capture failed"] == 2
    assert torch.cuda.get_sync_debug_mode() == 0  # put back
    ok = cuda_graph(_net().cuda())
    _loss(ok(_batch(0, device="cuda"))).backward()
    assert ok.stats.captures == 1 and ok.capture_error is None


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_train_py_cuda_graph_flag(tmp_path):
    out = _emit_mlp(tmp_path)
    proc = _run_train(out, "--o2", "--device", "cuda", "--cuda-graph")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cuda graph: 1 captured, 3 replayed, 0 eager calls" in proc.stdout, proc.stdout


class _FailsWhileCapturing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing: the capture itself fails
        return self.fc(x)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graph_capture_failing_midway_leaves_the_process_usable():
    """Last on purpose: the capture fails inside CUDA (not in warm-up); eager calls and new captures still work."""
    torch.manual_seed(0)
    module = _FailsWhileCapturing().cuda()
    graphed = cuda_graph(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = _batch(0, device="cuda")
        torch.testing.assert_close(graphed(x), module(x), rtol=0, atol=0)
    assert graphed.stats.failed_captures == 1, [str(w.message) for w in caught]
    assert graphed.capture_error is not None
    ok = cuda_graph(_net().cuda())
    for step in range(2):
        _loss(ok(_batch(step, device="cuda"))).backward()
    assert (ok.stats.captures, ok.stats.replays) == (1, 2) and ok.capture_error is None
