"""Measurement helpers for the mpconvert benchmark suite (benchmarks/README.md).

Everything here measures one thing and is independent of the models and variants in ``run.py``:

* :class:`CastCounter` — a ``TorchDispatchMode`` that counts the casts a step performs: every
  ``aten._to_copy`` whose output dtype differs from its input dtype (floating → floating), with
  bytes = input bytes + output bytes (what the cast reads plus what it writes). Dtype-changing
  ``copy_``/``_foreach_copy_`` calls (the O2 trainer's master-grad harvest and master→model copy)
  are counted separately, as they are not ``_to_copy`` and benchmarks/README.md counts ``_to_copy`` only.
* :class:`SavedTensorMeter` — ``torch.autograd.graph.saved_tensors_hooks`` that sums the bytes of
  the distinct storages autograd saves for backward (parameters and the step's inputs excluded:
  they exist whether or not backward needs them; a half *copy* of a weight is counted).
* :func:`sqnr_db` — ``20·log10(‖ref‖ / ‖ref − out‖)``, in float64: mpconvert's own
  (:func:`converter.numerics.common.sqnr_db`), re-exported here.
* :func:`interleaved` — runs the variants A B C … A B C … after warm-up and returns per-variant
  samples; :func:`summarize` gives the median and quartiles.
* :func:`peak_step_memory` — peak bytes allocated during one call, above what was live before it:
  ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the allocation events of
  ``torch.profiler`` (``profile_memory=True``), accumulated in time order. ``tracemalloc`` does not
  see torch's allocator and RSS is blurred by malloc's caching, so neither is used.
* :func:`machine_info` — CPU model (``lscpu``), cores, torch version, date.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from converter.numerics.common import sqnr_db

__all__ = [
    "encoder",
    "sgd",
    "CastCounter",
    "CastEvent",
    "OpTimer",
    "SavedTensorMeter",
    "sqnr_db",
    "Clock",
    "interleaved",
    "summarize",
    "peak_step_memory",
    "tensor_bytes",
    "unique_storage_bytes",
    "machine_info",
    "first_tensor",
    "MiB",
]

MiB = float(1 << 20)
_aten = torch.ops.aten


def encoder(d_model: int, nhead: int, ff: int, batch: int, seq: int, layers: int = 2) -> tuple[torch.nn.Module, torch.Tensor]:
    """The benchmark encoder: ``nn.TransformerEncoder``, ``layers`` layers (2 by default), in train mode, and its input.

    dropout=0: every variant computes the same function, so SQNR measures precision only (dropout
    masks drawn in different dtypes differ); the train-mode graph is otherwise kept.
    """
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead, ff, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).train()
    torch.manual_seed(1)
    return model, torch.randn(batch, seq, d_model)


def sgd(params, *, foreach: bool | None = None) -> torch.optim.Optimizer:
    """The optimizer every variant of every benchmark uses (``foreach=True``: torch's multi-tensor kernels)."""
    return torch.optim.SGD(list(params), lr=1e-4, momentum=0.9, foreach=foreach)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements (numel × element size), not of its storage."""
    return t.numel() * t.element_size()


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of storage bytes over distinct storages (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(seen.values())


# --------------------------------------------------------------------------- casts
@dataclass(frozen=True)
class CastEvent:
    """One dtype-changing call seen by :class:`CastCounter`."""

    phase: str
    op: str
    src: str
    dst: str
    shape: tuple
    bytes: int
    kernel: bool = False  #: inside a GEMM kernel's own operand conversion (converter/kernels/upcast.py)


#: the kernels whose operand conversions are part of a GEMM, counted apart from the graph's casts
_KERNEL_FILES = (os.path.join("converter", "kernels", "upcast.py"),)


def _in_gemm_kernel() -> bool:
    """Whether the current call comes from a GEMM kernel of :data:`_KERNEL_FILES` (its upcasts of the
    operands are the price of the fp32 GEMM it runs, not casts the conversion placed)."""
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_KERNEL_FILES):
            return True
        frame = frame.f_back
    return False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class CastCounter(TorchDispatchMode):
    """Count dtype-changing ``_to_copy`` calls (and, separately, dtype-changing copies).

    Set :attr:`phase` (e.g. ``"fwd"``, ``"bwd"``, ``"opt"``) between the parts of a step to split the
    counts. Only floating → floating changes count: mask and index conversions (bool/int → float)
    happen identically in fp32 and are not mixed-precision traffic.

    ``events`` keeps every counted call; :meth:`totals` sums them per phase and kind.
    """

    _COPY_OPS = {_aten.copy_.default, _aten._foreach_copy_.default, _aten._foreach_copy.default}

    def __init__(self) -> None:
        super().__init__()
        self.phase = "step"
        self.events: list[CastEvent] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _aten._to_copy.default:
            src = args[0]
            if isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor):
                self._record("_to_copy", src, out)
        elif func in self._COPY_OPS:
            dsts, srcs = args[0], args[1]
            if isinstance(dsts, torch.Tensor):
                dsts, srcs = [dsts], [srcs]
            for dst, src in zip(dsts, srcs):
                if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                    self._record("copy", src, dst)
        return out

    def _record(self, op: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.dtype == dst.dtype or not (src.is_floating_point() and dst.is_floating_point()):
            return
        self.events.append(
            CastEvent(self.phase, op, _dtype_name(src.dtype), _dtype_name(dst.dtype), tuple(dst.shape),
                      tensor_bytes(src) + tensor_bytes(dst), kernel=_in_gemm_kernel())
        )

    def totals(self, *, op: str = "_to_copy", phases: Iterable[str] | None = None,
               kernel: bool | None = False) -> tuple[int, int]:
        """(count, bytes) of the events of ``op`` (``"_to_copy"`` or ``"copy"``) in ``phases`` (all if None);
        ``kernel``: False (default) the graph's casts only, True the GEMM kernels' operand upcasts only, None both."""
        wanted = None if phases is None else set(phases)
        events = [e for e in self.events if e.op == op and (wanted is None or e.phase in wanted)
                  and (kernel is None or e.kernel == kernel)]
        return len(events), sum(e.bytes for e in events)

    def by_signature(self, *, op: str = "_to_copy") -> list[dict]:
        """Events grouped by (phase, src→dst, shape), largest bytes first: where the traffic goes."""
        groups: dict[tuple, list[int]] = {}
        for e in self.events:
            if e.op == op:
                g = groups.setdefault((e.phase, e.src, e.dst, e.shape), [0, 0])
                g[0] += 1
                g[1] += e.bytes
        rows = [
            {"phase": k[0], "cast": f"{k[1]}->{k[2]}", "shape": list(k[3]), "count": v[0], "bytes": v[1]}
            for k, v in groups.items()
        ]
        return sorted(rows, key=lambda r: -r["bytes"])


class OpTimer(TorchDispatchMode):
    """Per-aten-op time, keyed by op and input dtypes (``aten.mm[bf16,bf16]``), for profiling.

    Each call is timed around the kernel only, with ``time.thread_time`` (``clock="cpu"``, robust on
    a shared machine with one torch thread) or ``perf_counter`` (``"wall"``). The Python mode adds
    its own overhead between ops, which is not attributed to any op. ``phase`` splits the totals
    like :class:`CastCounter`. A ``_to_copy`` that changes dtype is keyed ``aten._to_copy[src->dst]``.
    """

    def __init__(self, clock: str = "cpu") -> None:
        super().__init__()
        self._now = time.thread_time if clock == "cpu" else time.perf_counter
        self.phase = "step"
        self.times: dict[tuple[str, str], float] = {}
        self.calls: dict[tuple[str, str], int] = {}

    @staticmethod
    def _key(func, args, out) -> str:
        name = str(func.overloadpacket)
        dtypes = []
        for a in args:
            if isinstance(a, torch.Tensor):
                dtypes.append(_SHORT.get(a.dtype, _dtype_name(a.dtype)))
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                dtypes.append("[" + _SHORT.get(a[0].dtype, _dtype_name(a[0].dtype)) + "]")
        if func is _aten._to_copy.default and isinstance(out, torch.Tensor) and args:
            return f"{name}[{_SHORT.get(args[0].dtype, '?')}->{_SHORT.get(out.dtype, '?')}]"
        return f"{name}[{','.join(dtypes[:3])}]"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = self._now()
        out = func(*args, **kwargs)
        dt = self._now() - t0
        key = (self.phase, self._key(func, args, out))
        self.times[key] = self.times.get(key, 0.0) + dt
        self.calls[key] = self.calls.get(key, 0) + 1
        return out


_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64",
          torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}


# --------------------------------------------------------------------------- saved activations
class SavedTensorMeter:
    """Bytes of the distinct storages autograd saves for backward inside the ``with`` block.

    ``exclude``: tensors whose storages do not count (the parameters and the step's inputs: they
    are alive whether or not autograd saves them). Views of one storage count once, at the full
    storage size (the storage is what stays alive). The pack hook keeps a reference only to the
    storages already saved by autograd, so it adds no memory of its own.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude if isinstance(t, torch.Tensor)}
        self._storages: dict[int, int] = {}
        self.count = 0
        self.by_dtype: dict[str, int] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        if t.device.type != "meta":
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._excluded and ptr not in self._storages and ptr != 0:
                self._storages[ptr] = storage.nbytes()
                key = _dtype_name(t.dtype)
                self.by_dtype[key] = self.by_dtype.get(key, 0) + storage.nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


# --------------------------------------------------------------------------- accuracy
def first_tensor(output: Any) -> torch.Tensor:
    """The first floating tensor in a model output (tensor, tuple/list, dict or HF ModelOutput)."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            return output
    elif isinstance(output, Mapping):
        for value in output.values():
            with contextlib.suppress(LookupError):
                return first_tensor(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            with contextlib.suppress(LookupError):
                return first_tensor(value)
    raise LookupError(f"no floating tensor in output of type {type(output).__name__}")


# --------------------------------------------------------------------------- timing
class Clock:
    """Phase clock for one step: ``start()``, ``mark("fwd")``, ``mark("bwd")`` …, then ``read()``.

    ``kind``:

    * ``"wall"`` — ``time.perf_counter`` (the CPU runs ops synchronously);
    * ``"cpu"`` — ``time.thread_time``: CPU time of the calling thread only. With one torch thread
      all of a CPU step (forward, autograd's CPU backward, optimizer) runs on the calling thread,
      so this excludes the time the process waits while other processes hold the cores: the
      robust choice on a shared machine. Meaningless with more than one intra-op thread;
    * ``"cuda"`` — ``torch.cuda.Event`` pairs, resolved by one synchronisation in :meth:`read`, so
      timing adds no sync inside the step.

    Marks accumulate across calls until :meth:`read`, which is how a block of several steps is timed.
    """

    KINDS = ("wall", "cpu", "cuda")

    def __init__(self, kind: str = "wall") -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown clock {kind!r}; use one of {self.KINDS}")
        self.kind = kind
        self._marks: list[tuple[str, Any]] = []

    def _now(self):
        if self.kind == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.thread_time() if self.kind == "cpu" else time.perf_counter()

    def start(self) -> None:
        self._marks.append(("", self._now()))

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))

    def read(self) -> dict[str, float]:
        """Seconds per phase since the last ``read`` (``total`` = sum of phases)."""
        if self.kind == "cuda":
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        prev = None
        for phase, stamp in self._marks:
            if phase and prev is not None:
                dt = prev.elapsed_time(stamp) / 1e3 if self.kind == "cuda" else stamp - prev
                out[phase] = out.get(phase, 0.0) + dt
            prev = stamp
        out["total"] = sum(out.values())
        self._marks.clear()
        return out


def interleaved(
    steps: Mapping[str, Callable[[Clock], None]],
    *,
    rounds: int,
    warmup: int = 3,
    inner: int = 1,
    clock: str = "wall",
    between: Callable[[], None] | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Run ``steps`` interleaved (A B C … A B C …) and return per-variant samples.

    Each sample is one block of ``inner`` consecutive steps of one variant, divided by ``inner``
    (a block amortises the cost of switching variants for sub-millisecond steps). ``warmup`` rounds
    are run first and discarded. The Python garbage collector is off during a block; objects alive
    before the first round are frozen (``gc.freeze``) so the collections between blocks stay cheap.
    Each step calls ``clock.mark(phase)`` at its phase boundaries; the sample holds seconds per
    phase and ``total``. ``clock`` is a :class:`Clock` kind (``wall``, ``cpu`` or ``cuda``).
    """
    if rounds < 1 or inner < 1:
        raise ValueError("rounds and inner must be >= 1")
    clock = Clock(clock)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in steps}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()  # objects alive now are never scanned again: a collection costs only the step's garbage
    try:
        for r in range(warmup + rounds):
            gc.collect()
            for name, step in steps.items():
                if between is not None:
                    between()
                gc.disable()
                try:
                    for _ in range(inner):
                        clock.start()
                        step(clock)
                    times = clock.read()
                finally:
                    gc.enable()
                gc.collect(0)
                if r >= warmup:
                    samples[name].append({k: v / inner for k, v in times.items()})
    finally:
        gc.unfreeze()
        if not gc_was_enabled:
            gc.disable()
    return samples


def summarize(samples: list[dict[str, float]]) -> dict[str, Any]:
    """Median (and quartiles of ``total``) in milliseconds, per phase."""
    if not samples:
        return {}
    phases = sorted({k for s in samples for k in s})
    out: dict[str, Any] = {f"{p}_ms": 1e3 * statistics.median(s.get(p, 0.0) for s in samples) for p in phases}
    totals = sorted(1e3 * s["total"] for s in samples)
    if len(totals) >= 4:
        q = statistics.quantiles(totals, n=4)
        out["total_q1_ms"], out["total_q3_ms"] = q[0], q[2]
    out["n"] = len(samples)
    return out


# --------------------------------------------------------------------------- memory
def peak_step_memory(fn: Callable[[], None], *, device: torch.device | str = "cpu") -> dict[str, int]:
    """Peak bytes allocated while ``fn()`` runs, above the bytes live when it starts.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (minus the bytes
    allocated before). CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocation
    and free of torch's CPU allocator; their sizes are accumulated in time order and the maximum is
    the peak. Returns ``{"peak_bytes": …, "method": …}``; ``live_before`` on CUDA.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"peak_bytes": int(peak - before), "live_before": int(before), "method": "cuda.max_memory_allocated"}
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        if e.device_type() == torch._C._autograd.DeviceType.CPU:
            running += e.nbytes()
            peak = max(peak, running)
    return {"peak_bytes": int(peak), "method": "torch.profiler(profile_memory=True) allocation events"}


# --------------------------------------------------------------------------- machine
def _lscpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What the results were measured on: CPU model, cores, threads, torch version, date, GPU name."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "cpu": _lscpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device.type,
    }
    if device.type == "cpu":
        caps = {}
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
            fn = getattr(torch.cpu, name, None)
            if fn is not None:
                with contextlib.suppress(Exception):
                    caps[name.strip("_").replace("is_", "").replace("_supported", "")] = bool(fn())
        info["cpu_capabilities"] = caps
    elif device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    try:
        load = os.getloadavg()
        info["loadavg_at_start"] = [round(x, 2) for x in load]
    except OSError:
        pass
    return info
