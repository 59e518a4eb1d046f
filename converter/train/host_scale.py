"""The loss scale as the trainer's host side knows it, so that a step reads the device only once.

The scale lives in a device tensor (:class:`~converter.train.scaler.LossScaler`) and changes in the
step's last op (the update). Reading it after the update would be a second host synchronisation per
step; instead the update's result is copied into the trainer's readout buffer and read with the next
step's one copy (or when ``trainer.stats`` is read). :class:`HostScale` keeps the bookkeeping of that:
the scale the current step unscaled with, whether it found inf/NaN, the scale whose updated value is
still pending on the device, and the last value read with the scaler's version it is valid for.
"""
from __future__ import annotations

import torch

from converter.train.scaler import LossScaler
from converter.train.stats import TrainStats

__all__ = ["HostScale"]


class HostScale:
    """The host's knowledge of an enabled loss scaler's scale (only a trainer that scales has one).

    Attributes:
        step_scale: the scale the current step unscaled with (set by :meth:`begin_step`).
        step_found: whether the scaler found inf/NaN this step (what its update backs off on).
        pending: the scale the last step used, while the scale after its update is unread (None once read).
    """

    def __init__(self, scaler: LossScaler, scale: float) -> None:
        self._scaler = scaler
        self.step_scale: float | None = None
        self.step_found = False
        self.pending: float | None = None
        # the scale's value as the host last read it, valid while the scaler's _version is _seen_version
        self._seen: float | None = scale
        self._seen_version = scaler._version
        self._version_after_update = 0

    def current(self) -> float:
        """The live scale as a float: known on the host from the last read of the updated value unless something
        changed the scale since (the scaler's version moved: a synchronising read then)."""
        seen = self._seen
        if self._scaler._version != self._seen_version or seen is None:
            seen = self._seen = self._scaler.get_scale()
            self._seen_version = self._scaler._version
        return seen

    def begin_step(self, found: bool) -> float:
        """Record this step's scale and the scaler's found-inf flag (read in the step's sync); returns the scale."""
        self.step_scale = self.current()
        self.step_found = found
        return self.step_scale

    def update(self, after: torch.Tensor) -> None:
        """Update the scale (the host read this step's flag and knows the scale: the bounds' clamp only runs when
        needed) and copy its new value into ``after``, the readout slot the next read settles from."""
        scaler, step_scale, scale = self._scaler, self.step_scale, self._scaler._scale
        assert step_scale is not None and scale is not None  # after begin_step, of a scaler that scales
        scaler._update(known=(self.step_found, step_scale))
        after.copy_(scale)  # (enabled: a HostScale exists only for a scaler that scales)
        self.pending = self.step_scale
        self._version_after_update = scaler._version

    def settle(self, after: float, stats: TrainStats) -> None:
        """The last step's scale after its update is known: set ``stats.scale`` and count an overflow."""
        stats.scale = after
        stats.overflows += int(self.pending is not None and after < self.pending)
        self.pending = None
        self._seen, self._seen_version = after, self._version_after_update

    def forget(self) -> None:
        """A checkpoint was loaded: nothing pending, and the scale is read again at the next step."""
        self.pending = None
        self._seen = None
