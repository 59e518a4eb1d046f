"""Running a module without leaving a trace on it: the one buffer, mode and RNG guard.

It sits in the lowest layer because both a pass (the forward check after conversion) and the
numerics stages (calibration, measurement, the emitted-model check) run models this way.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["preserved_state"]


def _rng_devices() -> list[int]:
    """The CUDA devices whose RNG state must be kept (only when CUDA is already initialised)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return [torch.cuda.current_device()]
    return []


@contextlib.contextmanager
def preserved_state(*modules: torch.nn.Module) -> Iterator[None]:
    """Run code on ``modules`` and leave no trace on them or on the global RNG.

    On exit (also after an exception): every buffer gets its value back (BatchNorm running
    statistics, counters), every submodule its train/eval flag, and the CPU RNG (and the current
    CUDA device's, when CUDA is initialised) its state. Parameters are not saved: the code in the
    block must not write them (calibration and measuring only read them).
    """
    saved = []
    for module in modules:
        buffers = {name: buf.detach().clone() for name, buf in module.named_buffers()}
        flags = {name: sub.training for name, sub in module.named_modules()}
        saved.append((module, buffers, flags))
    with torch.random.fork_rng(devices=_rng_devices()):
        try:
            yield
        finally:
            for module, buffers, flags in saved:
                with torch.no_grad():
                    for name, buf in module.named_buffers():
                        if name in buffers:
                            buf.copy_(buffers[name])
                for name, sub in module.named_modules():
                    if name in flags:
                        sub.training = flags[name]
