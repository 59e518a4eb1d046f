"""What the trainer counts and guards: its per-step counters, the spike guard, the stalled-training error.

:class:`TrainStats` is what ``MixedPrecisionTrainer.stats`` returns and what its checkpoints save;
:class:`SpikeGuard` configures the skip of a step whose gradient norm spikes; :class:`TrainingStalledError`
is raised when too many steps in a row were skipped. :func:`check_stats` validates a checkpoint's counters.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError

__all__ = ["SpikeGuard", "TrainStats", "TrainingStalledError", "check_stats"]


class TrainingStalledError(MpconvertError, RuntimeError):
    """Raised when ``max_consecutive_skips`` optimizer steps in a row were skipped (exit status 1: a check failed)."""

    exit_code = EXIT_CHECK_FAILED


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpikeGuard:
    """Skip a step whose unscaled gradient norm exceeds ``factor`` × the median of recent norms.

    GLM-130B's observation: loss blow-ups are often preceded by a gradient-norm spike, and
    skipping that batch avoids them. The median is over the last ``window`` finite gradient norms
    (skipped spikes included, so a lasting change of scale is accepted once it fills half the
    window); the guard only acts once ``min_history`` norms were seen.
    """

    factor: float = 10.0
    window: int = 100
    min_history: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
                or not math.isfinite(self.factor) or self.factor <= 1.0:
            raise ValueError(f"SpikeGuard.factor must be a finite number > 1, got {self.factor!r}")
        for name in ("window", "min_history"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SpikeGuard.{name} must be an int >= 1, got {value!r}")
        if self.min_history > self.window:
            raise ValueError(f"SpikeGuard.min_history ({self.min_history}) must be <= window ({self.window})")


@dataclasses.dataclass
class TrainStats:
    """Counters of a :class:`MixedPrecisionTrainer`, updated once per real (non-accumulation) step.

    Read them through ``trainer.stats``: that property fills in the values the step leaves to be read
    lazily (``scale``, ``overflows``, ``loss`` and, when nothing in the step needed it, ``grad_norm``),
    so that the step itself synchronises with the device only once.

    Attributes:
        scale: the loss scale after the step's update (1.0 without a scaler).
        steps: optimizer steps taken.
        skipped: optimizer steps skipped because the unscaled gradients held inf or NaN.
        spike_skips: optimizer steps skipped by the :class:`SpikeGuard` (finite but spiking norm).
        consecutive_skips: skipped steps (either kind) since the last real optimizer step.
        overflows: times the loss scale was reduced. Equal to ``skipped`` with the default
            hysteresis of 1; smaller with hysteresis, a static scale, or at ``min_scale``.
        grad_norm: total 2-norm of the unscaled gradients before clipping; inf on a skipped step;
            None before the first step. Computed in the step when the step needs it (``max_grad_norm``,
            ``spike_guard``, FSDP, a ``callback``, bf16 under O2 where it is the non-finite check);
            otherwise when ``stats`` is first read after the step, from the gradients the step left,
            exactly as it would have been; None if by then they were changed or freed (the next
            ``backward``, or ``zero_grad`` under O1). Pass a ``callback`` (it gets every step's stats)
            to have it on every step.
        loss: mean of the (unscaled) losses passed to ``backward()`` during the step's
            accumulation window; None before the first step.
    """

    scale: float = 1.0
    steps: int = 0
    skipped: int = 0
    spike_skips: int = 0
    consecutive_skips: int = 0
    overflows: int = 0
    grad_norm: float | None = None
    loss: float | None = None



def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_stats(stats: Any) -> TrainStats:
    """A checkpoint's counters as :class:`TrainStats`: a dict with keys from its fields, counters ints in range and
    the scale a finite positive number (string counters broke ``step()`` later); ValueError otherwise."""
    fields = {f.name for f in dataclasses.fields(TrainStats)}
    if not isinstance(stats, dict) or not set(stats) <= fields:
        raise ValueError(f"checkpoint stats must be a dict with keys from {sorted(fields)}, got {stats!r}")
    for name, value in stats.items():
        if name in ("grad_norm", "loss"):
            ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        elif name == "scale":
            ok = _finite_number(value) and value > 0
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
        if not ok:
            raise ValueError(f"checkpoint stats has {name}={value!r}, which is not a valid value; nothing was loaded")
    return TrainStats(**stats)
