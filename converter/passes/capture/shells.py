"""The model shell: a copy of the user's module tree over the same tensors, which every trace runs on.

:func:`shell` copies no weight and shares no mode, hook, attribute table or config with the model,
so nothing capture does reaches the user's model. :func:`without_layerdrop` names the config fields
that switch Hugging Face LayerDrop off on a shell; :func:`is_hf_model` recognises a transformers
model without importing transformers.
"""
from __future__ import annotations

import copy
import sys
from typing import Any, Optional

import torch

__all__ = ["shell", "without_layerdrop", "is_hf_model"]


#: what a module's ``__dict__`` holds per instance that a shell must not share with the original
#: (hooks, parameter/buffer/submodule tables: everything ``nn.Module.__init__`` makes a dict or set)
_OWN_TABLES = tuple(k for k, v in vars(torch.nn.Module()).items() if isinstance(v, (dict, set)))


def shell(model: torch.nn.Module, *, config: Optional[dict] = None) -> torch.nn.Module:
    """A copy of ``model``'s module tree over the same tensors: no weight is copied.

    Every submodule is a new object of its class with its own attribute, hook, parameter, buffer
    and submodule tables, so ``train()``/``eval()``, a registered hook or a replaced attribute on
    the shell leave ``model`` as it is. Each parameter is a new ``nn.Parameter`` over the same
    storage (tied weights stay tied; its ``requires_grad`` and ``.grad`` are the shell's own);
    buffers are the same tensors, so code that writes one in place (a train-mode batch norm) must
    run under :func:`~converter.ir.state.preserved_state`. ``config``: fields set on a copy of the
    model's ``config``, which every submodule of the shell that shared it reads instead (and on a copy
    of any other Hugging Face config in the tree that has the field). When ``config`` switches LayerDrop
    off, a submodule's own ``layerdrop`` attribute (a stack that copied the config's value in ``__init__``)
    is 0 on the shell too.
    """
    original_config = getattr(model, "config", None) if config else None
    hf_config = getattr(sys.modules.get("transformers.configuration_utils"), "PretrainedConfig", None)
    configs: dict[int, Any] = {}
    dropping = config is not None and bool(config) and any(config.get(f) == 0 for f in _LAYERDROP_FIELDS)

    def changed(value: Any) -> Any:
        """The shell's copy of a config: the root's, and any other Hugging Face config in the tree
        that has the field (T5's decoder stack reads a deep copy of the root's)."""
        if id(value) not in configs:
            new = configs[id(value)] = copy.copy(value)
            for field_name, field_value in (config or {}).items():  # (called only with a config)
                if value is original_config or hasattr(value, field_name):
                    setattr(new, field_name, field_value)
        return configs[id(value)]

    def is_config(value: Any) -> bool:
        return (original_config is not None and value is original_config) or (
            isinstance(hf_config, type) and isinstance(value, hf_config))

    params: dict[int, Any] = {}
    modules: dict[int, torch.nn.Module] = {}

    def clone(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in modules:  # a module reached by two paths stays one module
            return modules[id(module)]
        unscripted = _unscripted(module)
        if unscripted is not None:  # a ScriptModule: its Python class over the same tensors
            modules[id(module)] = unscripted
            unscripted._parameters = {k: _shared_param(p, params) for k, p in unscripted._parameters.items()}
            unscripted._modules = {k: None if m is None else clone(m) for k, m in unscripted._modules.items()}
            return unscripted
        new = object.__new__(type(module))
        modules[id(module)] = new
        state = dict(vars(module))
        for key in _OWN_TABLES:
            if key in state:
                state[key] = copy.copy(state[key])
        if config:
            state.update({k: changed(v) for k, v in state.items() if is_config(v)})
        state["_parameters"] = {k: _shared_param(p, params) for k, p in module._parameters.items()}
        state["_modules"] = {k: None if m is None else clone(m) for k, m in module._modules.items()}
        if dropping and isinstance(state.get("layerdrop"), (int, float)) and not isinstance(state["layerdrop"], bool):
            state["layerdrop"] = 0.0  # BART/M2M100/OPT copy config.*layerdrop onto the layer stack in __init__
        new.__dict__.update(state)
        return new

    return clone(model)


def _unscripted(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A ScriptModule (``torch.jit.script(GatedGelu(d))``) as an instance of the Python class it was scripted
    from, over its own parameters, buffers, submodules (still scripted: the shell unscripts them in turn) and
    attributes; None for any other module, or a ScriptModule with no Python class (``torch.jit.load``).

    No tracer sees into a ScriptModule (FX read its C++ module ``_c`` as a constant, so its parameters
    left training and model.py could not write it; torch.export refuses its call), while its Python
    class is exactly what it compiled: the graph traces that, and its tensors stay the model's."""
    if not isinstance(module, torch.jit.RecursiveScriptModule):
        return None
    concrete: Any = getattr(module, "_concrete_type", None)
    cls = getattr(concrete, "py_class", None)
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module) or issubclass(cls, torch.jit.ScriptModule):
        return None
    new = object.__new__(cls)
    torch.nn.Module.__init__(new)
    new.training = module.training
    new.__dict__.update(concrete.get_constants())
    for name, (_type, is_param) in concrete.get_attributes().items():
        if not is_param and name not in module._buffers and name not in vars(new):
            new.__dict__[name] = getattr(module, name)
    new._parameters = dict(module._parameters.items())
    new._buffers = dict(module._buffers.items())
    new._modules = dict(module._modules.items())
    return new


def _shared_param(param: Optional[torch.nn.Parameter], memo: dict) -> Optional[torch.nn.Parameter]:
    """A new ``nn.Parameter`` over ``param``'s storage (one per original: tied weights stay tied).
    Parameter subclasses (quantised weights...) are kept as they are."""
    if param is None or type(param) is not torch.nn.Parameter:
        return param
    if id(param) not in memo:
        memo[id(param)] = torch.nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    return memo[id(param)]


#: Hugging Face config fields of LayerDrop (skip a whole layer with probability p in train mode)
_LAYERDROP_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def without_layerdrop(model: torch.nn.Module) -> Optional[tuple[dict, str]]:
    """The config fields that switch LayerDrop off, and the note saying so; None if it has none.

    LayerDrop (``if self.training and torch.rand([]) < config.layerdrop: skip the layer``) is a
    branch on a random number: no graph records it. The train graph is then captured from a copy
    without it (every layer runs; dropout and the rest still follow train()), which the report says."""
    config = getattr(model, "config", None)
    fields = {f: getattr(config, f) for f in _LAYERDROP_FIELDS
              if isinstance(getattr(config, f, None), (int, float)) and getattr(config, f) > 0}
    if not fields:
        return None
    listed = ", ".join(f"config.{k}={v:g}" for k, v in fields.items())
    return dict.fromkeys(fields, 0.0), (f"; LayerDrop is off in the train graph ({listed} is a branch on a random "
                                        "number, which no graph records): every layer runs in training, dropout "
                                        "still follows train()")


def is_hf_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (never imports transformers)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)
