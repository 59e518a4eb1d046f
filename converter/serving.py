"""``conv.module`` serves every call the original serves: the calls its shape guards refuse are converted again.

A model captured whole by torch.export is a GraphModule whose ``_guards_fn`` checks, on every call, the
conditions the graph was traced under (a dim pinned by the model's code: ``x.size(1) % 4 == 0``, RWKV's
chunk length). :func:`serve_every_call` (which :func:`converter.convert` applies) makes a call those guards
refuse (:class:`~converter.passes.capture.served.ShapeNotServedError`; nothing of the graph ran) go to a
:class:`~converter.inplace.ConvertedForward` over the module itself, the code :func:`converter.apply` uses:
the original model converted again for that call's sizes with the same options, bounded by
``max_recaptures`` graphs, each with a :class:`~converter.inplace.RecaptureWarning` and a line in the
report's summary warnings; the new graph reads ``conv.module``'s own parameters and buffers, so training
and ``state_dict`` see one set of tensors. Past the bound (or where converting again fails) the call runs
the original model's code under ``torch.autocast`` on ``conv.module``'s tensors
(``torch.func.functional_call``), with one :class:`~converter.inplace.FallbackWarning`.

Only the module ``convert`` returned is served so: torch gives each GraphModule its own class, whose
call this replaces; a ``copy.deepcopy`` (a new GraphModule) raises the one-line error instead.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from converter.api import Conversion
from converter.inplace import (
    DEFAULT_MAX_RECAPTURES,
    ConvertedForward,
    FallbackWarning,
    _autocast_type,
    _ShapeMismatch,
    detached,
)
from converter.ir.precision import half_dtype
from converter.passes.capture.served import ShapeNotServedError, guard_owner

__all__ = ["serve_every_call", "module_server"]


class _ModuleServer(ConvertedForward):
    """The calls that ``conv.module`` of a whole conversion refuses by its shape guards, served: each new shape
    signature is converted again from the original model (bounded, as :func:`apply` does), the new graph reading
    ``conv.module``'s own tensors; past the bound, the original's code runs under autocast on those tensors."""

    @property
    def _called(self) -> str:
        return f"the converted module of {type(self.conversion.original).__name__}"

    def _recapture(self, args: tuple, kwargs: dict) -> ConvertedForward:
        new = self._convert_again(self.conversion.original, (detached(args), detached(kwargs)))
        return ConvertedForward(self.model, new, max_recaptures=0)

    def _fallback(self, why: str, args: tuple, kwargs: dict) -> Any:
        precision = self.conversion.precision
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"mpconvert: {type(self.conversion.original).__name__}'s converted module was called with {why}; "
                          f"running the original forward under torch.autocast({precision}) on the module's own tensors "
                          "for this call (convert with an example of these sizes to convert them)", FallbackWarning,
                          stacklevel=4)
        self.calls["fallback"] += 1
        original = self.conversion.original
        own = {name for name, _ in original.named_parameters()} | {name for name, _ in original.named_buffers()}
        tensors = {name: t for name, t in [*self.model.named_parameters(), *self.model.named_buffers()] if name in own}
        was = original.training
        original.train(self.model.training)
        try:
            with torch.autocast(device_type=_autocast_type(self._device() or self._graphs.home), dtype=half_dtype(precision)):
                return torch.func.functional_call(original, tensors, args, kwargs, strict=False)
        finally:
            original.train(was)


class _ServingCall:
    """``type(conv.module)._wrapped_call``: torch's call of the GraphModule, and the calls its guards refuse served by
    a :class:`_ModuleServer` (made on the first such call)."""

    def __init__(self, inner: Any, conversion: Conversion, max_recaptures: int):
        self.inner, self.conversion = inner, conversion
        #: how many graphs calls of other sizes may add; settable (0: such calls run the original under autocast)
        self.max_recaptures = max_recaptures
        self.server: Optional[_ModuleServer] = None

    @property
    def recaptures(self) -> list:
        """The graphs converted again for calls the module's guards refused (ConvertedForward each), oldest first."""
        return list(self.server.recaptures) if self.server is not None else []

    @property
    def calls(self) -> dict:
        """How many refused calls ran a graph converted again, ran the fallback, and how many graphs were added."""
        return dict(self.server.calls) if self.server is not None else {"converted": 0, "fallback": 0, "recaptured": 0}

    def __call__(self, obj: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.inner(obj, *args, **kwargs)
        except ShapeNotServedError as exc:
            if obj is not self.conversion.module or exc.owner not in guard_owner(obj):
                raise
            shapes = ", ".join(f"{name} of shape {tuple(shape)}" for name, shape in exc.shapes.items())
            why = _ShapeMismatch(f"{shapes or 'other sizes'} (its graph holds only where {exc.guard})")
        if self.server is None:
            self.server = _ModuleServer(obj, self.conversion, max_recaptures=self.max_recaptures)
        self.server.max_recaptures = self.max_recaptures
        return self.server._serve_elsewhere(why, args, kwargs)


def serve_every_call(conversion: Conversion, *, max_recaptures: int = DEFAULT_MAX_RECAPTURES) -> Conversion:
    """Make ``conversion.module`` (captured whole by torch.export) serve calls of sizes its shape guards refuse:
    converted again for them, up to ``max_recaptures`` graphs, with a :class:`RecaptureWarning` and a report line.
    A copy of the module (``copy.deepcopy``, pickling) raises :class:`ShapeNotServedError` for such calls instead."""
    gm = conversion.module
    cls = type(gm)
    if conversion.partition is not None or not guard_owner(gm) or "_wrapped_call" not in vars(cls) \
            or not cls.__qualname__.endswith("GraphModuleImpl"):  # torch gives each GraphModule its own class
        return conversion
    inner = vars(cls)["_wrapped_call"]
    if not isinstance(inner, _ServingCall):
        setattr(cls, "_wrapped_call", _ServingCall(inner, conversion, max_recaptures))  # noqa: B010 (torch's class attribute)
    return conversion


def module_server(gm: torch.nn.Module) -> Optional[_ServingCall]:
    """What serves the calls ``gm`` (``conv.module``) refuses: ``max_recaptures`` (settable), ``recaptures``, ``calls``;
    None for a module :func:`serve_every_call` was not applied to."""
    call = vars(type(gm)).get("_wrapped_call")
    return call if isinstance(call, _ServingCall) else None
