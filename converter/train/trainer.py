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
  masters are copied back into the half parameters with one ``torch._foreach_copy_`` per dtype.

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
whose gradient norm is not finite are still skipped, since stepping on inf/NaN destroys weights.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError
from converter.ir.meta import GM_PARAM_DTYPES, META_CAST, META_INFO, META_TRAINER
from converter.ir.precision import half_dtype
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

    Attributes:
        scale: the loss scale after the step's update (1.0 without a scaler).
        steps: optimizer steps taken.
        skipped: optimizer steps skipped because the unscaled gradients held inf or NaN.
        spike_skips: optimizer steps skipped by the :class:`SpikeGuard` (finite but spiking norm).
        consecutive_skips: skipped steps (either kind) since the last real optimizer step.
        overflows: times the loss scale was reduced. Equal to ``skipped`` with the default
            hysteresis of 1; smaller with hysteresis, a static scale, or at ``min_scale``.
        grad_norm: total 2-norm of the unscaled gradients before clipping; inf on a skipped step;
            None before the first step.
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


def _full_value(tensor: torch.Tensor) -> float:
    """A 0-dim tensor as a float; a DTensor (FSDP2 norm, partial per rank) is reduced first."""
    full_tensor = getattr(tensor, "full_tensor", None)
    if full_tensor is not None:
        tensor = full_tensor()
    return float(tensor.item())


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
    _ptrs: tuple = ()

    def pin(self) -> None:
        self._ptrs = tuple(t.data_ptr() for t in self.models + self.masters)

    def intact(self) -> bool:
        """Every parameter and master still lives in the flat buffers."""
        return tuple(t.data_ptr() for t in self.models + self.masters) == self._ptrs


@dataclasses.dataclass
class _GradArena:
    """O2: one fp32 buffer per device whose views are the gradients of every tensor the optimizer steps.

    Slots: the masters' gradients and those of the trainable parameters stored in fp32 (norm
    weights). When every optimizer gradient is its slot, the gradient norm is one reduction over
    the buffers (``norms``) instead of a norm per tensor, a stack and a norm of norms. A slot whose
    owner has no gradient this step is zeroed before (``dirty``: it may still hold an old one).
    """

    flats: list = dataclasses.field(default_factory=list)  # one fp32 buffer per device
    slots: list = dataclasses.field(default_factory=list)  # (owner, its gradient view)
    slot_of: dict = dataclasses.field(default_factory=dict)  # id(owner) -> view
    dirty: set = dataclasses.field(default_factory=set)  # ids of owners whose slot may hold a gradient

    def norms(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Per-device norms of ``params``' gradients (each not None) when they are exactly the slots in use."""
        if not self.flats:
            return None
        slot_of = self.slot_of
        for param in params:
            if param.grad is not slot_of.get(id(param)):
                return None
        with_grad = 0
        for owner, view in self.slots:
            if owner.grad is not None:
                with_grad += 1
            elif id(owner) in self.dirty:
                view.zero_()
                self.dirty.discard(id(owner))
        if with_grad != len(params):  # a slot's owner left the optimizer but kept its gradient
            return None
        return [torch.linalg.vector_norm(flat) for flat in self.flats]


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

    Every step is taken only on finite gradients: the check runs on the *unscaled* gradients (the
    scaler's fused check sees the scaled ones; a tiny scale can overflow on unscaling), for fp16,
    bf16 and no scaler alike, so no inf/NaN ever reaches the weights.

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
        if not isinstance(optimizer_foreach, bool):
            raise TypeError(f"optimizer_foreach must be a bool, got {type(optimizer_foreach).__name__}")
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
        """Live counters (see :class:`TrainStats`)."""
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

    def _all_ranks_agree(self, finite: bool) -> bool:
        """No scaler under DDP: step only if every rank's gradients are finite, so replicas never diverge.

        Under FSDP2 the norm itself is global (reduced over the shards' mesh), so every rank already
        sees the same value and no further collective is needed.
        """
        if self._ddp is None:
            return finite
        flag = torch.tensor([0.0 if finite else 1.0], device=self._first_param_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._ddp.process_group)
        return flag.item() == 0.0

    def _first_param_device(self) -> torch.device:
        for param in self._inner.parameters():
            return param.device
        return torch.device("cpu")

    def _grad_norm(self) -> float:
        """Total 2-norm of the (unscaled) gradients the optimizer will use; clips them when asked.

        Global under FSDP2 (the DTensor norm is reduced across the shards). Foreach/flat kernels only.
        """
        params = [p for p in self._optimizer_params() if p.grad is not None]
        if self._max_grad_norm is not None:
            return _full_value(torch.nn.utils.clip_grad_norm_(params, self._max_grad_norm, foreach=True))
        if self._fsdp is not None:
            return _full_value(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))
        # every gradient in its arena slot: one reduction per device; else one norm per tensor
        norms = self._arena.norms(params)
        if norms is None:
            norms = torch._foreach_norm([p.grad for p in params]) if params else []
        if not norms:
            return 0.0
        total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
        return float(total.item())

    def _set_grad_sync(self, sync: bool) -> None:
        """Whether the next backward reduces gradients across ranks (only the window's last one does)."""
        if self._ddp is not None and not self._master_weights:
            self._ddp.require_backward_grad_sync = sync
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(sync)

    def _unscale_and_check(self) -> tuple[float, bool]:
        """Unscale, then the gradient norm; returns ``(norm, non_finite)``, agreed by every rank.

        The scaler's fused check looks at the gradients *before* unscaling; a finite gradient can
        still become inf when multiplied by ``1/scale`` (a scale below 1, or 0 without a floor), so
        the norm of the unscaled gradients is checked as well.
        """
        if self._scaler is not None:
            self._scaler.unscale_(self._optimizer)
            found_inf = self._scaler.found_inf(self._optimizer)  # all-reduced by the scaler (sync_found_inf)
            if found_inf and self._fsdp is None:
                return math.inf, True
            # FSDP2: the norm is a collective, so every rank computes it; it is inf on every rank when any
            # shard holds an inf, which keeps the ranks together even with sync_found_inf=False
            norm = self._grad_norm()
            return (math.inf, True) if found_inf else (norm, not math.isfinite(norm))
        norm = self._grad_norm()
        return norm, not self._all_ranks_agree(math.isfinite(norm))

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
            self._harvest_half_grads()
            if self._ddp is not None:
                self._all_reduce_fp32_grads()
        scale_before = self._scaler.get_scale() if self._scaler is not None else 1.0
        grad_norm, non_finite = self._unscale_and_check()
        spike = not non_finite and self._is_spike(grad_norm)
        stepped = not (non_finite or spike)
        if stepped:
            self._optimizer.step()
            if self._masters:
                self._copy_masters_to_model()
        if self._scaler is not None:
            self._scaler.update()
            self._stats.scale = self._scaler.get_scale()
            self._stats.overflows += int(self._stats.scale < scale_before)
        self._record_step(stepped=stepped, non_finite=non_finite, spike=spike, grad_norm=grad_norm)
        return stepped

    def _record_step(self, *, stepped: bool, non_finite: bool, spike: bool, grad_norm: float) -> None:
        stats = self._stats
        stats.steps += int(stepped)
        stats.skipped += int(non_finite)
        stats.spike_skips += int(spike)
        stats.consecutive_skips = 0 if stepped else stats.consecutive_skips + 1
        stats.grad_norm = grad_norm
        if self._loss_sum is not None:
            stats.loss = float(self._loss_sum.item()) / self._accumulation_steps
        self._loss_sum = None
        if self._callback is not None:
            self._callback(dataclasses.replace(stats))
        limit = self._max_consecutive_skips
        if limit is not None and stats.consecutive_skips >= limit:
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
            "stats": dataclasses.asdict(self._stats),
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
