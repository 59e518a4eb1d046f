"""Does the device have fast math for the chosen half dtype? Read from the conversion's device profile.

fp16 on a CPU without fp16 arithmetic (most x86 CPUs: no AVX512-FP16/AMX-FP16) runs every matmul
through a slow conversion path: a char-level LM trained 12× slower in fp16 than in fp32 on this
project's 2-core EPYC, with nothing said. :func:`half_speed_advice` reads the conversion's
:class:`~converter.numerics.profile.DeviceProfile` (one small matmul timed in fp32, bf16 and fp16 on the CPU)
and returns a one-line advice when the chosen dtype is much slower than fp32 while the other half dtype is
not; for CUDA it reads the profile's compute capability instead (fp16 tensor cores from 7.0, bf16 from 8.0).
No profile (``ConvertOptions(device_profile=None)``, CLI ``--device-profile none``: a build machine converting
for another one; the test suite, whose expected output must not depend on the CPU it runs on): no advice.

The figures are the profile's, nothing else: ``device_profile="auto"`` measures once per process, a saved
profile (``mpconvert profile -o FILE``) gives identical runs identical advice wherever they run.
"""
from __future__ import annotations

from typing import Optional

from converter.numerics.profile import DeviceProfile
from converter.vocab import HALF_PRECISIONS

__all__ = ["half_speed_advice", "half_gemm_slowdown", "SLOW_FACTOR"]

#: a half dtype this many times slower than fp32 on a matmul counts as "no fast math"
SLOW_FACTOR = 2.0

#: the compute capability from which CUDA devices have tensor cores for each half dtype
_TENSOR_CORES = {"fp16": (7, 0), "bf16": (8, 0)}


def half_speed_advice(precision: str, device: Optional[str], profile: Optional[DeviceProfile]) -> Optional[str]:
    """One line of advice when ``precision`` (fp16/bf16) has no fast math on the device the model will
    train on (``device``; None: the profile's CUDA device if it has one, else its CPU); None if it has, or
    when there is no profile."""
    if precision not in HALF_PRECISIONS or profile is None:
        return None
    other = "bf16" if precision == "fp16" else "fp16"
    if device == "cuda" or (device is None and profile.cuda_capability is not None):
        return _cuda_advice(precision, other, profile)
    fp32 = profile.seconds("fp32")
    mine = profile.seconds(precision)
    if mine <= SLOW_FACTOR * fp32:
        return None
    theirs = profile.seconds(other)
    ratio = mine / fp32
    if theirs <= SLOW_FACTOR * fp32:
        return (f"{precision} matmuls on this CPU are {ratio:.0f}x slower than fp32 (measured: it has no fast {precision} "
                f"math), {other} runs at {theirs / fp32:.1f}x: convert with precision='{other}' (CLI --precision {other}) "
                f"to train on this CPU")
    return f"{precision} matmuls on this CPU are {ratio:.0f}x slower than fp32 (measured: it has no fast {precision} math)"


def _cuda_advice(precision: str, other: str, profile: DeviceProfile) -> Optional[str]:
    capability = profile.cuda_capability
    if capability is None:
        return None  # the profile has no CUDA device: the conversion is for another machine
    if capability >= _TENSOR_CORES[precision]:
        return None
    fix = f": convert with precision='{other}'" if capability >= _TENSOR_CORES[other] else ""
    need = ".".join(map(str, _TENSOR_CORES[precision]))
    return (f"{precision} has no tensor-core math on {profile.cuda_device} (compute capability "
            f"{capability[0]}.{capability[1]}, {precision} needs {need}): expect no speed-up over fp32{fix}")


def half_gemm_slowdown(precision: str, profile: Optional[DeviceProfile]) -> Optional[float]:
    """The profile's ``precision`` (fp16/bf16) matmul time over its fp32 matmul time; None without a profile.
    Read by ``convert(device="cpu")`` to choose the GEMM kernels (:mod:`converter.passes.cpu_gemm`)."""
    return None if profile is None else profile.slowdown(precision)
