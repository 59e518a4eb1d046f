"""The one precedence table: which rule wins when several match a node.

``node`` > ``module`` > ``module_type`` > ``op`` > ``default``, highest first, among the tables of
rule files. Above every rule file stands the user's own precision intent, written in the model
code (``user``, :mod:`converter.passes.intent`): a ``torch.autocast(enabled=False)`` region is
fp32, the matmul-class ops of a ``torch.autocast(dtype=...)`` region run in its dtype, and the
modules a transformers model names in ``_keep_in_fp32_modules`` stay fp32 — the model's author
said so on purpose (an STFT front end that overflows fp16), and a rule file written for many
models cannot know better. Above that, a precision that calibration or the accuracy search
measured on real inputs (``calibration``) outranks them all: those only ever widen a node (fp16
to bf16 or fp32), so they never undo a user's fp32.

The loader ranks matches with it, *decide* picks the winner with it, and the report and
``explain`` print it; nothing else spells the order out.
"""
from __future__ import annotations

from typing import Literal

__all__ = ["RuleLevel", "PRECEDENCE", "MATCH_TABLES", "DEFAULT_LEVEL", "SCOPED_LEVELS", "USER_LEVEL", "OVERRIDE_LEVEL",
           "rank", "describe"]

RuleLevel = Literal["node", "module", "module_type", "op", "default"]
#: rule levels, highest precedence first
PRECEDENCE: tuple[RuleLevel, ...] = ("node", "module", "module_type", "op", "default")
#: the tables of a rule file that match nodes by name (``default`` matches everything)
MATCH_TABLES: tuple[RuleLevel, ...] = PRECEDENCE[:-1]
#: the level of a rule file's ``default``: it matches every op, so a node it decides counts as unmatched
DEFAULT_LEVEL: RuleLevel = PRECEDENCE[-1]
#: the levels that match through the module stack, where the innermost module wins a tie
SCOPED_LEVELS: tuple[RuleLevel, ...] = ("module", "module_type")
#: the user's precision intent in the model code (autocast regions, ``_keep_in_fp32_modules``):
#: above every rule file; no rule file has a table of this name
USER_LEVEL = "user"
#: decisions measured on real inputs (calibration, accuracy search) outrank every rule level
OVERRIDE_LEVEL = "calibration"


def rank(level: str) -> int:
    """0 for the highest rule level, -1 for the user's intent, -2 for a measured override, past the
    lowest for anything else."""
    if level == OVERRIDE_LEVEL:
        return -2
    if level == USER_LEVEL:
        return -1
    return PRECEDENCE.index(level) if level in PRECEDENCE else len(PRECEDENCE)


def describe() -> str:
    """``user > node > module > module_type > op > default`` (calibration, when present, above all)."""
    return " > ".join((USER_LEVEL, *PRECEDENCE))
