"""The one table of precision names: every spelling a user may write, and what it means.

``convert``, ``audit``, the ONNX exporter, the trainer and the CLI all read precisions through
:func:`half_precision` (or :func:`canonical` where fp32 is meaningful), so a name accepted by one
is accepted by all, and an unknown one gets the same message everywhere.
"""
from __future__ import annotations

from typing import Union, cast

import torch

from converter.ir.meta import DTYPES, HALF_NAMES, HalfPrecision, Precision
from converter.ir.precision_names import ALIASES, PrecisionError, precision_message

__all__ = ["ALIASES", "PrecisionError", "canonical", "half_precision", "half_dtype"]

_BY_DTYPE: dict[torch.dtype, Precision] = {dtype: cast(Precision, name) for name, dtype in DTYPES.items()}


def canonical(precision: Union[str, torch.dtype]) -> Precision:
    """``fp32``/``fp16``/``bf16`` for any accepted spelling or torch dtype; :class:`PrecisionError` otherwise."""
    if isinstance(precision, torch.dtype):
        if precision in _BY_DTYPE:
            return _BY_DTYPE[precision]
    elif isinstance(precision, str) and precision.lower() in ALIASES:
        return ALIASES[precision.lower()]
    raise PrecisionError(precision_message(precision, known=False))


def half_precision(precision: Union[str, torch.dtype]) -> HalfPrecision:
    """``fp16`` or ``bf16`` for any accepted spelling of a half precision; :class:`PrecisionError` otherwise."""
    name = canonical(precision)
    if name not in HALF_NAMES:
        raise PrecisionError(precision_message(precision, known=True))
    return name  # type: ignore[return-value]


def half_dtype(precision: Union[str, torch.dtype]) -> torch.dtype:
    """The torch dtype of :func:`half_precision`."""
    return DTYPES[half_precision(precision)]
