"""The options of the calibrate stage, as one typed, validated record.

::

    conv = converter.convert(model, example, precision="fp16", calibration=batches,
                             calibration_options=CalibrationOptions(tolerance=30, progress=False))

A plain mapping with the same keys is accepted too and read by :meth:`CalibrationOptions.coerce`
(the keys ``max_evaluations``, ``max_keep`` and ``search_options`` fill :class:`SearchOptions`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

from converter.numerics.search import SearchOptions, Tolerance

__all__ = ["CalibrationOptions", "SearchOptions", "FALLBACKS"]

#: what an fp16 node that would overflow may be re-decided to
FALLBACKS = ("bf16", "fp32")


@dataclass(frozen=True)
class CalibrationOptions:
    """How :func:`converter.numerics.calibrate.calibrate_and_redecide` runs.

    * ``margin`` / ``fallback``: override the rules settings ``overflow_margin`` (> 0) and
      ``overflow_fallback`` (``bf16`` or ``fp32``); None: the rules decide (defaults 2 and bf16).
    * ``loss_fn(output, batch)``: the loss for the gradient statistics (None: the sum of the
      floating outputs); ``backward=False`` skips the gradient statistics.
    * ``progress``: a progress bar on a terminal; ``max_batches``: calibration batches used (None: all).
    * ``tolerance``: run the accuracy search until the outputs meet it (anything
      :meth:`~converter.numerics.search.Tolerance.parse` reads: ``30``, ``"rtol=1e-2,atol=1e-3"``,
      ``{"sqnr": 30}``); stored parsed. ``search``: the search's bounds.
    """

    margin: Optional[float] = None
    fallback: Optional[str] = None
    loss_fn: Optional[Callable] = None
    backward: bool = True
    progress: bool = True
    max_batches: Optional[int] = None
    tolerance: Optional[Tolerance] = None
    search: SearchOptions = field(default_factory=SearchOptions)

    def __post_init__(self) -> None:
        if self.margin is not None:
            if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not (
                    math.isfinite(self.margin) and self.margin > 0):
                raise ValueError(f"calibration margin must be a finite number > 0, got {self.margin!r}")
            object.__setattr__(self, "margin", float(self.margin))
        if self.fallback is not None and self.fallback not in FALLBACKS:
            raise ValueError(f"overflow_fallback must be 'bf16' or 'fp32', got {self.fallback!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ValueError(f"loss_fn must be callable as loss_fn(output, batch), got {type(self.loss_fn).__name__}")
        for name in ("backward", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"calibration option {name} must be True or False, got {getattr(self, name)!r}")
        if self.max_batches is not None and (isinstance(self.max_batches, bool) or not isinstance(self.max_batches, int)
                                             or self.max_batches < 1):
            raise ValueError(f"max_batches must be an integer >= 1 or None, got {self.max_batches!r}")
        if self.tolerance is not None:
            object.__setattr__(self, "tolerance", Tolerance.parse(self.tolerance))
        if not isinstance(self.search, SearchOptions):
            raise ValueError(f"search must be a SearchOptions, got {type(self.search).__name__}")

    @classmethod
    def coerce(cls, value: Any) -> "CalibrationOptions":
        """``value`` as options: None gives the defaults, an instance itself, a mapping its keys."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"calibration_options must be a CalibrationOptions or a mapping, got {type(value).__name__}")
        own = {f.name for f in fields(cls)} - {"search"}
        searched = {f.name for f in fields(SearchOptions)}
        unknown = set(value) - own - {"search", "search_options", "max_evaluations", "max_keep"}
        if unknown:
            raise TypeError(f"unknown calibration option(s) {sorted(unknown)}; known: "
                            f"{sorted(own | {'search', 'search_options', 'max_evaluations', 'max_keep'})}")
        search = value.get("search")
        if not isinstance(search, SearchOptions):
            extra = dict(search or {})
            extra.update(value.get("search_options") or {})
            extra.update({k: value[k] for k in ("max_evaluations", "max_keep") if k in value})
            bad = set(extra) - searched
            if bad:
                raise TypeError(f"unknown search option(s) {sorted(bad)}; known: {sorted(searched)}")
            search = SearchOptions(**extra)
        return cls(**{k: value[k] for k in own if k in value}, search=search)
