"""Trainer hardening (issue 19 items 1 and 5): no NaN ever reaches a weight, skip limits, the spike
guard, and all-or-nothing checkpoint loading for MixedPrecisionTrainer and LossScaler."""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from test_trainer import _batch, _mse, _tiny  # the same tiny model and batches as the trainer's own tests
from torch import nn

import converter
from converter.train.scaler import LossScaler
from converter.train.trainer import (
    MixedPrecisionTrainer,
    SpikeGuard,
    TrainingStalledError,
)

INF = float("inf")



def _weights(model: nn.Module, trainer: MixedPrecisionTrainer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *trainer.master_params]]


def _poisoned_step(model: nn.Module, trainer: MixedPrecisionTrainer, step: int, dtype: torch.dtype) -> bool:
    x, y = _batch(step % 10, dtype)
    trainer.zero_grad()
    trainer.backward(_mse(model, x, y))
    grads = [p.grad for p in (trainer.master_params or list(model.parameters()))]
    grads[step % len(grads)].view(-1)[0] = INF
    return trainer.step()


def _clean_step(model: nn.Module, trainer: MixedPrecisionTrainer, step: int, dtype: torch.dtype) -> bool:
    x, y = _batch(step % 10, dtype)
    trainer.zero_grad()
    trainer.backward(_mse(model, x, y))
    return trainer.step()


# ---------------------------------------------------------------- 19.1: the scale floor, never NaN weights
@pytest.mark.parametrize("master_weights", [False, True], ids=["O1", "O2"])
def test_300_overflowing_steps_then_clean_ones_weights_stay_finite_and_training_resumes(master_weights, one_thread):
    dtype = torch.float16 if master_weights else torch.float32
    model = _tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), precision="fp16",
                                    master_weights=master_weights, max_consecutive_skips=None)
    before = _weights(model, trainer)
    for step in range(300):
        assert not _poisoned_step(model, trainer, step, dtype)
    assert trainer.stats.scale == 1.0, f"the default scaler's floor is 1.0, got {trainer.stats.scale}"
    assert trainer.stats.skipped == 300 and trainer.stats.consecutive_skips == 300, trainer.stats
    for a, b in zip(before, _weights(model, trainer)):
        assert torch.equal(a, b), "a skipped step changed a weight"
    losses = []
    for step in range(300, 340):
        assert _clean_step(model, trainer, step, dtype), f"clean step {step} was skipped: {trainer.stats}"
        losses.append(trainer.stats.loss)
        for tensor in _weights(model, trainer):
            assert torch.isfinite(tensor).all(), f"step {step}: non-finite weight"
    assert trainer.stats.steps == 40 and trainer.stats.consecutive_skips == 0, trainer.stats
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.95 * first, f"training did not resume: mean loss {first:.4f} -> {last:.4f}"


def test_a_scaler_without_floor_reaches_zero_yet_no_nan_reaches_the_weights():
    """GradScaler's behaviour (no floor): the scale underflows to 0 after ~166 overflows; the next
    clean step would unscale by 1/0 = inf. The trainer checks the unscaled gradients and skips."""
    model = _tiny()
    scaler = LossScaler()  # GradScaler-compatible: min_scale=None
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), precision="fp16",
                                    loss_scale=scaler, max_consecutive_skips=None)
    before = _weights(model, trainer)
    for step in range(300):
        _poisoned_step(model, trainer, step, torch.float32)
    assert scaler.get_scale() == 0.0, scaler.get_scale()
    for step in range(300, 305):
        assert not _clean_step(model, trainer, step, torch.float32)
        assert not math.isfinite(trainer.stats.grad_norm), trainer.stats.grad_norm
    assert trainer.stats.skipped == 305, trainer.stats
    for a, b in zip(before, _weights(model, trainer)):
        assert torch.equal(a, b), f"weights changed (NaN written?): {b}"


def test_finite_gradients_that_overflow_when_unscaled_are_not_stepped():
    """The fused check looks at the scaled gradients; 1e36 is finite, 1e36 / 2**-10 is inf in fp32."""
    model = nn.Linear(2, 1, bias=False)
    scaler = LossScaler(init_scale=2.0**-10, dynamic=False, max_scale=None)
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0), precision="fp16",
                                    loss_scale=scaler)
    before = model.weight.detach().clone()
    trainer.backward(model(torch.ones(1, 2)).sum())
    model.weight.grad.fill_(1e36)
    assert not trainer.step()
    assert trainer.stats.skipped == 1 and trainer.stats.grad_norm == INF, trainer.stats
    assert torch.equal(model.weight, before), model.weight


def test_bf16_nan_gradient_is_never_stepped():
    model = _tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    before = _weights(model, trainer)
    x, y = _batch(0)
    trainer.backward(_mse(model, x, y))
    model[2].bias.grad[1] = float("nan")
    assert not trainer.step()
    assert trainer.stats.skipped == 1 and math.isnan(trainer.stats.grad_norm), trainer.stats
    for a, b in zip(before, _weights(model, trainer)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- 19.1: the consecutive-skip limit
def test_default_limit_raises_after_100_consecutive_skips_naming_the_steps():
    model = _tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), precision="fp16")
    for step in range(99):
        _poisoned_step(model, trainer, step, torch.float32)
    with pytest.raises(TrainingStalledError, match=r"^100 consecutive optimizer steps were skipped \(steps 1 to 100;"):
        _poisoned_step(model, trainer, 99, torch.float32)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_limit_counts_only_an_unbroken_run_of_skips(precision):
    model = _tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), precision=precision,
                                    max_consecutive_skips=4)
    plan = ["ok", "ok", "bad", "bad", "bad", "ok", "bad", "bad", "bad"]  # runs of 3 < 4: no error
    for step, kind in enumerate(plan):
        (_clean_step if kind == "ok" else _poisoned_step)(model, trainer, step, torch.float32)
    assert trainer.stats.consecutive_skips == 3 and trainer.stats.skipped == 6, trainer.stats
    with pytest.raises(TrainingStalledError, match=r"^4 consecutive optimizer steps were skipped \(steps 7 to 10;"):
        _poisoned_step(model, trainer, len(plan), torch.float32)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "10"])
def test_bad_max_consecutive_skips_is_rejected(value):
    model = _tiny()
    with pytest.raises(ValueError, match="max_consecutive_skips must be an int >= 1 or None"):
        MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), max_consecutive_skips=value)


# ---------------------------------------------------------------- spike guard
def _encoder_and_batches():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen)) for _ in range(24)]
    spike_at = 15
    x, y = batches[spike_at]
    batches[spike_at] = (x, y * 1e4)  # a corrupted target: its gradient norm is ~1e3 x the others
    return model, batches, spike_at


def _train_encoder(module, batches, *, guard):
    trainer = MixedPrecisionTrainer(module, torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9),
                                    precision="bf16", spike_guard=guard)
    stepped = []
    for x, y in batches:
        trainer.zero_grad()
        trainer.backward(nn.functional.mse_loss(module(x).float(), y))
        stepped.append(trainer.step())
    return trainer, stepped


def test_spike_guard_skips_a_planted_spike_and_training_goes_on_unchanged(caplog):
    model, batches, spike_at = _encoder_and_batches()
    conv = converter.convert(model, (batches[0][0],), precision="bf16")
    guard = SpikeGuard(factor=10.0, window=20, min_history=5)

    guarded = copy.deepcopy(conv.module)
    with caplog.at_level(logging.WARNING, logger="converter.train.trainer"):
        trainer, stepped = _train_encoder(guarded, batches, guard=guard)
    assert stepped == [i != spike_at for i in range(len(batches))], stepped
    assert trainer.stats.spike_skips == 1 and trainer.stats.skipped == 0, trainer.stats
    assert trainer.stats.steps == len(batches) - 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"step {spike_at + 1} skipped by the spike guard" in m for m in messages), messages

    without = copy.deepcopy(conv.module)
    _train_encoder(without, batches[:spike_at] + batches[spike_at + 1:], guard=guard)
    for (name, a), b in zip(guarded.named_parameters(), without.parameters()):
        assert torch.equal(a, b), f"{name}: differs from the run without the spike batch by {(a - b).abs().max()}"

    unguarded = copy.deepcopy(conv.module)
    trainer_off, stepped_off = _train_encoder(unguarded, batches, guard=None)
    assert all(stepped_off) and trainer_off.stats.spike_skips == 0, trainer_off.stats
    drift = max((a - b).abs().max().item() for a, b in zip(unguarded.parameters(), without.parameters()))
    assert drift > 1e-2, f"without the guard the spike batch should move the weights, max diff {drift}"


def test_spike_guard_waits_for_history_and_accepts_a_lasting_change():
    model = nn.Linear(3, 1, bias=False)
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), precision="bf16",
                                    spike_guard=SpikeGuard(factor=4.0, window=4, min_history=2),
                                    max_consecutive_skips=None)

    def step_with_norm(norm: float) -> bool:
        trainer.zero_grad()
        trainer.backward(model(torch.ones(1, 3)).sum())
        model.weight.grad.copy_(torch.tensor([[norm, 0.0, 0.0]]))
        return trainer.step()

    assert step_with_norm(1.0) and step_with_norm(100.0)  # fewer than min_history norms: never a spike
    assert not step_with_norm(1000.0)  # median(1, 100) = 50.5; 1000 > 4 x 50.5
    results = [step_with_norm(1000.0) for _ in range(3)]
    assert results == [False, True, True], results  # the median catches up with the new scale
    assert trainer.stats.spike_skips == 2, trainer.stats


def test_spike_guard_history_survives_a_checkpoint():
    def build():
        model = nn.Linear(3, 1, bias=False)
        trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), precision="bf16",
                                        spike_guard=SpikeGuard(factor=4.0, window=8, min_history=3))
        return model, trainer

    def step_with_norm(model, trainer, norm: float) -> bool:
        trainer.zero_grad()
        trainer.backward(model(torch.ones(1, 3)).sum())
        model.weight.grad.copy_(torch.tensor([[norm, 0.0, 0.0]]))
        return trainer.step()

    model, trainer = build()
    for norm in (1.0, 2.0, 1.5):
        assert step_with_norm(model, trainer, norm)
    state = trainer.state_dict()
    assert state["spike_history"] == [1.0, 2.0, 1.5]
    resumed_model, resumed = build()
    resumed.load_state_dict(state)
    assert not step_with_norm(resumed_model, resumed, 50.0), "the restored history should flag the spike"
    assert resumed.stats.spike_skips == 1
    state["spike_history"] = [1.0, float("nan")]
    with pytest.raises(ValueError, match="spike_history must be a list of finite gradient norms"):
        build()[1].load_state_dict(state)


@pytest.mark.parametrize("kwargs, match", [
    ({"factor": 1.0}, "factor must be a finite number > 1"),
    ({"factor": float("nan")}, "factor must be a finite number > 1"),
    ({"window": 0}, "window must be an int >= 1"),
    ({"min_history": 5, "window": 3}, r"min_history \(5\) must be <= window \(3\)"),
])
def test_bad_spike_guard_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpikeGuard(**kwargs)


# ---------------------------------------------------------------- 19.5: integrity
def _o2_trainer(seed: int = 0):
    model = _tiny(seed)
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    precision="fp16", master_weights=True,
                                    loss_scale=LossScaler(init_scale=256.0, growth_interval=2))
    for step in range(3):
        _clean_step(model, trainer, step, torch.float16)
    return model, trainer


def _snapshot(trainer: MixedPrecisionTrainer) -> dict:
    return copy.deepcopy(trainer.state_dict())


def _assert_same_state(a: dict, b: dict) -> None:
    for key in ("model", "master"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name} changed by a rejected load"
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][index][name]), f"optimizer {index}.{name} changed"
    assert a["scaler"] == b["scaler"] and a["stats"] == b["stats"], (a["scaler"], b["scaler"])


def _broadcastable_master(state):
    name = next(iter(state["master"]))
    state["master"][name] = state["master"][name][:1].clone()  # (1, 4) broadcasts into (8, 4)


def _half_master(state):
    name = next(iter(state["master"]))
    state["master"][name] = state["master"][name].half()


def _missing_master(state):
    state["master"].pop(next(iter(state["master"])))


def _extra_master(state):
    state["master"]["extra.weight"] = torch.zeros(2)


def _wrong_model_shape(state):
    state["model"]["2.bias"] = torch.zeros(1, dtype=state["model"]["2.bias"].dtype)


def _bad_scaler(state):
    state["scaler"]["growth_interval"] = 0


def _bad_stats(state):
    state["stats"]["bogus"] = 1


@pytest.mark.parametrize("corrupt, match", [
    (_broadcastable_master, r"master weights entry '0.weight' has shape \(1, 4\)"),
    (_half_master, "dtype torch.float16, but this trainer's has shape .* dtype torch.float32"),
    (_missing_master, r"missing \['0.weight'\]"),
    (_extra_master, r"unexpected \['extra.weight'\]"),
    (_wrong_model_shape, r"model entry '2.bias' has shape \(1,\)"),
    (_bad_scaler, "growth_interval must be >= 1"),
    (_bad_stats, "checkpoint stats must be a dict"),
], ids=lambda v: getattr(v, "__name__", "")[1:] if callable(v) else "")
def test_trainer_load_rejects_mismatched_checkpoints_and_loads_nothing(corrupt, match):
    _model, source = _o2_trainer(seed=0)
    state = source.state_dict()
    corrupt(state)
    _other, target = _o2_trainer(seed=5)
    before = _snapshot(target)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    _assert_same_state(before, _snapshot(target))


def _trained_scaler() -> LossScaler:
    scaler = LossScaler(init_scale=512.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    for value in (1.0, INF, 1.0, 1.0):
        param.grad = torch.full((3,), value)
        scaler.step(opt)
        scaler.update()
    return scaler


@pytest.mark.parametrize("change, match", [
    ({"growth_factor": 4.0, "scale": float("nan")}, "scale must be a finite number > 0"),
    ({"hysteresis": 3, "growth_interval": 0}, "growth_interval must be >= 1"),
    ({"min_scale": 1.0, "_growth_tracker": -1}, "_growth_tracker must be >= 0"),
    ({"backoff_factor": 0.25, "dynamic": "yes"}, "dynamic must be a bool"),
    ({"max_scale": 2.0**10, "min_scale": 2.0**12, "scale": 2.0**11}, "min_scale .* must be <= max_scale"),
    ({"growth_factor": 4.0, "_hysteresis_left": 0}, "_hysteresis_left must be >= 1"),
    ({"scale": 1.0}, r"scale \(1.0\) is outside \[min_scale, max_scale\]"),
    ({"growth_factor": 4.0, "surprise": 1}, r"unknown keys \['surprise'\]"),
])
def test_scaler_load_is_all_or_nothing(change, match):
    scaler = _trained_scaler()
    before = scaler.state_dict()
    assert before["_hysteresis_left"] != 2 or before["_growth_tracker"] != 0, before  # a non-trivial state
    bad = {**before, **change}
    with pytest.raises((ValueError, TypeError), match=match):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before, (scaler.state_dict(), before)


def test_scaler_load_of_a_valid_dict_still_applies_everything():
    scaler, other = _trained_scaler(), LossScaler(init_scale=8.0, max_scale=None)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()


# ---------------------------------------------------------------- arguments checked before anything changes
def _model_and_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "params": [(name, p, p.data_ptr(), p.dtype, p.detach().clone()) for name, p in module.named_parameters()],
        "groups": [{k: (list(v) if k == "params" else v) for k, v in g.items()} for g in optimizer.param_groups],
        "state": dict(optimizer.state),
        "code": module.code if isinstance(module, torch.fx.GraphModule) else None,
    }


def _assert_unchanged(before: dict, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    after = dict(module.named_parameters())
    assert [name for name, *_ in before["params"]] == list(after)
    for name, param, ptr, dtype, value in before["params"]:
        assert after[name] is param, f"{name} was replaced"
        assert param.data_ptr() == ptr, f"{name} was given new storage"
        assert param.dtype == dtype, f"{name} changed dtype to {param.dtype}"
        assert torch.equal(param.detach(), value), f"{name} changed value"
    assert len(optimizer.param_groups) == len(before["groups"])
    for group, saved in zip(optimizer.param_groups, before["groups"]):
        assert set(group) == set(saved), "the optimizer's param group options changed"
        assert all(a is b for a, b in zip(group["params"], saved["params"], strict=True)), \
            "the optimizer's param groups were re-pointed"
        assert all(group[k] == saved[k] for k in saved if k != "params"), "the optimizer's options changed"
    assert dict(optimizer.state) == before["state"]
    if before["code"] is not None:
        assert module.code == before["code"], "the module's graph was rewritten"
    assert not module._forward_hooks and all(not m._forward_hooks for m in module.modules()), "a hook was left"


_LATE_CHECKED = [  # arguments whose check once came after O2 re-laid the parameters out and re-pointed the optimizer
    pytest.param({"embedding_grad_shrink": 2.0}, ValueError, "embedding_grad_shrink must be a float in", id="shrink>1"),
    pytest.param({"embedding_grad_shrink": 0.5}, ValueError, "nothing to shrink", id="shrink-no-embedding"),
    pytest.param({"optimizer_fused": "yes"}, TypeError, "optimizer_fused must be a bool", id="fused-str"),
    pytest.param({"optimizer_foreach": 1}, TypeError, "optimizer_foreach must be a bool", id="foreach-int"),
]


@pytest.mark.parametrize("converted", [False, True], ids=["plain", "converted"])
@pytest.mark.parametrize(("kwargs", "error", "match"), _LATE_CHECKED)
def test_a_rejected_argument_leaves_the_model_and_optimizer_untouched(converted, kwargs, error, match):
    module = _tiny()
    if converted:
        module = converter.convert(module, (_batch(0)[0],), precision="fp16", opt_level="O2").module
    momentum = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    _mse(module, *_batch(0)).backward()
    momentum.step()  # optimizer state exists: O2 would move it onto the masters
    momentum.zero_grad(set_to_none=True)
    before = _model_and_optimizer(module, momentum)
    with pytest.raises(error, match=match):
        MixedPrecisionTrainer(module, momentum, precision="fp16", master_weights=True, **kwargs)
    _assert_unchanged(before, module, momentum)
    # and the untouched pair still builds a working trainer
    trainer = MixedPrecisionTrainer(module, momentum, precision="fp16", master_weights=True)
    trainer.zero_grad()
    trainer.backward(_mse(module, *_batch(1, next(module.parameters()).dtype)))
    assert trainer.step()
