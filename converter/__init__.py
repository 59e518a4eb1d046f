"""mpconvert: rule-driven mixed precision for PyTorch models, with an audit of every decision.

Public API (docs/architecture.md; the names are a stable contract)::

    conv = converter.convert(model, example_inputs, precision="bf16")
    conv = converter.convert(model, example_inputs, options=converter.ConvertOptions(precision="fp16", opt_level="O2"))
    model = converter.apply(model, example_inputs, precision="bf16")   # in place: the user's own object
    report = converter.audit(model, example_inputs)
    scaler = converter.LossScaler()
    trainer = converter.MixedPrecisionTrainer(conv.module, optimizer, precision="fp16")
    graphed = converter.cuda_graph(conv.module)   # GPU: forward and backward replay CUDA graphs
    profile = converter.DeviceProfile.measure()   # the device figures kernel choices read (device_profile=)
"""
from __future__ import annotations

from converter._version import __version__

__all__ = [
    "convert",
    "audit",
    "apply",
    "conversion_of",
    "restore",
    "FallbackWarning",
    "InPlaceError",
    "RecaptureWarning",
    "Conversion",
    "ConvertOptions",
    "OptionsError",
    "DeviceProfile",
    "DeviceProfileError",
    "CalibrationOptions",
    "Report",
    "Rules",
    "RulesError",
    "CaptureError",
    "BannedOpError",
    "PassError",
    "FrozenModeError",
    "Fp16OverflowError",
    "ForwardCheckError",
    "CacheCallError",
    "EmitError",
    "VerificationError",
    "EmptyWeightsError",
    "ShapeNotServedError",
    "BelowAutocastWarning",
    "SlowHalfWarning",
    "MpconvertError",
    "PrecisionError",
    "LossScaler",
    "MixedPrecisionTrainer",
    "cuda_graph",
    "CudaGraphModule",
    "CudaGraphWarning",
    "ToleranceNotMet",
    "SpikeGuard",
    "TrainingStalledError",
    "load_rules",
    "empty_weights",
    "normalize_precision",
    "__version__",
]

#: where each public name lives. Everything is imported on first use (PEP 562), so that
#: ``mpconvert explain OUT_DIR NODE`` and ``--help`` answer without importing torch, and converting
#: a model does not pay for the training wrapper.
_LAZY = {
    "convert": "converter.partition",
    "audit": "converter.partition",
    "Conversion": "converter.api",
    "PassError": "converter.api",
    "FrozenModeError": "converter.api",
    "Fp16OverflowError": "converter.api",
    "ForwardCheckError": "converter.passes.verify",
    "CacheCallError": "converter.passes.capture.cache",
    "EmitError": "converter.export.errors",
    "VerificationError": "converter.export.errors",
    "EmptyWeightsError": "converter.ir.empty",
    "ShapeNotServedError": "converter.passes.capture.served",
    "BelowAutocastWarning": "converter.numerics.gap",
    "SlowHalfWarning": "converter.api",
    "normalize_precision": "converter.api",
    "apply": "converter.partition",
    "conversion_of": "converter.inplace",
    "restore": "converter.inplace",
    "FallbackWarning": "converter.inplace",
    "InPlaceError": "converter.inplace",
    "RecaptureWarning": "converter.inplace",
    "ConvertOptions": "converter.options",
    "OptionsError": "converter.options",
    "DeviceProfile": "converter.numerics.profile",
    "DeviceProfileError": "converter.numerics.profile",
    "CalibrationOptions": "converter.numerics.options",
    "MpconvertError": "converter.ir.errors",
    "PrecisionError": "converter.vocab",
    "CaptureError": "converter.passes.capture",
    "BannedOpError": "converter.passes.decide",
    "Report": "converter.report.build",
    "Rules": "converter.rules.loader",
    "RulesError": "converter.rules.loader",
    "load_rules": "converter.rules.loader",
    "empty_weights": "converter.ir.empty",
    "ToleranceNotMet": "converter.numerics.search",
    "LossScaler": "converter.train.scaler",
    "MixedPrecisionTrainer": "converter.train.trainer",
    "cuda_graph": "converter.train.cuda_graph",
    "CudaGraphModule": "converter.train.cuda_graph",
    "CudaGraphWarning": "converter.train.cuda_graph",
    "SpikeGuard": "converter.train.trainer",
    "TrainingStalledError": "converter.train.trainer",
}


def __getattr__(name: str):
    import importlib
    import importlib.util

    module = _LAZY.get(name)
    if module is None:
        # a subpackage or module not imported yet (``converter.api.Fp16OverflowError`` before any convert())
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'converter' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
