"""All-or-nothing checkpoint loading (issue 31 item 4): ``MixedPrecisionTrainer.load_state_dict`` and the
Lightning plugin's validate everything before they change anything.

On the old code each case below was accepted (and broke training later: scale 1e-300 is 0.0 in fp32,
so every step was skipped; a NaN learning rate or NaN masters reached the weights) or failed after
the model, optimizer and masters had already been overwritten.
"""
from __future__ import annotations

import pytest
import torch
from test_trainer_safety import _assert_same_state, _o2_trainer, _snapshot

from converter.train.scaler import LossScaler


def _tiny_scale(state):
    state["scaler"]["scale"] = 1e-300  # a positive float64, 0.0 in fp32


def _huge_scale(state):
    state["scaler"]["scale"] = 1e39  # inf in fp32
    state["scaler"]["max_scale"] = None


def _tracker_past_int32(state):
    state["scaler"]["_growth_tracker"] = 2**40


def _interval_past_int32(state):
    state["scaler"]["growth_interval"] = 2**33


def _optimizer_without_state(state):
    del state["optimizer"]["state"]


def _meta_master(state):
    name = next(iter(state["master"]))
    state["master"][name] = torch.empty_like(state["master"][name], device="meta")


def _nan_lr(state):
    state["optimizer"]["param_groups"][0]["lr"] = float("nan")


def _string_lr(state):
    state["optimizer"]["param_groups"][0]["lr"] = "0.1"


def _nan_master(state):
    name = next(iter(state["master"]))
    state["master"][name] = state["master"][name].clone()
    state["master"][name].view(-1)[0] = float("nan")


def _nan_model_parameter(state):
    name = next(k for k, v in state["model"].items() if v.is_floating_point())
    state["model"][name] = state["model"][name].clone()
    state["model"][name].view(-1)[0] = float("inf")


def _wrong_shape_momentum(state):
    index, entry = next(iter(state["optimizer"]["state"].items()))
    entry["momentum_buffer"] = torch.zeros(3)


def _unknown_state_index(state):
    state["optimizer"]["state"][99] = {"momentum_buffer": torch.zeros(3)}


def _string_counter(state):
    state["stats"]["steps"] = "3"


def _nan_scale_stat(state):
    state["stats"]["scale"] = float("nan")


@pytest.mark.parametrize("corrupt, match", [
    (_tiny_scale, r"scale must lie in fp32's normal range .* got 1e-300"),
    (_huge_scale, r"scale must lie in fp32's normal range .* got 1e\+39"),
    (_tracker_past_int32, r"_growth_tracker must be <= 2147483647"),
    (_interval_past_int32, r"growth_interval must be <= 2147483647"),
    (_optimizer_without_state, r"with 'state' and 'param_groups'"),
    (_meta_master, r"is on the meta device"),
    (_nan_lr, r"param group 0 has lr=nan"),
    (_string_lr, r"param group 0 has lr of type str"),
    (_nan_master, r"master weights entry .* holds inf or NaN"),
    (_nan_model_parameter, r"model parameter .* holds inf or NaN"),
    (_wrong_shape_momentum, r"'momentum_buffer' of parameter 0 has shape \(3,\)"),
    (_unknown_state_index, r"names parameter 99, which no param group holds"),
    (_string_counter, r"stats has steps='3'"),
    (_nan_scale_stat, r"stats has scale=nan"),
], ids=lambda v: getattr(v, "__name__", "")[1:] if callable(v) else "")
def test_trainer_load_validates_everything_and_loads_nothing(corrupt, match):
    _model, source = _o2_trainer(seed=0)
    state = source.state_dict()
    corrupt(state)
    _other, target = _o2_trainer(seed=5)
    before = _snapshot(target)
    with pytest.raises((ValueError, TypeError), match=match):
        target.load_state_dict(state)
    _assert_same_state(before, _snapshot(target))
    assert target.optimizer.param_groups[0]["lr"] == 0.05


def test_a_valid_checkpoint_still_loads_exactly():
    _model, source = _o2_trainer(seed=0)
    state = source.state_dict()
    _other, target = _o2_trainer(seed=5)
    target.load_state_dict(state)
    _assert_same_state(_snapshot(source), _snapshot(target))


def test_scaler_refuses_values_fp32_and_int32_cannot_hold():
    scaler = LossScaler(init_scale=256.0)
    before = scaler.state_dict()
    for change in ({"scale": 1e-300}, {"scale": 1e39, "max_scale": None}, {"_growth_tracker": 2**31}):
        with pytest.raises(ValueError, match="fp32|int32"):
            scaler.load_state_dict({**before, **change})
        assert scaler.state_dict() == before


def _plugin_with_trainers():
    # only the Lightning plugin's test needs Lightning: the trainer and scaler tests above never sit behind it
    pytest.importorskip("pytorch_lightning")
    from converter.lightning import MixedPrecision

    plugin = MixedPrecision("16-mixed", opt_level="O2")
    _model, first = _o2_trainer(seed=0)
    _model2, second = _o2_trainer(seed=1)
    plugin.trainers = [first, second]
    return plugin


def test_lightning_plugin_refuses_an_unknown_format_and_bad_second_trainer_before_loading_any():
    plugin = _plugin_with_trainers()
    good = plugin.state_dict()
    before = [_snapshot(t) for t in plugin.trainers]
    with pytest.raises(ValueError, match=r"format 7, this version reads format 1"):
        plugin.load_state_dict({**good, "format": 7})
    # the first trainer's state is valid, the second's is not: neither may be loaded
    _other, donor = _o2_trainer(seed=9)
    donor_state = plugin.state_dict()["trainers"][0] | {"master": {k: v + 1 for k, v in donor.state_dict()["master"].items()}}
    broken = dict(plugin.state_dict()["trainers"][1])
    broken["scaler"] = {**broken["scaler"], "scale": 1e-300}
    with pytest.raises(ValueError, match="fp32's normal range"):
        plugin.load_state_dict({"format": 1, "trainers": [donor_state, broken]})
    for snap, trainer in zip(before, plugin.trainers):
        _assert_same_state(snap, _snapshot(trainer))
