"""The device a conversion chooses kernels for, as one explicit record: :class:`DeviceProfile`.

A conversion for the CPU (``convert(device="cpu")``) and a portable one choose some kernels from how fast
the machine's half GEMMs are (:mod:`converter.passes.cpu_gemm`, :mod:`converter.passes.dispatch`), and the
slow-half advice (:mod:`converter.numerics.device`) reads the same figures. Those figures are this record:
the CPU, the torch version, and the seconds of one 128x128 matmul per dtype (best of 5, one thread), plus the
CUDA device's name and compute capability where there is one. Nothing else decides: no environment variable,
no disk cache. ``ConvertOptions.device_profile`` says which profile a conversion uses:

* ``"auto"`` (default): measured in this process, once (:func:`measured_once`, a few milliseconds);
* a :class:`DeviceProfile`, or the path of a file :meth:`DeviceProfile.save` wrote (``mpconvert profile -o
  FILE``): those figures, wherever the conversion runs (a build machine converting for another one; two runs
  that must give the same graph);
* None (CLI ``none``): no measurement, fixed conservative choices: native half GEMMs, no advice.

report.json records the profile used (``device_profile``: :meth:`DeviceProfile.to_dict`, or null).

This module imports no torch at import time (options are built without it); :meth:`DeviceProfile.measure`
imports it.
"""
from __future__ import annotations

import functools
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from converter.ir.errors import MpconvertError
from converter.vocab import FLOAT_PRECISIONS, HALF_PRECISIONS

__all__ = ["DeviceProfile", "DeviceProfileError", "PROFILE_FORMAT", "DTYPES", "measured_once", "resolve_profile", "coerce_profile"]

#: the ``format`` of a saved profile; another number is refused
PROFILE_FORMAT = 1
#: the dtypes a profile times, by name
DTYPES = FLOAT_PRECISIONS
_KEYS = frozenset({"format", "cpu", "cores", "torch_version", "matmul_seconds", "cuda_device", "cuda_capability",
                   "gemm_crossover_flops"})
#: keys a saved profile may lack (profiles saved before the crossover was measured have no gemm_crossover_flops)
_OPTIONAL_KEYS = frozenset({"cuda_device", "cuda_capability", "gemm_crossover_flops"})


class DeviceProfileError(MpconvertError, ValueError):
    """A device profile (a file or a mapping) that is not one :meth:`DeviceProfile.save` writes; one line."""


@dataclass(frozen=True)
class DeviceProfile:
    """The figures a conversion's kernel choices and device advice read (module docstring).

    ``matmul_seconds``: (dtype name, seconds of one 128x128 matmul on the CPU, one thread) for each of
    :data:`DTYPES`; ``cuda_device``/``cuda_capability``: the CUDA device the model would train on, or None;
    ``gemm_crossover_flops``: (half dtype name, the GEMM size from which the upcast kernels beat the native half
    linear, forward and backward, or None where they never do: :func:`converter.kernels.upcast.gemm_crossover_flops`);
    empty in a profile saved without it (:data:`~converter.kernels.upcast.DEFAULT_MIN_GEMM_FLOPS` then applies)."""

    cpu: str
    cores: int
    torch_version: str
    matmul_seconds: tuple[tuple[str, float], ...]
    cuda_device: Optional[str] = None
    cuda_capability: Optional[tuple[int, int]] = None
    gemm_crossover_flops: tuple[tuple[str, Optional[int]], ...] = ()

    def __post_init__(self) -> None:  # one order (DTYPES'), whatever order the figures were given in
        order: dict[str, int] = {name: index for index, name in enumerate(DTYPES)}
        ordered = tuple(sorted(self.matmul_seconds, key=lambda pair: order.get(pair[0], len(order))))
        object.__setattr__(self, "matmul_seconds", ordered)
        halves: dict[str, int] = {name: index for index, name in enumerate(HALF_PRECISIONS)}
        crossover = tuple(sorted(self.gemm_crossover_flops, key=lambda pair: halves.get(pair[0], len(halves))))
        object.__setattr__(self, "gemm_crossover_flops", crossover)

    def seconds(self, dtype: str) -> float:
        """The measured seconds of the matmul in ``dtype`` (``fp32``, ``bf16``, ``fp16``)."""
        return dict(self.matmul_seconds)[dtype]

    def slowdown(self, precision: str) -> Optional[float]:
        """This CPU's ``precision`` (fp16/bf16) matmul time over its fp32 matmul time; None for another name."""
        if precision not in HALF_PRECISIONS:
            return None
        return self.seconds(precision) / self.seconds("fp32")

    def min_gemm_flops(self, precision: str) -> Optional[int]:
        """The measured GEMM size from which ``precision``'s upcast kernels pay on this CPU; None where the profile
        does not say (saved without it) or they never do."""
        return dict(self.gemm_crossover_flops).get(precision)

    @classmethod
    def measure(cls) -> "DeviceProfile":
        """This machine's profile, measured now in this process (no cache; a few milliseconds, and up to a second
        where the half GEMM is the slow one and the upcast kernels' crossover is measured)."""
        import torch

        from converter.ir.meta import DTYPES as TORCH_DTYPES
        from converter.kernels.upcast import MIN_SLOWDOWN, gemm_crossover_flops, matmul_seconds

        seconds = tuple((name, float(matmul_seconds(TORCH_DTYPES[name]))) for name in DTYPES)
        # the crossover only matters where the half GEMM is the slower one: measured there, None (never) elsewhere
        fp32 = dict(seconds)["fp32"]
        slow = {name: value >= MIN_SLOWDOWN * fp32 for name, value in seconds if name in HALF_PRECISIONS}
        crossover = tuple((name, gemm_crossover_flops(TORCH_DTYPES[name]) if slow[name] else None)
                          for name in HALF_PRECISIONS)
        device = capability = None
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name()
            major, minor = torch.cuda.get_device_capability()
            capability = (int(major), int(minor))
        return cls(cpu=_cpu_model(), cores=os.cpu_count() or 1, torch_version=str(torch.__version__),
                   matmul_seconds=seconds, cuda_device=device, cuda_capability=capability,
                   gemm_crossover_flops=crossover)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (a saved profile, report.json's ``device_profile``)."""
        return {"format": PROFILE_FORMAT, "cpu": self.cpu, "cores": self.cores, "torch_version": self.torch_version,
                "matmul_seconds": dict(self.matmul_seconds), "cuda_device": self.cuda_device,
                "cuda_capability": list(self.cuda_capability) if self.cuda_capability is not None else None,
                "gemm_crossover_flops": dict(self.gemm_crossover_flops)}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "the device profile") -> "DeviceProfile":
        """The profile :meth:`to_dict` wrote; anything else is a :class:`DeviceProfileError` naming ``source``."""
        def bad(what: str) -> DeviceProfileError:
            return DeviceProfileError(f"{source}: {what}; write one with `mpconvert profile -o FILE` "
                                      "(DeviceProfile.measure().save(path))")

        if not isinstance(data, Mapping):
            raise bad(f"expected a JSON object, got {type(data).__name__}")
        unknown, missing = sorted(set(data) - _KEYS), sorted(_KEYS - _OPTIONAL_KEYS - set(data))
        if unknown or missing:
            raise bad(f"unknown key(s) {unknown}" if unknown else f"missing key(s) {missing}")
        if data["format"] != PROFILE_FORMAT:
            raise bad(f"format {data['format']!r} is not {PROFILE_FORMAT}")
        for key in ("cpu", "torch_version"):
            if not isinstance(data[key], str):
                raise bad(f"{key} must be a string, got {data[key]!r}")
        if not isinstance(data["cores"], int) or isinstance(data["cores"], bool) or data["cores"] < 1:
            raise bad(f"cores must be a positive integer, got {data['cores']!r}")
        return cls(cpu=data["cpu"], cores=data["cores"], torch_version=data["torch_version"],
                   matmul_seconds=_seconds(data["matmul_seconds"], bad), cuda_device=_cuda_device(data, bad),
                   cuda_capability=_capability(data.get("cuda_capability"), bad),
                   gemm_crossover_flops=_crossover(data.get("gemm_crossover_flops", {}), bad))

    def save(self, path: Union[str, "os.PathLike[str]"]) -> Path:
        """Write the profile as JSON to ``path``; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: Union[str, "os.PathLike[str]"]) -> "DeviceProfile":
        """The profile :meth:`save` wrote to ``path``; a missing, unreadable or malformed file is one line."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DeviceProfileError(f"cannot read device profile {str(path)!r} ({exc.__class__.__name__}: "
                                     f"{exc}); give a file `mpconvert profile -o FILE` wrote, or 'auto'/'none'") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise DeviceProfileError(f"device profile {str(path)!r} is not JSON ({exc}); give a file "
                                     "`mpconvert profile -o FILE` wrote") from None
        return cls.from_dict(data, source=f"device profile {str(path)!r}")


def _seconds(value: Any, bad: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, Mapping) or set(value) != set(DTYPES):
        raise bad(f"matmul_seconds must map exactly {list(DTYPES)} to seconds, got {value!r}")
    for name in DTYPES:
        number = value[name]
        if (not isinstance(number, (int, float)) or isinstance(number, bool) or not math.isfinite(number)
                or not 0 < number < 60):
            raise bad(f"matmul_seconds[{name!r}] must be seconds in (0, 60), got {number!r}")
    return tuple((name, float(value[name])) for name in DTYPES)


def _crossover(value: Any, bad: Any) -> tuple[tuple[str, Optional[int]], ...]:
    if not isinstance(value, Mapping) or not set(value) <= set(HALF_PRECISIONS):
        raise bad(f"gemm_crossover_flops must map {list(HALF_PRECISIONS)} to FLOPs or null, got {value!r}")
    for name, flops in value.items():
        if flops is not None and (not isinstance(flops, int) or isinstance(flops, bool) or flops < 1):
            raise bad(f"gemm_crossover_flops[{name!r}] must be a positive integer or null, got {flops!r}")
    return tuple((name, value[name]) for name in HALF_PRECISIONS if name in value)


def _cuda_device(data: Mapping[str, Any], bad: Any) -> Optional[str]:
    device = data.get("cuda_device")
    if device is not None and not isinstance(device, str):
        raise bad(f"cuda_device must be a string or null, got {device!r}")
    return device


def _capability(value: Any, bad: Any) -> Optional[tuple[int, int]]:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise bad(f"cuda_capability must be [major, minor] or null, got {value!r}")
    return (value[0], value[1])


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def measured_once() -> DeviceProfile:
    """This process's measured profile (``device_profile="auto"``): measured on first use, then the same."""
    return DeviceProfile.measure()


def resolve_profile(value: Any) -> Optional[DeviceProfile]:
    """The profile a ``ConvertOptions.device_profile`` value means: None, ``"auto"`` (:func:`measured_once`),
    or a :class:`DeviceProfile` (a path was loaded when the options were built)."""
    if value is None or isinstance(value, DeviceProfile):
        return value
    if value == "auto":
        return measured_once()
    raise DeviceProfileError(f"device_profile must be 'auto', None, a DeviceProfile or a profile file's path, got {value!r}")


def coerce_profile(value: Any) -> Union[None, str, DeviceProfile]:
    """A ``device_profile`` option as stored: None (also ``"none"``), ``"auto"``, or a :class:`DeviceProfile`
    (a mapping, or a path that is loaded now)."""
    if value is None or isinstance(value, DeviceProfile) or value == "auto":
        return value
    if value == "none":
        return None
    if isinstance(value, Mapping):
        return DeviceProfile.from_dict(value)
    if isinstance(value, (str, os.PathLike)):
        return DeviceProfile.load(value)
    raise DeviceProfileError(f"device_profile must be 'auto', 'none'/None, a DeviceProfile or a profile file's path, "
                             f"got {type(value).__name__}")
