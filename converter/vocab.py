"""The one vocabulary of mpconvert's choices, and the one function that reads a precision.

Every choice a user makes by name is spelled here once, as a ``Literal`` type and the tuple of its values:
precision, opt level, tracer, device, FP8 recipe, fp32 math (and the placement strategies and rule
precisions). :class:`~converter.options.ConvertOptions`, the CLI's parsers, the rules loader, the trainer
and the Lightning plugin all read them from here, so a value one accepts is accepted by all, with the same
one-line error. ``tests/test_vocabulary.py`` fails on any other spelling of these lists in ``converter/``.

:func:`precision` is the one precision normaliser: ``"float16"``, ``"half"``, ``"16-mixed"``,
``torch.float16`` and ``"fp16"`` are all ``"fp16"``; ``allowed`` says which canonical names a caller takes
(conversion targets by default, where ``"fp8"`` is meaningful). :func:`choice` checks the other choices.
Both raise a :class:`ChoiceError` (:class:`PrecisionError` for a precision) that carries ``value`` and
``allowed`` as fields.

This module imports no torch: a torch dtype is recognised by its type's name (``mpconvert explain OUT_DIR``
reads a ``--precision`` flag without loading torch).
"""
from __future__ import annotations

import difflib
from typing import Literal, Optional, TypeVar, overload

from converter.ir.errors import MpconvertError

__all__ = [
    "Precision", "PRECISIONS", "HalfPrecision", "HALF_PRECISIONS", "FloatPrecision", "FLOAT_PRECISIONS",
    "PrecisionName", "RulePrecision", "RULE_PRECISIONS", "GEMM_PRECISIONS", "RUNS_IN",
    "OptLevel", "OPT_LEVELS", "Tracer", "TRACERS", "Device", "DEVICES", "Fp8Recipe", "FP8_RECIPES",
    "FP8_RECIPE_CHOICES", "Fp32Math", "FP32_MATHS", "Placement", "PLACEMENTS",
    "ALIASES", "ChoiceError", "PrecisionError", "precision", "choice", "describe",
]

#: a conversion target: the half dtype that ``half`` rules mean, or ``fp8`` (the GEMMs the rules mark fp8 run
#: in float8, everything else by the bf16 rules; no tensor is ever stored in fp8)
Precision = Literal["fp16", "bf16", "fp8"]
PRECISIONS: tuple[Precision, ...] = ("fp16", "bf16", "fp8")
#: a half dtype: what a conversion's half nodes, its autocast glue and its trainer run in
HalfPrecision = Literal["fp16", "bf16"]
HALF_PRECISIONS: tuple[HalfPrecision, ...] = ("fp16", "bf16")
#: a floating dtype this tool converts between (a node's decided precision, a report's ``by_precision`` key)
FloatPrecision = Literal["fp32", "fp16", "bf16"]
FLOAT_PRECISIONS: tuple[FloatPrecision, ...] = ("fp16", "bf16", "fp32")  # report.json's by_precision order
#: every canonical name :func:`precision` knows
PrecisionName = Literal["fp32", "fp16", "bf16", "fp8"]
#: the half dtype a conversion to each target runs its half nodes, glue and trainer in (``fp8`` -> ``bf16``)
RUNS_IN: dict[Precision, HalfPrecision] = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}

#: what a rule may name (docs/rules.md; DESIGN §4)
RulePrecision = Literal["half", "fp16", "bf16", "fp32", "tf32", "follow", "promote", "banned", "fp8"]
RULE_PRECISIONS: tuple[RulePrecision, ...] = ("half", "fp16", "bf16", "fp32", "tf32", "follow", "promote", "banned",
                                              "fp8")
#: the rule precisions only a GEMM may take
GEMM_PRECISIONS: tuple[RulePrecision, ...] = ("fp8",)

#: ``opt_level``: O1 keeps parameters fp32 (cast in the graph), O2 stores them in half with fp32 masters
OptLevel = Literal["O1", "O2"]
OPT_LEVELS: tuple[OptLevel, ...] = ("O1", "O2")
#: ``tracer``: ``auto`` tries torch.fx, then torch.export (:mod:`converter.passes.capture`)
Tracer = Literal["auto", "fx", "export"]
TRACERS: tuple[Tracer, ...] = ("auto", "fx", "export")
#: ``device``: the devices with lowerings (:mod:`converter.passes.lower`); None is a portable graph
Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")
#: the FP8 recipes of :data:`converter.fp8.kernels.RECIPES` (a test holds them equal)
Fp8Recipe = Literal["tensorwise", "rowwise", "rowwise_gw_hp", "blockwise"]
FP8_RECIPES: tuple[Fp8Recipe, ...] = ("tensorwise", "rowwise", "rowwise_gw_hp", "blockwise")
#: ``fp8_recipe=`` of a conversion: a recipe, or ``auto`` (the rule files' ``fp8_recipe`` setting, else tensorwise)
FP8_RECIPE_CHOICES: tuple[str, ...] = ("auto", *FP8_RECIPES)
#: ``[settings] fp32_math``: the math of fp32 matmul/conv nodes (:mod:`converter.passes.fp32_math`)
Fp32Math = Literal["ieee", "tf32", "inherit"]
FP32_MATHS: tuple[Fp32Math, ...] = ("ieee", "tf32", "inherit")
#: ``placement``: the strategies of :mod:`converter.passes.place.stage`
Placement = Literal["mincut", "mincut-bytes", "simple"]
PLACEMENTS: tuple[Placement, ...] = ("mincut", "mincut-bytes", "simple")

#: every accepted spelling of a precision (lower case) -> its canonical name
ALIASES: dict[str, PrecisionName] = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "16": "fp16", "16-mixed": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "bf16-mixed": "bf16",
    "fp32": "fp32", "float32": "fp32",
    "fp8": "fp8",
}

_P = TypeVar("_P", bound=str)
_C = TypeVar("_C", bound=str)


class ChoiceError(MpconvertError, ValueError):
    """A value that is not one of its choices; ``what`` names the setting, ``allowed`` lists the choices."""

    def __init__(self, message: str, *, what: str = "", value: object = None, allowed: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: the setting (``"precision"``, ``"tracer"``, ``"--precision"``...)
        self.what = what
        #: the value given, as given
        self.value = value
        #: the values accepted there
        self.allowed = tuple(allowed)


class PrecisionError(ChoiceError):
    """An unknown precision name, or a known one that is not accepted there (fp32 where a half one is needed).

    ``canonical``: the canonical name of ``value`` when it is a known spelling (``"fp32"``), else None."""

    def __init__(self, message: str, *, what: str = "precision", value: object = None,
                 allowed: tuple[str, ...] = (), canonical: Optional[str] = None) -> None:
        super().__init__(message, what=what, value=value, allowed=allowed)
        self.canonical = canonical


def _canonical(value: object) -> Optional[PrecisionName]:
    """The canonical name of a spelling (any case) or a torch dtype (read by name: no torch import); None if unknown."""
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return ALIASES.get(str(value).removeprefix("torch."))
    if isinstance(value, str):
        return ALIASES.get(value.strip().lower())
    return None


def _choices(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def describe(allowed: tuple[str, ...] = PRECISIONS) -> str:
    """``fp16, bf16 or fp8 (aliases: float16, half, 16-mixed, bfloat16, bf16-mixed)``: the precisions of
    ``allowed`` and their other spellings, for help texts and :func:`precision`'s message."""
    aliases = [a for a, c in ALIASES.items() if c in allowed and a not in allowed and not a.isdigit()]
    return _choices(allowed) + (f" (aliases: {', '.join(aliases)})" if aliases else "")


@overload
def precision(value: object, *, what: str = ...) -> Precision: ...


@overload
def precision(value: object, *, allowed: tuple[_P, ...], what: str = ...) -> _P: ...


def precision(value: object, *, allowed: tuple[str, ...] = PRECISIONS, what: str = "precision") -> str:
    """THE precision normaliser: the canonical name of ``value`` (a spelling of :data:`ALIASES`, any case, or a
    torch dtype) when it is one of ``allowed``; :class:`PrecisionError` (one line naming the choices, with the
    closest spelling; fields ``value``, ``allowed``, ``canonical``) otherwise.

    ``allowed``: :data:`PRECISIONS` (a conversion target, the default), :data:`HALF_PRECISIONS` (a dtype to
    run in), :data:`FLOAT_PRECISIONS`...; ``what``: the setting's name in the message.
    """
    found = _canonical(value)
    if found is not None and found in allowed:
        return found
    listed = f"{what} must be one of {describe(allowed)}"
    if found is None:
        close = difflib.get_close_matches(str(value).lower(), [a for a, c in ALIASES.items() if c in allowed],
                                          n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        message = f"unknown {what} {value!r}; {listed}{hint}"
    else:
        kind = "a half precision" if set(allowed) <= set(PRECISIONS) else f"one of {_choices(allowed)}"
        message = f"{what} {value!r} is not {kind}; {listed}"
    raise PrecisionError(message, what=what, value=value, allowed=tuple(allowed), canonical=found)


def choice(value: object, allowed: tuple[_C, ...], *, what: str, or_none: bool = False,
           error: type[ChoiceError] = ChoiceError) -> _C:
    """``value`` when it is one of ``allowed`` (exactly: choices are case-sensitive names), else ``error``
    (a :class:`ChoiceError`) saying ``{what} must be one of 'a', 'b', got 'x'`` with the fields set.

    ``or_none``: the message says None is accepted too (the caller lets None through before asking)."""
    for name in allowed:
        if isinstance(value, str) and value == name:
            return name
    shown = ", ".join(repr(a) for a in allowed) + (" or None" if or_none else "")
    close = difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.6) if isinstance(value, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise error(f"{what} must be one of {shown}, got {value!r}{hint}", what=what, value=value, allowed=tuple(allowed))
