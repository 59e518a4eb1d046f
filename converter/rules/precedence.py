"""The one precedence table: which rule wins when several match a node.

``node`` > ``module`` > ``module_type`` > ``op`` > ``default``, highest first; a precision that
calibration or the accuracy search measured on real inputs (``calibration``) outranks them all.
The loader ranks matches with it, *decide* picks the winner with it, and the report and
``explain`` print it; nothing else spells the order out.
"""
from __future__ import annotations

from typing import Literal

__all__ = ["RuleLevel", "PRECEDENCE", "MATCH_TABLES", "DEFAULT_LEVEL", "SCOPED_LEVELS", "OVERRIDE_LEVEL", "rank", "describe"]

RuleLevel = Literal["node", "module", "module_type", "op", "default"]
#: rule levels, highest precedence first
PRECEDENCE: tuple[RuleLevel, ...] = ("node", "module", "module_type", "op", "default")
#: the tables of a rule file that match nodes by name (``default`` matches everything)
MATCH_TABLES: tuple[RuleLevel, ...] = PRECEDENCE[:-1]
#: the level of a rule file's ``default``: it matches every op, so a node it decides counts as unmatched
DEFAULT_LEVEL: RuleLevel = PRECEDENCE[-1]
#: the levels that match through the module stack, where the innermost module wins a tie
SCOPED_LEVELS: tuple[RuleLevel, ...] = ("module", "module_type")
#: decisions measured on real inputs (calibration, accuracy search) outrank every rule level
OVERRIDE_LEVEL = "calibration"


def rank(level: str) -> int:
    """0 for the highest rule level, -1 for a measured override, past the lowest for anything else."""
    if level == OVERRIDE_LEVEL:
        return -1
    return PRECEDENCE.index(level) if level in PRECEDENCE else len(PRECEDENCE)


def describe() -> str:
    """``node > module > module_type > op > default``."""
    return " > ".join(PRECEDENCE)
