"""MixedPrecisionTrainer: O1/O2 mechanics, fault injection, underflow, resume, errors."""
from __future__ import annotations

import copy
import io
import math
import random

import pytest
import torch
import torch.fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import converter
from converter.train.scaler import LossScaler
from converter.train.trainer import MixedPrecisionTrainer, TrainStats

INF, NAN = float("inf"), float("nan")


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.numels: list[int] = []  # elements of each op's first tensor argument (0-dim: 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        first = args[0] if args else None
        self.numels.append(first.numel() if isinstance(first, torch.Tensor) else 0)
        return func(*args, **(kwargs or {}))


def _tiny(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def _batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 4, generator=gen).to(dtype), torch.randn(8, 4, generator=gen)


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y)


def _sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    noise = (ref - out).norm()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise.item())


# ---------------------------------------------------------------- O2 mechanics
class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)


def test_o2_fallback_keeps_norm_and_embedding_fp32_and_points_optimizer_at_masters():
    torch.manual_seed(0)
    model = _Mixed()
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    model_params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = MixedPrecisionTrainer(model, opt, precision="fp16", master_weights=True)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {
        "embed.weight": torch.float32, "proj.weight": torch.float16, "proj.bias": torch.float16,
        "norm.weight": torch.float32, "norm.bias": torch.float32, "bn.weight": torch.float32, "bn.bias": torch.float32,
    }, dtypes
    opt_params = opt.param_groups[0]["params"]
    assert all(p.dtype == torch.float32 for p in opt_params)
    masters = trainer.master_params
    assert len(masters) == 2 and opt_params[1] is masters[0] and opt_params[2] is masters[1]
    assert opt_params[0] is model_params["embed.weight"] and opt_params[3] is model_params["norm.weight"]
    # Masters keep the original fp32 values, not the values rounded to fp16.
    assert torch.equal(masters[0], original["proj.weight"]) and torch.equal(masters[1], original["proj.bias"])
    assert torch.equal(model.proj.weight, original["proj.weight"].half())


def test_o2_obeys_converter_param_dtype_map():
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4)))
    gm.meta["mp_param_dtypes"] = {
        "0.weight": torch.float16, "0.bias": torch.float16, "1.weight": torch.bfloat16, "1.bias": torch.float32,
        "2.weight": torch.float16,
    }
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    trainer = MixedPrecisionTrainer(gm, opt, precision="fp16", master_weights=True, loss_scale=1024.0)
    dtypes = {name: p.dtype for name, p in gm.named_parameters()}
    # 2.bias is not in the map: it stays fp32. 2.weight is a LayerNorm weight, but the map wins.
    assert dtypes == {"0.weight": torch.float16, "0.bias": torch.float16, "1.weight": torch.bfloat16,
                      "1.bias": torch.float32, "2.weight": torch.float16, "2.bias": torch.float32}, dtypes
    assert len(trainer.master_params) == 4

    # One master->model copy per storage dtype (fp16 buffer, bf16 buffer), nothing else: the half
    # params and their masters are views into one flat buffer each.
    loss = sum(p.float().sum() for p in gm.parameters())
    trainer.zero_grad()
    trainer.backward(loss)
    with _OpCounter() as counter:
        assert trainer.step()
    # (the trainer's other copy_ is the 0-dim loss scale snapshot into its readout buffer)
    copies = [op for op, numel in zip(counter.ops, counter.numels) if "copy_" in op and numel > 1]
    assert copies == ["aten.copy_.default"] * 2, counter.ops
    assert len({p.untyped_storage().data_ptr() for p in gm.parameters() if p.dtype == torch.float16}) == 1
    for (name, param), master in zip(
        [(n, p) for n, p in gm.named_parameters() if p.dtype != torch.float32], trainer.master_params
    ):
        assert torch.equal(param, master.to(param.dtype)), name


def test_o2_param_dtype_map_with_unknown_name_is_rejected():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    gm.meta["mp_param_dtypes"] = {"0.weight": torch.float16, "layer9.weight": torch.float16}
    with pytest.raises(ValueError, match="layer9.weight"):
        MixedPrecisionTrainer(gm, torch.optim.SGD(gm.parameters(), lr=0.1), master_weights=True)


def test_o2_moves_existing_optimizer_state_to_masters():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch(0)
    _mse(model, x, y).backward()
    opt.step()
    buffers = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    trainer = MixedPrecisionTrainer(model, opt, precision="fp16", master_weights=True)
    assert all(opt.state[m]["momentum_buffer"] is b for m, b in zip(trainer.master_params, buffers))
    assert not any(p in opt.state for p in model.parameters())


def test_o2_step_keeps_model_equal_to_rounded_masters():
    model = _tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), master_weights=True)
    for step in range(5):
        x, y = _batch(step, torch.float16)
        trainer.zero_grad()
        trainer.backward(_mse(model, x, y))
        assert trainer.step()
        for param, master in zip(model.parameters(), trainer.master_params):
            assert param.dtype == torch.float16 and master.dtype == torch.float32
            assert torch.equal(param, master.half())
            assert param.grad is None and master.grad is not None and master.grad.dtype == torch.float32


# ---------------------------------------------------------------- fault injection
@pytest.mark.parametrize("master_weights", [False, True], ids=["O1", "O2"])
def test_fault_injection_1000_steps(master_weights, one_thread):
    model = _tiny(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    min_scale, max_scale = 2.0**4, 2.0**12
    scaler = LossScaler(init_scale=2.0**8, growth_interval=4, min_scale=min_scale, max_scale=max_scale)
    trainer = MixedPrecisionTrainer(model, opt, precision="fp16", master_weights=master_weights, loss_scale=scaler)
    dtype = torch.float16 if master_weights else torch.float32
    rng = random.Random(42)
    injected, scales = 0, []
    for step in range(1000):
        rate = 0.6 if step < 150 else (0.02 if step < 500 else 0.2)  # drive the scale to its floor, then its cap
        x, y = _batch(step % 50, dtype)
        trainer.zero_grad()
        trainer.backward(_mse(model, x, y))
        if rng.random() < rate:
            grads = [p.grad for p in (trainer.master_params or list(model.parameters()))]
            grad = rng.choice(grads)
            grad.view(-1)[rng.randrange(grad.numel())] = rng.choice([INF, -INF, NAN])
            injected += 1
        trainer.step()
        scales.append(trainer.stats.scale)
        for tensor in [*model.parameters(), *trainer.master_params]:
            assert torch.isfinite(tensor).all(), f"step {step}: non-finite value reached a weight"
        assert min_scale <= trainer.stats.scale <= max_scale, f"step {step}: scale {trainer.stats.scale}"
    stats = trainer.stats
    print(f"{'O2' if master_weights else 'O1'}: injected={injected} skipped={stats.skipped} steps={stats.steps} "
          f"overflows={stats.overflows} scale range=[{min(scales)}, {max(scales)}]")
    assert stats.skipped == injected, (stats.skipped, injected)
    assert stats.steps == 1000 - injected
    assert min(scales) == min_scale and max(scales) == max_scale, (min(scales), max(scales))
    assert stats.loss is not None and math.isfinite(stats.loss)


# ---------------------------------------------------------------- underflow
def test_dynamic_scaling_recovers_underflowing_fp16_grads():
    torch.manual_seed(0)
    ref = nn.Linear(64, 64)
    x = torch.randn(16, 64)
    weights = torch.randn(16, 64) * 1e-8  # tiny loss weights: the output gradient is ~1e-8, below fp16's 6e-8
    (ref(x) * weights).sum().backward()
    reference = torch.cat([ref.weight.grad.flatten(), ref.bias.grad.flatten()])

    unscaled = copy.deepcopy(ref).half()
    unscaled.zero_grad()
    (unscaled(x.half()).float() * weights).sum().backward()
    plain = torch.cat([unscaled.weight.grad.flatten(), unscaled.bias.grad.flatten()]).float()
    zero_fraction = (plain == 0).float().mean().item()

    model = copy.deepcopy(ref)
    model.zero_grad()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), precision="fp16",
                                    master_weights=True, loss_scale="dynamic")
    # fp16 ran: O2 stores the module's weights in fp16 (the fp32 masters live in the trainer)
    assert {p.dtype for p in model.parameters()} == {torch.float16}, {p.dtype for p in model.parameters()}
    trainer.backward((model(x.half()).float() * weights).sum())
    assert trainer.step()
    scaled = torch.cat([m.grad.flatten() for m in trainer.master_params])
    sqnr_plain, sqnr_scaled = _sqnr_db(reference, plain), _sqnr_db(reference, scaled)
    print(f"underflow: unscaled fp16 grads {zero_fraction:.1%} exact zeros (SQNR {sqnr_plain:.1f} dB); "
          f"dynamic scaling SQNR {sqnr_scaled:.1f} dB")
    assert zero_fraction > 0.5, zero_fraction
    assert sqnr_scaled >= 20.0, sqnr_scaled


# ---------------------------------------------------------------- accumulation, clipping, stats
def test_accumulation_matches_fp32_control_and_grows_scale_twice():
    model, control = _tiny(), _tiny()
    trainer = MixedPrecisionTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", accumulation_steps=2,
        loss_scale=LossScaler(init_scale=128.0, growth_interval=1),
    )
    control_opt = torch.optim.SGD(control.parameters(), lr=0.1)
    returned = []
    for step in range(4):
        x, y = _batch(step)
        trainer.zero_grad()  # a no-op inside the window
        trainer.backward(_mse(model, x, y))
        returned.append(trainer.step())
        (_mse(control, x, y) / 2).backward()
        if step % 2 == 1:
            control_opt.step()
            control_opt.zero_grad()
    assert returned == [False, True, False, True]
    assert trainer.stats.scale == 128.0 * 2**2 == 512.0, trainer.stats.scale
    assert trainer.stats.steps == 2
    for a, b in zip(model.parameters(), control.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()


def test_clipping_after_unscale_matches_gradscaler_recipe():
    model, control = _tiny(), _tiny()
    trainer = MixedPrecisionTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), precision="fp16", max_grad_norm=0.2,
        loss_scale=LossScaler(init_scale=128.0, growth_interval=1, max_scale=None),
    )
    control_opt = torch.optim.SGD(control.parameters(), lr=0.5)
    gradscaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=1)
    for step in range(6):
        x, y = _batch(step)
        trainer.zero_grad()
        trainer.backward(_mse(model, x, y))
        trainer.step()
        control_opt.zero_grad()
        gradscaler.scale(_mse(control, x, y)).backward()
        gradscaler.unscale_(control_opt)
        norm = nn.utils.clip_grad_norm_(control.parameters(), 0.2)
        gradscaler.step(control_opt)
        gradscaler.update()
        assert trainer.stats.grad_norm == norm.item(), (trainer.stats.grad_norm, norm.item())
        assert norm.item() > 0.2  # the clip is active
    for a, b in zip(model.parameters(), control.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()


def test_stats_and_callback_per_real_step():
    model = _tiny()
    seen: list[TrainStats] = []
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="16-mixed",
                                    loss_scale=LossScaler(init_scale=1024.0), callback=seen.append)
    losses = []
    for step in range(5):
        x, y = _batch(step)
        trainer.zero_grad()
        loss = _mse(model, x, y)
        losses.append(loss.item())
        trainer.backward(loss)
        if step == 2:
            model[0].weight.grad[0, 0] = NAN
        trainer.step()
    assert len(seen) == 5 and seen[0] is not seen[1]
    assert [(s.steps, s.skipped, s.overflows, s.scale) for s in seen] == [
        (1, 0, 0, 1024.0), (2, 0, 0, 1024.0), (2, 1, 1, 512.0), (3, 1, 1, 512.0), (4, 1, 1, 512.0)
    ], seen
    assert seen[2].grad_norm == INF and all(math.isfinite(s.grad_norm) for i, s in enumerate(seen) if i != 2)
    assert [s.loss for s in seen] == pytest.approx(losses, rel=1e-6)
    assert trainer.stats == seen[-1]


def test_static_and_none_loss_scale():
    model = _tiny()
    static = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=256.0)
    assert static.scaler.get_scale() == 256.0 and not static.scaler.state_dict()["dynamic"]
    none = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=None)
    assert none.scaler.get_scale() == 1.0
    x, y = _batch(0)
    for trainer in (static, none):
        trainer.zero_grad()
        trainer.backward(_mse(model, x, y))
        model[2].bias.grad[0] = INF
        assert not trainer.step() and trainer.stats.skipped == 1 and trainer.scaler.get_scale() in (256.0, 1.0)


# ---------------------------------------------------------------- bf16
@pytest.mark.parametrize("master_weights", [False, True], ids=["O1", "O2"])
def test_bf16_runs_without_scaler_and_skips_nonfinite(master_weights):
    model = _tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), precision="bf16-mixed",
                                    master_weights=master_weights)
    assert trainer.scaler is None and trainer.stats.scale == 1.0
    dtype = torch.bfloat16 if master_weights else torch.float32
    assert all(p.dtype == dtype for p in model.parameters())
    x, y = _batch(0, dtype)
    losses = []
    for step in range(30):
        trainer.zero_grad()
        loss = _mse(model, x, y)
        losses.append(loss.item())
        trainer.backward(loss)
        if step == 10:
            (trainer.master_params or list(model.parameters()))[0].grad[0, 0] = INF
        trainer.step()
    assert trainer.stats.skipped == 1 and trainer.stats.steps == 29
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0], losses


# ---------------------------------------------------------------- resume
def _resume_trainer(master_weights: bool, seed: int) -> tuple[nn.Module, MixedPrecisionTrainer]:
    model = _tiny(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    trainer = MixedPrecisionTrainer(model, opt, precision="fp16", master_weights=master_weights, loss_scale=scaler,
                                    max_grad_norm=1.0, accumulation_steps=2)
    return model, trainer


def _train(model: nn.Module, trainer: MixedPrecisionTrainer, steps: range, dtype: torch.dtype) -> None:
    for step in steps:
        for micro in range(2):
            x, y = _batch(2 * step + micro, dtype)
            trainer.zero_grad()
            trainer.backward(_mse(model, x, y))
            if step % 7 == 3 and micro == 1:
                grads = [p.grad for p in (trainer.master_params or list(model.parameters()))]
                grads[-1].view(-1)[0] = INF
            trainer.step()


@pytest.mark.parametrize("master_weights", [False, True], ids=["O1", "O2"])
def test_resume_is_bit_identical(master_weights, one_thread):
    dtype = torch.float16 if master_weights else torch.float32
    model_a, trainer_a = _resume_trainer(master_weights, seed=0)
    _train(model_a, trainer_a, range(40), dtype)

    model_b, trainer_b = _resume_trainer(master_weights, seed=0)
    _train(model_b, trainer_b, range(20), dtype)
    buffer = io.BytesIO()
    torch.save(trainer_b.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model_c, trainer_c = _resume_trainer(master_weights, seed=123)  # different init: everything must come from state
    trainer_c.load_state_dict(state)
    _train(model_c, trainer_c, range(20, 40), dtype)

    for (name, a), c in zip(model_a.named_parameters(), model_c.parameters()):
        assert torch.equal(a, c), f"{name}: max diff {(a.float() - c.float()).abs().max()}"
    for a, c in zip(trainer_a.master_params, trainer_c.master_params):
        assert torch.equal(a, c)
    sd_a, sd_c = trainer_a.state_dict(), trainer_c.state_dict()
    assert sd_a["scaler"] == sd_c["scaler"] and sd_a["stats"] == sd_c["stats"], (sd_a["scaler"], sd_c["scaler"])
    for key, state_a in sd_a["optimizer"]["state"].items():
        for name, value in state_a.items():
            assert torch.equal(value, sd_c["optimizer"]["state"][key][name]), (key, name)
    assert sd_a["stats"]["skipped"] > 0 and sd_a["stats"]["steps"] > 0, sd_a["stats"]
    assert len(trainer_a.master_params) == (4 if master_weights else 0)


def test_state_dict_mid_window_and_mismatched_checkpoint_are_rejected():
    model, trainer = _resume_trainer(False, seed=0)
    x, y = _batch(0)
    trainer.backward(_mse(model, x, y))
    trainer.step()
    with pytest.raises(RuntimeError, match="accumulation window"):
        trainer.state_dict()
    trainer.backward(_mse(model, x, y))
    trainer.step()
    state = trainer.state_dict()
    _model, o2 = _resume_trainer(True, seed=0)
    with pytest.raises(ValueError, match="master_weights=False but this trainer has master_weights=True"):
        o2.load_state_dict(state)


# ---------------------------------------------------------------- embedding gradient shrink
def test_embedding_grad_shrink_scales_only_the_embedding_gradient():
    alpha = 0.1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(12, 4), nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16",
                                    embedding_grad_shrink=alpha)
    idx = torch.tensor([[1, 2, 2, 7]])
    out, ref_out = model(idx), reference(idx)
    assert torch.allclose(out, ref_out, rtol=1e-6, atol=1e-7), (out - ref_out).abs().max()
    trainer.backward(out.square().sum())
    ref_out.square().sum().backward()
    assert torch.allclose(model[0].weight.grad, alpha * reference[0].weight.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(model[1].weight.grad, reference[1].weight.grad, rtol=1e-6, atol=1e-7)
    assert model[0].weight.grad.abs().sum() > 0

    with pytest.raises(ValueError, match="no nn.Embedding submodule"):
        MixedPrecisionTrainer(_tiny(), torch.optim.SGD(_tiny().parameters(), lr=0.1), embedding_grad_shrink=0.1)
    with pytest.raises(ValueError, match=r"embedding_grad_shrink must be a float in \(0, 1\]"):
        MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), embedding_grad_shrink=1.5)


class _EmbedThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 4)
        self.proj = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(idx))


def _as_graph(kind: str, model: nn.Module, idx: torch.Tensor) -> torch.fx.GraphModule:
    if kind == "converted":
        return converter.convert(model, (idx,), precision="bf16").module
    return torch.fx.symbolic_trace(model)


@pytest.mark.parametrize("kind", ["symbolic_trace", "converted"])
def test_embedding_grad_shrink_in_graph_modules(kind):
    alpha = 0.25
    torch.manual_seed(0)
    base = _EmbedThenLinear()
    idx = torch.tensor([[1, 2, 2, 7]])
    module, reference = _as_graph(kind, copy.deepcopy(base), idx), _as_graph(kind, copy.deepcopy(base), idx)
    embed_called = any(node.op == "call_module" and node.target == "embed" for node in module.graph.nodes)
    # symbolic_trace keeps nn.Embedding as a module (hook path); the converter inlines it into
    # F.embedding (graph-rewrite path), where a module hook would never fire.
    assert embed_called is (kind == "symbolic_trace")
    trainer = MixedPrecisionTrainer(module, torch.optim.SGD(module.parameters(), lr=0.1), precision="bf16",
                                    embedding_grad_shrink=alpha)
    out, ref_out = module(idx).float(), reference(idx).float()
    assert torch.allclose(out, ref_out, rtol=1e-6, atol=1e-6), (out - ref_out).abs().max()
    trainer.backward(out.square().sum())
    ref_out.square().sum().backward()
    grad = dict(module.named_parameters())["embed.weight"].grad
    ref_grad = dict(reference.named_parameters())["embed.weight"].grad
    assert ref_grad.abs().sum() > 0
    assert torch.allclose(grad, alpha * ref_grad, rtol=1e-5, atol=1e-7), (grad - alpha * ref_grad).abs().max()


# ---------------------------------------------------------------- errors and configuration
@pytest.mark.parametrize("kwargs", [{"scaler": LossScaler()}, {"loss_scale": LossScaler()}, {"loss_scale": 128.0}])
def test_bf16_with_a_scaler_is_rejected(kwargs):
    model = _tiny()
    with pytest.raises(ValueError, match="bf16 has the same 8-bit exponent range as fp32.*loss scaling is unnecessary"):
        MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", **kwargs)


def test_closure_is_rejected_with_a_clear_error():
    model = _tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="does not take a closure.*trainer.backward"):
        trainer.step(closure=lambda: torch.zeros(()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"precision": "fp4"}, ValueError, "precision must be one of"),  # fp8 is taken (issue 43): tests/test_flows.py
        ({"precision": torch.float32}, ValueError, "precision must be one of"),
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps must be an int >= 1"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be a finite number > 0"),
        ({"loss_scale": "auto"}, ValueError, "loss_scale must be 'dynamic', a float, a LossScaler or None"),
        ({"loss_scale": 0.0}, ValueError, "static loss_scale must be a finite number > 0"),
        ({"loss_scale": 8.0, "scaler": LossScaler()}, ValueError, "either scaler= or loss_scale="),
        ({"master_weights": 1}, TypeError, "master_weights must be a bool"),
        ({"callback": 3}, TypeError, "callback must be callable"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, error, match):
    model = _tiny()
    with pytest.raises(error, match=match):
        MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_o1_with_fp16_params_is_rejected():
    model = _tiny().half()
    with pytest.raises(ValueError, match="master_weights=True"):
        MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")


def test_precision_aliases_and_scaler_choice():
    model = _tiny()
    scaler = LossScaler(init_scale=8.0)
    assert MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="16-mixed",
                                 loss_scale=scaler).scaler is scaler
    assert MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16",
                                 scaler=scaler).scaler is scaler
    assert MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 precision="bf16-mixed", loss_scale=None).scaler is None
    default = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert default.scaler.get_scale() == 2.0**16 and default.scaler.state_dict()["dynamic"]


def test_o2_harvest_reuses_fp32_buffers_and_accumulates_exactly_in_fp32():
    """The persistent master-grad buffers: exact widening on the first micro-batch, fp32 sum across the window,
    no value carried over from an earlier window, and zero_grad() leaves no gradient anywhere."""
    model = _tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16",
                                    master_weights=True, accumulation_steps=2)
    params = list(model.parameters())
    first_ptrs = None
    for step in range(3):
        expected = None
        for micro in range(2):
            x, y = _batch(2 * step + micro, torch.bfloat16)
            trainer.zero_grad()
            loss = _mse(model, x, y) / 2
            half_grads = torch.autograd.grad(loss, params)
            trainer.backward(_mse(model, x, y))
            widened = [g.float() for g in half_grads]
            expected = widened if expected is None else [e + w for e, w in zip(expected, widened)]
            for master, want in zip(trainer.master_params, expected):
                assert master.grad.dtype == torch.float32 and torch.equal(master.grad, want)
            assert all(p.grad is None for p in params)
            trainer.step()
        ptrs = [m.grad.data_ptr() for m in trainer.master_params]
        first_ptrs = first_ptrs or ptrs
        assert ptrs == first_ptrs
    trainer.zero_grad()
    assert all(p.grad is None for p in params) and all(m.grad is None for m in trainer.master_params)


def test_o2_flat_buffers_survive_a_repointed_parameter():
    """A half param whose storage is replaced after setup (``p.data = ...``, ``.to()``) still gets
    its master copied back; the flat fast path must not write into the orphaned buffer only."""
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    gm.meta["mp_param_dtypes"] = {n: torch.bfloat16 for n, _ in gm.named_parameters()}
    trainer = MixedPrecisionTrainer(gm, torch.optim.SGD(gm.parameters(), lr=0.5), precision="bf16", master_weights=True)
    weight = gm.get_parameter("0.weight")
    weight.data = weight.data.clone()  # leaves the flat buffer
    for _ in range(3):
        trainer.zero_grad()
        trainer.backward(gm(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean())
        assert trainer.step()
    for (_name, param), master in zip(gm.named_parameters(), trainer.master_params):
        assert torch.equal(param, master.to(torch.bfloat16)), _name
    assert not torch.equal(weight.float(), torch.zeros_like(weight.float()))


def test_o2_drops_the_weight_casts_half_storage_made_identities():
    """A converted O2 graph loses exactly its weight casts to half-stored params; outputs unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    conv = converter.convert(model, (x,), opt_level="O2")
    gm = conv.module
    weight_casts = [n for n in gm.graph.nodes if "mp_cast" in n.meta and n.meta["mp_cast"].on_weight]
    assert len(weight_casts) == 4  # both Linear weights and biases; LayerNorm params stay fp32
    with torch.no_grad():
        before = gm(x)
    trainer = MixedPrecisionTrainer(gm, torch.optim.SGD(gm.parameters(), lr=0.1), precision="bf16", master_weights=True)
    assert trainer.dropped_weight_casts == 4
    assert not [n for n in gm.graph.nodes if "mp_cast" in n.meta and n.meta["mp_cast"].on_weight]
    with _OpCounter() as counter, torch.no_grad():
        after = gm(x)
    assert torch.equal(before, after), (before - after).abs().max()
    # only the 4 activation casts run: input->bf16, GELU out->fp32 (LayerNorm), LayerNorm out->bf16,
    # logits->fp32; the 4 weight casts (no-ops since the params are bf16) are gone from the graph
    assert counter.ops.count("aten._to_copy.default") == 4, counter.ops
    trainer.zero_grad()
    trainer.backward(gm(x).pow(2).mean())
    assert trainer.step()
    o1 = MixedPrecisionTrainer(copy.deepcopy(conv.module), torch.optim.SGD(gm.parameters(), lr=0.1), precision="bf16")
    assert o1.dropped_weight_casts == 0


# ---------------------------------------------------------------- foreach optimizer
def test_optimizer_foreach_is_switched_on_only_where_left_to_the_default():
    model = _tiny()
    params = list(model.parameters())
    opt = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "foreach": False}], lr=0.1)
    trainer = MixedPrecisionTrainer(model, opt, precision="bf16")
    assert trainer.foreach_groups == 1
    assert [g["foreach"] for g in opt.param_groups] == [True, False]
    untouched = torch.optim.SGD(_tiny().parameters(), lr=0.1)
    MixedPrecisionTrainer(_tiny(), untouched, precision="bf16", optimizer_foreach=False)
    assert untouched.param_groups[0]["foreach"] is None


# ---------------------------------------------------------------- O2 gradient arena (issue 18 item 4)
class _Branchy(nn.Module):
    """Linear layers in half, a LayerNorm kept fp32, and a layer used only when ``use_extra``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.extra = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x).float()).to(self.inp.weight.dtype)
        if self.use_extra:
            h = self.extra(h)
        return self.out(h)


def _reference_norm(model: nn.Module, x: torch.Tensor) -> float:
    """Plain autograd on a copy of the O2 model as stored (half weights, fp32 norm): the 2-norm, in
    fp32, of every gradient it produces (widening bf16 to fp32 is exact, so the trainer must match)."""
    ref = copy.deepcopy(model)
    ref(x).float().pow(2).mean().backward()
    grads = [p.grad.float().flatten() for p in ref.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.cat(grads)).item()


def _branchy_o2(**kw) -> tuple[_Branchy, MixedPrecisionTrainer]:
    torch.manual_seed(0)
    model = _Branchy()
    model.meta = {"mp_param_dtypes": {n: (torch.float32 if n.startswith("norm") else torch.bfloat16)
                                      for n, _ in model.named_parameters()}}
    return model, MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=kw.pop("lr", 0.1)),
                                        precision="bf16", master_weights=True, **kw)


def test_o2_grad_norm_is_one_reduction_over_the_arena_and_exact():
    """O2 with fp32-stored norm weights: every optimizer gradient (masters' and the fp32 params') is
    a view of one fp32 buffer, so the non-finite check is one ``linalg_vector_norm`` (no per-tensor
    ``_foreach_norm``, no stack), written straight into the trainer's readout buffer (the ``out=``
    overload), and its value is the norm of those gradients (bf16 → fp32 is exact)."""
    model, trainer = _branchy_o2()
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    expected = _reference_norm(model, x)
    trainer.zero_grad()
    trainer.backward(model(x).float().pow(2).mean())
    arena = trainer._masters.arena.flats[0]
    for param in [model.norm.weight, model.norm.bias, *trainer.master_params]:
        assert param.grad.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    with _OpCounter() as counter:
        assert trainer.step()
    norms = [op for op in counter.ops if "norm" in op and "layer_norm" not in op]
    assert norms == ["aten.linalg_vector_norm.out"], counter.ops
    assert trainer.stats.grad_norm == pytest.approx(expected, rel=1e-5), (trainer.stats.grad_norm, expected)


def test_o2_arena_norm_ignores_stale_slots_of_unused_params():
    """A layer used in step 1 and skipped in step 2 (no gradient) must not count with its old
    gradient in step 2's norm, and is not stepped; it counts again once it is used again."""
    model, trainer = _branchy_o2(lr=0.0)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    for use_extra in (True, False, True):
        model.use_extra = use_extra
        expected = _reference_norm(model, x)
        trainer.zero_grad()
        trainer.backward(model(x).float().pow(2).mean())
        assert trainer.step()
        assert trainer.stats.grad_norm == pytest.approx(expected, rel=1e-5), (use_extra, trainer.stats.grad_norm,
                                                                              expected)
        half = [n for n, p in model.named_parameters() if p.dtype == torch.bfloat16]
        masters = dict(zip(half, trainer.master_params))
        assert [(masters[n].grad is None) for n in ("extra.weight", "extra.bias")] == [not use_extra] * 2


def test_o2_arena_accumulates_fp32_param_grads_in_place():
    """With accumulation, the fp32-stored params' gradients sum over the window in their slots and
    match plain autograd's accumulation over the same two micro-batches."""
    model, trainer = _branchy_o2(lr=0.0, accumulation_steps=2)
    ref = copy.deepcopy(model)  # the model as stored: half weights, fp32 norm
    xs = [torch.randn(5, 8, dtype=torch.bfloat16) for _ in range(2)]
    trainer.zero_grad()
    for x in xs:
        trainer.backward(model(x).float().pow(2).mean())
        (ref(x).float().pow(2).mean() / 2).backward()
        trainer.step()
    slot = trainer._masters.arena.slot_of[id(model.norm.weight)]
    assert model.norm.weight.grad is slot
    torch.testing.assert_close(model.norm.weight.grad, ref.norm.weight.grad, rtol=1e-6, atol=1e-7)
    assert trainer.stats.steps == 1


def test_o2_arena_leaves_a_repointed_fp32_param_its_own_gradient():
    """An fp32-stored param whose storage was replaced after setup keeps its own gradient (no slot):
    the norm falls back to per-tensor norms and is still exact, and the param is still stepped."""
    model, trainer = _branchy_o2(lr=0.5)
    model.norm.weight.data = model.norm.weight.data.clone()
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    expected = _reference_norm(model, x)
    before = model.norm.weight.detach().clone()
    trainer.zero_grad()
    trainer.backward(model(x).float().pow(2).mean())
    assert model.norm.weight.grad is not trainer._masters.arena.slot_of[id(model.norm.weight)]
    assert trainer.step()
    assert trainer.stats.grad_norm == pytest.approx(expected, rel=1e-5), (trainer.stats.grad_norm, expected)
    assert not torch.equal(model.norm.weight, before)
