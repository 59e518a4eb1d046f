"""Training wrapper for converted mixed-precision models: loss scaling, fp32 master weights, DDP.

Two modes, named after Apex's opt levels:

* **O1** (``master_weights=False``): parameters stay fp32 and the converted graph casts them to
  half where an op runs in half. The optimizer steps the fp32 parameters directly; fp16 runs
  through a :class:`~converter.train.scaler.LossScaler`.
* **O2** (``master_weights=True``): parameters are *stored* in half, which halves weight memory
  and removes the per-forward weight casts. The trainer keeps an fp32 master copy of every half
  parameter and points the optimizer at the masters, so updates smaller than half's resolution
  are not lost. Each step: half grads are accumulated into fp32 master grads, (DDP) all-reduced
  in fp32, unscaled, checked for inf/NaN, clipped, the optimizer steps the masters, and the
  masters are copied back into the half parameters with one ``copy_`` per flat buffer.

What one ``step()`` costs, measured against ``torch.amp.GradScaler`` + the optimizer (whose work it
replaces; ``benchmarks/trainer_step.py``): one fused unscale-and-check kernel per gradient buffer
(O2's fp32 gradients are views of one buffer per device), the optimizer's foreach (or, opt-in,
fused) step, O2's one master→model copy, the scale update on the device, and **one** host
synchronisation, before the optimizer step, that reads every scalar the step decides on (the
found-inf flag, the loss, and the gradient norm where one is computed). Nothing the step does not need
is computed or read: the gradient norm is computed in the step only for clipping, the spike guard,
FSDP, a callback, or as bf16's check under O2 (else lazily, when ``trainer.stats`` is read), and the
scale after the update is read by the next step's copy or when the stats are
(:attr:`MixedPrecisionTrainer.stats`).

The model's weights: a converted module shares its parameters' storage with the original model
(``converter.convert`` copies no weight), so O1 training updates the original model's weights in
place too. O2 gives every trainable parameter storage of its own when the trainer is built (half
copies, and copies of the ones kept fp32), so O2 training leaves the original model as it was;
the trained weights are the module's (``trainer.state_dict()``, or its masters).

Which parameters stay fp32 under O2: the converter records the storage dtype of each parameter
in ``module.meta["mp_param_dtypes"]`` (fqn -> dtype); parameters the map does not name stay fp32.
Without that map (a hand-written model) the fallback keeps fp32 every parameter of a module whose
class name contains ``"Norm"`` or ``"Embedding"`` (as Apex O2 keeps batch norm fp32 and Keras keeps
normalisation and embedding layers fp32): their statistics and lookups gain nothing from half
storage and are the usual source of precision loss.

bf16 has fp32's 8-bit exponent, so gradients do not underflow and no loss scaler is used; steps
whose gradients hold inf/NaN are still skipped, since stepping on inf/NaN destroys weights.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import statistics
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError
from converter.ir.meta import GM_PARAM_DTYPES, META_CAST, META_INFO, META_TRAINER
from converter.ir.precision import half_dtype
from converter.train.amp_kernels import unscale_grads, unscale_groups
from converter.train.cuda_graph import CudaGraphModule
from converter.train.scaler import LossScaler

__all__ = ["MixedPrecisionTrainer", "SpikeGuard", "TrainStats", "TrainingStalledError"]

_LOG = logging.getLogger(__name__)

_FP32_MODULE_MARKERS = ("Norm", "Embedding")
_BF16_NO_SCALER = (
    "bf16 has the same 8-bit exponent range as fp32, so gradients do not underflow and loss scaling "
    "is unnecessary; pass precision='fp16' to use a loss scaler, or drop the {what} for bf16."
)
_STATE_FORMAT = 1
_DEFAULT_MIN_SCALE = 1.0  # the trainer's dynamic scaler never goes below 1 (DeepSpeed, Megatron)
_DEFAULT_MAX_CONSECUTIVE_SKIPS = 100


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


# C-level accessors for the per-step loops over parameters (map() over these runs no Python frame per tensor)
_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr
_NOT_NONE = functools.partial(operator.is_not, None)


def _unwrap(module: nn.Module) -> nn.Module:
    """The model inside a data-parallel wrapper or a :func:`converter.cuda_graph` wrapper (its fqns, its meta)."""
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel, CudaGraphModule)):
        return module.module
    return module


def _fsdp_module(module: nn.Module) -> nn.Module | None:
    """``module`` when it was sharded with ``torch.distributed.fsdp.fully_shard`` (FSDP2), else None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return module if isinstance(module, FSDPModule) else None


def _enable_foreach(optimizer: torch.optim.Optimizer) -> int:
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
_FUSED_DEVICE_TYPES = ("cpu", "cuda")


def _enable_fused(optimizer: torch.optim.Optimizer) -> int:
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


def _check_optional_count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value


def _shrink_embedding_grad(alpha: float, _module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
    """GLM-130B's embedding gradient shrink: same forward value, gradient multiplied by ``alpha``."""
    return output * alpha + output.detach() * (1.0 - alpha)


def _is_embedding_node(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in (nn.functional.embedding, torch.ops.aten.embedding.default):
        return True
    info = node.meta.get(META_INFO)  # the converter's canonical op name
    return getattr(info, "op", None) == "embedding"


def _shrink_graph_embeddings(gm: torch.fx.GraphModule, alpha: float) -> int:
    """Rewrite every embedding node ``e`` of ``gm`` into ``e*alpha + e.detach()*(1-alpha)``; returns the count.

    The converter inlines modules into functional calls (``F.embedding`` on a ``get_attr``
    weight), so a hook on the ``nn.Embedding`` module would never fire there.
    """
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if not _is_embedding_node(node):
            continue
        with graph.inserting_after(node):
            kept = graph.call_function(operator.mul, (node, alpha))
        with graph.inserting_after(kept):
            frozen = graph.call_method("detach", (node,))
        with graph.inserting_after(frozen):
            rest = graph.call_function(operator.mul, (frozen, 1.0 - alpha))
        with graph.inserting_after(rest):
            shrunk = graph.call_function(operator.add, (kept, rest))
        for new in (kept, frozen, rest, shrunk):
            new.meta[META_TRAINER] = "embedding_grad_shrink"
        node.replace_all_uses_with(shrunk, delete_user_cb=lambda user, mine=(kept, frozen): user not in mine)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def _drop_identity_weight_casts(inner: nn.Module) -> int:
    """O2: remove the converter's weight casts that the half storage made identities.

    A converted graph casts each fp32 parameter to half where an op runs in half (O1). Once the
    parameter is *stored* in that dtype the cast returns its input unchanged, but each one is
    still a Python call and a dispatch per forward (~1.5 µs, 16 of them in a 2-layer encoder).
    Only casts the converter inserted on a ``get_attr`` of a parameter now stored in the cast's
    dtype are removed; the count is returned (and kept as ``trainer.dropped_weight_casts``).
    Storing the parameters back in fp32 afterwards would need the casts again: O2 is one-way.
    """
    if not isinstance(inner, torch.fx.GraphModule):
        return 0
    params = dict(inner.named_parameters())
    graph = inner.graph
    dropped = 0
    for node in list(graph.nodes):
        record = node.meta.get(META_CAST)
        if record is None or not record.on_weight or not record.inserted:
            continue
        if node.op != "call_method" or node.target != "to" or len(node.args) != 2 or node.kwargs:
            continue
        src, dtype = node.args
        if not (isinstance(src, torch.fx.Node) and src.op == "get_attr" and isinstance(dtype, torch.dtype)):
            continue
        param = params.get(str(src.target))
        if param is None or param.dtype != dtype:
            continue
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        dropped += 1
    if dropped:
        inner.recompile()
    return dropped


def _fallback_storage_dtype(module_class: str, half: torch.dtype) -> torch.dtype:
    if any(marker in module_class for marker in _FP32_MODULE_MARKERS):
        return torch.float32
    return half


def _storage_plan(inner: nn.Module, half: torch.dtype, given: dict | None = None) -> dict[str, torch.dtype]:
    """fqn -> storage dtype under O2 for every floating (non-fp64) parameter of ``inner``: from ``given``,
    else ``inner.meta["mp_param_dtypes"]``, else the Norm/Embedding fallback."""
    params = {
        name: p for name, p in inner.named_parameters() if p.is_floating_point() and p.dtype != torch.float64
    }
    meta = getattr(inner, "meta", None)
    if given is not None or (isinstance(meta, dict) and GM_PARAM_DTYPES in meta):
        recorded = given if given is not None else meta[GM_PARAM_DTYPES]
        if not isinstance(recorded, dict):
            raise TypeError(f"module.meta['mp_param_dtypes'] must be a dict fqn -> torch.dtype, got {type(recorded)}")
        unknown = sorted(set(recorded) - set(dict(inner.named_parameters())))
        if unknown:
            raise ValueError(f"module.meta['mp_param_dtypes'] names parameters the module does not have: {unknown[:5]}")
        for fqn, dtype in recorded.items():
            if dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise ValueError(
                    f"module.meta['mp_param_dtypes'][{fqn!r}] must be torch.float16, torch.bfloat16 or "
                    f"torch.float32, got {dtype!r}"
                )
        return {name: recorded.get(name, torch.float32) for name in params}
    owners = {}
    for module_name, module in inner.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            fqn = f"{module_name}.{param_name}" if module_name else param_name
            owners.setdefault(fqn, type(module).__name__)
    return {name: _fallback_storage_dtype(owners.get(name, ""), half) for name in params}


@dataclasses.dataclass
class _FlatGroup:
    """O2 buffers of one (device, half dtype): model params and fp32 masters as views of one buffer each."""

    model_flat: torch.Tensor
    master_flat: torch.Tensor
    models: list = dataclasses.field(default_factory=list)
    masters: list = dataclasses.field(default_factory=list)
    _tensors: list = dataclasses.field(default_factory=list)
    _ptrs: list = dataclasses.field(default_factory=list)

    def pin(self) -> None:
        self._tensors = self.models + self.masters
        self._ptrs = list(map(_DATA_PTR, self._tensors))

    def intact(self) -> bool:
        """Every parameter and master still lives in the flat buffers (checked every step, in C-level loops)."""
        return list(map(_DATA_PTR, self._tensors)) == self._ptrs


@dataclasses.dataclass
class _GradArena:
    """O2: one fp32 buffer per device whose views are the gradients of every tensor the optimizer steps.

    Slots: the masters' gradients and those of the trainable parameters stored in fp32 (norm
    weights). When every optimizer gradient is its slot, the per-step passes over the gradients run
    on the buffers (``buffers``): one fused unscale-and-check kernel, one norm reduction, one clip
    multiply per device, instead of one per tensor (and a stack and a norm of norms). A slot whose
    owner has no gradient this step is zeroed before (``dirty``: it may still hold an old one), so
    the buffers hold exactly the optimizer's gradients.
    """

    flats: list = dataclasses.field(default_factory=list)  # one fp32 buffer per device
    slots: list = dataclasses.field(default_factory=list)  # (owner, its gradient view)
    slot_of: dict = dataclasses.field(default_factory=dict)  # id(owner) -> view
    dirty: set = dataclasses.field(default_factory=set)  # ids of owners whose slot may hold a gradient

    def buffers(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The flat buffers when ``params``' gradients ``grads`` (none None) are exactly the slots in use, else None."""
        if not self.flats:
            return None
        if not all(map(operator.is_, grads, map(self.slot_of.get, map(id, params)))):
            return None
        if len(params) == len(self.slots):  # every slot is some param's gradient: none is stale
            return self.flats
        with_grad = 0
        for owner, view in self.slots:
            if owner.grad is not None:
                with_grad += 1
            elif id(owner) in self.dirty:
                view.zero_()
                self.dirty.discard(id(owner))
        if with_grad != len(params):  # a slot's owner left the optimizer but kept its gradient
            return None
        return self.flats


def _total_norm(grads: list[torch.Tensor], buffers: list[torch.Tensor] | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """2-norm of ``grads`` as a 0-dim device tensor (no sync): one reduction per arena buffer when
    ``buffers`` hold exactly those gradients, else ``get_total_norm``'s arithmetic. Written into ``out``
    (a 0-dim fp32 slot of the trainer's readout buffer) when given."""
    if buffers is not None:
        norms = [torch.linalg.vector_norm(flat) for flat in buffers] if len(buffers) > 1 else list(buffers)
    elif not grads:
        return torch.zeros(()) if out is None else out.zero_()
    else:
        # get_total_norm's arithmetic and order (per (device, dtype) group, _foreach_norm, a norm of the
        # stacked norms), without its .to() on every per-tensor norm when there is only one group
        grouped = torch._C._group_tensors_by_device_and_dtype([grads], False)
        norms = [norm for (tensors,), _indices in grouped.values() for norm in torch._foreach_norm(tensors)]
        if len(grouped) > 1:
            norms = [norm.to(grads[0].device) for norm in norms]
    source = norms[0] if buffers is not None and len(buffers) == 1 else torch.stack(
        [n.to(norms[0].device) for n in norms] if buffers is not None else norms)
    if out is not None and out.device == source.device and source.dtype == torch.float32:
        return torch.linalg.vector_norm(source, out=out)
    norm = torch.linalg.vector_norm(source)
    return norm if out is None else out.copy_(norm)


class _LazyNorm:
    """The gradient norm of the last step, computed only when read (``TrainStats.grad_norm``).

    The step needs the norm only to clip, for the spike guard, for bf16's non-finite check or a
    callback; otherwise computing it would be a pass over all gradient memory that nobody reads.
    This keeps what is needed to compute it later, exactly, from the same (unscaled, unclipped)
    gradients: the arena buffers (persistent memory, so held strongly) or weak references to the
    gradient tensors (a dropped gradient is not kept alive), plus their version counters, taken
    before the optimizer step. A gradient changed since (an optimizer writing it in place, the next
    backward's harvest) or freed (``zero_grad``) makes the value unknown: None.
    """

    __slots__ = ("_buffers", "_refs", "_versions")

    def __init__(self, grads: list[torch.Tensor], buffers: list[torch.Tensor] | None) -> None:
        self._buffers = buffers
        self._refs = None if buffers is not None else list(map(weakref.ref, grads))
        self._versions = list(map(_VERSION, buffers if buffers is not None else grads))

    def value(self) -> float | None:
        if self._buffers is not None:
            tensors = self._buffers
        else:
            tensors = [ref() for ref in self._refs]
            if any(t is None for t in tensors):
                return None
        if list(map(_VERSION, tensors)) != self._versions:
            return None
        return float(_total_norm(tensors, self._buffers).item())


#: slots of the trainer's readout buffer: the step's device scalars, copied to the host together
_FOUND, _NORM, _AGREE, _LOSS, _AFTER, _ONE = range(6)  # _ONE holds 1.0: the no-op inv_scale of a check


class MixedPrecisionTrainer:
    """Drives the backward/step of a mixed-precision model: scaling, master weights, clipping, DDP.

    Args:
        module: the model (usually ``converter.convert(...).module``), optionally wrapped in
            ``DistributedDataParallel``.
        optimizer: built on ``module``'s parameters. Under O2 its param groups are rewritten to
            point at the fp32 masters (any state it already has moves with them).
        precision: ``"fp16"``/``"float16"``/``"16-mixed"`` or ``"bf16"``/``"bfloat16"``/``"bf16-mixed"`` (any
            spelling :mod:`converter.ir.precision` accepts). fp16 is the default
            because it is the mode that needs this wrapper (scaling); bf16 only needs O2.
        master_weights: False = O1 (fp32 params, cast in the graph); True = O2 (half params, fp32
            masters). False by default: O1 keeps the model exactly as converted and works with any
            optimizer; O2 is the memory/speed option.
        loss_scale: ``"dynamic"`` (a :class:`LossScaler` with ``min_scale=1.0``: DeepSpeed's and
            Megatron's floor, so a run of overflows cannot drive the scale to 0, whose reciprocal
            would turn every later gradient into inf/NaN), a float (a static scale), a
            :class:`LossScaler` (used as given, floor or not), or None (fp16 without scaling: a
            static scale of 1 that still skips non-finite steps). Must be ``"dynamic"`` or None
            for bf16, which needs no scaling.
        max_grad_norm: clip the total 2-norm of the unscaled gradients to this (None = no clipping,
            the neutral choice; clipping always happens after unscaling, so the threshold is in
            true gradient units).
        accumulation_steps: backward calls per optimizer step (1 = no accumulation). The loss is
            divided by it so the accumulated gradient is the mean.
        scaler: a :class:`LossScaler` to use (same as passing it as ``loss_scale``).
        callback: called with a copy of :class:`TrainStats` after every real step.
        max_consecutive_skips: raise :class:`TrainingStalledError` (naming the step count) when
            this many optimizer steps in a row were skipped (non-finite gradients or spikes),
            instead of going on silently without learning. 100 by default (from the default cap of
            2**24 a dynamic scale reaches 1 in 24 overflows, 48 with hysteresis 2); None disables it.
        spike_guard: a :class:`SpikeGuard` to skip steps whose gradient norm spikes; None (off) by
            default. Skips are counted in ``stats.spike_skips`` and logged (``logging`` warning).
        optimizer_foreach: set ``foreach=True`` on the optimizer's param groups that left
            ``foreach`` at None (torch's default on CPU is then a per-parameter Python loop; the
            multi-tensor path does the same arithmetic in a few ``_foreach_*`` calls: SGD with
            momentum on the 2-layer d128 encoder takes 170 µs instead of 210 µs). True by default;
            groups with ``foreach``/``fused``/``differentiable`` set explicitly are left alone.
        optimizer_fused: set ``fused=True`` instead on the param groups of a ``torch.optim`` SGD, Adam or
            AdamW that left ``foreach`` and ``fused`` at None and have no state yet (CPU or CUDA params):
            the whole update in one kernel pass per tensor (SGD with momentum on the benchmark encoder:
            0.30 ms instead of 0.48 on the CPU; AdamW 0.55 instead of 3.3 ms). False by default: fused
            kernels round differently in the last bit from the foreach/per-parameter paths (which agree
            exactly), so a run would no longer match a plain torch loop bit for bit.
        param_dtypes: O2's storage plan, fqn -> dtype, instead of ``module.meta["mp_param_dtypes"]``
            (for a model converted in place with :func:`converter.apply`, which has no ``meta``:
            pass ``converter.conversion_of(model).module.meta["mp_param_dtypes"]``).
        embedding_grad_shrink: ``alpha`` in (0, 1]: every ``nn.Embedding`` output becomes
            ``alpha*e + (1-alpha)*e.detach()`` (GLM-130B's trick against early loss spikes). None by
            default: it changes the optimisation. Implemented as forward hooks on the ``nn.Embedding``
            modules that run; in a GraphModule (a converted model inlines modules into
            ``F.embedding`` calls; ``torch.export`` gives ``aten.embedding``) each embedding node is
            rewritten in place into that expression. An embedding computed any other way (a plain
            module calling ``F.embedding`` itself) is not seen; when nothing is found the option is
            rejected with a ValueError rather than silently doing nothing.

    Use::

        trainer.zero_grad(); loss = loss_fn(model(x), y); trainer.backward(loss); trainer.step()

    ``zero_grad()`` only clears gradients at an accumulation boundary, so that loop accumulates
    correctly with ``accumulation_steps > 1``.

    Every step is taken only on finite gradients, for fp16, bf16 and no scaler alike, so no inf/NaN
    ever reaches the weights. fp16's fused kernel checks the scaled gradients; a finite one can still
    overflow when multiplied by ``1/scale`` if the scale is below 1, so the unscaled gradients are
    checked too: through their norm when the step computes one, else, whenever the scale is below 1,
    by an exact element-wise pass (a second sync, only then). bf16 checks the gradient norm under O2
    and the gradients element-wise under O1. Where the step computes the norm, a norm that overflows
    (only past ~1.8e19, gradients that are finite but absurd) skips the step too.

    **FSDP2** (``torch.distributed.fsdp.fully_shard``): build the trainer on the sharded module,
    after ``fully_shard`` (the optimizer too). O1 only (``master_weights=False``). The gradient
    norm is the global one (DTensor shards reduced), every rank skips together, accumulation uses
    ``set_requires_gradient_sync``, and ``state_dict()``/``load_state_dict()`` go through
    ``torch.distributed.checkpoint.state_dict`` (sharded, for ``torch.distributed.checkpoint``).
    Never let FSDP and the converted graph both cast: for a converted module keep FSDP's
    ``MixedPrecisionPolicy`` at ``param_dtype=None`` (the graph casts each weight where its op
    runs in half; FSDP would also round the weights the converter kept fp32, such as norm
    weights) with ``reduce_dtype=torch.float32``. For a plain module, FSDP's
    ``param_dtype=torch.bfloat16, reduce_dtype=torch.float32`` *is* O2: its fp32 shards are the
    master weights. See ``docs/training.md``.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        precision: str = "fp16",
        master_weights: bool = False,
        loss_scale: str | float | LossScaler | None = "dynamic",
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        scaler: LossScaler | None = None,
        callback: Callable[[TrainStats], Any] | None = None,
        embedding_grad_shrink: float | None = None,
        max_consecutive_skips: int | None = _DEFAULT_MAX_CONSECUTIVE_SKIPS,
        spike_guard: SpikeGuard | None = None,
        optimizer_foreach: bool = True,
        optimizer_fused: bool = False,
        param_dtypes: dict[str, torch.dtype] | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        half = half_dtype(precision)  # PrecisionError (a ValueError) names the accepted spellings
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
        self._max_consecutive_skips = _check_optional_count("max_consecutive_skips", max_consecutive_skips)
        self._spike_guard = spike_guard
        self._norm_history: deque[float] = deque(maxlen=spike_guard.window if spike_guard else 1)

        self._module = module
        self._inner = _unwrap(module)
        self._ddp = module if isinstance(module, nn.parallel.DistributedDataParallel) else None
        self._fsdp = _fsdp_module(module)
        if self._fsdp is not None and master_weights:
            raise ValueError(
                "master_weights=True (O2) is not supported on an FSDP2 (fully_shard) module: its DTensor "
                "shards cannot be re-laid out as half copies. Use master_weights=False; for O2 storage let FSDP "
                "keep fp32 shards as the masters with MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32) on an unconverted module (docs/training.md)."
            )
        self._optimizer = optimizer
        self._half = half
        self._precision = "fp16" if self._half == torch.float16 else "bf16"
        self._master_weights = master_weights
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._accumulation_steps = accumulation_steps
        self._callback = callback
        self._scaler = self._resolve_scaler(loss_scale, scaler)
        self._micro = 0
        self._loss_sum: torch.Tensor | None = None
        self._stats = TrainStats(scale=self._scaler.get_scale() if self._scaler is not None else 1.0)
        # a scaler that scales (a disabled LossScaler is a pass-through: the norm is then the check)
        self._scaling = self._scaler is not None and self._scaler.is_enabled()
        # the gradient norm is computed in the step only where the step or a caller needs it (see _LazyNorm);
        # without scaling it is also the check where it is the cheapest one (O2's arena: one read-only reduction)
        self._eager_norm = (self._max_grad_norm is not None or spike_guard is not None or callback is not None
                            or self._fsdp is not None)
        self._lazy_norm: _LazyNorm | None = None
        # One fp32 buffer per step for the device scalars the host needs (found-inf flag, gradient norm, the
        # ranks' agreement, the loss, the scale after the last update: slots _FOUND.._AFTER), written by the
        # ops that produce them and copied to the host with one .tolist(): GradScaler's one sync per step.
        self._readout: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []  # its 0-dim views, made once (indexing is an op per call)
        self._step_scale: float | None = None  # the scale the current step unscaled with
        self._step_found = False  # whether the scaler found inf/NaN this step
        # stats.scale/overflows of the last step are settled lazily, so that no sync follows the optimizer
        # step: the scale it used, and the scale after its update (slot _AFTER, read by the next step's copy
        # or when stats are read).
        self._pending_scale: float | None = None
        self._step_loss: float | None = None  # this step's mean loss (slot _LOSS)
        # the scale's value as the host last read it, valid while the scaler's _version is _scale_seen_version
        self._scale_seen: float | None = self._stats.scale if self._scaling else None
        self._scale_seen_version = self._scaler._version if self._scaling else 0
        self._version_after_update = 0
        # (fqn, half model param, fp32 master) for every trainable half-stored parameter (O2).
        self._masters: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        # O2 storage: flat buffers of half params, fp32 masters and master grads (see _flatten)
        self._flat_groups: list[_FlatGroup] = []
        self._loose_groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        # O2 harvest: (half model param, fp32 master) pairs, and one persistent fp32 gradient buffer per
        # master (its view of the flat grad buffer; allocated on first use for a non-contiguous param),
        # so a step's harvest copies into memory it already owns.
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._grad_bufs: list[torch.Tensor | None] = []
        # O2: the optimizer's gradients as slots of one fp32 buffer per device (see _GradArena), and the
        # (fp32-stored trainable param, its slot) pairs among them
        self._arena = _GradArena()
        self._direct: list[tuple[nn.Parameter, torch.Tensor, int]] = []  # (param, slot, param's data_ptr)
        self._half_params: list[nn.Parameter] = []  # the half params of _pairs, and the params/slots of _direct
        self._direct_params: list[nn.Parameter] = []
        self._direct_slots: list[torch.Tensor] = []
        # Every parameter of the model, listed once so zero_grad() need not walk the module tree.
        self._model_params: list[nn.Parameter] = list(self._inner.parameters())
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._param_dtypes = param_dtypes  # O2 storage plan (fqn -> dtype) instead of module.meta's
        self.dropped_weight_casts = 0  # O2: converter weight casts made identities by half storage

        if master_weights:
            self._setup_master_weights()
            self.dropped_weight_casts = _drop_identity_weight_casts(self._inner)
        else:
            self._check_o1_params()
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(accumulation_steps == 1)
        if self._ddp is not None:
            # O2: DDP would all-reduce half gradients into buckets laid out for the fp32 params it
            # was built with. Turn its reduction off (what no_sync() does) and all-reduce the fp32
            # master gradients in step() instead. O1: keep DDP's reduction, but only on the
            # backward that completes an accumulation window.
            self._ddp.require_backward_grad_sync = (not master_weights) and accumulation_steps == 1
        if embedding_grad_shrink is not None:
            self._install_embedding_shrink(embedding_grad_shrink)
        for name, flag in (("optimizer_foreach", optimizer_foreach), ("optimizer_fused", optimizer_fused)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.fused_groups = _enable_fused(optimizer) if optimizer_fused else 0  # groups switched to fused
        self.foreach_groups = _enable_foreach(optimizer) if optimizer_foreach else 0  # groups switched to foreach

    # ------------------------------------------------------------------ setup
    def _resolve_scaler(self, loss_scale: Any, scaler: LossScaler | None) -> LossScaler | None:
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(f"scaler must be a LossScaler, got {type(scaler).__name__}")
        if self._half == torch.bfloat16:
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

    def _optimizer_params(self) -> list[torch.Tensor]:
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def _check_o1_params(self) -> None:
        if self._scaler is None:
            return
        half_params = [p for p in self._optimizer_params() if p.dtype == torch.float16]
        if half_params:
            raise ValueError(
                f"{len(half_params)} optimizer parameters are stored in fp16, but master_weights=False "
                "(O1) steps the stored parameters directly and fp16 gradients cannot be unscaled safely; "
                "keep the parameters fp32 or pass master_weights=True (O2)."
            )

    def _setup_master_weights(self) -> None:
        plan = _storage_plan(self._inner, self._half, self._param_dtypes)
        master_of: dict[int, nn.Parameter] = {}
        for fqn, param in self._inner.named_parameters():
            if fqn not in plan:
                continue
            target = plan[fqn]
            original = param.detach()
            if target != torch.float32 and param.requires_grad:
                master = nn.Parameter(original.to(torch.float32, copy=True))
                self._masters.append((fqn, param, master))
                master_of[id(param)] = master
            if param.dtype != target:
                param.data = original.to(target)
            elif param.requires_grad:
                # a converted module shares its weights' storage with the original model (O1 trains
                # both); O2 trains half copies and fp32 masters, so the parameters kept fp32 get
                # storage of their own too: the original model keeps all its weights as they were
                # (a storage nothing else holds is freed right away: no memory is added)
                param.data = original.clone()
        for group in self._optimizer.param_groups:
            group["params"] = [master_of.get(id(p), p) for p in group["params"]]
        for param in list(self._optimizer.state.keys()):
            if id(param) in master_of:
                self._optimizer.state[master_of[id(param)]] = self._optimizer.state.pop(param)
        self._pairs = [(param, master) for _fqn, param, master in self._masters]
        self._grad_bufs = [None] * len(self._pairs)
        self._flatten()

    def _flatten(self) -> None:
        """Lay the half params, their fp32 masters and the optimizer's grads out in flat buffers.

        One buffer of half params and one of masters per (device, half dtype), parameters as views
        into it: the master→model copy is then one ``copy_`` per buffer instead of one kernel per
        parameter (on a 2-layer d128 encoder that is 0.15 ms of a 4.4 ms step). The gradients the
        optimizer reads (masters', and those of trainable fp32-stored params) get slots in one fp32
        buffer per device (:class:`_GradArena`), so the gradient norm is one reduction.
        Non-contiguous parameters keep their own storage and go through ``_foreach_copy_``.
        """
        by_key: dict[tuple, list[int]] = {}
        loose: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for index, (param, master) in enumerate(self._pairs):
            if param.is_contiguous() and master.is_contiguous():
                by_key.setdefault((param.device, param.dtype), []).append(index)
            else:
                models, masters = loose.setdefault(param.dtype, ([], []))
                models.append(param)
                masters.append(master)
        self._loose_groups = list(loose.values())
        self._flat_groups = []
        owners: dict[torch.device, list[torch.Tensor]] = {}
        for (device, dtype), indices in by_key.items():
            total = sum(self._pairs[i][0].numel() for i in indices)
            group = _FlatGroup(model_flat=torch.empty(total, dtype=dtype, device=device),
                               master_flat=torch.empty(total, dtype=torch.float32, device=device))
            offset = 0
            with torch.no_grad():
                for index in indices:
                    param, master = self._pairs[index]
                    span = slice(offset, offset + param.numel())
                    offset = span.stop
                    view = group.model_flat[span].view_as(param)
                    view.copy_(param.detach())
                    param.data = view
                    view = group.master_flat[span].view_as(master)
                    view.copy_(master.detach())
                    master.data = view
                    group.models.append(param)
                    group.masters.append(master)
                    owners.setdefault(device, []).append(master)
            group.pin()
            self._flat_groups.append(group)
        masters = {id(master) for _pair, master in self._pairs}
        # trainable contiguous fp32 params the optimizer steps directly (O2 keeps them fp32: norms)
        direct = [p for p in self._optimizer_params() if id(p) not in masters and p.requires_grad
                  and p.dtype == torch.float32 and p.is_contiguous()]
        for param in direct:
            owners.setdefault(param.device, []).append(param)
        self._build_arena(owners, masters)

    def _build_arena(self, owners: dict[torch.device, list[torch.Tensor]], masters: set[int]) -> None:
        arena = _GradArena()
        for device, tensors in owners.items():
            flat = torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float32, device=device)
            offset = 0
            for tensor in tensors:
                view = flat[offset:offset + tensor.numel()].view_as(tensor)
                offset += tensor.numel()
                arena.slots.append((tensor, view))
                arena.slot_of[id(tensor)] = view
            arena.flats.append(flat)
        self._arena = arena
        self._grad_bufs = [arena.slot_of.get(id(master)) for _param, master in self._pairs]
        self._direct = [(t, view, t.data_ptr()) for t, view in arena.slots if id(t) not in masters]
        self._half_params = [param for param, _master in self._pairs]
        self._direct_params = [t for t, _view, _ptr in self._direct]
        self._direct_slots = [view for _t, view, _ptr in self._direct]

    def _copy_masters_to_model(self) -> None:
        with torch.no_grad():
            for group in self._flat_groups:
                if group.intact():
                    group.model_flat.copy_(group.master_flat)
                else:  # a parameter was re-pointed (e.g. moved with .to()): copy one by one
                    torch._foreach_copy_(group.models, group.masters)
            for models, masters in self._loose_groups:
                torch._foreach_copy_(models, masters)

    def _install_embedding_shrink(self, alpha: Any) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha <= 1.0:
            raise ValueError(f"embedding_grad_shrink must be a float in (0, 1], got {alpha!r}")
        alpha = float(alpha)
        inner = self._inner
        if isinstance(inner, torch.fx.GraphModule):
            modules = dict(inner.named_modules())
            called = {node.target for node in inner.graph.nodes if node.op == "call_module"}
            embeddings = [modules[name] for name in sorted(called) if isinstance(modules.get(name), nn.Embedding)]
            rewritten = _shrink_graph_embeddings(inner, alpha)
        else:
            embeddings = [m for m in inner.modules() if isinstance(m, nn.Embedding)]
            rewritten = 0
        if not embeddings and not rewritten:
            raise ValueError(
                "embedding_grad_shrink is set but the module has no nn.Embedding submodule and no embedding "
                "node in its graph, so there is nothing to shrink"
            )
        hook = functools.partial(_shrink_embedding_grad, alpha)
        self._hooks = [m.register_forward_hook(hook) for m in embeddings]

    # ------------------------------------------------------------------ properties
    @property
    def stats(self) -> TrainStats:
        """Live counters (see :class:`TrainStats`).

        Reading this property settles what the last step left lazy (at most one host sync): the
        scale after its update, the overflow count, and the gradient norm when nothing in the step
        needed it. Read the counters through ``trainer.stats`` after each step rather than through
        a reference kept from before.
        """
        self._settle_stats()
        return self._stats

    @property
    def scaler(self) -> LossScaler | None:
        """The loss scaler (None for bf16)."""
        return self._scaler

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer this trainer steps (under O2 its param groups hold the fp32 masters)."""
        return self._optimizer

    @property
    def master_params(self) -> list[nn.Parameter]:
        """The fp32 master copies (O2; empty under O1), in ``named_parameters`` order."""
        return [master for _fqn, _param, master in self._masters]

    # ------------------------------------------------------------------ training
    def zero_grad(self) -> None:
        """Drop all gradients (model, masters, optimizer), but only at an accumulation boundary."""
        if self._micro != 0:
            return
        self._optimizer.zero_grad(set_to_none=True)
        for param in self._model_params:
            if param.grad is not None:
                param.grad = None
        for _param, master in self._pairs:
            if master.grad is not None:
                master.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        """Divide by ``accumulation_steps``, scale (fp16), run backward; O2 moves grads into fp32 masters."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a Tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(f"loss must be a scalar tensor, got shape {tuple(loss.shape)}")
        detached = loss.detach()
        if detached.dtype != torch.float32 or detached.dim() != 0:
            detached = detached.float().reshape(())
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        if self._accumulation_steps > 1:
            loss = loss / self._accumulation_steps
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        loss.backward()
        self._harvest_half_grads()

    def _harvest_waiting(self) -> bool:
        """Whether a gradient waits for :meth:`_harvest_half_grads` (a half param's, or an fp32 param's outside
        its slot). Not after ``trainer.backward()``, which harvests: then two C-level passes replace the loop."""
        if any(map(_NOT_NONE, map(_GRAD, self._half_params))):
            return True
        return not all(map(operator.is_, map(_GRAD, self._direct_params), self._direct_slots))

    def _harvest_half_grads(self) -> None:
        """Accumulate half gradients into the fp32 master gradients and free them (O2).

        A master without a gradient gets its persistent fp32 buffer, filled by one ``_foreach_copy_``
        (the exact widening of the half gradient); a master that already has one (an accumulation
        window, or a gradient the caller set) is added to in fp32 with one ``_foreach_add_``. A
        trainable fp32 param's fresh gradient moves into its arena slot in the same copy (autograd
        then accumulates into the slot in place for the rest of an accumulation window).
        """
        copy_dst: list[torch.Tensor] = []
        copy_src: list[torch.Tensor] = []
        add_dst: list[torch.Tensor] = []
        add_src: list[torch.Tensor] = []
        bufs = self._grad_bufs
        dirty = self._arena.dirty
        for index, (param, master) in enumerate(self._pairs):
            grad = param.grad
            if grad is None:
                continue
            param.grad = None
            master_grad = master.grad
            if master_grad is None:
                buf = bufs[index]
                if buf is None:
                    buf = bufs[index] = torch.empty_like(master)
                master.grad = buf
                dirty.add(id(master))
                copy_dst.append(buf)
                copy_src.append(grad)
            else:
                add_dst.append(master_grad)
                add_src.append(grad)
        for param, slot, data_ptr in self._direct:
            grad = param.grad
            # a param re-pointed since setup (.to(), .data = ...) keeps its own gradient
            if grad is None or grad is slot or param.data_ptr() != data_ptr:
                continue
            param.grad = slot
            dirty.add(id(param))
            copy_dst.append(slot)
            copy_src.append(grad)
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        if add_dst:
            torch._foreach_add_(add_dst, add_src)

    def _all_reduce_fp32_grads(self) -> None:
        """O2 under DDP: average the fp32 master grads (and fp32-stored grads) across ranks."""
        dist = torch.distributed
        group = self._ddp.process_group
        world = dist.get_world_size(group)
        master_of = {id(param): master for _fqn, param, master in self._masters}
        trainable = [master_of.get(id(p), p) for p in self._inner.parameters() if p.requires_grad]
        device = trainable[0].device if trainable else torch.device("cpu")
        present = torch.tensor([t.grad is not None for t in trainable], dtype=torch.int32, device=device)
        dist.all_reduce(present, op=dist.ReduceOp.SUM, group=group)
        reduced = [t for t, n in zip(trainable, present.tolist()) if n > 0]
        for tensor in reduced:
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in reduced:
            by_dtype.setdefault(tensor.grad.dtype, []).append(tensor.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(world)
            torch._foreach_copy_(grads, [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def _first_param_device(self) -> torch.device:
        for param in self._inner.parameters():
            return param.device
        return torch.device("cpu")

    def _set_grad_sync(self, sync: bool) -> None:
        """Whether the next backward reduces gradients across ranks (only the window's last one does)."""
        if self._ddp is not None and not self._master_weights:
            self._ddp.require_backward_grad_sync = sync
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(sync)

    def _unscale_and_check(self) -> tuple[float | None, bool, torch.Tensor | None, list, list, list | None]:
        """Unscale and check the optimizer's gradients with one host sync.

        Returns ``(norm, non_finite, norm_tensor, params, grads, buffers)``: the gradient norm (None when
        it is left to :class:`_LazyNorm`; inf on an overflow), whether the step must be skipped (agreed
        by every rank), the norm as a device tensor for clipping, the optimizer's params that have
        gradients, those gradients, and the arena buffers holding exactly them (None when they do not).

        fp16: one fused ``_amp_foreach_non_finite_check_and_unscale_`` per arena buffer (O2) or per
        (device, dtype) group of gradients, as ``GradScaler`` does. That kernel checks the gradients
        *before* unscaling; a finite gradient can still become inf when multiplied by ``1/scale``
        (a scale below 1, or 0 without a floor). The gradient norm of the unscaled gradients catches
        that when it is computed anyway; when it is not, a scale below 1 (read in the same sync)
        triggers an exact element-wise check of the unscaled gradients (a second sync, only then).
        bf16 (no scaling): the norm is the check where the step computes it anyway, and under O2, where it
        is one read-only reduction over the arena (33 µs on the benchmark encoder's 265k gradients, warm,
        against 62 for the fused kernel, which writes too); under O1 the fused kernel with
        ``inv_scale = 1`` is (79 µs against 118 for a norm per tensor, a stack and a norm of them).
        """
        params = self._optimizer_params()
        grads = list(map(_GRAD, params))
        if not all(map(_NOT_NONE, grads)):
            params = [p for p, g in zip(params, grads) if g is not None]
            grads = [g for g in grads if g is not None]
        buffers = self._arena.buffers(params, grads) if self._arena.flats else None
        readout, slot = self._readout_on(self._scalar_device(grads, buffers))
        pending = self._pending_scale is not None
        if self._loss_sum is not None:
            slot[_LOSS].copy_(self._loss_sum)
        # the check: fp16's fused unscale-and-check; without scaling, the norm where it is computed anyway or
        # is the cheapest check (O2's flat arena, read-only), else the fused check with inv_scale 1 (O1:
        # one multi-tensor kernel instead of a norm per tensor, a stack and a norm of norms)
        by_norm = self._eager_norm or (not self._scaling and buffers is not None)
        found = norm_t = None
        if self._scaling:
            found = self._scaler._unscale(self._optimizer, buffers, found_inf=slot[_FOUND])
        elif not by_norm:
            found = slot[_FOUND].zero_()
            unscale_grads(params, inv_scale=slot[_ONE], found_inf=found, allow_fp16=True)
        if by_norm:
            if self._fsdp is not None:  # DTensor shards: the norm is reduced across ranks (a collective)
                norm_t = torch.nn.utils.get_total_norm(grads, foreach=True)
                full_tensor = getattr(norm_t, "full_tensor", None)
                slot[_NORM].copy_(full_tensor() if full_tensor is not None else norm_t)
            else:
                norm_t = _total_norm(grads, buffers, out=slot[_NORM])
        if not self._scaling and self._ddp is not None:  # every rank skips if any rank's gradients are not finite
            bad = found if found is not None else torch.logical_not(torch.isfinite(slot[_NORM])).to(torch.float32)
            agree = bad.clone()
            torch.distributed.all_reduce(agree, op=torch.distributed.ReduceOp.MAX, group=self._ddp.process_group)
            slot[_AGREE].copy_(agree)
        values = readout.tolist()  # the one host sync
        self._step_loss = None if self._loss_sum is None else values[_LOSS] / self._accumulation_steps
        norm = values[_NORM] if norm_t is not None else None
        if not self._scaling:
            if self._ddp is not None:
                non_finite = values[_AGREE] > 0
            else:
                non_finite = values[_FOUND] > 0 if norm is None else not math.isfinite(norm)
            if non_finite and norm is None:  # a skipped step reports its norm (inf or NaN), as a norm check would
                norm = float(_total_norm(grads, buffers).item())
            return norm, non_finite, norm_t, params, grads, buffers
        if pending:
            self._settle_scale(values[_AFTER])
        self._step_scale = scale = self._current_scale()  # the scale this step unscaled with
        self._step_found = values[_FOUND] > 0  # the scaler's flag (what its update backs off on)
        if values[_FOUND]:
            return math.inf, True, None, params, grads, buffers
        if norm is not None:
            return norm, not math.isfinite(norm), norm_t, params, grads, buffers
        if scale < 1.0 and self._nonfinite_after_unscale(params, buffers):
            return math.inf, True, None, params, grads, buffers
        return None, False, None, params, grads, buffers

    def _scalar_device(self, grads: list[torch.Tensor], buffers: list[torch.Tensor] | None) -> torch.device:
        """Where the step's scalars live: the loss scale's device (found_inf is written next to it), else the
        gradients' (the norm)."""
        scale = self._scaler._scale_tensor() if self._scaling else None
        if scale is not None:
            return scale.device
        if buffers:
            return buffers[0].device
        return grads[0].device if grads else self._first_param_device()

    def _readout_on(self, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The readout buffer on ``device`` and its slot views (made again only if the device changed)."""
        readout = self._readout
        if readout is None or readout.device != device:
            self._settle_stats()  # a pending value may sit in the old buffer
            readout = self._readout = torch.zeros(_ONE + 1, dtype=torch.float32, device=device)
            readout[_ONE] = 1.0
            self._slots = list(readout.unbind(0))
        return readout, self._slots

    def _current_scale(self) -> float:
        """The live scale as a float: known on the host from the last read of slot _AFTER unless something
        changed the scale since (the scaler's version moved: a synchronising read then)."""
        if self._scaler._version != self._scale_seen_version or self._scale_seen is None:
            self._scale_seen, self._scale_seen_version = self._scaler.get_scale(), self._scaler._version
        return self._scale_seen

    def _nonfinite_after_unscale(self, params: list[torch.Tensor], buffers: list[torch.Tensor] | None) -> bool:
        """Whether an unscaled gradient holds inf/NaN: the fused check again with ``inv_scale = 1`` (exact).

        Only for a scale below 1 (``1/scale > 1`` can overflow a finite scaled gradient) when no
        norm was computed; the gradients are the same on every rank here (DDP reduces them, FSDP
        always computes the norm), so every rank reaches the same answer.
        """
        flag = torch.zeros((), dtype=torch.float32, device=self._readout.device)
        one = self._slots[_ONE]
        if buffers is not None:
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for buffer in buffers:
                groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
            unscale_groups(groups.items(), inv_scale=one, found_inf=flag)
        else:
            unscale_grads(params, inv_scale=one, found_inf=flag, allow_fp16=True)
        return bool(flag.item())

    def _clip(self, params: list[torch.Tensor], buffers: list[torch.Tensor] | None, norm: torch.Tensor) -> None:
        """Scale the gradients by ``min(1, max_grad_norm / (norm + 1e-6))``: ``clip_grad_norm_``'s arithmetic,
        with the norm already computed, and one multiply per arena buffer when there is one."""
        if buffers is None:
            torch.nn.utils.clip_grads_with_norm_(params, self._max_grad_norm, norm, foreach=True)
            return
        coef = torch.clamp(self._max_grad_norm / (norm + 1e-6), max=1.0)
        for flat in buffers:
            flat.mul_(coef.to(flat.device))

    def _settle_scale(self, after: float) -> None:
        """The last step's scale after its update is known: set ``stats.scale`` and count an overflow."""
        self._stats.scale = after
        self._stats.overflows += int(after < self._pending_scale)
        self._pending_scale = None
        self._scale_seen, self._scale_seen_version = after, self._version_after_update

    def _settle_stats(self) -> None:
        """Fill in what the last step left lazy (scale, overflows, gradient norm); two reads at most."""
        if self._pending_scale is not None:
            self._settle_scale(float(self._slots[_AFTER].item()))
        if self._lazy_norm is not None:
            self._stats.grad_norm = self._lazy_norm.value()
            self._lazy_norm = None

    def _is_spike(self, norm: float) -> bool:
        guard = self._spike_guard
        if guard is None:
            return False
        history = self._norm_history
        median = statistics.median(history) if len(history) >= guard.min_history else math.inf
        history.append(norm)
        if norm <= guard.factor * median:
            return False
        _LOG.warning("step %d skipped by the spike guard: gradient norm %.4g > %g x median %.4g of the last %d",
                     self._stats.steps + self._stats.skipped + self._stats.spike_skips + 1, norm, guard.factor,
                     median, len(history) - 1)
        return True

    def step(self, *, closure: Any = None) -> bool:
        """Finish an accumulation window: unscale, check, clip, step, copy masters back.

        Returns True when the optimizer stepped; False inside an accumulation window or when the
        step was skipped (non-finite unscaled gradients, or a spike the :class:`SpikeGuard` caught).
        Raises :class:`TrainingStalledError` when ``max_consecutive_skips`` steps in a row were skipped.
        """
        if closure is not None:
            raise ValueError(
                "MixedPrecisionTrainer.step() does not take a closure: a closure recomputes the loss inside "
                "optimizer.step(), after gradients were unscaled and checked, so they would be neither. "
                "Call trainer.backward(loss) and then trainer.step()."
            )
        self._micro += 1
        if self._micro < self._accumulation_steps:
            self._set_grad_sync(self._micro == self._accumulation_steps - 1)
            return False
        self._micro = 0
        self._set_grad_sync(self._accumulation_steps == 1)

        if self._master_weights:
            if self._harvest_waiting():
                self._harvest_half_grads()
            if self._ddp is not None:
                self._all_reduce_fp32_grads()
        self._lazy_norm = None
        grad_norm, non_finite, norm_t, params, grads, buffers = self._unscale_and_check()
        spike = not non_finite and self._is_spike(grad_norm)
        stepped = not (non_finite or spike)
        if grad_norm is None and stepped:
            self._lazy_norm = _LazyNorm(grads, buffers)
        if stepped:
            if self._max_grad_norm is not None:
                self._clip(params, buffers, norm_t)
            self._optimizer.step()
            if self._masters:
                self._copy_masters_to_model()
        if self._scaling:
            # the host read this step's flag and knows the scale: the bounds' clamp only runs when needed
            self._scaler._update(known=(self._step_found, self._step_scale))
            self._slots[_AFTER].copy_(self._scaler._scale_tensor())
            self._pending_scale = self._step_scale
            self._version_after_update = self._scaler._version
        self._record_step(stepped=stepped, non_finite=non_finite, spike=spike, grad_norm=grad_norm)
        return stepped

    def _record_step(self, *, stepped: bool, non_finite: bool, spike: bool, grad_norm: float) -> None:
        stats = self._stats
        stats.steps += int(stepped)
        stats.skipped += int(non_finite)
        stats.spike_skips += int(spike)
        stats.consecutive_skips = 0 if stepped else stats.consecutive_skips + 1
        stats.grad_norm = grad_norm
        if self._step_loss is not None:
            stats.loss = self._step_loss
        self._loss_sum = None
        if self._callback is not None:
            self._settle_stats()
            self._callback(dataclasses.replace(stats))
        limit = self._max_consecutive_skips
        if limit is not None and stats.consecutive_skips >= limit:
            self._settle_stats()
            total = stats.steps + stats.skipped + stats.spike_skips
            raise TrainingStalledError(
                f"{stats.consecutive_skips} consecutive optimizer steps were skipped (steps "
                f"{total - stats.consecutive_skips + 1} to {total}; last gradient norm {grad_norm:.4g}, loss scale "
                f"{stats.scale:g}): the gradients are non-finite or spiking on every step. Check the data, the "
                f"learning rate and the model's numerics, or raise max_consecutive_skips (None disables the limit)."
            )

    # ------------------------------------------------------------------ checkpoints
    def _model_state(self) -> dict[str, Any]:
        if self._fsdp is not None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self._fsdp)
        return self._inner.state_dict()

    def _optimizer_state(self) -> dict[str, Any]:
        if self._fsdp is not None:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self._fsdp, self._optimizer)
        return self._optimizer.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Model, fp32 masters, optimizer, scaler, counters and the spike guard's recent gradient norms.

        Loads with ``torch.load(weights_only=True)``.

        Only at an accumulation boundary: accumulated gradients are not saved, so a checkpoint
        taken mid-window could not resume bit-identically. Under FSDP2 the model and optimizer
        entries come from ``torch.distributed.checkpoint.state_dict`` (sharded DTensors): save the
        dict with ``torch.distributed.checkpoint.save`` and load it into a fresh trainer's
        ``state_dict()`` with ``torch.distributed.checkpoint.load`` before ``load_state_dict``.
        """
        if self._micro != 0:
            raise RuntimeError(
                f"state_dict() called {self._micro} backward(s) into an accumulation window of "
                f"{self._accumulation_steps}; save after step() completes the window"
            )
        return {
            "format": _STATE_FORMAT,
            "precision": self._precision,
            "master_weights": self._master_weights,
            "model": self._model_state(),
            "master": {fqn: master.detach() for fqn, _param, master in self._masters},
            "optimizer": self._optimizer_state(),
            "scaler": self._scaler.state_dict() if self._scaler is not None else {},
            "stats": dataclasses.asdict(self.stats),
            "spike_history": list(self._norm_history) if self._spike_guard is not None else [],
        }

    def _check_state_dict(self, state_dict: Any) -> TrainStats:
        """Validate a whole checkpoint before anything is loaded; returns its stats."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"a trainer state dict must be a dict, got {type(state_dict).__name__}")
        if state_dict.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown trainer state format {state_dict.get('format')!r}, expected {_STATE_FORMAT}")
        missing = sorted({"precision", "master_weights", "model", "master", "optimizer", "scaler", "stats"}
                         - set(state_dict))
        if missing:
            raise ValueError(f"trainer state dict is missing keys {missing}")
        for key, mine in (("precision", self._precision), ("master_weights", self._master_weights)):
            if state_dict[key] != mine:
                raise ValueError(f"checkpoint has {key}={state_dict[key]!r} but this trainer has {key}={mine!r}")
        expected = {fqn: master for fqn, _param, master in self._masters}
        local = self._fsdp is None  # FSDP2 entries are sharded DTensors: checked by torch.distributed.checkpoint
        _check_tensors("master weights", state_dict["master"], expected, finite=local)
        model_state = self._model_state()
        _check_tensors("model", state_dict["model"], model_state, finite=False)
        if local:
            for name, _param in self._inner.named_parameters():
                if name in model_state:
                    _check_values(f"checkpoint model parameter {name!r}", state_dict["model"][name])
        if self._fsdp is None:
            _check_optimizer_groups(state_dict["optimizer"], self._optimizer)
            _check_optimizer_state(state_dict["optimizer"], self._optimizer)
        if self._scaler is not None:
            self._scaler.check_state_dict(state_dict["scaler"])
        stats = state_dict["stats"]
        fields = {f.name for f in dataclasses.fields(TrainStats)}
        if not isinstance(stats, dict) or not set(stats) <= fields:
            raise ValueError(f"checkpoint stats must be a dict with keys from {sorted(fields)}, got {stats!r}")
        _check_stats(stats)
        history = state_dict.get("spike_history", [])
        if not isinstance(history, list) or not all(
            isinstance(v, float) and math.isfinite(v) and v >= 0 for v in history
        ):
            raise ValueError("checkpoint spike_history must be a list of finite gradient norms (floats >= 0)")
        return TrainStats(**stats)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore everything ``state_dict()`` saved; the trainer must be built the same way.

        The whole checkpoint is validated first (format, mode, every master's and model tensor's
        name, shape and dtype, the scaler dict): a mismatch raises ``ValueError`` naming it and
        loads nothing; nothing is broadcast or silently converted.
        """
        stats = self._check_state_dict(state_dict)
        masters = state_dict["master"]
        if self._fsdp is not None:
            from torch.distributed.checkpoint.state_dict import (
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            set_model_state_dict(self._fsdp, state_dict["model"])
            set_optimizer_state_dict(self._fsdp, self._optimizer, state_dict["optimizer"])
        else:
            self._inner.load_state_dict(state_dict["model"])
            self._optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for fqn, _param, master in self._masters:
                master.copy_(masters[fqn])
        if self._scaler is not None:
            self._scaler.load_state_dict(state_dict["scaler"])
        self._stats = stats
        self._lazy_norm = None
        self._pending_scale = None
        self._scale_seen = None  # read again at the next step (the scaler's version moved anyway)
        self._norm_history.clear()
        if self._spike_guard is not None:
            self._norm_history.extend(state_dict.get("spike_history", []))
        self._micro = 0
        self._loss_sum = None


def _check_tensors(what: str, given: Any, expected: dict[str, torch.Tensor], *, finite: bool = True) -> None:
    """``given`` must name exactly ``expected``'s tensors, each with the same shape and dtype, holding data
    (and, with ``finite``, no inf or NaN: a model's buffers may hold -inf mask fills on purpose)."""
    if not isinstance(given, dict):
        raise TypeError(f"checkpoint {what} must be a dict of tensors, got {type(given).__name__}")
    if set(given) != set(expected):
        extra, absent = sorted(set(given) - set(expected)), sorted(set(expected) - set(given))
        raise ValueError(f"checkpoint {what} do not match this trainer: unexpected {extra[:5]}, missing {absent[:5]}")
    for name, mine in expected.items():
        theirs = given[name]
        if not isinstance(mine, torch.Tensor):
            continue
        if not isinstance(theirs, torch.Tensor):
            raise TypeError(f"checkpoint {what} entry {name!r} must be a tensor, got {type(theirs).__name__}")
        if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            raise ValueError(
                f"checkpoint {what} entry {name!r} has shape {tuple(theirs.shape)} and dtype {theirs.dtype}, "
                f"but this trainer's has shape {tuple(mine.shape)} and dtype {mine.dtype}; nothing was loaded"
            )
        _check_values(f"checkpoint {what} entry {name!r}", theirs, finite=finite)


def _check_values(what: str, tensor: torch.Tensor, *, finite: bool = True) -> None:
    """A checkpoint tensor holds data (not the meta device's nothing) and, if floating, only finite values."""
    if tensor.is_meta:
        raise ValueError(f"{what} is on the meta device (it holds no data); nothing was loaded")
    if finite and (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what} holds inf or NaN values; nothing was loaded")


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_optimizer_state(given: dict, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer checkpoint's hyperparameters are finite and its per-parameter state fits the parameters.

    ``optimizer.load_state_dict`` accepts a NaN learning rate, a missing ``state`` and an ``exp_avg``
    of another shape; each of them surfaces only steps later (NaN weights, a shape error mid-step)."""
    state = given.get("state")
    if not isinstance(state, dict):
        raise ValueError("checkpoint optimizer state must be an optimizer state_dict() with 'state' and 'param_groups'; "
                         "nothing was loaded")
    params: dict[Any, torch.Tensor] = {}
    for index, (theirs, mine) in enumerate(zip(given["param_groups"], optimizer.param_groups)):
        for key, value in theirs.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor):
                _check_values(f"checkpoint optimizer param group {index}'s {key}", value)
            elif isinstance(value, float) and not math.isfinite(value):  # ints (and bools) are finite
                raise ValueError(f"checkpoint optimizer param group {index} has {key}={value}; nothing was loaded")
            elif key in ("lr", "weight_decay", "eps", "momentum") and not isinstance(value, (int, float, torch.Tensor)):
                raise TypeError(f"checkpoint optimizer param group {index} has {key} of type {type(value).__name__}; "
                                "nothing was loaded")
        if isinstance(theirs.get("lr"), (int, float)) and theirs["lr"] < 0:
            raise ValueError(f"checkpoint optimizer param group {index} has a negative lr ({theirs['lr']}); nothing was loaded")
        params.update(zip(theirs["params"], mine["params"]))
    for key, entry in state.items():
        param = params.get(key)
        if param is None:
            raise ValueError(f"checkpoint optimizer state names parameter {key!r}, which no param group holds; "
                             "nothing was loaded")
        if not isinstance(entry, dict):
            raise TypeError(f"checkpoint optimizer state of parameter {key!r} must be a dict, got {type(entry).__name__}")
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            where = f"checkpoint optimizer state {name!r} of parameter {key!r}"
            if value.dim() > 0 and value.shape != param.shape:
                raise ValueError(f"{where} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}; "
                                 "nothing was loaded")
            _check_values(where, value)


def _check_stats(stats: dict) -> None:
    """Counters are ints in range and the scale a finite positive number (string counters broke ``step()`` later)."""
    for name, value in stats.items():
        if name in ("grad_norm", "loss"):
            ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        elif name == "scale":
            ok = _finite_number(value) and value > 0
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
        if not ok:
            raise ValueError(f"checkpoint stats has {name}={value!r}, which is not a valid value; nothing was loaded")


def _check_optimizer_groups(given: Any, optimizer: torch.optim.Optimizer) -> None:
    """The checkpoint's optimizer has as many param groups, of the same sizes, as ``optimizer``."""
    groups = given.get("param_groups") if isinstance(given, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise ValueError("checkpoint optimizer state must be an optimizer state_dict() with 'param_groups'")
    theirs = [len(g["params"]) for g in groups]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if theirs != mine:
        raise ValueError(f"checkpoint optimizer has param groups of sizes {theirs}, this optimizer {mine}")
