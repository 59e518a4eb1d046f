"""A planted conversion that leaves every op in fp32, to prove that the suite can fail.

With ``pytest --plant-fp32`` (or ``MPCONVERT_PLANT_FP32=1`` in the environment; the option sets it, so that
subprocesses that import this module inherit it) the decide stage runs as usual and then rewrites every
decision that would run in half (fp16, bf16, or an fp8 GEMM, whose storage is bf16) to fp32, recording the
plant as its rule. Placement then resolves the ``follow``/``promote`` nodes to fp32 too: the conversion
runs, reports and emits as usual, computing everything in fp32, and its SQNR against fp32 is +inf or
near it. Every numeric test must fail under the plant (``tests/test_suite_can_fail.py`` checks a subset).
"""
from __future__ import annotations

import functools
import os

ENV = "MPCONVERT_PLANT_FP32"


def planted() -> bool:
    return os.environ.get(ENV) == "1"


def _all_fp32(decide):
    from converter.ir.meta import BUILTIN, META_DECISION, RuleRef

    rule = RuleRef(BUILTIN, "builtin", "planted-fp32")

    @functools.wraps(decide)
    def planted_decide(gm, rules, *, precision):
        decide(gm, rules, precision=precision)
        for node in gm.graph.nodes:
            decision = node.meta.get(META_DECISION)
            if decision is None or decision.requested == "fixed":
                continue  # a dtype the model itself fixes (an explicit .half()) is not a decision
            if decision.precision in ("fp16", "bf16") or decision.requested in ("half", "fp16", "bf16", "fp8"):
                node.meta[META_DECISION] = decision.replace(
                    precision="fp32", requested="fp32", rule=rule, reason="planted: every op in fp32 (tests/plant.py)")

    planted_decide.planted = True
    return planted_decide


def install() -> None:
    """Patch every module that calls the decide stage (idempotent)."""
    import converter.api
    import converter.numerics.redecide

    for module in (converter.api, converter.numerics.redecide):
        if not getattr(module.decide, "planted", False):
            module.decide = _all_fp32(module.decide)
