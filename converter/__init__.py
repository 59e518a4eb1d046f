"""mpconvert: rule-driven mixed precision for PyTorch models, with an audit of every decision.

Public API (DESIGN §5)::

    conv = converter.convert(model, example_inputs, precision="bf16")
    report = converter.audit(model, example_inputs)
    scaler = converter.LossScaler()
    trainer = converter.MixedPrecisionTrainer(conv.module, optimizer, precision="fp16")
"""
from __future__ import annotations

from .api import Conversion, PassError, audit, convert, normalize_precision
from .capture import CaptureError
from .decide import BannedOpError
from .report import Report
from .rules import Rules, RulesError, load_rules

__version__ = "0.1.0"

__all__ = [
    "convert",
    "audit",
    "Conversion",
    "Report",
    "Rules",
    "RulesError",
    "CaptureError",
    "BannedOpError",
    "PassError",
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
        from .scaler import LossScaler

        return LossScaler
    if name == "ToleranceNotMet":
        from .calibrate import ToleranceNotMet

        return ToleranceNotMet
    if name == "MixedPrecisionTrainer":
        from .trainer import MixedPrecisionTrainer

        return MixedPrecisionTrainer
    raise AttributeError(f"module 'converter' has no attribute {name!r}")
