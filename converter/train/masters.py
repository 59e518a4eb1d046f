"""O2's master-weights store: the half model parameters, their fp32 masters, and the buffers laid out around them.

Under O2 the trainer stores trainable parameters in half, keeps an fp32 master of each, and points the
optimizer at the masters. :class:`MasterWeights` owns all of it, in one object: which parameter has which
master (by fqn), the flat buffers that make the master→model copy one ``copy_`` per (device, dtype), the
gradient arena whose views are the optimizer's gradients, the persistent fp32 gradient buffers the half
gradients are harvested into, and the masters' part of a checkpoint. Under O1 the store is empty (every
method does nothing).

Which parameters stay fp32 (:func:`storage_plan`): the converter records the storage dtype of each
parameter in ``module.meta["mp_param_dtypes"]`` (fqn -> dtype); parameters the map does not name stay
fp32. Without that map (a hand-written model) the fallback keeps fp32 every parameter of a module whose
class name contains ``"Norm"`` or ``"Embedding"`` (as Apex O2 keeps batch norm fp32 and Keras keeps
normalisation and embedding layers fp32).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, cast

import torch
from torch import nn

from converter.ir.meta import GM_PARAM_DTYPES

__all__ = ["MasterWeights", "check_o1_optimizer", "storage_plan"]

_FP32_MODULE_MARKERS = ("Norm", "Embedding")
# C-level accessors for the per-step loops over parameters (map() over these runs no Python frame per tensor)
_GRAD = operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr
_NOT_NONE = functools.partial(operator.is_not, None)


def _fallback_storage_dtype(module_class: str, half: torch.dtype) -> torch.dtype:
    if any(marker in module_class for marker in _FP32_MODULE_MARKERS):
        return torch.float32
    return half


def storage_plan(inner: nn.Module, half: torch.dtype, given: dict | None = None) -> dict[str, torch.dtype]:
    """fqn -> storage dtype under O2 for every floating (non-fp64) parameter of ``inner``: from ``given``,
    else ``inner.meta["mp_param_dtypes"]``, else the Norm/Embedding fallback."""
    params = {
        name: p for name, p in inner.named_parameters() if p.is_floating_point() and p.dtype != torch.float64
    }
    meta = getattr(inner, "meta", None)
    if given is not None or (isinstance(meta, dict) and GM_PARAM_DTYPES in meta):
        recorded = given if given is not None else cast(dict, meta)[GM_PARAM_DTYPES]
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
    owners: dict[str, str] = {}
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



def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def check_o1_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """O1 with a loss scaler steps the stored parameters directly: none of the optimizer's may be fp16."""
    half_params = [p for p in _optimizer_params(optimizer) if p.dtype == torch.float16]
    if half_params:
        raise ValueError(
            f"{len(half_params)} optimizer parameters are stored in fp16, but master_weights=False "
            "(O1) steps the stored parameters directly and fp16 gradients cannot be unscaled safely; "
            "keep the parameters fp32 or pass master_weights=True (O2)."
        )


class MasterWeights:
    """The O2 state of one trainer: model params ↔ fp32 masters, their flat buffers, the gradient arena.

    Made empty (O1: :meth:`__len__` is 0 and every method does nothing) or by :meth:`create`, which is the
    only place that changes the user's parameters and optimizer.
    """

    def __init__(self) -> None:
        # (fqn, half model param, fp32 master) for every trainable half-stored parameter, in named_parameters order
        self._entries: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        # one persistent fp32 gradient buffer per master (its view of the arena; allocated on first use for a
        # non-contiguous param), so that a step's harvest copies into memory it already owns
        self._grad_bufs: list[torch.Tensor | None] = []
        # flat buffers of half params and masters per (device, dtype); non-contiguous pairs per dtype
        self._flat_groups: list[_FlatGroup] = []
        self._loose_groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        #: the optimizer's gradients as slots of one fp32 buffer per device (see ``_GradArena``)
        self.arena = _GradArena()
        # the trainable fp32-stored params the optimizer steps directly, each with its arena slot and data_ptr;
        # the half params, and these params and slots as lists, for the per-step C-level passes
        self._direct: list[tuple[nn.Parameter, torch.Tensor, int]] = []
        self._half_params: list[nn.Parameter] = []
        self._direct_params: list[nn.Parameter] = []
        self._direct_slots: list[torch.Tensor] = []
        # the optimizer's params as last seen by settled() and their arena slots (None when one has no slot)
        self._slots_of_params: tuple[list[torch.Tensor], list[torch.Tensor] | None] = ([], [])

    def __len__(self) -> int:
        """How many masters there are (0 under O1, and under O2 when every trainable parameter stays fp32)."""
        return len(self._entries)

    @classmethod
    def create(cls, inner: nn.Module, optimizer: torch.optim.Optimizer, plan: dict[str, torch.dtype]) -> MasterWeights:
        """Store ``inner``'s parameters as ``plan`` says, make the fp32 masters, point ``optimizer`` at them.

        Every trainable parameter gets storage of its own (half copies, and copies of the ones kept fp32):
        a converted module shares its weights' storage with the original model, which O2 leaves as it was.
        The optimizer's param groups hold the masters afterwards, and any state it had moves with them.
        """
        store = cls()
        master_of: dict[int, nn.Parameter] = {}
        for fqn, param in inner.named_parameters():
            if fqn not in plan:
                continue
            target = plan[fqn]
            original = param.detach()
            if target != torch.float32 and param.requires_grad:
                master = nn.Parameter(original.to(torch.float32, copy=True))
                store._entries.append((fqn, param, master))
                master_of[id(param)] = master
            if param.dtype != target:
                param.data = original.to(target)
            elif param.requires_grad:
                # a storage nothing else holds is freed right away: no memory is added
                param.data = original.clone()
        for group in optimizer.param_groups:
            group["params"] = [master_of.get(id(p), p) for p in group["params"]]
        for key in list(optimizer.state.keys()):
            if id(key) in master_of:
                optimizer.state[master_of[id(key)]] = optimizer.state.pop(key)
        store._grad_bufs = [None] * len(store._entries)
        store._flatten(optimizer)
        return store

    def _flatten(self, optimizer: torch.optim.Optimizer) -> None:
        """Lay the half params, their fp32 masters and the optimizer's grads out in flat buffers.

        One buffer of half params and one of masters per (device, half dtype), parameters as views
        into it: the master→model copy is then one ``copy_`` per buffer instead of one kernel per
        parameter (on a 2-layer d128 encoder that is 0.15 ms of a 4.4 ms step). The gradients the
        optimizer reads (masters', and those of trainable fp32-stored params) get slots in one fp32
        buffer per device (:class:`_GradArena`), so the gradient norm is one reduction.
        Non-contiguous parameters keep their own storage and go through ``_foreach_copy_``.
        """
        by_key: dict[tuple, list[tuple[nn.Parameter, nn.Parameter]]] = {}
        loose: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for _fqn, param, master in self._entries:
            if param.is_contiguous() and master.is_contiguous():
                by_key.setdefault((param.device, param.dtype), []).append((param, master))
            else:
                models, masters = loose.setdefault(param.dtype, ([], []))
                models.append(param)
                masters.append(master)
        self._loose_groups = list(loose.values())
        owners: dict[torch.device, list[torch.Tensor]] = {}
        for (device, dtype), pairs in by_key.items():
            total = sum(param.numel() for param, _master in pairs)
            group = _FlatGroup(model_flat=torch.empty(total, dtype=dtype, device=device),
                               master_flat=torch.empty(total, dtype=torch.float32, device=device))
            offset = 0
            with torch.no_grad():
                for param, master in pairs:
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
        master_ids = {id(master) for _fqn, _param, master in self._entries}
        # trainable contiguous fp32 params the optimizer steps directly (O2 keeps them fp32: norms)
        direct = [p for p in _optimizer_params(optimizer) if id(p) not in master_ids and p.requires_grad
                  and p.dtype == torch.float32 and p.is_contiguous()]
        for tensor in direct:
            owners.setdefault(tensor.device, []).append(tensor)
        self._build_arena(owners, master_ids)

    def _build_arena(self, owners: dict[torch.device, list[torch.Tensor]], masters: set[int]) -> None:
        arena = self.arena
        for device, tensors in owners.items():
            flat = torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float32, device=device)
            offset = 0
            for tensor in tensors:
                view = flat[offset:offset + tensor.numel()].view_as(tensor)
                offset += tensor.numel()
                arena.slots.append((tensor, view))
                arena.slot_of[id(tensor)] = view
            arena.flats.append(flat)
        self._grad_bufs = [arena.slot_of.get(id(master)) for _fqn, _param, master in self._entries]
        self._direct = [(t, view, t.data_ptr()) for t, view in arena.slots if id(t) not in masters]
        self._half_params = [param for _fqn, param, _master in self._entries]
        self._direct_params = [t for t, _view, _ptr in self._direct]
        self._direct_slots = [view for _t, view, _ptr in self._direct]

    # ------------------------------------------------------------------ per step
    @property
    def params(self) -> list[nn.Parameter]:
        """The fp32 masters, in ``named_parameters`` order (what ``trainer.master_params`` returns)."""
        return [master for _fqn, _param, master in self._entries]

    def grad_buffers(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The arena's flat buffers when they hold exactly ``params``' gradients ``grads``, else None."""
        return self.arena.buffers(params, grads) if self.arena.flats else None

    def settled(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The arena's buffers when nothing waits for :meth:`harvest` and ``params`` (the optimizer's) have exactly
        the arena's slots as their gradients ``grads``, every slot in use: the state ``trainer.backward()`` leaves.
        Else None (the caller then harvests and asks :meth:`grad_buffers`). Three C-level passes, no Python loop.

        Every slot's owner is one of ``params`` here (as many params as slots, each holding its own slot), so
        the trainable fp32 params' gradients are in their slots too: nothing is left to harvest.
        """
        arena = self.arena
        if not arena.flats or len(params) != len(arena.slots) or any(map(_NOT_NONE, map(_GRAD, self._half_params))):
            return None
        known, slots = self._slots_of_params
        if len(known) != len(params) or not all(map(operator.is_, params, known)):  # (compares no tensor data)
            slots = cast(list[torch.Tensor], [arena.slot_of.get(id(p)) for p in params])  # None: checked next
            if not all(map(_NOT_NONE, slots)):  # a param the arena has no slot for: never settled
                slots = None
            self._slots_of_params = (params, slots)
        return arena.flats if slots is not None and all(map(operator.is_, grads, slots)) else None

    def harvest_waiting(self) -> bool:
        """Whether a gradient waits for :meth:`harvest` (a half param's, or an fp32 param's outside its slot).
        Not after ``trainer.backward()``, which harvests: then two C-level passes replace the loop."""
        if any(map(_NOT_NONE, map(_GRAD, self._half_params))):
            return True
        return not all(map(operator.is_, map(_GRAD, self._direct_params), self._direct_slots))

    def harvest(self) -> None:
        """Accumulate half gradients into the fp32 master gradients and free them.

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
        dirty = self.arena.dirty
        for index, (_fqn, param, master) in enumerate(self._entries):
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

    def copy_to_model(self) -> None:
        """Copy the masters into the half model parameters: one ``copy_`` per flat buffer.

        The flat buffers are plain tensors (the parameters are views of them through ``.data``), so their copy
        records nothing for autograd and needs no ``no_grad``; the per-parameter fallbacks write into leaves
        that require grad and do.
        """
        for group in self._flat_groups:
            if group.intact():
                group.model_flat.copy_(group.master_flat)
            else:  # a parameter was re-pointed (e.g. moved with .to()): copy one by one
                with torch.no_grad():
                    torch._foreach_copy_(group.models, group.masters)
        if self._loose_groups:
            with torch.no_grad():
                for models, masters in self._loose_groups:
                    torch._foreach_copy_(models, masters)

    def drop_grads(self) -> None:
        """Drop the masters' gradients (their buffers stay, for the next harvest)."""
        for _fqn, _param, master in self._entries:
            if master.grad is not None:
                master.grad = None

    def stepped(self, inner: nn.Module) -> list[torch.Tensor]:
        """Each trainable parameter of ``inner``, or its master where it has one: what the optimizer steps."""
        master_of = {id(param): master for _fqn, param, master in self._entries}
        return [master_of.get(id(p), p) for p in inner.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ checkpoints
    def tensors(self) -> dict[str, nn.Parameter]:
        """fqn -> master: what a checkpoint's ``"master"`` entry must match."""
        return {fqn: master for fqn, _param, master in self._entries}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fqn -> the master's values (detached): a checkpoint's ``"master"`` entry."""
        return {fqn: master.detach() for fqn, _param, master in self._entries}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a checked ``"master"`` entry into the masters (the model parameters are loaded separately)."""
        with torch.no_grad():
            for fqn, _param, master in self._entries:
                master.copy_(state[fqn])
