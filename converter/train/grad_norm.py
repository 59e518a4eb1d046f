"""The gradient norm of a step: computed on the device without a sync, or left to be computed when read.

:func:`total_norm` is ``torch.nn.utils.get_total_norm``'s arithmetic, with one reduction per flat buffer when
the O2 trainer's gradient arena holds exactly the gradients; :class:`LazyNorm` keeps what is needed to
compute the same value later, when nothing in the step needed it (``TrainStats.grad_norm``).
"""
from __future__ import annotations

import operator
import weakref
from typing import Optional, cast

import torch

__all__ = ["LazyNorm", "total_norm"]

_VERSION = operator.attrgetter("_version")


def total_norm(grads: list[torch.Tensor], buffers: list[torch.Tensor] | None,
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
        grouped = torch._C._group_tensors_by_device_and_dtype([cast(list[Optional[torch.Tensor]], grads)], False)
        norms = [norm for (tensors,), _indices in grouped.values()
                 for norm in torch._foreach_norm(cast(list[torch.Tensor], tensors))]
        if len(grouped) > 1:
            norms = [norm.to(grads[0].device) for norm in norms]
    source = norms[0] if buffers is not None and len(buffers) == 1 else torch.stack(
        [n.to(norms[0].device) for n in norms] if buffers is not None else norms)
    if out is not None and out.device == source.device and source.dtype == torch.float32:
        return torch.linalg.vector_norm(source, out=out)
    norm = torch.linalg.vector_norm(source)
    return norm if out is None else out.copy_(norm)


class LazyNorm:
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
            live = [ref() for ref in cast("list[weakref.ref[torch.Tensor]]", self._refs)]  # set without buffers
            if any(t is None for t in live):
                return None
            tensors = cast(list[torch.Tensor], live)
        if list(map(_VERSION, tensors)) != self._versions:
            return None
        return float(total_norm(tensors, self._buffers).item())

