"""Key/value caches: a Hugging Face model is captured without its cache (:func:`cache_off`), and the
converted graph refuses a call that asks for one with a clear :class:`CacheCallError`
(:func:`guard_cache_calls`). Decoding calls are served by :mod:`converter.inplace`.
"""
from __future__ import annotations

from typing import Optional

import torch

from converter.ir.errors import MpconvertError
from converter.passes.capture.shells import is_hf_model

__all__ = ["CACHE_ARGUMENTS", "cache_off", "cache_request", "CacheCallError", "guard_cache_calls", "guard_cache_calls_keeping"]


#: forward arguments that hand a key/value cache in (transformers 5 renamed ``past_key_values`` to ``cache``)
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def cache_off(model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
    """The note saying the training graph is captured without the key/value cache, or None.

    A Hugging Face model whose ``config.use_cache`` is true (every stock decoder and encoder-decoder)
    returns a ``DynamicCache`` from ``forward``, which no graph can return (torch.export refuses it)
    and which training never reads. Unless the example asks for a cache (``use_cache=True`` or a
    cache argument), the model is traced with ``use_cache=False`` set on a shell's copy of its
    config; the model and its config are left as they are. Calls that ask for a cache (decoding,
    ``generate``) are served by :mod:`converter.inplace` (see :class:`~converter.inplace.ConvertedForward`)."""
    hf = _hf_model(model)
    if hf is None or getattr(getattr(hf, "config", None), "use_cache", None) is not True:
        return None
    import inspect

    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    named = _named_inputs(signature, args, kwargs)
    if named is None or not _takes_cache(signature, hf):
        return None  # an encoder (BERT's config says use_cache too): no cache to leave out
    if cache_request(model, args, kwargs):
        return None  # the example asks for a cache
    how = "use_cache=False in the example" if named.get("use_cache") is False else "use_cache=False"
    return (f"captured without the key/value cache ({how}; config.use_cache=True returns a cache object, "
            "which training never reads): the graph is the training forward; calls that ask for a cache "
            "(use_cache=True, a cache, generate()) run the original forward under autocast on an applied model")


def cache_request(model: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """What in the example asks ``model`` for a key/value cache (``"use_cache=True"``, ``"a cache
    (past_key_values)"``), or "" when nothing does."""
    import inspect

    try:
        named = _named_inputs(inspect.signature(model.forward), args, kwargs)
    except (TypeError, ValueError):
        named = None
    named = dict(kwargs) if named is None else named
    if named.get("use_cache") is True:
        return "use_cache=True"
    given = [k for k in CACHE_ARGUMENTS if named.get(k) is not None]
    return f"a cache ({given[0]})" if given else ""


def _named_inputs(signature, args: tuple, kwargs: dict) -> Optional[dict]:
    """The example's inputs by name (what ``**kwargs`` took included), or None if they do not bind."""
    import inspect

    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None
    named = dict(bound)
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
    return named


def _hf_model(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The Hugging Face model whose config decides the cache: ``model`` itself, or the first one inside a
    wrapper that is not one (PEFT's ``PeftModel`` around a causal LM, whose ``config`` is the inner model's)."""
    if is_hf_model(model):
        return model
    return next((m for m in model.modules() if is_hf_model(m)), None)


def _takes_cache(signature, hf: torch.nn.Module) -> bool:
    """Whether a forward of this ``signature`` can return a key/value cache: it names ``use_cache`` or a
    cache argument, or it takes ``**kwargs`` (Granite-MoE's causal LM, PEFT's wrappers pass ``use_cache``
    through them) and the Hugging Face model under it generates (``can_generate()``: decoders and
    encoder-decoders; an encoder such as BertForMaskedLM does not)."""
    import inspect

    parameters = signature.parameters
    if "use_cache" in parameters or any(k in parameters for k in CACHE_ARGUMENTS):
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return False
    can_generate = getattr(hf, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


class CacheCallError(MpconvertError, TypeError):
    """A call asked ``conv.module`` (a graph captured without the key/value cache) for a cache."""


def guard_cache_calls(gm: torch.nn.Module) -> None:
    """Make ``gm`` (captured without the cache, see :func:`cache_off`) answer a call that asks for a
    cache with one clear :class:`CacheCallError` instead of "unexpected keyword argument", and serve
    ``use_cache=False``/``None``, which is what the graph computes. A forward pre-hook: the generated
    ``forward`` takes the example's arguments only."""
    gm.register_forward_pre_hook(_cache_call_hook, with_kwargs=True)


def guard_cache_calls_keeping(gm: torch.nn.Module) -> None:
    """:func:`guard_cache_calls` for a graph whose example passed ``use_cache=False``: the keyword is
    one of its inputs, so it is kept (``use_cache=True`` still gets the clear error)."""
    gm.register_forward_pre_hook(_cache_call_refusal, with_kwargs=True)


def _cache_call_refusal(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("use_cache") or any(kwargs.get(k) is not None for k in CACHE_ARGUMENTS):
        raise CacheCallError(
            "this converted module is the training graph, captured without the key/value cache (use_cache=False), "
            "so it cannot take or return one; decode with converter.apply(model, ...) (its cache calls run the "
            "original forward under autocast) or the original model, or call it without use_cache/cache")


def _cache_call_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    _cache_call_refusal(module, args, kwargs)
    if "use_cache" in kwargs:  # use_cache=False or None: what the graph computes
        return args, {k: v for k, v in kwargs.items() if k != "use_cache"}
    return None
