"""Dynamic loss scaling with ``torch.amp.GradScaler``'s API, plus the knobs large-model trainers use.

Why loss scaling exists: fp16 has a 5-bit exponent, so gradient values below about 6e-8 flush to
zero. Multiplying the loss by a large factor ``S`` before ``backward()`` multiplies every gradient
by ``S`` (the chain rule is linear), which lifts small gradients back into fp16's range. Before the
optimizer steps, the gradients are multiplied by ``1/S`` again ("unscaled") in fp32. When ``S`` is
too large some gradient overflows to inf/NaN: that step is skipped and ``S`` is reduced.

``LossScaler`` reproduces ``torch.amp.GradScaler`` exactly when used with its defaults and
``max_scale=None`` (the tests replay PyTorch's own GradScaler checks and a 300-step parity run),
and adds:

* ``hysteresis`` (DeepSpeed / Megatron semantics): an overflow first decrements a counter; the
  scale backs off only when the counter has run out. The counter is refilled when the scale grows
  (DeepSpeed's default ``consecutive_hysteresis=False``). Every overflow, absorbed or not,
  restarts the growth window, as in DeepSpeed where the window counts from the last overflow.
* ``min_scale``: a floor (GradScaler has none, pytorch#99640; DeepSpeed and Megatron use 1).
* ``max_scale``: a cap, so the scale never reaches inf and never grows into a range where the
  first overflow wastes many steps backing off.
* ``dynamic=False``: a static scale that never changes but still skips non-finite steps.
* ``sync_found_inf``: when ``torch.distributed`` is initialized, the inf/NaN flag is all-reduced
  (MAX) so every rank skips the same steps and replicas never diverge.

The scale lives in a 0-dim float32 tensor on the device of the first tensor it sees, so the
update needs no host synchronisation; the fused ATen kernels
(``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_``) are used on every
device that registers them (CPU and CUDA in torch 2.13), and equivalent tensor ops elsewhere.
"""
from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from converter.train.amp_kernels import (
    UNSCALE_OP,
    UPDATE_OP,
    has_kernel,
    inverse_scale,
    unscale_grads,
    unscale_groups,
    update_with_tensor_ops,
)

__all__ = ["LossScaler"]

_DISTRIBUTED = torch.distributed.is_available()

_STATE_KEYS = (
    "scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker",
    "hysteresis", "_hysteresis_left", "min_scale", "max_scale", "dynamic",
)
_CLOSURE_MESSAGE = (
    "Closure use is not currently supported if GradScaler is enabled. "
    "A closure re-evaluates the loss inside optimizer.step(), after the gradients were unscaled and "
    "checked for inf/NaN, so its gradients would be neither scaled nor checked. Call "
    "scaler.scale(loss).backward() yourself and then scaler.step(optimizer) without a closure."
)


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerRecord:
    """What the scaler knows about one optimizer between two ``update()`` calls."""

    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None


@overload
def _check_positive_finite(name: str, value: Any, *, allow_none: Literal[False] = False) -> float: ...
@overload
def _check_positive_finite(name: str, value: Any, *, allow_none: bool) -> float | None: ...
def _check_positive_finite(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    if not _FP32_TINY <= value <= _FP32_MAX:  # the scale and its bounds are held in fp32 tensors
        raise ValueError(f"{name} must lie in fp32's normal range [{_FP32_TINY:g}, {_FP32_MAX:g}] "
                         f"(it is held in fp32), got {value:g}")
    return value


#: the counters are held in int32 tensors
_INT32_MAX = 2**31 - 1
_FP32_TINY = float(torch.finfo(torch.float32).tiny)
_FP32_MAX = float(torch.finfo(torch.float32).max)


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > _INT32_MAX:
        raise ValueError(f"{name} must be <= {_INT32_MAX} (it is held in int32), got {value}")
    return value


def _check_growth_factor(value: Any) -> float:
    value = _check_positive_finite("growth_factor", value)
    if value <= 1.0:
        raise ValueError(f"The growth factor must be > 1.0, got {value}")
    return value


def _check_backoff_factor(value: Any) -> float:
    value = _check_positive_finite("backoff_factor", value)
    if value >= 1.0:
        raise ValueError(f"The backoff factor must be < 1.0, got {value}")
    return value


class LossScaler:
    """Loss scaler with ``torch.amp.GradScaler``'s methods and dynamics, plus hysteresis and bounds.

    Args (all keyword-only):
        init_scale: starting scale. 2**16 is GradScaler's and Apex's default: large enough that
            typical gradients are far from fp16's underflow, and a too-large start costs only a
            few skipped steps while it backs off.
        growth_factor: multiplier applied after ``growth_interval`` clean steps (2: power-of-two
            scales keep scaling and unscaling exact in binary floating point).
        backoff_factor: multiplier applied on overflow (0.5, for the same reason).
        growth_interval: clean steps between growths (2000, GradScaler's default: overflows are
            rare, and growing too eagerly skips a step each time the scale overshoots).
        hysteresis: overflows tolerated before backing off (1 = back off on every overflow, which
            is GradScaler's behaviour; DeepSpeed and Megatron use 2 for very large models whose
            rare spikes should not halve the scale).
        min_scale: floor for the scale (None = no floor, as in GradScaler; set 1.0 to follow
            DeepSpeed/Megatron and keep a run of bad steps from collapsing the scale).
        max_scale: cap for the scale (2**24, Apex's ``max_loss_scale``: beyond it fp32 loss
            values risk losing low-order bits and growth buys nothing). None means no cap;
            growth is then kept only while the result is finite, exactly as GradScaler.
        enabled: False makes every method a pass-through and ``get_scale()`` return 1.0, so the
            same training loop runs in fp32 or bf16 unchanged.
        dynamic: False keeps ``init_scale`` fixed (a static loss scale); non-finite steps are
            still skipped, because stepping on inf/NaN gradients would destroy the weights.
        sync_found_inf: all-reduce the inf/NaN flag (MAX) over the default process group when
            ``torch.distributed`` is initialized, so every rank skips together. True by default:
            one scalar all-reduce per step is cheap and a rank-local skip silently desynchronises
            replicas. The flag lives on the scale's device, which must suit the backend
            (CPU for gloo, CUDA for NCCL).
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        enabled: bool = True,
        dynamic: bool = True,
        sync_found_inf: bool = True,
    ) -> None:
        for name, flag in (("enabled", enabled), ("dynamic", dynamic), ("sync_found_inf", sync_found_inf)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self._enabled = enabled
        self._dynamic = dynamic
        self._sync_found_inf = sync_found_inf
        self._growth_factor = _check_growth_factor(growth_factor)
        self._backoff_factor = _check_backoff_factor(backoff_factor)
        self._growth_interval = _check_int("growth_interval", growth_interval, minimum=1)
        self._hysteresis = _check_int("hysteresis", hysteresis, minimum=1)
        self._min_scale = _check_positive_finite("min_scale", min_scale, allow_none=True)
        self._max_scale = _check_positive_finite("max_scale", max_scale, allow_none=True)
        self._check_bounds(_check_positive_finite("init_scale", init_scale), "init_scale")
        self._init_scale = float(init_scale)
        self._init_growth_tracker = 0
        self._init_hysteresis_left = self._hysteresis
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None
        self._records: dict[int, _OptimizerRecord] = defaultdict(_OptimizerRecord)
        self._changes = 0  # see _version
        self._update_kernel = False  # _amp_update_scale_ was found for the scale's device

    # ------------------------------------------------------------------ helpers
    def _check_bounds(self, value: float, what: str) -> None:
        if self._min_scale is not None and self._max_scale is not None and self._min_scale > self._max_scale:
            raise ValueError(f"min_scale ({self._min_scale}) must be <= max_scale ({self._max_scale})")
        if self._min_scale is not None and value < self._min_scale:
            raise ValueError(f"{what} ({value}) is below min_scale ({self._min_scale})")
        if self._max_scale is not None and value > self._max_scale:
            raise ValueError(
                f"{what} ({value}) is above max_scale ({self._max_scale}); pass max_scale=None for no cap"
            )

    def _lazy_init(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
            self._hysteresis_left = torch.full((), self._init_hysteresis_left, dtype=torch.int32, device=device)
        return self._scale

    def _first_grad_device(self, optimizer: torch.optim.Optimizer) -> torch.device:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    return param.grad.device
        return torch.device("cpu")

    # ------------------------------------------------------------------ GradScaler API
    def is_enabled(self) -> bool:
        """Whether scaling is on (False: every method is a pass-through)."""
        return self._enabled

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor, or a (nested) list/tuple of tensors, by the current scale.

        The scale is a float32 0-dim tensor, so a 0-dim fp16 loss is promoted to fp32 and the
        scaled loss itself cannot overflow.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            scale = self._lazy_init(outputs.device)
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                scale = self._lazy_init(value.device)
                if value.device not in per_device:
                    per_device[value.device] = scale.to(device=value.device, non_blocking=True)
                return value * per_device[value.device]
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict)):
                return map(apply, value)
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record whether any is inf/NaN.

        At most once per optimizer between two ``update()`` calls, and never after ``step()``.
        ``1/scale`` is computed in double and rounded to float32 once, as GradScaler does.
        """
        if not self._enabled:
            return
        self._unscale(optimizer)

    def _unscale(self, optimizer: torch.optim.Optimizer, buffers: list[torch.Tensor] | None = None, *,
                 found_inf: torch.Tensor | None = None) -> torch.Tensor:
        """``unscale_`` that returns the found-inf flag (0-dim float32 on the scale's device) without reading it.

        ``buffers``: dense fp32 tensors that hold exactly ``optimizer``'s gradients, as views (the O2
        trainer's gradient arena): they are unscaled and checked with one fused kernel per buffer
        instead of collecting and grouping every ``.grad``. ``found_inf``: a 0-dim float32 tensor the
        flag is written to (the trainer's readout buffer, read with its other per-step scalars in one
        copy to the host); used as the flag itself when it is on the scale's device. The record is
        the one ``unscale_`` keeps, so ``step``/``update`` behave the same either way. Nothing here
        synchronises with the device.
        """
        record = self._ready_record(optimizer)
        scale = self._scale
        if scale is None:
            scale = self._lazy_init(buffers[0].device if buffers else self._first_grad_device(optimizer))
        inv_scale = inverse_scale(scale)
        out = found_inf
        device = scale.device
        distributed = self._sync_found_inf and _DISTRIBUTED and torch.distributed.is_initialized()
        if out is not None and not distributed and out.device == device:
            found_inf = out.zero_()
        else:  # a collective gets a tensor of its own, not a view into the caller's buffer
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        if buffers is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            unscale_grads(params, inv_scale=inv_scale, found_inf=found_inf, allow_fp16=False)
        elif len(buffers) == 1 and buffers[0].device == device and has_kernel(UNSCALE_OP, device):
            # the O2 arena on the scale's device: one kernel, nothing to group
            torch._amp_foreach_non_finite_check_and_unscale_(buffers, found_inf, inv_scale)
        else:
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            for buffer in buffers:
                groups[(buffer.device, buffer.dtype)].append(buffer)
            unscale_groups(groups.items(), inv_scale=inv_scale, found_inf=found_inf)
        if distributed:
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        if out is not None and out is not found_inf:
            out.copy_(found_inf)
        record.found_inf = found_inf
        record.stage = _Stage.UNSCALED
        return found_inf

    def _ready_record(self, optimizer: torch.optim.Optimizer) -> _OptimizerRecord:
        """``optimizer``'s record, which must not have been unscaled or stepped since the last ``update()``."""
        record = self._records[id(optimizer)]
        if record.stage is not _Stage.READY:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()."
                               if record.stage is _Stage.UNSCALED else "unscale_() is being called after step().")
        return record

    def _unscale_placed(self, optimizer: torch.optim.Optimizer, buffers: list[torch.Tensor],
                        found_inf: torch.Tensor) -> None:
        """:meth:`_unscale` for a caller that keeps its gradient buffers and flag where the fused kernel runs and
        checked that once (the O2 trainer's arena and readout): dense fp32 ``buffers`` and the 0-dim fp32
        ``found_inf`` on the scale's device (made already), which has the kernel. The same record, checks and
        kernel, without looking at devices or grouping again; with a process group (a collective) it is
        :meth:`_unscale`."""
        if self._sync_found_inf and _DISTRIBUTED and torch.distributed.is_initialized():
            self._unscale(optimizer, buffers, found_inf=found_inf)
            return
        record = self._ready_record(optimizer)
        assert self._scale is not None  # _ready_record made it
        torch._amp_foreach_non_finite_check_and_unscale_(buffers, found_inf.zero_(), inverse_scale(self._scale))
        record.found_inf = found_inf
        record.stage = _Stage.UNSCALED

    def _scale_tensor(self) -> torch.Tensor | None:
        """The live 0-dim scale tensor (None before first use or when disabled); read it without a sync."""
        return self._scale if self._enabled else None

    @property
    def _version(self) -> int:
        """Bumped by everything that may change the scale (``update``, ``update(new_scale)``, a loaded state):
        a caller that knows the scale's value at one version knows it as long as the version holds."""
        return self._changes

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``unscale_`` (if not done yet), then ``optimizer.step(*args, **kwargs)`` unless inf/NaN was found.

        Returns what ``optimizer.step`` returned, or None when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(_CLOSURE_MESSAGE)
        record = self._records[id(optimizer)]
        if record.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if record.stage is _Stage.READY:
            self.unscale_(optimizer)
        result = None
        assert record.found_inf is not None  # unscale_ recorded it
        if not bool(record.found_inf.item()):
            result = optimizer.step(*args, **kwargs)
        record.stage = _Stage.STEPPED
        return result

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the last ``unscale_`` of ``optimizer`` (since the last ``update()``) saw inf/NaN.

        Not in GradScaler's API; the trainer uses it to count skipped steps. Synchronises with
        the device. False when scaling is disabled or the optimizer was not unscaled yet.
        """
        if not self._enabled:
            return False
        record = self._records.get(id(optimizer))
        if record is None or record.found_inf is None:
            return False
        return bool(record.found_inf.item())

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off after an overflow (subject to hysteresis), grow after ``growth_interval`` clean steps.

        Call once per iteration, after ``step()`` for every optimizer. ``new_scale`` sets the
        scale directly instead (a float, or a 1-element float tensor without grad).
        """
        self._update(new_scale)

    def _update(self, new_scale: float | torch.Tensor | None = None, *, known: tuple[bool, float] | None = None) -> None:
        """``update``; ``known``: (whether the one recorded flag is set, the scale now) as the caller read them from
        the device, so that the bounds' clamp runs only when this update can cross a bound (``_may_leave_bounds``)."""
        if not self._enabled:
            return
        self._changes += 1
        if new_scale is not None:
            self._set_scale(new_scale)
        else:
            records = self._records
            if len(records) == 1:  # one optimizer (the trainer's case): its flag, as _unscale left it
                (record,) = records.values()
                found_inf, single = record.found_inf, True
            else:  # every flag is on the scale's device (_unscale makes it there)
                flags = [r.found_inf for r in records.values() if r.found_inf is not None]
                found_inf, single = (sum(flags[1:], flags[0]) if flags else None), len(flags) == 1
            if found_inf is None:
                raise RuntimeError("No inf checks were recorded prior to update.")
            if self._dynamic:  # ``known`` describes one optimizer's flag: with several, the clamp decides itself
                self._update_dynamic(found_inf, known if single else None)
        self._records.clear()

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
                raise ValueError("new_scale should be a float or a 1-element float tensor with requires_grad=False.")
            scale = self._lazy_init(new_scale.device)
            scale.copy_(new_scale.reshape(()))
            return
        value = _check_positive_finite("new_scale", new_scale)
        self._check_bounds(value, "new_scale")
        if self._scale is None:
            self._init_scale = value
        else:
            self._scale.fill_(value)

    def _may_leave_bounds(self, known: tuple[bool, float] | None) -> bool:
        """Whether ``_amp_update_scale_`` can take the scale outside [min_scale, max_scale] (True when unknown).

        The kernel either keeps the scale, multiplies it by the growth factor (no inf found) or by the
        backoff factor (inf found), each product formed in double and rounded to fp32. Rounding to the
        nearest fp32 is monotone and the bounds are fp32 values, so comparing the double products with
        the bounds decides it exactly: ``scale * growth <= max_scale`` means the grown scale is too.
        """
        if known is None:
            return self._min_scale is not None or self._max_scale is not None
        found, scale = known
        high = scale if found else scale * self._growth_factor
        low = scale * self._backoff_factor if found else scale
        return (self._max_scale is not None and high > self._max_scale) or (
            self._min_scale is not None and low < self._min_scale)

    def _update_dynamic(self, found_inf: torch.Tensor, known: tuple[bool, float] | None = None) -> None:
        scale, tracker, left = self._scale, self._growth_tracker, self._hysteresis_left
        assert scale is not None and tracker is not None and left is not None  # made together by _lazy_init
        if self._hysteresis == 1 and (self._update_kernel or has_kernel(UPDATE_OP, scale.device)):
            self._update_kernel = True  # found once, registered for good (the scale never changes device)
            torch._amp_update_scale_(
                scale, tracker, found_inf, self._growth_factor, self._backoff_factor, self._growth_interval
            )
            if self._may_leave_bounds(known):
                scale.clamp_(min=self._min_scale, max=self._max_scale)
            return
        update_with_tensor_ops(
            scale=scale,
            growth_tracker=tracker,
            hysteresis_left=left,
            found_inf=found_inf,
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            growth_interval=self._growth_interval,
            hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
        )

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Synchronises with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = _check_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = _check_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = _check_int("growth_interval", new_interval, minimum=1)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def _get_hysteresis_left(self) -> int:
        return self._init_hysteresis_left if self._hysteresis_left is None else int(self._hysteresis_left.item())

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's five keys plus ``hysteresis``, ``_hysteresis_left``, ``min_scale``, ``max_scale``, ``dynamic``.

        Empty when disabled, like GradScaler. Holds only Python scalars, so it loads with
        ``torch.load(weights_only=True)``.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": self._hysteresis,
            "_hysteresis_left": self._get_hysteresis_left(),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "dynamic": self._dynamic,
        }

    def check_state_dict(self, state_dict: Any) -> dict[str, Any]:
        """Validate a dict from ``state_dict()`` (or a ``GradScaler``'s) without changing anything.

        Returns the values ``load_state_dict`` would apply; raises ``ValueError``/``TypeError``
        naming the first bad key. Keys this class does not save keep their current values.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"a LossScaler state dict must be a dict, got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler or LossScaler."
            )
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
                   if k not in state_dict]
        if missing:
            raise ValueError(f"LossScaler state dict is missing keys {missing}; got keys {sorted(state_dict)}")
        unknown = sorted(set(state_dict) - set(_STATE_KEYS))
        if unknown:
            raise ValueError(f"LossScaler state dict has unknown keys {unknown}; expected a subset of {_STATE_KEYS}")
        values: dict[str, Any] = {
            "min_scale": _check_positive_finite("min_scale", state_dict.get("min_scale", self._min_scale),
                                                allow_none=True),
            "max_scale": _check_positive_finite("max_scale", state_dict.get("max_scale", self._max_scale),
                                                allow_none=True),
            "hysteresis": _check_int("hysteresis", state_dict.get("hysteresis", self._hysteresis), minimum=1),
            "dynamic": state_dict.get("dynamic", self._dynamic),
            "scale": _check_positive_finite("scale", state_dict["scale"]),
            "growth_factor": _check_growth_factor(state_dict["growth_factor"]),
            "backoff_factor": _check_backoff_factor(state_dict["backoff_factor"]),
            "growth_interval": _check_int("growth_interval", state_dict["growth_interval"], minimum=1),
            "_growth_tracker": _check_int("_growth_tracker", state_dict["_growth_tracker"], minimum=0),
        }
        if not isinstance(values["dynamic"], bool):
            raise TypeError(f"dynamic must be a bool, got {type(values['dynamic']).__name__}")
        values["_hysteresis_left"] = _check_int(
            "_hysteresis_left", state_dict.get("_hysteresis_left", values["hysteresis"]), minimum=1
        )
        low, high, scale = values["min_scale"], values["max_scale"], values["scale"]
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_scale ({low}) must be <= max_scale ({high})")
        if (low is not None and scale < low) or (high is not None and scale > high):
            raise ValueError(f"scale ({scale}) is outside [min_scale, max_scale] = [{low}, {high}]")
        return values

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from ``state_dict()`` (or from a ``GradScaler``: our extra keys then keep their values).

        All or nothing: the whole dict is validated first (:meth:`check_state_dict`), so a bad
        dict raises and leaves the scaler exactly as it was.
        """
        if not self._enabled:
            return
        values = self.check_state_dict(state_dict)
        self._changes += 1
        self._min_scale, self._max_scale = values["min_scale"], values["max_scale"]
        self._hysteresis, self._dynamic = values["hysteresis"], values["dynamic"]
        self._growth_factor, self._backoff_factor = values["growth_factor"], values["backoff_factor"]
        self._growth_interval = values["growth_interval"]
        self._init_scale = values["scale"]
        self._init_growth_tracker = values["_growth_tracker"]
        self._init_hysteresis_left = values["_hysteresis_left"]
        if self._scale is not None and self._growth_tracker is not None and self._hysteresis_left is not None:
            self._scale.fill_(values["scale"])
            self._growth_tracker.fill_(values["_growth_tracker"])
            self._hysteresis_left.fill_(values["_hysteresis_left"])

    def __repr__(self) -> str:
        return (
            f"LossScaler(scale={self.get_scale()}, growth_factor={self._growth_factor}, "
            f"backoff_factor={self._backoff_factor}, growth_interval={self._growth_interval}, "
            f"hysteresis={self._hysteresis}, min_scale={self._min_scale}, max_scale={self._max_scale}, "
            f"enabled={self._enabled}, dynamic={self._dynamic})"
        )
