"""mpconvert: rule-driven mixed precision for PyTorch models, with an audit of every decision.

Public API (DESIGN §5)::

    conv = converter.convert(model, example_inputs, precision="bf16")
    report = converter.audit(model, example_inputs)
    scaler = converter.LossScaler()
    trainer = converter.MixedPrecisionTrainer(conv.module, optimizer, precision="fp16")
"""
from __future__ import annotations

from converter.api import Conversion, PassError, audit, convert, normalize_precision
from converter.ir.errors import MpconvertError
from converter.ir.precision import PrecisionError
from converter.numerics.options import CalibrationOptions
from converter.passes.capture import CaptureError
from converter.passes.decide import BannedOpError
from converter.report.build import Report
from converter.rules.loader import Rules, RulesError, load_rules

from converter._version import __version__

__all__ = [
    "convert",
    "audit",
    "Conversion",
    "CalibrationOptions",
    "Report",
    "Rules",
    "RulesError",
    "CaptureError",
    "BannedOpError",
    "PassError",
    "MpconvertError",
    "PrecisionError",
    "LossScaler",
    "MixedPrecisionTrainer",
    "ToleranceNotMet",
    "load_rules",
    "normalize_precision",
    "__version__",
]


def __getattr__(name: str):
    # The training wrapper is imported lazily: converting a model should not pay for it.
    if name == "LossScaler":
        from converter.train.scaler import LossScaler

        return LossScaler
    if name == "ToleranceNotMet":
        from converter.numerics.search import ToleranceNotMet

        return ToleranceNotMet
    if name == "MixedPrecisionTrainer":
        from converter.train.trainer import MixedPrecisionTrainer

        return MixedPrecisionTrainer
    raise AttributeError(f"module 'converter' has no attribute {name!r}")
