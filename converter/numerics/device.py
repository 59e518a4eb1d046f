"""Does the device have fast math for the chosen half dtype? Measured, not guessed.

fp16 on a CPU without fp16 arithmetic (most x86 CPUs: no AVX512-FP16/AMX-FP16) runs every matmul
through a slow conversion path: a char-level LM trained 12× slower in fp16 than in fp32 on this
project's 2-core EPYC, with nothing said. :func:`half_speed_advice` times one small matmul in fp32,
bf16 and fp16 on the CPU (a few milliseconds, once per process) and returns a one-line advice when
the chosen dtype is much slower than fp32 while the other half dtype is not; on CUDA it reads the
device capability instead (fp16 tensor cores from compute capability 7.0, bf16 from 8.0).
``MPCONVERT_NO_DEVICE_ADVICE=1`` in the environment turns the check off (a build machine converting
for another one; the test suite, whose expected output must not depend on the CPU it runs on).

The CPU timings are measured once per machine and kept in ``device.json`` under
``$MPCONVERT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/mpconvert`` or ``~/.cache/mpconvert``), keyed by
the CPU model, its flags, the core count and the torch version: a timing taken while the machine was
busy flipped the advice in 1 of 5 identical runs, and identical runs must print the same advice.
An unreadable or unwritable cache only means measuring again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch

from converter.kernels.upcast import matmul_seconds

__all__ = ["half_speed_advice", "half_gemm_slowdown", "cpu_matmul_seconds", "measure_matmul_seconds", "cache_path", "SLOW_FACTOR"]

#: a half dtype this many times slower than fp32 on a matmul counts as "no fast math"
SLOW_FACTOR = 2.0


def cache_path() -> Path:
    """Where the per-machine timings are kept (see the module docstring)."""
    base = os.environ.get("MPCONVERT_CACHE_DIR")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpconvert")
    return Path(base) / "device.json"


@functools.lru_cache(maxsize=None)
def _machine_key() -> str:
    """The CPU model and flags, the core count and the torch version, hashed."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        cpu = "|".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))
    except OSError:
        import platform

        cpu = platform.processor() or platform.machine()
    text = f"{cpu}|{os.cpu_count()}|{torch.__version__}"
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]


def _read_cache() -> dict:
    try:
        with open(cache_path(), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, seconds: float) -> None:
    """Add one timing to the cache, atomically (a temporary file renamed over it); failures are ignored."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read_cache(), key: seconds}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


@functools.lru_cache(maxsize=None)
def cpu_matmul_seconds(dtype: torch.dtype) -> float:
    """Seconds of one 128×128 matmul on the CPU in ``dtype``: this machine's cached timing,
    else measured (:func:`measure_matmul_seconds`) and cached."""
    key = f"{_machine_key()}:{str(dtype).removeprefix('torch.')}"
    cached = _read_cache().get(key)
    if isinstance(cached, float) and 0 < cached < 60:
        return cached
    seconds = measure_matmul_seconds(dtype)
    _write_cache(key, seconds)
    return seconds


def measure_matmul_seconds(dtype: torch.dtype) -> float:
    """Best-of-5 seconds of one 128×128 matmul on the CPU in ``dtype``, on one thread: the probe that portable
    graphs' GEMM kernels run themselves (:func:`converter.kernels.upcast.matmul_seconds`)."""
    return matmul_seconds(dtype)


_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: the compute capability from which CUDA devices have tensor cores for each half dtype
_TENSOR_CORES = {"fp16": (7, 0), "bf16": (8, 0)}


def half_speed_advice(precision: str, device: Optional[str]) -> Optional[str]:
    """One line of advice when ``precision`` (fp16/bf16) has no fast math on the device the model will
    train on (``device``; None: this machine's CUDA device if there is one, else its CPU); None if it has."""
    if precision not in _NAMES or os.environ.get("MPCONVERT_NO_DEVICE_ADVICE") == "1":
        return None
    other = "bf16" if precision == "fp16" else "fp16"
    cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    if cuda:
        if not torch.cuda.is_available():
            return None  # nothing to measure here; the conversion is for another machine
        capability = torch.cuda.get_device_capability()
        if capability >= _TENSOR_CORES[precision]:
            return None
        fix = f": convert with precision='{other}'" if capability >= _TENSOR_CORES[other] else ""
        need = ".".join(map(str, _TENSOR_CORES[precision]))
        return (f"{precision} has no tensor-core math on {torch.cuda.get_device_name()} (compute capability "
                f"{capability[0]}.{capability[1]}, {precision} needs {need}): expect no speed-up over fp32{fix}")
    fp32 = cpu_matmul_seconds(torch.float32)
    mine = cpu_matmul_seconds(_NAMES[precision])
    if mine <= SLOW_FACTOR * fp32:
        return None
    theirs = cpu_matmul_seconds(_NAMES[other])
    ratio = mine / fp32
    if theirs <= SLOW_FACTOR * fp32:
        return (f"{precision} matmuls on this CPU are {ratio:.0f}x slower than fp32 (measured: it has no fast {precision} "
                f"math), {other} runs at {theirs / fp32:.1f}x: convert with precision='{other}' (CLI --precision {other}) "
                f"to train on this CPU")
    return f"{precision} matmuls on this CPU are {ratio:.0f}x slower than fp32 (measured: it has no fast {precision} math)"


def half_gemm_slowdown(precision: str) -> Optional[float]:
    """This CPU's ``precision`` (fp16/bf16) matmul time over its fp32 matmul time (cached per machine, see
    :func:`cpu_matmul_seconds`); None when measuring is off (``MPCONVERT_NO_DEVICE_ADVICE=1``). Read by
    ``convert(device="cpu")`` to choose the GEMM kernels (:mod:`converter.passes.cpu_gemm`)."""
    if precision not in _NAMES or os.environ.get("MPCONVERT_NO_DEVICE_ADVICE") == "1":
        return None
    return cpu_matmul_seconds(_NAMES[precision]) / cpu_matmul_seconds(torch.float32)
