"""Key/value caches: a Hugging Face model is captured without its cache (:func:`cache_off`), and the
converted graph refuses a call that asks for one with a clear :class:`CacheCallError`
(:func:`guard_cache_calls`). Decoding calls are served by :mod:`converter.inplace`.
"""
from __future__ import annotations

from typing import Optional

import torch

from converter.ir.errors import MpconvertError
from converter.passes.capture.shells import is_hf_model

__all__ = ["CACHE_ARGUMENTS", "cache_off", "CacheCallError", "guard_cache_calls", "guard_cache_calls_keeping"]


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
    if not is_hf_model(model) or getattr(getattr(model, "config", None), "use_cache", None) is not True:
        return None
    import inspect

    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    if "use_cache" not in signature.parameters:
        return None  # an encoder (BERT's config says use_cache too): no cache to leave out
    named = dict(bound)
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
    if named.get("use_cache") is True or any(named.get(k) is not None for k in CACHE_ARGUMENTS):
        return None  # the example asks for a cache
    how = "use_cache=False in the example" if named.get("use_cache") is False else "use_cache=False"
    return (f"captured without the key/value cache ({how}; config.use_cache=True returns a cache object, "
            "which training never reads): the graph is the training forward; calls that ask for a cache "
            "(use_cache=True, a cache, generate()) run the original forward under autocast on an applied model")


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
