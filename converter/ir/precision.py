"""The torch dtype of a precision name: :func:`half_dtype` reads any spelling through the one normaliser,
:func:`converter.vocab.precision`, and maps it to ``torch.float16``/``torch.bfloat16``."""
from __future__ import annotations

from typing import Union

import torch

from converter.ir.meta import DTYPES
from converter.vocab import HALF_PRECISIONS, RUNS_IN, PrecisionError, precision

__all__ = ["PrecisionError", "half_dtype", "run_dtype"]


def half_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    """The torch dtype of a half precision (any spelling or dtype); :class:`PrecisionError` otherwise."""
    return DTYPES[precision(value, allowed=HALF_PRECISIONS)]


def run_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    """The torch dtype a conversion to ``value`` (a target, ``fp8`` included) runs its half nodes in."""
    return DTYPES[RUNS_IN[precision(value)]]
