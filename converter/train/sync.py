"""How a trainer's ranks agree: no sync, DistributedDataParallel, or FSDP2 (``fully_shard``).

The trainer picks one strategy when it is built (:func:`choose_sync`) and calls it at the points where
data parallelism changes what a step does: which backward reduces gradients, how O2's fp32 gradients
are averaged, how the gradient norm is computed, how the ranks agree to skip a step, and how the model
and optimizer are saved and loaded. :class:`SyncStrategy` is the single-process behaviour (and
``nn.DataParallel``'s, which reduces inside its forward); :class:`DDPSync` and :class:`FSDP2Sync` change
only what their wrappers need.
"""
from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from converter.train import checkpoint
from converter.train.grad_norm import total_norm
from converter.train.masters import MasterWeights

__all__ = ["DDPSync", "FSDP2Sync", "NoSync", "SyncStrategy", "choose_sync"]


class SyncStrategy:
    """Nothing crosses ranks: each method is the single-process step's behaviour.

    Attributes:
        eager_norm: the step must compute the gradient norm (FSDP2: the global norm decides every rank's skip).
        local_state: the model and optimizer state are plain local tensors (not sharded), so a checkpoint's
            values and optimizer state can be checked here before loading.
        reduces_master_grads: :meth:`reduce_master_grads` does something (O2 under DDP), so every step calls it.
    """

    eager_norm = False
    local_state = True
    reduces_master_grads = False

    def start(self, *, accumulation_steps: int) -> None:
        """Set the wrapper's gradient reduction for the first backward (called once, after every check passed)."""

    def set_grad_sync(self, sync: bool) -> None:
        """Whether the next backward reduces gradients across ranks (only a window's last one does)."""

    def reduce_master_grads(self, inner: nn.Module, masters: MasterWeights) -> None:
        """O2: average the fp32 gradients the optimizer steps across ranks (after the harvest)."""

    def total_norm(self, grads: list[torch.Tensor], buffers: list[torch.Tensor] | None,
                   out: torch.Tensor) -> torch.Tensor:
        """The gradient 2-norm as a device tensor, written into ``out`` (a 0-dim fp32 slot); no host sync."""
        return total_norm(grads, buffers, out=out)

    def agree_on_skip(self, found: torch.Tensor | None, norm: torch.Tensor, agree: torch.Tensor) -> bool:
        """Without a loss scaler (whose flag is all-reduced already): make every rank skip if any rank's gradients
        are non-finite, writing the agreed flag into ``agree``. Returns whether it did (False: the rank decides)."""
        return False

    def model_state(self, inner: nn.Module) -> dict[str, Any]:
        """The model entry of a checkpoint."""
        return inner.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer entry of a checkpoint."""
        return optimizer.state_dict()

    def check_checkpoint(self, state_dict: dict[str, Any], inner: nn.Module, optimizer: torch.optim.Optimizer,
                         model_state: dict[str, Any]) -> None:
        """Check what loading would otherwise find only later: the checkpoint's parameter values are finite and its
        optimizer has this one's param groups, with per-parameter state of the parameters' shapes."""
        for name, _param in inner.named_parameters():
            if name in model_state:
                checkpoint.check_values(f"checkpoint model parameter {name!r}", state_dict["model"][name])
        checkpoint.check_optimizer_groups(state_dict["optimizer"], optimizer)
        checkpoint.check_optimizer_state(state_dict["optimizer"], optimizer)

    def load(self, inner: nn.Module, optimizer: torch.optim.Optimizer, model: dict[str, Any],
             optim: dict[str, Any]) -> None:
        """Load a checked checkpoint's model and optimizer entries."""
        inner.load_state_dict(model)
        optimizer.load_state_dict(optim)


class NoSync(SyncStrategy):
    """A single process, or ``nn.DataParallel`` (which reduces inside its forward)."""


class DDPSync(SyncStrategy):
    """``DistributedDataParallel``: O1 keeps DDP's reduction, O2 all-reduces the fp32 gradients itself.

    O2: DDP would all-reduce half gradients into buckets laid out for the fp32 params it was built
    with. Its reduction is turned off (what ``no_sync()`` does) and the fp32 master gradients are
    all-reduced in the step instead. O1: DDP's reduction runs, but only on the backward that completes
    an accumulation window.
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, *, master_weights: bool) -> None:
        self._ddp = ddp
        self._master_weights = master_weights
        self.reduces_master_grads = master_weights

    def start(self, *, accumulation_steps: int) -> None:
        self._ddp.require_backward_grad_sync = (not self._master_weights) and accumulation_steps == 1

    def set_grad_sync(self, sync: bool) -> None:
        if not self._master_weights:
            self._ddp.require_backward_grad_sync = sync

    def reduce_master_grads(self, inner: nn.Module, masters: MasterWeights) -> None:
        if not self._master_weights:
            return
        dist = torch.distributed
        group = self._ddp.process_group
        world = dist.get_world_size(group)
        trainable = masters.stepped(inner)
        device = trainable[0].device if trainable else torch.device("cpu")
        present = torch.tensor([t.grad is not None for t in trainable], dtype=torch.int32, device=device)
        dist.all_reduce(present, op=dist.ReduceOp.SUM, group=group)
        reduced = [t for t, n in zip(trainable, present.tolist()) if n > 0]
        for tensor in reduced:
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in reduced:
            grad = cast(torch.Tensor, tensor.grad)  # made above where it was None
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(world)
            torch._foreach_copy_(grads, [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def agree_on_skip(self, found: torch.Tensor | None, norm: torch.Tensor, agree: torch.Tensor) -> bool:
        bad = found if found is not None else torch.logical_not(torch.isfinite(norm)).to(torch.float32)
        flag = bad.clone()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._ddp.process_group)
        agree.copy_(flag)
        return True


class FSDP2Sync(SyncStrategy):
    """``torch.distributed.fsdp.fully_shard``: O1 only; global norm; sharded checkpoints.

    The gradient norm is the global one (DTensor shards reduced), so every rank skips together;
    accumulation uses ``set_requires_gradient_sync``; ``state_dict``/``load`` go through
    ``torch.distributed.checkpoint.state_dict`` (sharded DTensors).
    """

    eager_norm = True
    local_state = False

    def __init__(self, fsdp: nn.Module) -> None:
        self._fsdp: Any = fsdp  # an FSDPModule (fully_shard swaps the class): its methods are not nn.Module's

    def start(self, *, accumulation_steps: int) -> None:
        self._fsdp.set_requires_gradient_sync(accumulation_steps == 1)

    def set_grad_sync(self, sync: bool) -> None:
        self._fsdp.set_requires_gradient_sync(sync)

    def total_norm(self, grads: list[torch.Tensor], buffers: list[torch.Tensor] | None,
                   out: torch.Tensor) -> torch.Tensor:
        # DTensor shards: the norm is reduced across ranks (a collective); the DTensor is what clipping takes
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        full_tensor = getattr(norm, "full_tensor", None)
        out.copy_(full_tensor() if full_tensor is not None else norm)
        return norm

    def check_checkpoint(self, state_dict: dict[str, Any], inner: nn.Module, optimizer: torch.optim.Optimizer,
                         model_state: dict[str, Any]) -> None:
        """Sharded entries: ``torch.distributed.checkpoint`` checks them as it loads."""

    def model_state(self, inner: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self._fsdp)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self._fsdp, optimizer)

    def load(self, inner: nn.Module, optimizer: torch.optim.Optimizer, model: dict[str, Any],
             optim: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self._fsdp, model)
        set_optimizer_state_dict(self._fsdp, optimizer, optim)


def _is_fsdp2(module: nn.Module) -> bool:
    """Whether ``module`` was sharded with ``torch.distributed.fsdp.fully_shard`` (FSDP2)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def choose_sync(module: nn.Module, *, master_weights: bool) -> SyncStrategy:
    """The strategy for ``module`` as the trainer was given it; changes nothing. ValueError for O2 on FSDP2."""
    if _is_fsdp2(module):
        if master_weights:
            raise ValueError(
                "master_weights=True (O2) is not supported on an FSDP2 (fully_shard) module: its DTensor "
                "shards cannot be re-laid out as half copies. Use master_weights=False; for O2 storage let FSDP "
                "keep fp32 shards as the masters with MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32) on an unconverted module (docs/training.md)."
            )
        return FSDP2Sync(module)
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return DDPSync(module, master_weights=master_weights)
    return NoSync()
