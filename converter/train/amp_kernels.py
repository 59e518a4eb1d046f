"""The loss scaler's kernels: the fused unscale-and-check over gradients and the branch-free scale update.

These are the device-side halves of :class:`~converter.train.scaler.LossScaler` (and of the O2 trainer's
per-step check): ``torch._amp_foreach_non_finite_check_and_unscale_`` and ``torch._amp_update_scale_`` on
every device that registers them, equivalent tensor ops elsewhere. Nothing here synchronises with the
device or keeps state beyond the cache of found kernels.
"""
from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Iterable
from typing import cast

import torch

__all__ = ["UNSCALE_OP", "UPDATE_OP", "has_kernel", "inverse_scale", "local_shard", "unscale_grads",
           "unscale_groups", "update_with_tensor_ops"]

UPDATE_OP = "aten::_amp_update_scale_"
UNSCALE_OP = "aten::_amp_foreach_non_finite_check_and_unscale_"
_DISPATCH_KEY_FOR_DEVICE = {
    "cpu": "CPU",
    "cuda": "CUDA",
    "mps": "MPS",
    "xpu": "XPU",
    "hpu": "HPU",
    "xla": "XLA",
    "mtia": "MTIA",
    "meta": "Meta",
    "privateuseone": "PrivateUse1",
}


def has_kernel(op_name: str, device: torch.device) -> bool:
    """Whether ``op_name`` has a kernel registered for ``device``'s backend (no host sync).

    A found kernel is remembered: the dispatcher lookup costs ~8 µs and runs twice per step, and a
    registered kernel stays registered. A missing one is looked up again (a backend may load later).
    """
    if (op_name, device.type) in _KERNELS_FOUND:
        return True
    key = _DISPATCH_KEY_FOR_DEVICE.get(device.type)
    if key is None:
        return False
    found = bool(torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key))
    if found:
        _KERNELS_FOUND.add((op_name, device.type))
    return found


#: (op name, device type) pairs whose kernel :func:`has_kernel` has found
_KERNELS_FOUND: set[tuple[str, str]] = set()


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1/scale`` as a 0-dim fp32 tensor, rounded once from the exact quotient, as ``GradScaler`` computes it
    (``scale.double().reciprocal().float()``: three kernels).

    On the CPU one fp32 ``reciprocal`` gives the same bits: its fp32 division is correctly rounded, and rounding
    a quotient to double and then to fp32 equals rounding it to fp32 directly (double rounding is innocuous
    for a quotient when the wider format has at least 2p+2 bits, and 53 >= 2*24+2); ``tests/test_scaler.py``
    compares the two over random fp32 values. Other devices keep the double computation.
    """
    if scale.is_cpu:
        return torch.reciprocal(scale)
    return scale.double().reciprocal().float()


def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


_DTENSOR = _dtensor_class()
# C-level accessors for the per-step loops over gradients
_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")
_NOT_NONE = functools.partial(operator.is_not, None)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (FSDP2 gradients), else the tensor itself.

    Ops on the shard change the DTensor in place; each rank checks only its own shard, and
    ``sync_found_inf`` makes the ranks agree.
    """
    if _DTENSOR is not None and isinstance(tensor, _DTENSOR):
        return cast(torch.Tensor, tensor.to_local())  # type: ignore[attr-defined]  # _DTENSOR is DTensor when set
    return tensor


def unscale_grads(
    params: Iterable[torch.Tensor],
    *,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool,
) -> None:
    """Multiply every ``.grad`` of ``params`` by ``inv_scale`` in place and OR inf/NaN into ``found_inf``.

    Grads are grouped by (device, dtype) so that each group is one fused kernel call. A sparse
    fp16 grad is coalesced first: an uncoalesced sparse tensor may hold several finite values for
    one index whose sum overflows, and only the coalesced values show that.
    ``found_inf`` is a float32 0-dim tensor; grads on other devices get their own flag, which is
    then folded into ``found_inf`` (0 or 1 afterwards).
    """
    grads = list(filter(_NOT_NONE, map(_GRAD, params)))
    if grads and set(map(type, grads)) == {torch.Tensor} and set(map(_LAYOUT, grads)) == {torch.strided}:
        # the common case, dense plain tensors: grouped in C++ (as torch's optimizers group theirs), no
        # Python work per gradient; only a complex group needs its real views
        grouped = torch._C._group_tensors_by_device_and_dtype([grads], False)
        dense: list[tuple[tuple[torch.device, torch.dtype], list[torch.Tensor]]] = []
        for (device, dtype), ((group,), _indices) in grouped.items():
            tensors = cast(list[torch.Tensor], group)  # gradients: no None in a group
            if not allow_fp16 and dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if dtype.is_complex:  # a complex weight (a Fourier layer): unscaled in place through its real view
                tensors = [torch.view_as_real(t) for t in tensors]
                dtype = tensors[0].dtype
            dense.append(((device, dtype), tensors))
        unscale_groups(dense, inv_scale=inv_scale, found_inf=found_inf)
        return
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if not allow_fp16 and grad.dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        if grad.is_sparse:
            if grad.dtype == torch.float16:
                param.grad = grad = grad.coalesce()
            target = grad._values()
        else:
            target = local_shard(grad)
        if target.is_complex():  # a complex weight (a Fourier layer): unscaled in place through its real view
            target = torch.view_as_real(target)
        groups[(target.device, target.dtype)].append(target)
    unscale_groups(groups.items(), inv_scale=inv_scale, found_inf=found_inf)


def unscale_groups(
    groups: Iterable[tuple[tuple[torch.device, torch.dtype], list[torch.Tensor]]],
    *,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    """The kernel side of :func:`unscale_grads`: one fused call per ((device, dtype), dense tensors) group."""
    flags: dict[torch.device, torch.Tensor] = {found_inf.device: found_inf}
    inv_by_device: dict[torch.device, torch.Tensor] = {inv_scale.device: inv_scale}
    for (device, _dtype), tensors in groups:
        if device not in flags:
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            inv_by_device[device] = inv_scale.to(device)
        flag, inv = flags[device], inv_by_device[device]
        if has_kernel(UNSCALE_OP, device):
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
        else:
            for tensor in tensors:
                nonfinite = torch.logical_not(torch.isfinite(tensor)).any()
                flag.copy_(torch.maximum(flag, nonfinite.to(flag.dtype)))
                tensor.mul_(inv.to(tensor.dtype))
    for device, flag in flags.items():
        if device != found_inf.device:
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))


def update_with_tensor_ops(
    *,
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_left: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
) -> None:
    """The scale update as branch-free tensor ops (no host sync), in place.

    With ``hysteresis == 1`` and no bounds this computes exactly what ``_amp_update_scale_`` does:
    products are formed in double and rounded once to float32, and growth is kept only when the
    result is finite. Used when hysteresis is on or the device has no fused kernel.
    """
    found = found_inf > 0
    absorbed = found & (hysteresis_left > 1)
    back_off = found & torch.logical_not(absorbed)
    counted = growth_tracker + 1
    grow = torch.logical_not(found) & (counted >= growth_interval)

    scale64 = scale.double()
    grown = (scale64 * growth_factor).float()
    backed = (scale64 * backoff_factor).float()
    new_scale = torch.where(grow & torch.isfinite(grown), grown, scale)
    new_scale = torch.where(back_off, backed, new_scale)
    if min_scale is not None or max_scale is not None:
        new_scale = new_scale.clamp(min=min_scale, max=max_scale)

    new_tracker = torch.where(found | grow, torch.zeros_like(counted), counted)
    refill = torch.full_like(hysteresis_left, hysteresis)
    new_hysteresis = torch.where(absorbed, hysteresis_left - 1, hysteresis_left)
    new_hysteresis = torch.where(grow, refill, new_hysteresis)

    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)
    hysteresis_left.copy_(new_hysteresis)
