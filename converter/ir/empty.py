"""Build a model without its weights: parameters on the meta device, buffers real.

::

    with converter.empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)   # a 70B model: no memory
    conv = converter.convert(model, example_inputs)
    conv.save("out/")                                    # model.py, train.py, reports; the buffers
    model = out_model.load(weights="path/to/checkpoint") # the weights from your save_pretrained folder

Every parameter a module registers inside the block is moved to the meta device as it is
registered: a layer's ``reset_parameters`` (and a Hugging Face ``post_init``) then runs on meta
and the ``torch.empty`` it was made from is freed untouched, so building costs no memory. Buffers
stay real: a rotary embedding's ``inv_freq`` is computed from the config, is not in a checkpoint
(non-persistent) and is written next to model.py. ``torch.device("meta")`` alone would put them on
meta too, and model.py could then not be loaded from a checkpoint.

A tensor factory call (``torch.empty``, ``zeros``, ``randn``...) without a device that asks for at
least :data:`LARGE_BYTES` is made on the meta device straight away: a layer's weight is allocated
before it is registered, and one weight larger than the machine's memory (a ~1e13-parameter config)
failed in the allocator before it could be moved. Such a tensor registered as a *buffer* cannot be
kept real without that memory: :class:`EmptyWeightsError` names it (one line) instead.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from converter.ir.errors import MpconvertError

__all__ = ["empty_weights", "EmptyWeightsError", "LARGE_BYTES"]

#: factory calls asking for at least this many bytes are made on meta inside ``empty_weights()``
LARGE_BYTES = 1 << 30

#: factories whose leading positional arguments (or ``size=``) are the shape
_SIZED = {torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn}


class EmptyWeightsError(MpconvertError, ValueError):
    """A buffer too large to build for real inside ``empty_weights()``; the message is one line."""


def _shape(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    if func in _SIZED:
        size = kwargs.get("size", args)
    elif func in (torch.full, torch.empty_strided):
        size = kwargs.get("size", args[0] if args else None)
    elif func is torch.randint:
        size = kwargs.get("size", next((a for a in args if isinstance(a, (tuple, list, torch.Size))), None))
    else:
        return None
    if isinstance(size, (tuple, list, torch.Size)) and len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    if not isinstance(size, (tuple, list, torch.Size)) or not all(isinstance(d, int) for d in size):
        return None
    return tuple(size)


class _LargeOnMeta(TorchFunctionMode):
    """Large device-less factory calls go to meta; the tensors made so are remembered (weakly)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # id -> tensor

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        shape = _shape(func, args, kwargs) if kwargs.get("device") is None else None
        if shape is not None:
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            count = 1
            for d in shape:
                count *= max(d, 0)
            if count * dtype.itemsize >= LARGE_BYTES:
                out = func(*args, **{**kwargs, "device": "meta"})
                self.made[id(out)] = out
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Inside the block, every parameter a module registers goes to the meta device (see module docstring)."""
    original_param = nn.Module.register_parameter
    original_buffer = nn.Module.register_buffer
    mode = _LargeOnMeta()

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_param(self, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            self._parameters[name] = meta

    def register_buffer(self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta and mode.made.get(id(tensor)) is tensor:
            size = tensor.numel() * tensor.element_size()
            raise EmptyWeightsError(
                f"{type(self).__name__}.{name}: a buffer of {size / 2**30:,.1f} GiB {tuple(tensor.shape)}; empty_weights() "
                "keeps buffers real (they are not in checkpoints) and this one needs that memory: make it smaller in the "
                "config, or build the model on a machine that has the memory")
        original_buffer(self, name, tensor, persistent)

    setattr(nn.Module, "register_parameter", register_parameter)  # noqa: B010 (mypy: a method is assigned on purpose)
    setattr(nn.Module, "register_buffer", register_buffer)  # noqa: B010
    try:
        with mode:
            yield
    finally:
        setattr(nn.Module, "register_parameter", original_param)  # noqa: B010
        setattr(nn.Module, "register_buffer", original_buffer)  # noqa: B010
