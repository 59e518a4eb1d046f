"""Validation of a trainer checkpoint before anything is loaded: every check raises naming what does not fit.

``MixedPrecisionTrainer.load_state_dict`` is all-or-nothing: these checks run over the whole checkpoint first
(its header, the master and model tensors, the optimizer's groups and per-parameter state, the spike guard's
history), so that a mismatch loads nothing rather than half a checkpoint.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

__all__ = ["STATE_FORMAT", "check_header", "check_optimizer_groups", "check_optimizer_state", "check_spike_history",
           "check_tensors", "check_values"]

#: the ``format`` entry of a trainer state dict
STATE_FORMAT = 1
_KEYS = {"precision", "master_weights", "model", "master", "optimizer", "scaler", "stats"}


def check_header(state_dict: Any, *, precision: str, master_weights: bool) -> None:
    """A trainer state dict of this format, with every key, saved by a trainer of the same precision and mode."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"a trainer state dict must be a dict, got {type(state_dict).__name__}")
    if state_dict.get("format") != STATE_FORMAT:
        raise ValueError(f"unknown trainer state format {state_dict.get('format')!r}, expected {STATE_FORMAT}")
    missing = sorted(_KEYS - set(state_dict))
    if missing:
        raise ValueError(f"trainer state dict is missing keys {missing}")
    for key, mine in (("precision", precision), ("master_weights", master_weights)):
        if state_dict[key] != mine:
            raise ValueError(f"checkpoint has {key}={state_dict[key]!r} but this trainer has {key}={mine!r}")


def check_spike_history(history: Any) -> None:
    """The spike guard's saved gradient norms: a list of finite floats >= 0."""
    if not isinstance(history, list) or not all(
        isinstance(v, float) and math.isfinite(v) and v >= 0 for v in history
    ):
        raise ValueError("checkpoint spike_history must be a list of finite gradient norms (floats >= 0)")


def check_tensors(what: str, given: Any, expected: Mapping[str, torch.Tensor], *, finite: bool = True) -> None:
    """``given`` must name exactly ``expected``'s tensors, each with the same shape and dtype, holding data
    (and, with ``finite``, no inf or NaN: a model's buffers may hold -inf mask fills on purpose)."""
    if not isinstance(given, dict):
        raise TypeError(f"checkpoint {what} must be a dict of tensors, got {type(given).__name__}")
    if set(given) != set(expected):
        unexpected, absent = sorted(set(given) - set(expected)), sorted(set(expected) - set(given))
        raise ValueError(f"checkpoint {what} do not match this trainer: unexpected {unexpected[:5]}, missing {absent[:5]}")
    for name, mine in expected.items():
        theirs = given[name]
        if not isinstance(mine, torch.Tensor):
            continue
        if not isinstance(theirs, torch.Tensor):
            raise TypeError(f"checkpoint {what} entry {name!r} must be a tensor, got {type(theirs).__name__}")
        if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            raise ValueError(
                f"checkpoint {what} entry {name!r} has shape {tuple(theirs.shape)} and dtype {theirs.dtype}, "
                f"but this trainer's has shape {tuple(mine.shape)} and dtype {mine.dtype}; nothing was loaded"
            )
        check_values(f"checkpoint {what} entry {name!r}", theirs, finite=finite)


def check_values(what: str, tensor: torch.Tensor, *, finite: bool = True) -> None:
    """A checkpoint tensor holds data (not the meta device's nothing) and, if floating, only finite values."""
    if tensor.is_meta:
        raise ValueError(f"{what} is on the meta device (it holds no data); nothing was loaded")
    if finite and (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what} holds inf or NaN values; nothing was loaded")


def check_optimizer_state(given: dict, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer checkpoint's hyperparameters are finite and its per-parameter state fits the parameters.

    ``optimizer.load_state_dict`` accepts a NaN learning rate, a missing ``state`` and an ``exp_avg``
    of another shape; each of them surfaces only steps later (NaN weights, a shape error mid-step)."""
    state = given.get("state")
    if not isinstance(state, dict):
        raise ValueError("checkpoint optimizer state must be an optimizer state_dict() with 'state' and 'param_groups'; "
                         "nothing was loaded")
    params: dict[Any, torch.Tensor] = {}
    for index, (theirs, mine) in enumerate(zip(given["param_groups"], optimizer.param_groups)):
        for key, value in theirs.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor):
                check_values(f"checkpoint optimizer param group {index}'s {key}", value)
            elif isinstance(value, float) and not math.isfinite(value):  # ints (and bools) are finite
                raise ValueError(f"checkpoint optimizer param group {index} has {key}={value}; nothing was loaded")
            elif key in ("lr", "weight_decay", "eps", "momentum") and not isinstance(value, (int, float, torch.Tensor)):
                raise TypeError(f"checkpoint optimizer param group {index} has {key} of type {type(value).__name__}; "
                                "nothing was loaded")
        if isinstance(theirs.get("lr"), (int, float)) and theirs["lr"] < 0:
            raise ValueError(f"checkpoint optimizer param group {index} has a negative lr ({theirs['lr']}); nothing was loaded")
        params.update(zip(theirs["params"], mine["params"]))
    for key, entry in state.items():
        param = params.get(key)
        if param is None:
            raise ValueError(f"checkpoint optimizer state names parameter {key!r}, which no param group holds; "
                             "nothing was loaded")
        if not isinstance(entry, dict):
            raise TypeError(f"checkpoint optimizer state of parameter {key!r} must be a dict, got {type(entry).__name__}")
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            where = f"checkpoint optimizer state {name!r} of parameter {key!r}"
            if value.dim() > 0 and value.shape != param.shape:
                raise ValueError(f"{where} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}; "
                                 "nothing was loaded")
            check_values(where, value)


def check_optimizer_groups(given: Any, optimizer: torch.optim.Optimizer) -> None:
    """The checkpoint's optimizer has as many param groups, of the same sizes, as ``optimizer``."""
    groups = given.get("param_groups") if isinstance(given, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise ValueError("checkpoint optimizer state must be an optimizer state_dict() with 'param_groups'")
    theirs = [len(g["params"]) for g in groups]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if theirs != mine:
        raise ValueError(f"checkpoint optimizer has param groups of sizes {theirs}, this optimizer {mine}")
