"""The one table of precision spellings, without torch: ``mpconvert explain`` normalises a
``--precision`` flag with it before deciding whether a saved report fits, and must not import torch
to do so (``explain OUT_DIR`` answers in milliseconds). :mod:`converter.ir.precision` adds the
torch dtypes on top of this table and re-exports it.
"""
from __future__ import annotations

import difflib
from typing import Literal, Optional, cast

from converter.ir.errors import MpconvertError

__all__ = ["ALIASES", "HALF_NAMES", "COMPUTE_MODES", "PrecisionError", "canonical_name", "half_name", "precision_message",
           "target_name", "run_half"]

#: every accepted spelling (lower case) -> the canonical name
ALIASES: dict[str, Literal["fp32", "fp16", "bf16"]] = {
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
HALF_NAMES = ("fp16", "bf16")
#: conversion targets that are compute modes, not dtypes -> the half dtype the rest of the model runs in.
#: ``fp8``: the GEMMs the rules mark fp8 run in float8 (converter.passes.fp8), everything else by the bf16
#: rules; no tensor is ever stored in fp8, so fp8 is in neither ALIASES nor HALF_NAMES
COMPUTE_MODES: dict[str, Literal["fp16", "bf16"]] = {"fp8": "bf16"}
_HALF_ALIASES = ", ".join(k for k, v in ALIASES.items() if v in HALF_NAMES and k not in HALF_NAMES and not k.isdigit())


class PrecisionError(MpconvertError, ValueError):
    """An unknown precision name, or fp32 where a half precision is needed."""


def precision_message(precision: object, known: bool, targets: bool = False) -> str:
    """The one message for an unknown name (``known=False``) or a known one that is not half.

    ``targets``: the name was a conversion target, where the compute modes (``fp8``) are accepted too, so
    the message lists them and suggests them.
    """
    shown = repr(precision)
    names = list(ALIASES) + (list(COMPUTE_MODES) if targets else [])
    close = [] if known else difflib.get_close_matches(str(precision).lower(), names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    what = f"precision {shown} is not a half precision" if known else f"unknown precision {shown}"
    choices = f"fp16, bf16 or {', '.join(COMPUTE_MODES)}" if targets else "fp16 or bf16"
    return f"{what}; precision must be one of {choices} (aliases: {_HALF_ALIASES}){hint}"


def canonical_name(name: str) -> Optional[Literal["fp32", "fp16", "bf16"]]:
    """``fp32``/``fp16``/``bf16`` for an accepted spelling (any case); None for anything else."""
    return ALIASES.get(name.lower()) if isinstance(name, str) else None


def half_name(name: str) -> Literal["fp16", "bf16"]:
    """``fp16`` or ``bf16`` for an accepted spelling of a half precision; :class:`PrecisionError` otherwise."""
    found = canonical_name(name)
    if found is None or found not in HALF_NAMES:
        raise PrecisionError(precision_message(name, known=found is not None))
    return found  # type: ignore[return-value]


def target_name(name: str) -> Literal["fp16", "bf16", "fp8"]:
    """A conversion target: a compute mode of :data:`COMPUTE_MODES` (``fp8``, any case) or :func:`half_name`."""
    if isinstance(name, str) and name.strip().lower() in COMPUTE_MODES:
        return name.strip().lower()  # type: ignore[return-value]
    found = canonical_name(name)
    if found is None or found not in HALF_NAMES:
        raise PrecisionError(precision_message(name, known=found is not None, targets=True))
    return found  # type: ignore[return-value]


def run_half(target: str) -> Literal["fp16", "bf16"]:
    """The half dtype a conversion to ``target`` runs its half nodes in (``fp8`` -> ``bf16``)."""
    mode = COMPUTE_MODES.get(target)
    return mode if mode is not None else cast(Literal["fp16", "bf16"], target)
