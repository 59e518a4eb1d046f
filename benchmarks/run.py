"""mpconvert benchmark suite (benchmarks/README.md): fp32 vs autocast vs converted O1/O2 vs all-half.

Run from the repository root::

    python benchmarks/run.py                       # full suite, CPU bf16 -> benchmarks/results/cpu.{json,md}
    python benchmarks/run.py --quick               # fewer rounds and models (a minute or two)
    python benchmarks/run.py --models encoder_large encoder_small
    python benchmarks/run.py --device cuda --precision fp16 --out benchmarks/results/cuda_fp16_<gpu>.json
    python benchmarks/run.py --from-json benchmarks/results/cpu.json   # regenerate the Markdown only
    python benchmarks/run.py --models encoder_large --profile   # + per-op time of every variant (JSON)

Variants (same weights, inputs, loss and optimizer for all):

* ``fp32``     — the original model;
* ``autocast`` — the original model, forward under ``torch.autocast(device, dtype=half)``
  (fp16 on CUDA adds ``torch.amp.GradScaler``);
* ``O1``       — ``converter.convert(...).module``: fp32 parameters, casts in the graph, the
  optimizer steps the fp32 parameters directly;
* ``O2``       — a copy of the converted module driven by ``MixedPrecisionTrainer(master_weights=True)``:
  parameters stored in half per ``gm.meta["mp_param_dtypes"]``, fp32 master weights, the master
  gradient harvest and the master→model copy with ``torch._foreach_copy_``;
* ``floor``    — ``model.to(half)`` with its floating inputs cast once, before timing: no casts at
  all, no master weights. It is the speed floor, not a training recipe;
* ``O2g``      — CUDA only: ``O2`` with its forward and backward replayed as CUDA graphs
  (``converter.cuda_graph`` on another copy of the O2 module; loss and trainer step eager). Its casts
  and saved activations are measured on the eager path (a dispatch mode or saved-tensor hooks make
  the wrapper run eagerly), so they are O2's; its peak memory adds the graphs' pools
  (``graph_bytes``); ``cuda_graph`` in its entry says what was captured and why calls ran eagerly.

A step is ``zero_grad`` + forward + loss + backward + optimizer step. The loss is the model's
output when it is a scalar (the CNN returns its loss), else ``output.float().pow(2).mean()``.

Measures (one run): step time (median of interleaved rounds, with fwd/bwd/opt split), casts and
cast bytes per fwd+bwd (``aten._to_copy`` changing a floating dtype, input + output bytes),
dtype-changing copies (O2 trainer), saved-activation bytes, peak memory, output and gradient SQNR
against fp32, and conversion time (capture and pass). See ``benchmarks/README.md``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    CastCounter,
    Clock,
    MiB,
    OpTimer,
    SavedTensorMeter,
    encoder,
    first_tensor,
    interleaved,
    machine_info,
    peak_step_memory,
    sqnr_db,
    summarize,
    unique_storage_bytes,
)
from converter.numerics.common import from_json, to_json  # noqa: E402

__all__ = ["MODELS", "VARIANTS", "EXTRA_VARIANTS", "main", "run_model", "to_markdown", "check_targets"]

VARIANTS = ("fp32", "autocast", "O1", "O2", "floor")
#: ``--ablate``: O2 with one of the conversion's lowering choices flipped, timed in the same interleaved rounds,
#: so the table shows what each choice of the cost model (converter.passes.lower.recompute_plan) is worth
ABLATIONS = {
    "O2-bf16-attention": "attention lowered to bf16 matmul·softmax·matmul (the cost model's recompute choice), not "
                         "run in fp32 arithmetic (ConvertOptions.fp32_attention=False)",
    "O2-recompute": "as O2-bf16-attention, every lowered attention recomputed in backward (the rule before the cost model)",
    "O2-keep": "as O2-bf16-attention, no lowered attention recomputed (probabilities kept for backward)",
    "O2-portable": "no device lowering (converted without naming the device): kernels that choose per device at run time",
    "O2-portable-plain": "the portable graph without its dispatching kernels (fused attention, native half GEMMs; "
                         "ConvertOptions.dispatch_kernels=False)",
    "O2-raw": "without the simplify pass",
    "O2-native-gemm": "half GEMMs on the native half kernels (no upcast to fp32 GEMMs; converter.passes.cpu_gemm)",
}
#: variants only some runs have (``O2g``: CUDA graphs, on CUDA only; the --ablate ones), in table order after VARIANTS
EXTRA_VARIANTS = ("O2g", *ABLATIONS)
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
SCHEMA = 1


# =========================================================================== models
@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    build: Callable[[], tuple[nn.Module, tuple, dict]]
    quick: bool = False
    #: the devices whose default model set includes it (``--models`` runs it anywhere)
    devices: tuple[str, ...] = ("cpu", "cuda")


def _load_sample(name: str):
    path = ROOT / "samples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_mp_bench_sample_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _split_inputs(example: Any) -> tuple[tuple, dict]:
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, dict):
        return (), dict(example)
    if (isinstance(example, (tuple, list)) and len(example) == 2 and isinstance(example[0], (tuple, list))
            and isinstance(example[1], dict)):
        return tuple(example[0]), dict(example[1])
    return tuple(example), {}


def _sample(name: str) -> Callable[[], tuple[nn.Module, tuple, dict]]:
    def build():
        module = _load_sample(name)
        model = module.build_model()
        args, kwargs = _split_inputs(module.example_inputs())
        return model, args, kwargs

    return build


def _encoder(d_model: int, nhead: int, ff: int, batch: int, seq: int,
             layers: int = 2) -> Callable[[], tuple[nn.Module, tuple, dict]]:
    def build():
        model, x = encoder(d_model, nhead, ff, batch, seq, layers)
        return model, (x,), {}

    return build


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("encoder_large", "nn.TransformerEncoder d512 h8 ff2048 ×2, B8×T128 (large)",
                  _encoder(512, 8, 2048, 8, 128)),
        ModelSpec("encoder_small", "nn.TransformerEncoder d128 h4 ff512 ×2, B2×T16 (small)",
                  _encoder(128, 4, 512, 2, 16), quick=True),
        ModelSpec("cnn", "samples/cnn.py: conv-BN-ReLU ×3, B4 3×16×16 (returns its loss)", _sample("cnn"), quick=True),
        ModelSpec("hf_gpt2", "samples/hf_gpt2.py: HF GPT-2 d64 ×2, B2×T16", _sample("hf_gpt2")),
        ModelSpec("hf_bert", "samples/hf_bert.py: HF BERT d64 ×2, B2×T16", _sample("hf_bert")),
        ModelSpec("tiny_transformer", "samples/tiny_transformer.py: d64 ×2, RMSNorm, B2×T16", _sample("tiny_transformer"),
                  quick=True),
        # GPU-sized (the others are launch-bound on a GPU); a step takes seconds on a CPU, so only CUDA runs it by default
        ModelSpec("encoder_gpu", "nn.TransformerEncoder d1024 h16 ff4096 ×4, B16×T512 (GPU-sized)",
                  _encoder(1024, 16, 4096, 16, 512, layers=4), devices=("cuda",)),
    )
}


# =========================================================================== variants
def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _iter_tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _iter_tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v)


def loss_of(output: Any) -> torch.Tensor:
    """The benchmark loss: the output itself when it is a scalar, else ``mean(output.float()²)``."""
    out = first_tensor(output)
    if out.numel() == 1:
        return out.float().reshape(())
    return out.float().pow(2).mean()


@dataclass
class Variant:
    """One way of running the model; :meth:`step` is what is timed."""

    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    optimizer: torch.optim.Optimizer
    autocast: torch.dtype | None = None
    device_type: str = "cpu"
    trainer: Any = None  # MixedPrecisionTrainer (O2)
    grad_scaler: Any = None  # torch.amp.GradScaler (autocast fp16)
    notes: list[str] = field(default_factory=list)
    call: Any = None  # what the forward calls instead of ``module`` (O2g: the CUDA-graph wrapper of ``module``)

    def forward(self) -> Any:
        call = self.call if self.call is not None else self.module
        if self.autocast is not None:
            with torch.autocast(self.device_type, dtype=self.autocast):
                return call(*self.args, **self.kwargs)
        return call(*self.args, **self.kwargs)

    def zero_grad(self) -> None:
        if self.trainer is not None:
            self.trainer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        if self.trainer is not None:
            self.trainer.backward(loss)
        elif self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()

    def optimizer_step(self) -> None:
        if self.trainer is not None:
            self.trainer.step()
        elif self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()

    def step(self, clock: Clock | None = None) -> None:
        self.zero_grad()
        loss = loss_of(self.forward())
        if clock is not None:
            clock.mark("fwd")
        self.backward(loss)
        if clock is not None:
            clock.mark("bwd")
        self.optimizer_step()
        if clock is not None:
            clock.mark("opt")

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters, fp32 masters (O2) and optimizer state: what lives between steps."""
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        for group in self.optimizer.param_groups:
            tensors.extend(group["params"])
        for state in self.optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return tensors

    def input_tensors(self) -> list[torch.Tensor]:
        return list(_iter_tensors((self.args, self.kwargs)))


def _make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    params = list(params)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    raise ValueError(f"unknown optimizer {kind!r}")


def build_variants(model: nn.Module, conv: Any, args: tuple, kwargs: dict, *, half: torch.dtype,
                   device: torch.device, optimizer: str, conv_o2: Any = None,
                   graphed: bool | None = None) -> dict[str, Variant]:
    """The five variants (six with ``O2g``), each on its own copy of the same weights.

    ``conv``: the O1 conversion; ``conv_o2``: the conversion placed for O2 storage
    (``opt_level="O2"``: weight casts are free in the cost model), else a copy of ``conv``.
    ``graphed``: add ``O2g`` (default: on CUDA, where CUDA graphs exist).
    """
    from converter.train.trainer import MixedPrecisionTrainer

    precision = "fp16" if half == torch.float16 else "bf16"
    dtype_name = precision
    variants: dict[str, Variant] = {}

    fp32 = copy.deepcopy(model)
    variants["fp32"] = Variant("fp32", fp32, args, kwargs, _make_optimizer(optimizer, fp32.parameters()),
                               device_type=device.type)

    amp = copy.deepcopy(model)
    scaler = torch.amp.GradScaler(device.type) if half == torch.float16 else None
    variants["autocast"] = Variant("autocast", amp, args, kwargs, _make_optimizer(optimizer, amp.parameters()),
                                   autocast=half, device_type=device.type, grad_scaler=scaler,
                                   notes=[f"torch.autocast({device.type!r}, dtype={dtype_name})"
                                          + (" + GradScaler" if scaler is not None else "")])

    o1 = conv.module
    variants["O1"] = Variant("O1", o1, args, kwargs, _make_optimizer(optimizer, o1.parameters()),
                             device_type=device.type, notes=["fp32 params, casts in graph, plain optimizer.step()"])

    o2 = conv_o2.module if conv_o2 is not None else copy.deepcopy(conv.module)
    if "mp_param_dtypes" not in getattr(o2, "meta", {}):  # deepcopy must keep it; fail loudly if not
        raise RuntimeError("deepcopy of the converted GraphModule lost meta['mp_param_dtypes']")
    if graphed is None:
        graphed = device.type == "cuda"
    o2g = copy.deepcopy(o2) if graphed else None  # before O2's trainer gives o2's weights half storage
    opt2 = _make_optimizer(optimizer, o2.parameters())
    trainer = MixedPrecisionTrainer(o2, opt2, precision=precision, master_weights=True)
    n_half = sum(1 for p in o2.parameters() if p.dtype == half)
    variants["O2"] = Variant("O2", o2, args, kwargs, opt2, device_type=device.type, trainer=trainer,
                             notes=[f"{n_half}/{sum(1 for _ in o2.parameters())} params stored in {dtype_name}; "
                                    "MixedPrecisionTrainer(master_weights=True)"])

    if o2g is not None:
        from converter.train.cuda_graph import cuda_graph

        opt2g = _make_optimizer(optimizer, o2g.parameters())
        trainer_g = MixedPrecisionTrainer(o2g, opt2g, precision=precision, master_weights=True)
        variants["O2g"] = Variant("O2g", o2g, args, kwargs, opt2g, device_type=device.type, trainer=trainer_g,
                                  call=cuda_graph(o2g),
                                  notes=["O2 with converter.cuda_graph: forward and backward replay CUDA graphs; "
                                         "loss and trainer.step() eager"])

    floor = copy.deepcopy(model).to(half)
    cast_once = lambda t: t.to(half) if t.is_floating_point() else t  # noqa: E731
    variants["floor"] = Variant("floor", floor, _map_tensors(args, cast_once), _map_tensors(kwargs, cast_once),
                                _make_optimizer(optimizer, floor.parameters()), device_type=device.type,
                                notes=[f"model.to({dtype_name}); inputs cast once before timing"])
    return variants


def ablation_variants(model: nn.Module, args: tuple, kwargs: dict, *, precision: str, device: torch.device,
                      optimizer: str, rules: list[str] | None) -> dict[str, Variant]:
    """The ``--ablate`` variants (:data:`ABLATIONS`): O2 conversions for ``device`` with one choice flipped."""
    import converter
    from converter.api import pipeline
    from converter.options import ConvertOptions
    from converter.train.trainer import MixedPrecisionTrainer

    def o2(name: str, module: nn.Module) -> Variant:
        opt = _make_optimizer(optimizer, module.parameters())
        trainer = MixedPrecisionTrainer(module, opt, precision=precision, master_weights=True)
        return Variant(name, module, args, kwargs, opt, device_type=device.type, trainer=trainer, notes=[ABLATIONS[name]])

    def convert(**options: Any) -> nn.Module:
        return converter.convert(copy.deepcopy(model), (args, kwargs), precision=precision, rules=rules,
                                 opt_level="O2", **options).module

    out: dict[str, Variant] = {}
    # the bf16 lowering and its cost model (on a CPU with fast half GEMMs: the default)
    for name, forced in (("O2-bf16-attention", None), ("O2-recompute", True), ("O2-keep", False)):
        out[name] = o2(name, convert(device=device.type, fp32_attention=False, recompute_attention=forced))
    out["O2-portable"] = o2("O2-portable", convert())
    out["O2-portable-plain"] = o2("O2-portable-plain", convert(dispatch_kernels=False))
    options = ConvertOptions(precision=precision, opt_level="O2", device=device.type)
    captured, *_ = pipeline(copy.deepcopy(model), (args, kwargs), options, rules=rules, simplify_graph=False)
    out["O2-raw"] = o2("O2-raw", captured.gm)
    if device.type == "cpu":  # the GEMM kernels' choice (measured on this CPU) flipped to native half GEMMs
        out["O2-native-gemm"] = o2("O2-native-gemm", convert(device=device.type, upcast_half_gemms=False))
    return out


# =========================================================================== measures
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_sqnr(variants: dict[str, Variant], names: list[str]) -> dict[str, dict[str, float]]:
    """Output SQNR (no_grad forward) and gradient SQNR (one backward, no step) against fp32.

    Runs on the untrained copies, so all variants hold the same weights (O2's rounded to half).
    Gradients are compared over the parameters all variants share by name, concatenated.
    """
    outputs: dict[str, torch.Tensor] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for name, v in variants.items():
        with torch.no_grad():
            outputs[name] = first_tensor(v.forward()).detach().float().clone()
        v.module.zero_grad(set_to_none=True)
        loss_of(v.forward()).backward()  # plain backward: O2's half grads are what the trainer harvests
        grads[name] = {n: p.grad.detach().float().clone() for n, p in v.module.named_parameters()
                       if p.grad is not None}
        v.module.zero_grad(set_to_none=True)
    common = [n for n in names if all(n in g for g in grads.values())]
    ref_grad = torch.cat([grads["fp32"][n].reshape(-1) for n in common]) if common else None
    result = {}
    for name in variants:
        entry = {"sqnr_db": sqnr_db(outputs["fp32"], outputs[name])}
        if ref_grad is not None:
            entry["grad_sqnr_db"] = sqnr_db(ref_grad, torch.cat([grads[name][n].reshape(-1) for n in common]))
        result[name] = entry
    return result


def _phased_step(v: Variant, recorder: Any) -> None:
    """One training step under ``recorder`` (a dispatch mode with a ``phase`` attribute), phase by phase."""
    v.zero_grad()
    with recorder:
        recorder.phase = "fwd"
        loss = loss_of(v.forward())
        recorder.phase = "bwd"
        v.backward(loss)
        recorder.phase = "opt"
        v.optimizer_step()


def measure_casts(v: Variant) -> dict[str, Any]:
    """Casts of one step: ``_to_copy`` in fwd and bwd (benchmarks/README.md), dtype-changing copies anywhere."""
    counter = CastCounter()
    _phased_step(v, counter)
    n, b = counter.totals(phases=("fwd", "bwd"))
    nf, bf = counter.totals(phases=("fwd",))
    nc, bc = counter.totals(op="copy")
    no, bo = counter.totals(phases=("opt",))
    nk, bk = counter.totals(phases=("fwd", "bwd"), kernel=True)
    return {
        "casts": n, "cast_bytes": b, "casts_fwd": nf, "cast_bytes_fwd": bf,
        "kernel_casts": nk, "kernel_cast_bytes": bk,
        "casts_opt": no, "cast_bytes_opt": bo,
        "copy_casts": nc, "copy_cast_bytes": bc,
        "top_casts": counter.by_signature()[:12],
    }


def _cast_cell(e: dict) -> str:
    """The graph's cast MiB, and the GEMM kernels' operand upcasts apart (``+ N k``) when there are any."""
    kernel = e.get("kernel_cast_bytes") or 0
    return _f(e["cast_bytes"] / MiB) + (f" + {kernel / MiB:.1f} k" if kernel else "")


def measure_saved(v: Variant) -> dict[str, Any]:
    exclude = list(v.module.parameters()) + list(v.module.buffers()) + v.input_tensors()
    v.zero_grad()
    with SavedTensorMeter(exclude=exclude) as meter:
        loss = loss_of(v.forward())
    loss.backward()
    v.module.zero_grad(set_to_none=True)
    if v.trainer is not None:
        for master in v.trainer.master_params:
            master.grad = None
    return {"saved_bytes": meter.bytes, "saved_tensors": meter.count, "saved_by_dtype": meter.by_dtype}


def measure_memory(v: Variant, device: torch.device) -> dict[str, Any]:
    """Resident state (params, masters, optimizer state, buffers) + peak extra bytes of one step."""
    v.zero_grad()  # free the previous step's grads before measuring
    if v.trainer is not None:
        for master in v.trainer.master_params:
            master.grad = None
    _sync(device)
    state = unique_storage_bytes(v.state_tensors())
    peak = peak_step_memory(v.step, device=device)
    return {"state_bytes": state, "step_peak_bytes": peak["peak_bytes"],
            "peak_bytes": state + peak["peak_bytes"], "memory_method": peak["method"]}


def profile_variants(variants: dict[str, Variant], names: tuple[str, ...], *, clock: str, reps: int = 7,
                     top: int = 25) -> dict[str, Any]:
    """Per-op time of one step (fwd/bwd/opt) for each named variant: median over ``reps`` interleaved steps.

    Uses :class:`~benchmarks.common.OpTimer` (a dispatch mode timing each aten call), so on a shared
    machine with ``--clock cpu`` the figures are CPU time of the one torch thread.
    """
    per_rep: dict[str, list[OpTimer]] = {name: [] for name in names}
    for rep in range(reps + 1):
        for name in names:
            v = variants[name]
            timer = OpTimer("cpu" if clock == "cpu" else "wall")
            _phased_step(v, timer)
            if rep:  # the first is a warm-up
                per_rep[name].append(timer)
    result: dict[str, Any] = {}
    for name, timers in per_rep.items():
        keys = {k for t in timers for k in t.times}
        rows = []
        for key in keys:
            ms = statistics.median(1e3 * t.times.get(key, 0.0) for t in timers)
            rows.append({"phase": key[0], "op": key[1], "calls": timers[0].calls.get(key, 0), "ms": ms})
        rows.sort(key=lambda r: -r["ms"])
        phases = {p: sum(r["ms"] for r in rows if r["phase"] == p) for p in ("fwd", "bwd", "opt")}
        casts = sum(r["ms"] for r in rows if r["op"].startswith("aten._to_copy[") and "->" in r["op"])
        copies = sum(r["ms"] for r in rows if r["op"].startswith(("aten.copy_", "aten._foreach_copy_")))
        result[name] = {"ops_ms_by_phase": phases, "cast_ms": casts, "copy_ms": copies, "top": rows[:top],
                        "all": rows}
    return result


def _top_by_time(events: list, micros: Callable[[Any], float], top: int) -> list[tuple[str, tuple[int, float]]]:
    """(name, (calls, summed µs)) of the ``top`` event names with the most time."""
    totals: dict[str, list[float]] = {}
    for e in events:
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += micros(e)
    return sorted(((k, (c, us)) for k, (c, us) in totals.items()), key=lambda kv: -kv[1][1])[:top]


def profile_cuda_variants(variants: dict[str, Variant], names: tuple[str, ...], *, reps: int = 5,
                          top: int = 15) -> dict[str, Any]:
    """Where a CUDA step's time goes, per variant (``--profile`` with ``--device cuda``): ``torch.profiler``
    over ``reps`` steps after one untimed step.

    Per step: the kernels launched and their summed GPU time (``gpu_busy_ms``: when it is far below the step
    time, the step is bound by the host launching work, not by the GPU), the aten calls the host dispatched,
    and the top kernels (GPU time) and top aten ops (host self time). Profiler overhead inflates the host
    figures; compare variants with each other, not with the timed step.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, Any] = {}
    for name in names:
        v = variants[name]
        v.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                v.step()
            torch.cuda.synchronize()
        events = prof.events()
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        aten = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        top_k = _top_by_time(kernels, lambda e: e.time_range.elapsed_us(), top)
        top_h = _top_by_time(aten, lambda e: e.self_cpu_time_total, top)
        result[name] = {
            "reps": reps,
            "kernels_per_step": len(kernels) / reps,
            "gpu_busy_ms": sum(e.time_range.elapsed_us() for e in kernels) / reps / 1e3,
            "aten_calls_per_step": len(aten) / reps,
            "aten_self_host_ms": sum(e.self_cpu_time_total for e in aten) / reps / 1e3,
            "top_kernels": [{"kernel": k[:120], "calls": c / reps, "ms": us / reps / 1e3} for k, (c, us) in top_k],
            "top_host_ops": [{"op": k, "calls": c / reps, "self_ms": us / reps / 1e3} for k, (c, us) in top_h],
        }
    return result


def _estimate_step_s(v: Variant, device: torch.device, clock: str, n: int = 2) -> float:
    now = time.thread_time if clock == "cpu" else time.perf_counter
    times = []
    for _ in range(n):
        _sync(device)
        t = now()
        v.step()
        _sync(device)
        times.append(now() - t)
    return min(times)


def _report_facts(report: Any) -> dict:
    """The stages' report.json keys of a report: ``records`` (mpconvert with typed records), else older versions' ``extra``."""
    records = getattr(report, "records", None)
    return records.to_dict() if records is not None else dict(getattr(report, "extra", {}))


def run_model(spec: ModelSpec, *, device: torch.device, half: torch.dtype, optimizer: str, min_rounds: int,
              max_rounds: int, budget_s: float, block_s: float, warmup: int, profile: bool, clock: str = "wall",
              rules: list[str] | None = None, portable: bool = False, graphed: bool | None = None, ablate: bool = False,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    import converter

    torch.manual_seed(0)
    model, args, kwargs = spec.build()
    model = model.to(device)
    args = _map_tensors(args, lambda t: t.to(device))
    kwargs = _map_tensors(kwargs, lambda t: t.to(device))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    precision = "fp16" if half == torch.float16 else "bf16"

    # what this converter accepts: convert()'s keywords, or (since ConvertOptions) the options' fields
    convert_params = set(inspect.signature(converter.convert).parameters)
    if hasattr(converter, "ConvertOptions"):
        convert_params |= {f.name for f in dataclasses.fields(converter.ConvertOptions)}
    has_opt_level = "opt_level" in convert_params
    # converted for the device it runs on (its lowerings), unless --portable
    target = {} if portable or "device" not in convert_params else {"device": device.type}
    convs: dict[str, Any] = {}
    conversion: dict[str, Any] = {}
    for level in ("O1", "O2") if has_opt_level else ("O1",):
        t0 = time.perf_counter()
        extra = ({"opt_level": level} if has_opt_level else {}) | target
        conv = converter.convert(copy.deepcopy(model), (args, kwargs), precision=precision, rules=rules, **extra)
        total_s = time.perf_counter() - t0
        summary = conv.report.summary if isinstance(conv.report.summary, dict) else {}
        convs[level] = conv
        conversion[level] = {
            "tracer": conv.tracer, "capture_s": conv.timings.get("capture_s"), "pass_s": conv.timings.get("pass_s"),
            "total_s": total_s, "graph_casts": summary.get("casts"), "graph_weight_casts": summary.get("weight_casts"),
            "half_flop_fraction": summary.get("half_flop_fraction"), "device": target.get("device"),
            "lowered": _report_facts(conv.report).get("lowered", []), "codegen_s": conv.timings.get("codegen_s"),
        }
        log(f"[{spec.name}] {level}: converted via {conv.tracer} in {total_s:.2f}s (capture "
            f"{conv.timings.get('capture_s', math.nan):.3f}s, pass {conv.timings.get('pass_s', math.nan):.3f}s)")

    variants = build_variants(model, convs["O1"], args, kwargs, half=half, device=device, optimizer=optimizer,
                              conv_o2=convs.get("O2"), graphed=graphed)
    if ablate and not portable:
        variants.update(ablation_variants(model, args, kwargs, precision=precision, device=device, optimizer=optimizer,
                                          rules=rules))
    conversion["O2"]["lowering"] = _report_facts(convs["O2"].report).get("lowering", []) if "O2" in convs else []
    result: dict[str, Any] = {
        "description": spec.description,
        "params": sum(p.numel() for p in model.parameters()),
        # the O1 conversion's figures at top level; both levels under "levels"
        "conversion": {**conversion["O1"], "levels": conversion},
        "variants": {name: {"notes": v.notes} for name, v in variants.items()},
    }

    # accuracy first, on identical (untrained) weights
    for name, entry in measure_sqnr(variants, names).items():
        result["variants"][name].update(entry)
    # one step each so that optimizer state exists, then counts and saved tensors
    for v in variants.values():
        v.step()
    for name, v in variants.items():
        result["variants"][name].update(measure_casts(v))
        result["variants"][name].update(measure_saved(v))

    # timing: interleaved rounds
    est = {name: _estimate_step_s(v, device, clock) for name, v in variants.items()}
    slowest = max(est.values())
    inner = max(1, min(50, round(block_s / max(slowest, 1e-6))))
    per_round = sum(est.values()) * inner
    rounds = int(max(min_rounds, min(max_rounds, budget_s / max(per_round, 1e-6))))
    log(f"[{spec.name}] timing: {rounds} rounds × {len(variants)} variants × {inner} step(s)/block "
        f"(≈{per_round * (rounds + warmup):.0f}s)")
    samples = interleaved({name: v.step for name, v in variants.items()}, rounds=rounds, warmup=warmup,
                          inner=inner, clock=clock)
    result["timing"] = {"rounds": rounds, "inner": inner, "warmup_rounds": warmup, "clock": clock}
    for name, s in samples.items():
        stats = summarize(s)
        result["variants"][name].update({
            "step_ms": stats["total_ms"], "fwd_ms": stats.get("fwd_ms"), "bwd_ms": stats.get("bwd_ms"),
            "opt_ms": stats.get("opt_ms"), "step_q1_ms": stats.get("total_q1_ms"),
            "step_q3_ms": stats.get("total_q3_ms"), "samples": stats["n"],
        })

    for name, v in variants.items():
        result["variants"][name].update(measure_memory(v, device))
        stats = getattr(v.call, "stats", None)
        if stats is not None:  # O2g: the graphs' pools are memory the step holds too
            entry = result["variants"][name]
            entry["graph_bytes"] = stats.graph_bytes
            entry["state_bytes"] += stats.graph_bytes
            entry["peak_bytes"] += stats.graph_bytes
            entry["cuda_graph"] = {"captures": stats.captures, "replays": stats.replays,
                                   "eager_calls": stats.eager_calls, "eager_reasons": dict(stats.eager_reasons),
                                   "failed_captures": stats.failed_captures, "invalidations": stats.invalidations,
                                   "capture_error": v.call.capture_error}

    ac = result["variants"]["autocast"]
    for entry in result["variants"].values():
        entry["step_vs_autocast"] = entry["step_ms"] / ac["step_ms"]
        entry["step_vs_fp32"] = entry["step_ms"] / result["variants"]["fp32"]["step_ms"]
        entry["step_vs_floor"] = entry["step_ms"] / result["variants"]["floor"]["step_ms"]
        entry["cast_bytes_vs_autocast"] = entry["cast_bytes"] / ac["cast_bytes"] if ac["cast_bytes"] else None
        entry["saved_vs_autocast"] = entry["saved_bytes"] / ac["saved_bytes"] if ac["saved_bytes"] else None

    if profile:
        result["profile"] = (profile_cuda_variants(variants, tuple(variants)) if device.type == "cuda"
                             else profile_variants(variants, tuple(variants), clock=clock))
    for name, p in (result.get("profile") or {}).items():
        if "kernels_per_step" in p:
            log(f"[{spec.name}] {name:9s} profile: {p['kernels_per_step']:.0f} kernels / {p['gpu_busy_ms']:.3f} ms GPU busy "
                f"per step, {p['aten_calls_per_step']:.0f} aten calls / {p['aten_self_host_ms']:.3f} ms host self time")
    for name in _variant_names(result):
        e = result["variants"][name]
        log(f"[{spec.name}] {name:9s} step {e['step_ms']:8.3f} ms ({e['step_vs_autocast']:.3f}× autocast)  "
            f"casts {e['casts']:3d} / {e['cast_bytes'] / MiB:7.2f} MiB  saved {e['saved_bytes'] / MiB:7.2f} MiB  "
            f"peak {e['peak_bytes'] / MiB:7.2f} MiB  SQNR {e['sqnr_db']:6.2f} dB")
    graph = result["variants"].get("O2g", {}).get("cuda_graph")
    if graph is not None:
        log(f"[{spec.name}] O2g cuda_graph: {graph['captures']} captured, {graph['replays']} replays, "
            f"{graph['eager_calls']} eager calls {graph['eager_reasons']}"
            + (f"; capture failed: {graph['capture_error']}" if graph["capture_error"] else ""))
    return result


def _variant_names(model_result: dict[str, Any]) -> list[str]:
    """The variants a model's result holds, in table order."""
    return [n for n in VARIANTS + EXTRA_VARIANTS if n in model_result["variants"]]


# =========================================================================== targets
def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """benchmarks/README.md's targets, evaluated on whatever models were run."""
    models = results["models"]
    gpu = results["machine"].get("device") == "cuda"
    rows: list[dict[str, Any]] = []

    def add(target: str, model: str, value: float | None, limit: float, met: bool | None, detail: str,
            binding: bool = True) -> None:
        rows.append({"target": target, "model": model, "value": value, "limit": limit, "met": met,
                     "binding": binding, "detail": detail})

    portable = bool(results.get("config", {}).get("portable"))
    # issue 32: converted for the CPU, the small encoder ≤ 0.90× and the large ≤ 0.80×; the portable graph ≤ 0.95× on both
    step_limits = {"encoder_large": 1.0 if gpu else (0.95 if portable else 0.80),
                   "encoder_small": None if gpu else (0.95 if portable else 0.90),
                   "encoder_gpu": 1.0 if gpu else None}
    for model, limit in step_limits.items():
        if model in models and limit is not None:
            v = models[model]["variants"]
            ratio = v["O2"]["step_ms"] / v["autocast"]["step_ms"]
            add("O2 step ≤ k× autocast", model, ratio, limit, ratio <= limit,
                f"O2 {v['O2']['step_ms']:.3f} ms vs autocast {v['autocast']['step_ms']:.3f} ms "
                f"(O1 {v['O1']['step_ms'] / v['autocast']['step_ms']:.3f}×, floor {v['floor']['step_ms'] / v['autocast']['step_ms']:.3f}×)")
    for model in ("encoder_large", "encoder_small"):  # --ablate: the portable graph of the same run (issue 32)
        v = models.get(model, {}).get("variants", {})
        if gpu or portable or "O2-portable" not in v:
            continue
        ratio = v["O2-portable"]["step_ms"] / v["autocast"]["step_ms"]
        plain = v.get("O2-portable-plain")
        add("portable O2 step ≤ 0.95× autocast", model, ratio, 0.95, ratio <= 0.95,
            f"O2-portable {v['O2-portable']['step_ms']:.3f} ms vs autocast {v['autocast']['step_ms']:.3f} ms"
            + (f" (without its dispatching kernels {plain['step_ms'] / v['autocast']['step_ms']:.3f}×)" if plain else ""))
    for model, m in models.items():
        v = m["variants"]
        if "O2g" not in v:
            continue
        ac, fp32, g = v["autocast"]["step_ms"], v["fp32"]["step_ms"], v["O2g"]["step_ms"]
        graph = v["O2g"].get("cuda_graph") or {}
        how = (f"O2g {g:.3f} ms vs autocast {ac:.3f} ms, fp32 {fp32:.3f} ms, O2 {v['O2']['step_ms']:.3f} ms; "
               f"{graph.get('replays', '?')} replays, {graph.get('eager_calls', '?')} eager calls")
        # GPU targets (issue 32); on the CPU (--graphs on) O2g runs eagerly and the rows are information
        add("O2g step ≤ 0.9× autocast", model, g / ac, 0.9, g / ac <= 0.9, how, binding=gpu)
        add("O2g step ≤ fp32 step", model, g / fp32, 1.0, g <= fp32, how, binding=gpu)
        if model == "encoder_gpu":
            add("fp32 step ≥ 3.5× O2g (GPU-sized)", model, fp32 / g, 3.5, fp32 / g >= 3.5,
                f"fp32 {fp32:.3f} ms / O2g {g:.3f} ms (O2 {fp32 / v['O2']['step_ms']:.2f}×)", binding=gpu)
    for big in ("encoder_large", "encoder_gpu"):
        if big not in models:
            continue
        v = models[big]["variants"]
        for variant in ("O2", "O1"):
            ratio = v[variant]["cast_bytes"] / v["autocast"]["cast_bytes"]
            # "in O2 if O1 cannot reach it": the O1 row is information, not a target
            add(f"{variant} cast bytes ≤ 0.5× autocast", big, ratio, 0.5, ratio <= 0.5,
                f"{v[variant]['casts']} casts / {v[variant]['cast_bytes'] / MiB:.1f} MiB vs autocast "
                f"{v['autocast']['casts']} / {v['autocast']['cast_bytes'] / MiB:.1f} MiB"
                + (f"; plus {v[variant]['kernel_cast_bytes'] / MiB:.1f} MiB of operand upcasts inside the CPU GEMM "
                   "kernels (converter/passes/cpu_gemm.py, in the step time)" if v[variant].get("kernel_cast_bytes") else ""),
                binding=variant == "O2")
    for model, m in models.items():
        v = m["variants"]
        ac_saved = v["autocast"]["saved_bytes"]
        ratio = v["O2"]["saved_bytes"] / ac_saved if ac_saved else math.nan
        add("O2 saved activations ≤ autocast", model, ratio, 1.0, v["O2"]["saved_bytes"] <= ac_saved,
            f"O2 {v['O2']['saved_bytes'] / MiB:.2f} MiB (O1 {v['O1']['saved_bytes'] / MiB:.2f}) vs autocast {ac_saved / MiB:.2f} MiB")
        for variant in ("O2", "O1"):
            diff = v[variant]["sqnr_db"] - v["autocast"]["sqnr_db"]
            add(f"{variant} SQNR ≥ autocast − 1 dB", model, diff, -1.0, diff >= -1.0,
                f"{v[variant]['sqnr_db']:.2f} dB vs autocast {v['autocast']['sqnr_db']:.2f} dB")
    return rows


# =========================================================================== markdown
def _f(x: Any, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "−∞"
    return format(x, fmt)


def to_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    cfg = results["config"]
    threads = f"{m['torch_threads']} torch thread{'s' if m['torch_threads'] != 1 else ''}"
    dev = m.get("gpu") if m.get("device") == "cuda" else f"{m['cpu']}, {m['cores']} cores ({threads})"
    clock = cfg.get("clock", "wall")
    clock_text = {"wall": "wall-clock time (perf_counter)",
                  "cpu": "CPU time of the one torch thread (time.thread_time; the machine was shared)",
                  "cuda": "CUDA events"}[clock]
    lines = [
        f"Measured with `python benchmarks/run.py{' ' + ' '.join(cfg['argv']) if cfg.get('argv') else ''}` on {dev}, "
        f"{m['date']}, torch {m['torch']}, {cfg['precision']}, optimizer {cfg['optimizer']}"
        f"{', rules: default + ' + ', '.join(cfg['rules']) if cfg.get('rules') else ', default rules'}. "
        f"Step = zero_grad + forward + loss + backward + optimizer step, timed as {clock_text}; median of interleaved rounds "
        f"(rounds per model in the last table). Casts: `aten._to_copy` calls that change a floating dtype in "
        f"forward + backward, bytes read + written (`+ N k`: N MiB more are the operand upcasts inside the CPU "
        f"GEMM kernels of converter/kernels/upcast.py, counted apart: they are part of a GEMM that runs in fp32). Saved: distinct storages autograd saves for backward "
        f"(parameters and inputs excluded). Peak: params + masters + optimizer state + the step's peak "
        f"extra allocation ({'torch.cuda.max_memory_allocated' if m.get('device') == 'cuda' else 'torch.profiler allocation events'}).",
        "",
        "| model | variant | step ms | × autocast | × floor | fwd / bwd / opt ms | casts | cast MiB | saved MiB | peak MiB | SQNR dB | grad SQNR dB |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, r in results["models"].items():
        for name in _variant_names(r):
            e = r["variants"][name]
            lines.append(
                f"| {model} | {name} | {_f(e['step_ms'], '.3f' if e['step_ms'] < 10 else '.1f')} | "
                f"{_f(e['step_vs_autocast'])} | {_f(e['step_vs_floor'])} | "
                f"{_f(e['fwd_ms'])} / {_f(e['bwd_ms'])} / {_f(e['opt_ms'])} | {e['casts']} | "
                f"{_cast_cell(e)} | {_f(e['saved_bytes'] / MiB)} | {_f(e['peak_bytes'] / MiB, '.1f')} | "
                f"{'ref' if name == 'fp32' else _f(e['sqnr_db'], '.1f')} | "
                f"{'ref' if name == 'fp32' else _f(e.get('grad_sqnr_db'), '.1f')} |"
            )
    lines += ["", "**Targets** (benchmarks/README.md)", "", "| target | model | value | limit | met | detail |",
              "|---|---|---:|---:|:-:|---|"]
    for t in results.get("targets", []):
        met = "✅" if t["met"] else ("❌" if t["met"] is not None else "–")
        if not t.get("binding", True):
            met += " (info)"
        lines.append(f"| {t['target']} | {t['model']} | {_f(t['value'], '.3f')} | {_f(t['limit'])} | {met} | {t['detail']} |")
    profiled = [(model, r["profile"]) for model, r in results["models"].items()
                if any("kernels_per_step" in p for p in (r.get("profile") or {}).values())]
    if profiled:
        lines += ["", "**Where a CUDA step goes** (`--profile`: torch.profiler over a few steps; GPU busy = summed kernel "
                  "time; a step much longer than its GPU busy time is bound by the host launching kernels)", "",
                  "| model | variant | step ms | GPU busy ms | kernels / step | aten events / step (nested incl.) | host self ms (profiled) |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for model, prof in profiled:
            for name in VARIANTS + EXTRA_VARIANTS:
                if name in prof:
                    p = prof[name]
                    lines.append(f"| {model} | {name} | {_f(results['models'][model]['variants'][name]['step_ms'], '.3f')} | "
                                 f"{_f(p['gpu_busy_ms'], '.3f')} | {_f(p['kernels_per_step'], '.0f')} | "
                                 f"{_f(p['aten_calls_per_step'], '.0f')} | {_f(p['aten_self_host_ms'], '.2f')} |")
    lines += ["", "**Conversion time** (capture, then decide + place + rewrite) **and timing rounds**", "",
              "| model | tracer | capture s | pass s | graph casts O1 (act / weight) | graph casts O2 (act / weight) | rounds × steps/block |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for model, r in results["models"].items():
        c = r["conversion"]
        o2 = c.get("levels", {}).get("O2", {})
        lines.append(f"| {model} | {c['tracer']} | {_f(c['capture_s'], '.3f')} | {_f(c['pass_s'], '.3f')} | "
                     f"{c.get('graph_casts')} / {c.get('graph_weight_casts')} | "
                     f"{o2.get('graph_casts', '–')} / {o2.get('graph_weight_casts', '–')} | "
                     f"{r['timing']['rounds']} × {r['timing']['inner']} |")
    return "\n".join(lines) + "\n"


# =========================================================================== main
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and, by default, only the small models")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help="models to run (default: all, encoder_gpu on CUDA only; --quick: the small ones)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (CUDA events timing, cuda.max_memory_allocated)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="CPU only. wall: perf_counter with torch's default threads (a quiet machine). cpu: one torch "
                        "thread timed with time.thread_time, which excludes time spent descheduled (a shared machine)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for --clock wall (default: torch's default)")
    p.add_argument("--precision", default="bf16", choices=sorted(HALF), help="the half dtype (fp16 is ~200× slower on CPU)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"), help="same optimizer for every variant")
    p.add_argument("--rounds", type=int, help="minimum timing rounds per model (default 15; --quick 5)")
    p.add_argument("--max-rounds", type=int, default=400)
    p.add_argument("--budget", type=float, help="target timing seconds per model (default 45; --quick 2)")
    p.add_argument("--block-ms", type=float, default=20.0, help="consecutive steps of one variant are grouped into a "
                   "block of about this many ms (sub-ms steps are not timed one by one)")
    p.add_argument("--warmup", type=int, help="discarded rounds (default 3; --quick 1)")
    p.add_argument("--rules", nargs="+", help="rule files layered over the defaults for the converted variants")
    p.add_argument("--portable", action="store_true", help="convert without naming the device (no device lowerings; "
                   "by default the converted variants are converted for the device they run on)")
    p.add_argument("--ablate", action="store_true", help="also time O2 with each lowering choice flipped: "
                   + "; ".join(f"{k}: {v}" for k, v in ABLATIONS.items()))
    p.add_argument("--profile", action="store_true", help="also store per-op times (fwd/bwd/opt) of every variant: where O2 loses to the floor "
                   "(on CUDA: torch.profiler kernels, GPU busy time and host ops per step)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                   help="the O2g variant (O2 with converter.cuda_graph): auto = on CUDA only; on = also on the CPU, "
                        "where its calls run eagerly (a check of the code path, not a speed-up)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/<device>.json); Markdown next to it")
    p.add_argument("--from-json", type=Path, help="only regenerate the Markdown of an existing JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parse(argv)
    if a.from_json is not None:
        results = from_json(json.loads(a.from_json.read_text()))
        results["targets"] = check_targets(results)
        md = a.from_json.with_suffix(".md")
        md.write_text(to_markdown(results))
        print(f"wrote {md}")
        return 0
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device available", file=sys.stderr)
        return 2
    half = HALF[a.precision]
    clock = "cuda" if device.type == "cuda" else a.clock
    if clock == "cpu":
        if a.threads not in (None, 1):
            print("--clock cpu times one thread: it needs --threads 1", file=sys.stderr)
            return 2
        torch.set_num_threads(1)
    elif a.threads is not None:
        torch.set_num_threads(a.threads)
    names = a.models or [n for n, s in MODELS.items() if (s.quick or not a.quick) and device.type in s.devices]
    min_rounds = a.rounds if a.rounds is not None else (5 if a.quick else 15)
    if min_rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    budget = a.budget if a.budget is not None else (2.0 if a.quick else 45.0)
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    out = a.out or ROOT / "benchmarks" / "results" / (
        "cpu.json" if device.type == "cpu" else f"cuda_{a.precision}.json")
    warnings.filterwarnings("ignore")  # HF config chatter and dtype-mismatch notices are not results

    results: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": machine_info(device),
        "config": {"argv": argv, "quick": a.quick, "precision": a.precision, "optimizer": a.optimizer, "clock": clock,
                   "rules": a.rules or [], "portable": a.portable, "graphs": a.graphs, "ablate": a.ablate,
                   "rules_text": {str(r): Path(r).read_text() for r in (a.rules or []) if Path(r).is_file()},
                   "min_rounds": min_rounds, "max_rounds": a.max_rounds, "budget_s": budget,
                   "block_ms": a.block_ms, "warmup_rounds": warmup},
        "models": {},
    }
    load = results["machine"].get("loadavg_at_start")
    if clock == "wall" and load and load[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load[0]} on {os.cpu_count()} cores: wall-clock timings will be noisy; "
              "consider --clock cpu", file=sys.stderr)
    t_all = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    md = out.with_suffix(".md")

    def write() -> None:  # after every model: a run cut short (a time-boxed GPU session) keeps what it measured
        results["wall_s"] = time.perf_counter() - t_all
        results["targets"] = check_targets(results)
        out.write_text(json.dumps(to_json(results), indent=1, allow_nan=False) + "\n")
        md.write_text(to_markdown(results))

    for name in names:
        results["models"][name] = run_model(
            MODELS[name], device=device, half=half, optimizer=a.optimizer, min_rounds=min_rounds,
            max_rounds=a.max_rounds, budget_s=budget, block_s=a.block_ms / 1e3, warmup=warmup, profile=a.profile, clock=clock, rules=a.rules,
            portable=a.portable, graphed={"auto": None, "on": True, "off": False}[a.graphs], ablate=a.ablate)
        write()
    if not names:
        write()
    print(f"wrote {out} and {md} in {results['wall_s']:.0f}s")
    for t in results["targets"]:
        tag = ("MET " if t["met"] else "MISS") if t.get("binding", True) else "info"
        print(f"  {tag} {t['target']} [{t['model']}]: {t['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
