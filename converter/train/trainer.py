"""Training wrapper for converted mixed-precision models: loss scaling, fp32 master weights, DDP, FSDP2.

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
found-inf flag, and the gradient norm where one is computed). Nothing the step does not need is
computed or read: the gradient norm is computed in the step only for clipping, the spike guard,
FSDP, a callback, or as bf16's check under O2 (else lazily, when ``trainer.stats`` is read), and the
loss and the scale after the update are read together when the stats are
(:attr:`MixedPrecisionTrainer.stats`; the scale also with the next step's copy). No step runs a
Python loop or a kernel per parameter: after ``trainer.backward()`` it checks in three C-level passes
that every gradient is in its arena slot and none waits on the model, and the fp16 check goes straight
to the kernel (the placement of the arena and the flag is checked once).

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

How it is built: the trainer is step control (accumulation windows, the one-sync unscale-and-check, clipping,
the spike guard, the counters) over a master-weights store (:class:`~converter.train.masters.MasterWeights`,
empty under O1) and a sync strategy (:mod:`converter.train.sync`: none, DDP or FSDP2, chosen once). Its
arguments are all checked (:mod:`converter.train.options`) before it changes the model or the optimizer.
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
from typing import Any, cast

import torch
from torch import nn

from converter.train import checkpoint
from converter.train.amp_kernels import UNSCALE_OP, has_kernel, unscale_grads, unscale_groups
from converter.train.buffers import BufferGuard
from converter.train.cuda_graph import CudaGraphModule
from converter.train.grad_norm import LazyNorm, total_norm
from converter.train.graph_edits import drop_identity_weight_casts, plan_embedding_shrink
from converter.train.host_scale import HostScale
from converter.train.masters import MasterWeights, check_o1_optimizer, storage_plan
from converter.train.options import (
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    check_options,
    enable_foreach,
    enable_fused,
    resolve_scaler,
)
from converter.train.scaler import LossScaler
from converter.train.stats import SpikeGuard, TrainingStalledError, TrainStats, check_stats
from converter.train.sync import choose_sync

__all__ = ["MixedPrecisionTrainer", "SpikeGuard", "TrainStats", "TrainingStalledError"]

_LOG = logging.getLogger(__name__)
_GRAD = operator.attrgetter("grad")
_NOT_NONE = functools.partial(operator.is_not, None)


def _unwrap(module: nn.Module) -> nn.Module:
    """The model inside a data-parallel wrapper or a :func:`converter.cuda_graph` wrapper (its fqns, its meta)."""
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel, CudaGraphModule)):
        return module.module
    return module


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
            spelling :func:`converter.vocab.precision` accepts), or ``"fp8"`` as :func:`converter.convert` takes it (a
            conversion whose GEMMs run in fp8 trains as bf16: no loss scaling, bf16 O2 storage). fp16 is the default
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
    (only past ~1.8e19, gradients that are finite but absurd) skips the step too. A skipped step also
    puts back the buffers its window's forwards wrote (batch norm statistics; :mod:`converter.train.buffers`).

    Every argument is checked before the module or the optimizer is changed (O2's storage and param
    groups, graph rewrites, hooks, the optimizer's ``foreach``/``fused``): a rejected argument raises
    ``TypeError``/``ValueError`` and leaves both exactly as they were.

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
        max_consecutive_skips: int | None = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        spike_guard: SpikeGuard | None = None,
        optimizer_foreach: bool = True,
        optimizer_fused: bool = False,
        param_dtypes: dict[str, torch.dtype] | None = None,
    ) -> None:
        # 1. every argument is checked, and everything the trainer will change is found, before anything changes
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        opts = check_options(
            precision=precision, master_weights=master_weights, max_grad_norm=max_grad_norm,
            accumulation_steps=accumulation_steps, callback=callback, embedding_grad_shrink=embedding_grad_shrink,
            max_consecutive_skips=max_consecutive_skips, spike_guard=spike_guard,
            optimizer_foreach=optimizer_foreach, optimizer_fused=optimizer_fused,
        )
        inner = _unwrap(module)
        sync = choose_sync(module, master_weights=opts.master_weights)
        resolved = resolve_scaler(opts.half, loss_scale, scaler)
        plan = storage_plan(inner, opts.half, param_dtypes) if opts.master_weights else None
        if plan is None and resolved is not None:
            check_o1_optimizer(optimizer)
        shrink = None if opts.embedding_grad_shrink is None else plan_embedding_shrink(inner, opts.embedding_grad_shrink)

        # 2. the trainer's own state
        self._module, self._inner, self._optimizer, self._opts, self._sync = module, inner, optimizer, opts, sync
        self._init_step_state(resolved)
        # every parameter of the model, listed once so zero_grad() need not walk the module tree
        self._model_params: list[nn.Parameter] = list(inner.parameters())

        # 3. the changes: O2's storage and masters, the graph, the wrapper's reduction, hooks, optimizer options
        self._masters = MasterWeights.create(inner, optimizer, plan) if plan is not None else MasterWeights()
        self._has_masters = len(self._masters) > 0  # (the step's test, without a __len__ call)
        #: O2: converter weight casts made identities by half storage (see drop_identity_weight_casts)
        self.dropped_weight_casts = drop_identity_weight_casts(inner) if opts.master_weights else 0
        sync.start(accumulation_steps=opts.accumulation_steps)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = shrink.install() if shrink is not None else []
        self.fused_groups = enable_fused(optimizer) if opts.optimizer_fused else 0  # groups switched to fused
        self.foreach_groups = enable_foreach(optimizer) if opts.optimizer_foreach else 0  # groups switched to foreach
        #: the buffers a window's forwards write (batch norm statistics), put back when its step is skipped
        self._buffer_guard = BufferGuard(inner, [module, inner])

    def _init_step_state(self, scaler: LossScaler | None) -> None:
        """The counters, the scale bookkeeping and the per-step buffers (nothing outside the trainer changes)."""
        opts = self._opts
        self._scaler = scaler
        self._stats = TrainStats(scale=scaler.get_scale() if scaler is not None else 1.0)
        # a scaler that scales (a disabled LossScaler is a pass-through: the norm is then the check)
        scaling = scaler is not None and scaler.is_enabled()
        self._host_scale = HostScale(scaler, self._stats.scale) if scaling and scaler is not None else None
        # the gradient norm is computed in the step only where the step or a caller needs it (see LazyNorm);
        # without scaling it is also the check where it is the cheapest one (O2's arena: one read-only reduction)
        self._eager_norm = (opts.max_grad_norm is not None or opts.spike_guard is not None
                            or opts.callback is not None or self._sync.eager_norm)
        self._lazy_norm: LazyNorm | None = None
        self._norm_history: deque[float] = deque(maxlen=opts.spike_guard.window if opts.spike_guard else 1)
        self._micro = 0
        self._loss_sum: torch.Tensor | None = None
        # One fp32 buffer per step for the device scalars the host needs (found-inf flag, gradient norm, the
        # ranks' agreement, the loss, the scale after the last update: slots _FOUND.._AFTER), written by the
        # ops that produce them and copied to the host with one .tolist(): GradScaler's one sync per step.
        self._readout: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []  # its 0-dim views, made once (indexing is an op per call)
        # the last window's summed loss (a 0-dim device tensor), read into stats.loss when the stats are read
        self._lazy_loss: torch.Tensor | None = None
        self._readout_scale: torch.Tensor | None = None  # the scale tensor the readout was placed next to
        self._arena_placed = False  # O2's arena and the readout sit with the scale, whose device has the kernel

    # ------------------------------------------------------------------ properties
    @property
    def stats(self) -> TrainStats:
        """Live counters (see :class:`TrainStats`).

        Reading this property settles what the last step left lazy (at most two host reads): the
        loss and the scale after its update (one copy), the overflow count, and the gradient norm when
        nothing in the step needed it. Read the counters through ``trainer.stats`` after each step
        rather than through a reference kept from before.
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
        return self._masters.params

    # ------------------------------------------------------------------ training
    def zero_grad(self) -> None:
        """Drop all gradients (model, masters, optimizer), but only at an accumulation boundary."""
        if self._micro != 0:
            return
        self._buffer_guard.save()  # a window starts: its forwards' buffer writes are undone if its step is skipped
        self._optimizer.zero_grad(set_to_none=True)
        for param in self._model_params:
            if param.grad is not None:
                param.grad = None
        self._masters.drop_grads()

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
        if self._opts.accumulation_steps > 1:
            loss = loss / self._opts.accumulation_steps
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        loss.backward()
        self._masters.harvest()

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
        window = self._opts.accumulation_steps
        if window > 1:  # (a window of 1 never turned the gradient sync off: nothing to set)
            self._micro += 1
            if self._micro < window:
                self._sync.set_grad_sync(self._micro == window - 1)
                return False
            self._micro = 0
            self._sync.set_grad_sync(False)

        self._lazy_norm = None
        params, grads, buffers = self._gradients()
        host = self._host_scale
        if host is not None and not self._eager_norm:
            grad_norm, non_finite, norm_t = self._scaled_check(host, params, grads, buffers)
        else:
            grad_norm, non_finite, norm_t = self._unscale_and_check(params, grads, buffers)
        spike = not non_finite and self._opts.spike_guard is not None and self._is_spike(cast(float, grad_norm))  # (a spike guard: eager norm)
        stepped = not (non_finite or spike)
        if host is not None:  # (the update needs only the flag: done before the optimizer's passes over memory)
            host.update(self._slots[_AFTER])
        if stepped:
            if grad_norm is None:
                self._lazy_norm = LazyNorm(grads, buffers)
            if self._opts.max_grad_norm is not None:
                self._clip(params, buffers, cast(torch.Tensor, norm_t))  # max_grad_norm: the norm is eager
            self._optimizer.step()
            if self._has_masters:
                self._masters.copy_to_model()
        self._buffer_guard.end(skipped=not stepped)
        self._record_step(stepped=stepped, non_finite=non_finite, spike=spike, grad_norm=grad_norm)
        return stepped

    def _optimizer_params(self) -> list[torch.Tensor]:
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def _gradients(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """The optimizer's params that have gradients, those gradients, and the arena buffers holding exactly them
        (None when they do not). O2: half gradients still on the model are harvested first and, under DDP, the
        fp32 gradients averaged; after ``trainer.backward()`` (nothing to harvest, every gradient in its arena
        slot) that is a check of three C-level passes (:meth:`MasterWeights.settled`)."""
        params = self._optimizer_params()
        grads = list(map(_GRAD, params))
        if self._opts.master_weights:
            masters = self._masters
            buffers = None if self._sync.reduces_master_grads else masters.settled(params, grads)
            if buffers is not None:
                return params, grads, buffers
            if masters.harvest_waiting():
                masters.harvest()
            self._sync.reduce_master_grads(self._inner, masters)
            grads = list(map(_GRAD, params))
        if not all(map(_NOT_NONE, grads)):
            params = [p for p, g in zip(params, grads) if g is not None]
            grads = [g for g in grads if g is not None]
        return params, grads, self._masters.grad_buffers(params, grads)

    def _first_param_device(self) -> torch.device:
        for param in self._inner.parameters():
            return param.device
        return torch.device("cpu")

    def _unscale_and_check(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                           buffers: list[torch.Tensor] | None) -> tuple[float | None, bool, torch.Tensor | None]:
        """Unscale and check the optimizer's gradients (``params``' ``grads``, held by the arena ``buffers`` when not
        None: :meth:`_gradients`) with one host sync.

        Returns ``(norm, non_finite, norm_tensor)``: the gradient norm (None when it is left to :class:`LazyNorm`;
        inf on an overflow), whether the step must be skipped (agreed by every rank), and the norm as a device
        tensor for clipping.

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
        readout, slot = self._readout_on(self._scalar_device(grads, buffers))
        host = self._host_scale
        pending = host is not None and host.pending is not None
        # the check: fp16's fused unscale-and-check; without scaling, the norm where it is computed anyway or
        # is the cheapest check (O2's flat arena, read-only), else the fused check with inv_scale 1 (O1:
        # one multi-tensor kernel instead of a norm per tensor, a stack and a norm of norms)
        by_norm = self._eager_norm or (host is None and buffers is not None)
        found = norm_t = None
        if host is not None:
            assert self._scaler is not None  # a host scale is made for a scaler
            found = self._scaler._unscale(self._optimizer, buffers, found_inf=slot[_FOUND])
        elif not by_norm:
            found = slot[_FOUND].zero_()
            unscale_grads(params, inv_scale=slot[_ONE], found_inf=found, allow_fp16=True)
        if by_norm:
            norm_t = self._sync.total_norm(grads, buffers, slot[_NORM])
        # without a scaler (whose flag is all-reduced already) the ranks agree on a skip here, where they must
        agreed = host is None and self._sync.agree_on_skip(found, slot[_NORM], slot[_AGREE])
        values = readout.tolist()  # the one host sync
        norm = values[_NORM] if norm_t is not None else None
        if host is None:
            if agreed:
                non_finite = values[_AGREE] > 0
            else:
                non_finite = values[_FOUND] > 0 if norm is None else not math.isfinite(norm)
            if non_finite and norm is None:  # a skipped step reports its norm (inf or NaN), as a norm check would
                norm = float(total_norm(grads, buffers).item())
            return norm, non_finite, norm_t
        if pending:
            host.settle(values[_AFTER], self._stats)
        scale = host.begin_step(values[_FOUND] > 0)  # the scale this step unscaled with
        if values[_FOUND]:
            return math.inf, True, None
        if norm is not None:
            return norm, not math.isfinite(norm), norm_t
        if scale < 1.0 and self._nonfinite_after_unscale(params, buffers):
            return math.inf, True, None
        return None, False, None

    def _scaled_check(self, host: HostScale, params: list[torch.Tensor], grads: list[torch.Tensor],
                      buffers: list[torch.Tensor] | None) -> tuple[float | None, bool, None]:
        """:meth:`_unscale_and_check` for a step that scales (fp16) and needs no gradient norm: the scaler's fused
        unscale-and-check (one kernel per arena buffer or per (device, dtype) group), then the one host read of
        the found-inf flag and the last update's scale. A finite gradient can still overflow when multiplied
        by ``1/scale`` below 1: only then the unscaled gradients are checked again, element-wise."""
        readout = self._readout
        scaler = self._scaler
        assert scaler is not None  # a step that scales has a scaler
        scale = scaler._scale
        if readout is None or scale is None or self._readout_scale is not scale:  # (placed once, by the scale)
            readout = self._readout_on(self._scalar_device(grads, buffers))[0]
            self._readout_scale = scale
            # O2's arena buffers on the scale's device, with the fused kernel there: no device to look at per step
            flats = self._masters.arena.flats
            self._arena_placed = scale is not None and bool(flats) and has_kernel(UNSCALE_OP, scale.device) and all(
                flat.device == scale.device for flat in flats)
        if buffers is not None and self._arena_placed:
            scaler._unscale_placed(self._optimizer, buffers, self._slots[_FOUND])
        else:
            scaler._unscale(self._optimizer, buffers, found_inf=self._slots[_FOUND])
        pending = host.pending
        values = readout.tolist()  # the one host sync
        if pending is not None:
            host.settle(values[_AFTER], self._stats)
        found = values[_FOUND] > 0
        if host.begin_step(found) < 1.0 and not found and self._nonfinite_after_unscale(params, buffers):
            return math.inf, True, None  # (begin_step returns the scale this step unscaled with)
        return (math.inf, True, None) if found else (None, False, None)

    def _scalar_device(self, grads: list[torch.Tensor], buffers: list[torch.Tensor] | None) -> torch.device:
        """Where the step's scalars live: the loss scale's device (found_inf is written next to it), else the
        gradients' (the norm)."""
        scale = self._scaler._scale_tensor() if self._host_scale is not None and self._scaler is not None else None
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
            self._readout_scale = None
            readout[_ONE] = 1.0
            self._slots = list(readout.unbind(0))
        return readout, self._slots

    def _nonfinite_after_unscale(self, params: list[torch.Tensor], buffers: list[torch.Tensor] | None) -> bool:
        """Whether an unscaled gradient holds inf/NaN: the fused check again with ``inv_scale = 1`` (exact).

        Only for a scale below 1 (``1/scale > 1`` can overflow a finite scaled gradient) when no
        norm was computed; the gradients are the same on every rank here (DDP reduces them, FSDP
        always computes the norm), so every rank reaches the same answer.
        """
        assert self._readout is not None  # placed by the step's check
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
        max_norm = cast(float, self._opts.max_grad_norm)  # called only with clipping
        if buffers is None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
            return
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for flat in buffers:
            flat.mul_(coef.to(flat.device))

    def _settle_stats(self) -> None:
        """Fill in what the last step left lazy (loss, scale, overflows, gradient norm); two reads at most (the
        loss and the scale after the update in one copy, the gradient norm)."""
        host = self._host_scale
        pending = host is not None and host.pending is not None
        loss = self._lazy_loss
        if pending or loss is not None:
            if loss is not None:
                self._slots[_LOSS].copy_(loss)
            assert self._readout is not None  # a pending scale or loss was copied into it
            values = self._readout.tolist()
            if pending and host is not None:
                host.settle(values[_AFTER], self._stats)
            if loss is not None:
                self._stats.loss = values[_LOSS] / self._opts.accumulation_steps
                self._lazy_loss = None
        if self._lazy_norm is not None:
            self._stats.grad_norm = self._lazy_norm.value()
            self._lazy_norm = None

    def _is_spike(self, norm: float) -> bool:
        guard = self._opts.spike_guard
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

    def _record_step(self, *, stepped: bool, non_finite: bool, spike: bool, grad_norm: float | None) -> None:
        stats = self._stats
        if stepped:
            stats.steps += 1
            stats.consecutive_skips = 0
        else:
            stats.skipped += int(non_finite)
            stats.spike_skips += int(spike)
            stats.consecutive_skips += 1
        stats.grad_norm = grad_norm
        if self._loss_sum is not None:
            self._lazy_loss, self._loss_sum = self._loss_sum, None
        if self._opts.callback is not None:
            self._settle_stats()
            self._opts.callback(dataclasses.replace(stats))
        limit = self._opts.max_consecutive_skips
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
                f"{self._opts.accumulation_steps}; save after step() completes the window"
            )
        return {
            "format": checkpoint.STATE_FORMAT,
            "precision": self._opts.precision,
            "master_weights": self._opts.master_weights,
            "model": self._sync.model_state(self._inner),
            "master": self._masters.state_dict(),
            "optimizer": self._sync.optimizer_state(self._optimizer),
            "scaler": self._scaler.state_dict() if self._scaler is not None else {},
            "stats": dataclasses.asdict(self.stats),
            "spike_history": list(self._norm_history) if self._opts.spike_guard is not None else [],
        }

    def check_state_dict(self, state_dict: Any) -> TrainStats:
        """Validate a whole checkpoint before anything is loaded (raises ``ValueError`` naming the
        first mismatch; nothing changes); returns its stats. The Lightning plugin checks with it too."""
        checkpoint.check_header(state_dict, precision=self._opts.precision, master_weights=self._opts.master_weights)
        # FSDP2's entries are sharded DTensors: their values are checked by torch.distributed.checkpoint
        checkpoint.check_tensors("master weights", state_dict["master"], self._masters.tensors(),
                                 finite=self._sync.local_state)
        model_state = self._sync.model_state(self._inner)
        checkpoint.check_tensors("model", state_dict["model"], model_state, finite=False)
        self._sync.check_checkpoint(state_dict, self._inner, self._optimizer, model_state)
        if self._scaler is not None:
            self._scaler.check_state_dict(state_dict["scaler"])
        stats = check_stats(state_dict["stats"])
        checkpoint.check_spike_history(state_dict.get("spike_history", []))
        return stats

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore everything ``state_dict()`` saved; the trainer must be built the same way.

        The whole checkpoint is validated first (format, mode, every master's and model tensor's
        name, shape and dtype, the scaler dict): a mismatch raises ``ValueError`` naming it and
        loads nothing; nothing is broadcast or silently converted.
        """
        stats = self.check_state_dict(state_dict)
        self._buffer_guard.forget()
        self._sync.load(self._inner, self._optimizer, state_dict["model"], state_dict["optimizer"])
        self._masters.load_state_dict(state_dict["master"])
        if self._scaler is not None:
            self._scaler.load_state_dict(state_dict["scaler"])
        self._stats = stats
        self._lazy_norm = self._lazy_loss = None
        if self._host_scale is not None:
            self._host_scale.forget()  # read again at the next step (the scaler's version moved anyway)
        self._norm_history.clear()
        if self._opts.spike_guard is not None:
            self._norm_history.extend(state_dict.get("spike_history", []))
        self._micro = 0
        self._loss_sum = None
