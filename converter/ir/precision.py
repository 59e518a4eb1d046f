"""The one table of precision names: every spelling a user may write, and what it means.

``convert``, ``audit``, the ONNX exporter, the trainer and the CLI all read precisions through
:func:`half_precision` (or :func:`canonical` where fp32 is meaningful), so a name accepted by one
is accepted by all, and an unknown one gets the same message everywhere.
"""
from __future__ import annotations

import difflib
from typing import Union

import torch

from converter.ir.errors import MpconvertError
from converter.ir.meta import DTYPES, HALF_NAMES, HalfPrecision, Precision

__all__ = ["ALIASES", "PrecisionError", "canonical", "half_precision", "half_dtype"]

#: every accepted spelling (lower case) -> the canonical name
ALIASES: dict[str, Precision] = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
}
_BY_DTYPE: dict[torch.dtype, Precision] = {dtype: name for name, dtype in DTYPES.items()}
_HALF_ALIASES = ", ".join(k for k, v in ALIASES.items() if v in HALF_NAMES and k not in HALF_NAMES and not k.isdigit())


class PrecisionError(MpconvertError, ValueError):
    """An unknown precision name, or fp32 where a half precision is needed."""


def _message(precision: object, known: bool) -> str:
    shown = repr(precision)
    close = [] if known else difflib.get_close_matches(str(precision).lower(), list(ALIASES), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    what = f"precision {shown} is not a half precision" if known else f"unknown precision {shown}"
    return f"{what}; precision must be one of fp16 or bf16 (aliases: {_HALF_ALIASES}){hint}"


def canonical(precision: Union[str, torch.dtype]) -> Precision:
    """``fp32``/``fp16``/``bf16`` for any accepted spelling or torch dtype; :class:`PrecisionError` otherwise."""
    if isinstance(precision, torch.dtype):
        if precision in _BY_DTYPE:
            return _BY_DTYPE[precision]
    elif isinstance(precision, str) and precision.lower() in ALIASES:
        return ALIASES[precision.lower()]
    raise PrecisionError(_message(precision, known=False))


def half_precision(precision: Union[str, torch.dtype]) -> HalfPrecision:
    """``fp16`` or ``bf16`` for any accepted spelling of a half precision; :class:`PrecisionError` otherwise."""
    name = canonical(precision)
    if name not in HALF_NAMES:
        raise PrecisionError(_message(precision, known=True))
    return name  # type: ignore[return-value]


def half_dtype(precision: Union[str, torch.dtype]) -> torch.dtype:
    """The torch dtype of :func:`half_precision`."""
    return DTYPES[half_precision(precision)]
