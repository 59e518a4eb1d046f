"""A Lightning precision plugin: mpconvert's conversion, loss scaling and O2 master weights in ``Trainer``.

::

    from converter.lightning import MixedPrecision

    trainer = lightning.pytorch.Trainer(plugins=[MixedPrecision("bf16-mixed")], ...)          # bf16, O1
    trainer = lightning.pytorch.Trainer(plugins=[MixedPrecision("16-mixed", opt_level="O2")], ...)  # fp16, O2
    trainer = lightning.pytorch.Trainer(plugins=[MixedPrecision("fp8", rules=[...])], ...)     # fp8 GEMMs

At setup (``convert_module``) the plugin converts the LightningModule in place with
:func:`converter.apply`, on ``example_inputs`` or the module's ``example_input_array`` (Lightning's own
convention), with the options of :func:`converter.convert` (``rules``, ``opt_level``, ``device``,
``tracer``...). ``submodule="model"`` converts that attribute instead (a LightningModule that wraps a
model). The converted forward runs with autocast off: every precision is the one the report records.

Once the optimizers exist (``connect``), each gets a :class:`~converter.train.trainer.MixedPrecisionTrainer`
that owns the backward and the step: fp16 losses are scaled by a :class:`~converter.train.scaler.LossScaler`
(GradScaler's semantics: skip and back off on inf/NaN, grow after clean steps), O2 stores the weights in
half and steps fp32 masters, and Lightning's ``gradient_clip_val`` (norm) clips the unscaled
gradients. The plugin's ``state_dict`` (saved in every Lightning checkpoint) holds each trainer's
scaler, fp32 masters and counters, so ``Trainer.fit(ckpt_path=...)`` resumes exactly.

``"fp8"`` (or ``fp8_recipe=...`` with bf16) converts with precision fp8: the GEMMs the rules mark ``fp8`` run in
float8, everything else as bf16. FP8 is compute only, so the plugin trains it as bf16 (no loss scaling; Lightning
sees ``"bf16-mixed"``) and checkpoints hold the stored dtypes (fp32, or bf16 under O2 with fp32 masters).

Needs ``lightning`` or ``pytorch-lightning`` (``pip install 'mpconvert[lightning]'``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Optional

import torch
from torch import nn

from converter.inplace import conversion_of
from converter.ir.errors import MpconvertError
from converter.ir.meta import GM_PARAM_DTYPES
from converter.options import ConvertOptions, build_options
from converter.partition import apply
from converter.train.trainer import MixedPrecisionTrainer

try:  # the unified package first, then the standalone one
    from lightning.pytorch.plugins.precision import Precision as _Precision
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning.plugins.precision import Precision as _Precision
    except ImportError as exc:
        raise ImportError("converter.lightning needs Lightning: pip install 'mpconvert[lightning]' "
                          "(or lightning / pytorch-lightning)") from exc

__all__ = ["MixedPrecision"]

_LIGHTNING_NAMES = {"bf16": "bf16-mixed", "fp16": "16-mixed"}
#: the arguments of :func:`converter.apply` that are not conversion options
_APPLY_ARGUMENTS = ("rules", "calibration", "max_recaptures")


class MixedPrecision(_Precision):
    """Lightning ``Precision`` plugin that trains the mpconvert-converted module (see the module docstring).

    Args:
        precision: ``"bf16-mixed"`` / ``"16-mixed"`` (or ``bf16``/``fp16``), or ``"fp8"`` (bf16 with fp8 GEMMs).
        example_inputs: what :func:`converter.convert` takes; default: the module's ``example_input_array``.
        submodule: convert this attribute of the LightningModule instead of the module itself.
        opt_level: ``"O1"`` (fp32 parameters, casts in the graph) or ``"O2"`` (weights stored in half, fp32
            masters in the trainer).
        loss_scale: fp16 only: ``"dynamic"`` (default), a fixed float, or a :class:`~converter.LossScaler`.
        **convert_options: passed on to :func:`converter.apply`: ``rules``, ``calibration``, ``max_recaptures``
            and the fields of :class:`~converter.options.ConvertOptions` (``tracer``, ``device``, ...), which are
            checked here, once, with ``precision`` and ``opt_level``: ``options`` holds them.
    """

    def __init__(self, precision: str = "bf16-mixed", *, example_inputs: Any = None, submodule: Optional[str] = None,
                 opt_level: str = "O1", loss_scale: Any = "dynamic", **convert_options: Any) -> None:
        super().__init__()
        #: ``rules``, ``calibration`` and ``max_recaptures``: what :func:`converter.apply` takes besides the options
        self.apply_arguments = {key: convert_options.pop(key) for key in _APPLY_ARGUMENTS if key in convert_options}
        #: the one record of the conversion's options (precision canonical: ``bf16`` or ``fp16``)
        self.options: ConvertOptions = build_options(None, {"precision": precision, "opt_level": opt_level, **convert_options},
                                                     caller="MixedPrecision")
        self.precision = _LIGHTNING_NAMES[self.half]  # what Lightning logs and compares
        if self.half == "bf16" and loss_scale not in ("dynamic", None):
            raise ValueError("bf16 needs no loss scaling (fp32's exponent range): drop loss_scale, or use '16-mixed'")
        self.example_inputs = example_inputs
        self.submodule = submodule
        self.loss_scale = loss_scale if self.half == "fp16" else None
        #: the converted module (the LightningModule itself, or its ``submodule``), once set up
        self.target: Optional[nn.Module] = None
        #: one trainer per optimizer, in the order Lightning lists them (set by ``connect``)
        self.trainers: list[MixedPrecisionTrainer] = []
        self._pending_state: Optional[dict] = None

    @property
    def half(self) -> str:
        """The half dtype, ``bf16`` or ``fp16`` (``options.precision``; ``bf16`` for ``"fp8"``)."""
        return self.options.precision

    @property
    def opt_level(self) -> str:
        """``O1`` or ``O2`` (``options.opt_level``)."""
        return self.options.opt_level

    # ------------------------------------------------------------------ setup
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert the LightningModule (or its ``submodule``) in place; returns ``module``."""
        target = getattr(module, self.submodule) if self.submodule else module
        if not isinstance(target, nn.Module):
            raise MpconvertError(f"MixedPrecision(submodule={self.submodule!r}): that attribute is a "
                                 f"{type(target).__name__}, not an nn.Module")
        inputs = self.example_inputs if self.example_inputs is not None else getattr(module, "example_input_array", None)
        if inputs is None:
            raise MpconvertError("MixedPrecision needs example inputs to convert the model: set the LightningModule's "
                                 "example_input_array, or pass MixedPrecision(..., example_inputs=...)")
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        elif isinstance(inputs, dict):
            inputs = ((), inputs)
        with _training_mode(target):  # convert the mode Lightning will train in (dropout, batch norm)
            apply(target, inputs, options=self.options, **self.apply_arguments)
        self.target = target
        return module

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """One :class:`MixedPrecisionTrainer` per optimizer (O2 re-points each at its fp32 masters)."""
        if self.target is None:
            raise MpconvertError("MixedPrecision.connect() before convert_module(): the strategy did not set the plugin up")
        trainer = getattr(model, "_trainer", None)
        clip = getattr(trainer, "gradient_clip_val", None) if trainer is not None else None
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm")
        if clip and "value" in algorithm:
            raise MpconvertError("MixedPrecision clips by norm on the unscaled gradients; gradient_clip_algorithm='value' "
                                 "is not supported: use 'norm'")
        conversion = conversion_of(self.target)
        assert conversion is not None  # (convert_module applied it)
        dtypes = conversion.module.meta.get(GM_PARAM_DTYPES)
        self.trainers = [
            MixedPrecisionTrainer(self.target, optimizer, precision=self.half, master_weights=self.opt_level == "O2",
                                  loss_scale=self.loss_scale if self.half == "fp16" else None,
                                  max_grad_norm=float(clip) if clip else None, param_dtypes=dtypes)
            for optimizer in optimizers
        ]
        if self._pending_state is not None:  # a checkpoint's state loaded before the optimizers existed
            self.load_state_dict(self._pending_state)
        return model, optimizers, lr_schedulers

    # ------------------------------------------------------------------ training
    def _trainer_for(self, optimizer: Any) -> MixedPrecisionTrainer:
        if not self.trainers:
            raise MpconvertError("MixedPrecision has no optimizer to train with (configure_optimizers returned none)")
        if optimizer is None:  # manual optimization: manual_backward() passes no optimizer
            if len(self.trainers) > 1:
                raise MpconvertError("manual_backward() with several optimizers: MixedPrecision cannot tell which one "
                                     "the loss is for; use one optimizer")
            return self.trainers[0]
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wrapper
        for trainer in self.trainers:
            if trainer.optimizer is inner:
                return trainer
        raise MpconvertError(f"MixedPrecision does not know the optimizer {type(inner).__name__}")

    def forward_context(self) -> contextlib.AbstractContextManager:
        """No autocast: the converted graph carries its own casts."""
        return contextlib.nullcontext()

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """The trainer's backward: scale (fp16), backward, move half gradients into fp32 masters (O2)."""
        self._trainer_for(optimizer).backward(tensor)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (forward + backward), Lightning's hooks, then the trainer's checked step."""
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return closure_result  # training_step returned None: no backward, no step
        self._trainer_for(optimizer).step()
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Clipping happens in the trainer's step, after unscaling (see ``connect``)."""

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Per optimizer: the loss scaler, the fp32 masters (O2) and the counters."""
        out = []
        for trainer in self.trainers:
            full = trainer.state_dict()
            out.append({key: full[key] for key in ("precision", "master_weights", "master", "scaler", "stats")})
        return {"format": 1, "trainers": out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (after ``connect``; earlier, it is kept until then)."""
        if not self.trainers:
            self._pending_state = state_dict
            return
        self._pending_state = None
        if not isinstance(state_dict, dict) or state_dict.get("format") != 1:
            found = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"the checkpoint's MixedPrecision state has format {found!r}, this version reads format 1; "
                             "nothing was loaded")
        saved = state_dict.get("trainers")
        if not isinstance(saved, list) or len(saved) != len(self.trainers):
            raise ValueError(f"the checkpoint's MixedPrecision state has {len(saved) if isinstance(saved, list) else 0} "
                             f"trainer(s), this run has {len(self.trainers)} optimizer(s)")
        if not all(isinstance(state, dict) for state in saved):
            raise TypeError("the checkpoint's MixedPrecision trainer states must be dicts; nothing was loaded")
        merged = [{**trainer.state_dict(), **state} for trainer, state in zip(self.trainers, saved)]
        for trainer, state in zip(self.trainers, merged):  # every trainer's state checked before any is loaded
            trainer.check_state_dict(state)
        for trainer, state in zip(self.trainers, merged):
            trainer.load_state_dict(state)


@contextlib.contextmanager
def _training_mode(module: nn.Module) -> Generator[None, None, None]:
    """``module`` in train mode for the duration, every submodule's flag restored afterwards."""
    flags = {name: sub.training for name, sub in module.named_modules()}
    module.train()
    try:
        yield
    finally:
        for name, sub in module.named_modules():
            sub.training = flags.get(name, sub.training)
