"""Never silent under autocast: a conversion that measures well under ``torch.autocast`` on its own example says so.

:func:`converter.numerics.measure.measure` compares the converted module and ``torch.autocast`` on the original,
each against the fp32 original. When the conversion's output SQNR is more than :data:`GAP_DB` under autocast's,
:func:`below_autocast` gives one line naming the node that adds the most error by itself (the lowest *local*
SQNR of the per-node attribution, ``numerics.worst``) and the rule that pins it to fp32; ``measure`` raises it as a
:class:`BelowAutocastWarning`, and the CLI says it on stderr and in its summary. The line is computed from the
measured numbers each time (nothing more is stored in the report).
"""
from __future__ import annotations

import math
from typing import Optional

from converter.ir.errors import MpconvertError

__all__ = ["GAP_DB", "BelowAutocastWarning", "below_autocast"]

#: how far (dB) the conversion's output SQNR vs fp32 may be under autocast's before it is said
GAP_DB = 3.0


class BelowAutocastWarning(MpconvertError, UserWarning):
    """The conversion's output is more than :data:`GAP_DB` dB further from fp32 than ``torch.autocast``'s."""


def _finite(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not math.isnan(value) else None


def below_autocast(numerics: dict) -> Optional[str]:
    """The line saying the conversion is more than :data:`GAP_DB` dB under autocast on its example, or None."""
    ours = _finite((numerics.get("vs_fp32") or {}).get("sqnr_db"))
    amp = _finite((numerics.get("autocast_vs_fp32") or {}).get("sqnr_db"))
    if ours is None or amp is None or math.isinf(ours) or amp - ours <= GAP_DB:
        return None
    gap = "all of autocast's exactness" if math.isinf(amp) else f"{amp - ours:.1f} dB"
    head = (f"output SQNR vs fp32 is {ours:.1f} dB, {gap} under torch.autocast's "
            f"({'exact' if math.isinf(amp) else f'{amp:.1f} dB'}) on the example")
    worst = next(iter(numerics.get("worst") or ()), None)
    if worst is None:
        return (f"{head}; no per-node measurement names the node (a partial conversion is measured end to end): "
                "measure its regions, or pin the module that costs it with a [module] rule (docs/rules.md)")
    where = f", module {worst['module']!r}" if worst.get("module") else ""
    local = _finite(worst.get("local_sqnr_db"))
    cost = f"local SQNR {local:.1f} dB" if local is not None else "the lowest local SQNR"
    return (f"{head}; node {worst['name']!r} ({worst['op']}{where}, {worst['precision']}) adds the most error "
            f"({cost}): the rule [node] \"{worst['name']}\" = \"fp32\" in a rules file (CLI --rules FILE, Python "
            "rules=) keeps it in fp32")
