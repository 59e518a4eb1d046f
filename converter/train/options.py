"""The trainer's arguments, checked all at once before anything is changed, and the optimizer options they set.

:func:`check_options` validates every scalar argument of ``MixedPrecisionTrainer`` and returns them as one
frozen :class:`TrainerOptions`; :func:`resolve_scaler` turns ``loss_scale``/``scaler`` into the
:class:`~converter.train.scaler.LossScaler` the trainer uses. Neither touches the user's model or
optimizer. :func:`enable_foreach` and :func:`enable_fused` are the two that do (the last step of building
a trainer).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from converter.ir.meta import name_of
from converter.ir.precision import run_dtype
from converter.train.scaler import LossScaler
from converter.train.stats import SpikeGuard, TrainStats
from converter.vocab import DEVICES

__all__ = ["DEFAULT_MAX_CONSECUTIVE_SKIPS", "TrainerOptions", "check_options", "enable_foreach", "enable_fused",
           "resolve_scaler"]

#: ``max_consecutive_skips``'s default: from the default cap of 2**24 a dynamic scale reaches 1 in 24 overflows
DEFAULT_MAX_CONSECUTIVE_SKIPS = 100
_DEFAULT_MIN_SCALE = 1.0  # the trainer's dynamic scaler never goes below 1 (DeepSpeed, Megatron)
_BF16_NO_SCALER = (
    "bf16 has the same 8-bit exponent range as fp32, so gradients do not underflow and loss scaling "
    "is unnecessary; pass precision='fp16' to use a loss scaler, or drop the {what} for bf16."
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerOptions:
    """``MixedPrecisionTrainer``'s arguments once checked (see its docstring for each)."""

    half: torch.dtype  # torch.float16 or torch.bfloat16
    master_weights: bool
    max_grad_norm: float | None
    accumulation_steps: int
    callback: Callable[[TrainStats], Any] | None
    max_consecutive_skips: int | None
    spike_guard: SpikeGuard | None
    embedding_grad_shrink: float | None
    optimizer_foreach: bool
    optimizer_fused: bool

    @property
    def precision(self) -> str:
        """``"fp16"`` or ``"bf16"`` (the name a checkpoint records)."""
        return name_of(self.half)


def _check_optional_count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value


def check_options(*, precision: str, master_weights: Any, max_grad_norm: Any, accumulation_steps: Any, callback: Any,
                  embedding_grad_shrink: Any, max_consecutive_skips: Any, spike_guard: Any, optimizer_foreach: Any,
                  optimizer_fused: Any) -> TrainerOptions:
    """Every scalar argument checked (TypeError/ValueError naming it); nothing is changed."""
    # a conversion target, as convert and the Lightning plugin take it: "fp8" trains as its bf16 (the fp8 GEMMs are
    # the graph's own, no tensor is stored in fp8); PrecisionError (a ValueError) names the accepted spellings
    half = run_dtype(precision)
    if not isinstance(master_weights, bool):
        raise TypeError(f"master_weights must be a bool, got {type(master_weights).__name__}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
            raise TypeError(f"max_grad_norm must be a float or None, got {type(max_grad_norm).__name__}")
        if not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}")
    if callback is not None and not callable(callback):
        raise TypeError("callback must be callable or None")
    if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
        raise TypeError(f"spike_guard must be a SpikeGuard or None, got {type(spike_guard).__name__}")
    max_consecutive_skips = _check_optional_count("max_consecutive_skips", max_consecutive_skips)
    alpha = embedding_grad_shrink
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0):
        raise ValueError(f"embedding_grad_shrink must be a float in (0, 1], got {alpha!r}")
    for name, flag in (("optimizer_foreach", optimizer_foreach), ("optimizer_fused", optimizer_fused)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return TrainerOptions(
        half=half, master_weights=master_weights, max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
        accumulation_steps=accumulation_steps, callback=callback, max_consecutive_skips=max_consecutive_skips,
        spike_guard=spike_guard, embedding_grad_shrink=None if alpha is None else float(alpha),
        optimizer_foreach=optimizer_foreach, optimizer_fused=optimizer_fused,
    )


def resolve_scaler(half: torch.dtype, loss_scale: Any, scaler: Any) -> LossScaler | None:
    """The loss scaler for ``loss_scale``/``scaler`` (None for bf16, which needs none); a new one unless given."""
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler must be a LossScaler, got {type(scaler).__name__}")
    if half == torch.bfloat16:
        if scaler is not None:
            raise ValueError(_BF16_NO_SCALER.format(what="scaler"))
        if loss_scale not in (None, "dynamic"):
            raise ValueError(_BF16_NO_SCALER.format(what=f"loss_scale={loss_scale!r}"))
        return None
    if scaler is not None:
        if loss_scale != "dynamic":
            raise ValueError("pass either scaler= or loss_scale=, not both")
        return scaler
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if loss_scale == "dynamic":
        return LossScaler(min_scale=_DEFAULT_MIN_SCALE)
    if loss_scale is None:
        return LossScaler(init_scale=1.0, dynamic=False, max_scale=None)
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if not math.isfinite(loss_scale) or loss_scale <= 0:
            raise ValueError(f"a static loss_scale must be a finite number > 0, got {loss_scale}")
        return LossScaler(init_scale=float(loss_scale), dynamic=False, max_scale=None)
    raise ValueError(f"loss_scale must be 'dynamic', a float, a LossScaler or None, got {loss_scale!r}")


def enable_foreach(optimizer: torch.optim.Optimizer) -> int:
    """``foreach=True`` on every param group that left it to torch's default; returns how many."""
    if "foreach" not in optimizer.defaults:
        return 0
    count = 0
    for group in optimizer.param_groups:
        if group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True
            count += 1
    return count


#: torch optimizers whose ``fused=True`` path exists on CPU and CUDA in torch 2.4 and later
_FUSED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_FUSED_DEVICE_TYPES = DEVICES  # the devices mpconvert supports: both have fused kernels


def enable_fused(optimizer: torch.optim.Optimizer) -> int:
    """``fused=True`` on every param group of an SGD/Adam/AdamW that left ``foreach`` and ``fused`` to torch's
    default, holds only floating-point params on CPU or CUDA and has no optimizer state yet; returns how many.

    Fused kernels do the whole update in one pass per tensor: SGD with momentum on the
    trainer-step benchmark's encoder takes 0.30 ms instead of foreach's 0.48 ms on this CPU, AdamW
    0.55 instead of 3.3 ms (thread CPU time, warm, 265k parameters in 24 tensors). They round
    differently in the last bit (measured: SGD with momentum, Adam, AdamW differ from the foreach
    and per-parameter paths by 1-2 ulp after 20 steps; foreach matches per-parameter exactly), which
    is why this is opt-in. A group with state is left alone: Adam's fused kernel wants its ``step``
    counters on the parameters' device, and existing ones are on the CPU.
    """
    if type(optimizer) not in _FUSED_OPTIMIZERS:
        return 0
    count = 0
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
            continue
        params = group["params"]
        if not params or any(not p.is_floating_point() or p.device.type not in _FUSED_DEVICE_TYPES
                             or optimizer.state.get(p) for p in params):
            continue
        group["fused"] = True
        count += 1
    return count


