"""The options of a conversion, as one frozen, validated record (in the style of torchao's ``Float8LinearConfig``).

::

    options = ConvertOptions(precision="fp16", opt_level="O2", device="cpu")
    conv = converter.convert(model, example_inputs, options=options)
    conv.options.precision                                   # "fp16"
    same = converter.convert(model, example_inputs, precision="float16", opt_level="O2", device="cpu")

:func:`converter.convert`, :func:`converter.audit`, :func:`converter.apply`, the Lightning plugin and the
``mpconvert`` command each build one :class:`ConvertOptions` and hand it down; every field is checked and
normalised once, in ``__post_init__`` (``"bfloat16"``, ``torch.bfloat16`` and ``"bf16-mixed"`` are all
``"bf16"``). A bad value is one line: :class:`~converter.vocab.PrecisionError` for a precision,
:class:`OptionsError` for anything else (both ``ValueError``; the CLI exits 2).

This module imports no torch (``mpconvert explain OUT_DIR`` builds its options without it): a torch dtype
is read by name (:func:`converter.vocab.precision`), and calibration options through
:mod:`converter.numerics.options`, only when one is given.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from converter.vocab import (
    DEVICES,
    FP8_RECIPE_CHOICES,
    OPT_LEVELS,
    PLACEMENTS,
    RUNS_IN,
    TRACERS,
    ChoiceError,
    choice,
)
from converter.vocab import (
    precision as _precision,
)

__all__ = ["ConvertOptions", "OptionsError", "build_options", "TRACERS", "PLACEMENTS", "OPT_LEVELS", "DEVICES",
           "FP8_RECIPES"]

# the choice lists are :mod:`converter.vocab`'s (re-exported here under their historical names):
# ``tracer``: ``auto`` tries torch.fx, then torch.export; ``placement``: the strategies of
# :mod:`converter.passes.place.stage` (a test holds them equal); ``opt_level``: how parameters are stored for
# training; ``device``: the devices with lowerings, or None; ``fp8_recipe``: :data:`converter.fp8.kernels.RECIPES`'
# names (a test holds them equal), or ``"auto"``: the rule files' ``fp8_recipe`` setting, else tensorwise
FP8_RECIPES = FP8_RECIPE_CHOICES


class OptionsError(ChoiceError):
    """An option has a value :class:`ConvertOptions` does not take (or options were given twice); one line."""


@dataclass(frozen=True)
class ConvertOptions:
    """How :func:`converter.convert` (and ``audit``, ``apply``, the Lightning plugin, the CLI) converts a model.

    * ``precision``: the half dtype that ``half`` rules mean: ``"bf16"`` (default: fp32's range, no loss
      scaling) or ``"fp16"``, any alias (``"bfloat16"``, ``"bf16-mixed"``, ``"float16"``, ``"half"``,
      ``"16-mixed"``) or torch dtype; stored canonical.
    * ``tracer``: ``"auto"`` (torch.fx, then torch.export; torch.export first for a Hugging Face model),
      ``"fx"`` or ``"export"``.
    * ``placement``: ``"mincut"`` (fewest cast bytes that round nothing autocast keeps in fp32),
      ``"mincut-bytes"`` (fewest cast bytes only) or ``"simple"``.
    * ``keep_io_types``: outputs keep their original dtype (default True).
    * ``opt_level``: ``"O1"`` (fp32 parameters, weight casts count in placement) or ``"O2"`` (half storage
      where every consumer is half, fp32 masters in the trainer; weight casts are free in placement).
    * ``device``: the device the model will train on (``"cpu"``, ``"cuda"``), which enables its lowerings;
      None (default): a portable graph.
    * ``dynamic``: torch.export captures batch, sequence and other input dims as dynamic (False: the
      example's sizes); ``dynamic_shapes``: torch.export-style dims instead of the default.
    * ``strict_modes``: refuse (:class:`~converter.api.FrozenModeError`) a model whose train mode cannot be
      traced, instead of converting it frozen in one mode.
    * ``fp8_recipe``: None (default) or the FP8 recipe of the GEMMs the rules mark ``fp8``
      (``"tensorwise"``, ``"rowwise"``, ``"rowwise_gw_hp"``, ``"blockwise"``, or ``"auto"``: the rule
      files' ``fp8_recipe`` setting, else tensorwise). ``precision="fp8"`` is ``precision="bf16"`` with
      ``fp8_recipe="auto"`` (unless one is given): fp8 is compute for GEMMs only, everything else follows
      the bf16 rules, storage included (:mod:`converter.passes.fp8`).
    * ``partial``: a model that no tracer captures whole (data-dependent loops, ``.item()``, numpy, Python
      ``random``, module state written in forward) is converted region by region: the largest submodules that
      capture are converted graphs, the rest of its forward runs eagerly under ``torch.autocast``
      (:mod:`converter.partition`); False refuses such a model (one graph, e.g. for ONNX). Default True:
      never refuse a model that runs eagerly.
    * ``calibration_options``: how a calibration runs (a
      :class:`~converter.numerics.options.CalibrationOptions`, or a mapping of its fields, stored as one);
      used only when calibration data is given. None: the defaults.
    * ``device_profile``: the figures the device-dependent kernel choices and the slow-half advice read
      (:class:`~converter.numerics.profile.DeviceProfile`): ``"auto"`` (default: measured once in this
      process), a ``DeviceProfile``, a mapping of its fields or the path of a saved one (``mpconvert profile
      -o FILE``; loaded when the options are built), or None / ``"none"``: no measurement, fixed choices
      (native half GEMMs, no advice). report.json records it (``device_profile``).
    * ``dispatch_kernels``: a portable graph (``device=None``) calls kernels that choose per device at run
      time (:mod:`converter.passes.dispatch`; default True); False keeps the plain calls.
    * ``upcast_half_gemms``: ``device="cpu"``'s half GEMMs as fp32 GEMMs (:mod:`converter.passes.cpu_gemm`):
      None (default) where the profile measured the half GEMM slow; True/False force it.
    * ``fp32_attention``: ``device="cpu"`` runs attention in fp32 arithmetic instead of the bf16 lowering:
      None (default) where the profile measured the half GEMM slow; True/False force it.
    * ``recompute_attention``: a lowered attention recomputes its probabilities in backward: None (default)
      the cost model decides per call (:func:`converter.passes.lower.recompute_plan`); True/False force it.
    * ``check_graph``: lint the graph after each rewriting pass (the test suite does; ~15 % of a large pass).

    Frozen: ``dataclasses.replace(options, precision="fp16")`` gives another (checked again).
    """

    precision: Any = "bf16"
    tracer: str = "auto"
    placement: str = "mincut"
    keep_io_types: bool = True
    opt_level: str = "O1"
    device: Optional[str] = None
    dynamic: bool = True
    dynamic_shapes: Any = None
    strict_modes: bool = False
    calibration_options: Any = None
    fp8_recipe: Optional[str] = None
    partial: bool = True
    device_profile: Any = "auto"
    dispatch_kernels: bool = True
    upcast_half_gemms: Optional[bool] = None
    fp32_attention: Optional[bool] = None
    recompute_attention: Optional[bool] = None
    check_graph: bool = False

    def __post_init__(self) -> None:
        target = _precision(self.precision)  # the one normaliser: a spelling or torch dtype, fp8 among the choices
        if target == "fp8":
            object.__setattr__(self, "fp8_recipe", self.fp8_recipe or "auto")
        object.__setattr__(self, "precision", RUNS_IN[target])
        if self.fp8_recipe is not None:
            choice(self.fp8_recipe, FP8_RECIPES, what="fp8_recipe", or_none=True, error=OptionsError)
            if self.precision != "bf16":
                raise OptionsError(f"fp8_recipe={self.fp8_recipe!r} runs the GEMMs in fp8 and the rest in bf16, "
                                   f"not {self.precision}; use precision='fp8' (or 'bf16'), or drop fp8_recipe")
        choice(self.tracer, TRACERS, what="tracer", error=OptionsError)
        choice(self.placement, PLACEMENTS, what="placement", error=OptionsError)
        choice(self.opt_level, OPT_LEVELS, what="opt_level", error=OptionsError)
        if self.device is not None:
            choice(self.device, DEVICES, what="device", or_none=True, error=OptionsError)
        for name in ("keep_io_types", "dynamic", "strict_modes", "partial", "dispatch_kernels", "check_graph"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise OptionsError(f"{name} must be True or False, got {value!r}")
        for name in ("upcast_half_gemms", "fp32_attention", "recompute_attention"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise OptionsError(f"{name} must be None (decided), True or False (forced), got {value!r}")
        from converter.numerics.profile import coerce_profile  # torch-free

        object.__setattr__(self, "device_profile", coerce_profile(self.device_profile))
        if self.calibration_options is not None:
            from converter.numerics.options import CalibrationOptions

            object.__setattr__(self, "calibration_options", CalibrationOptions.coerce(self.calibration_options))


#: the field names, for the keyword form of convert/audit/apply
FIELDS = frozenset(f.name for f in fields(ConvertOptions))


def build_options(options: Optional[ConvertOptions], keywords: Mapping[str, Any], *, caller: str,
                  allowed: frozenset[str] = FIELDS) -> ConvertOptions:
    """The one :class:`ConvertOptions` of a call: ``options`` itself, or one built from the keyword options.

    Both at once is an :class:`OptionsError`; a keyword that is no option (of ``allowed``) is a ``TypeError``
    as Python gives for any unknown keyword."""
    if options is not None:
        if not isinstance(options, ConvertOptions):
            raise TypeError(f"{caller}(options=...) must be a ConvertOptions, got {type(options).__name__}")
        if keywords:
            names = ", ".join(f"{k}=" for k in sorted(keywords))
            raise OptionsError(f"{caller}() got options= and {names} too; give one: put them in the ConvertOptions "
                               "(dataclasses.replace(options, ...)) or drop options=")
        return options
    unknown = sorted(set(keywords) - allowed)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}; its options are "
                        f"{', '.join(sorted(allowed))}")
    return ConvertOptions(**keywords)
