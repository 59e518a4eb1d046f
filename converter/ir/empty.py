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
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["empty_weights"]


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Inside the block, every parameter a module registers goes to the meta device (see module docstring)."""
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param) -> None:
        original(self, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            self._parameters[name] = meta

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original
