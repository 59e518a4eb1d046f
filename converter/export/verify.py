"""Check an emitted model.py against ``conv.module`` before the output directory is published.

The code is checked with ``conv.module``'s own tensors attached to the emitted class (model.py's
``_build``): no second copy of the weights is made, so saving a big model needs no second copy of
it in memory. The weight files are checked separately against the same tensors, bit for bit
(:func:`converter.export.weights.check_weights`); together the two checks are what ``load()``
gives. Tests load emitted folders fresh, from the files, end to end.
"""
from __future__ import annotations

import importlib.util
import math
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from converter.export.errors import VerificationError
from converter.export.notes import EmitNote, check
from converter.numerics.common import output_tensors, preserved_state, sqnr_db

__all__ = ["verify_emitted", "import_file"]


def import_file(path: Path) -> Any:
    """Import the Python file at ``path`` as a fresh module (not registered in ``sys.modules``)."""
    name = f"_mpconvert_emitted_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, str(path))
    assert spec is not None and spec.loader is not None  # (a .py path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _run_restoring(module: nn.Module, args: tuple, kwargs: dict, seed: int) -> Any:
    """Run ``module`` without leaving a trace on its buffers, modes or the RNG, with a fixed RNG seed."""
    with preserved_state(module), torch.no_grad():
        torch.manual_seed(seed)
        return module(*args, **kwargs)


def _emitted_model(emitted: Any, tensors: Optional[Mapping[str, torch.Tensor]]) -> nn.Module:
    """model.py's class with ``tensors`` attached as they are; without them, ``load()`` from the files."""
    if tensors is None:
        return emitted.load(device="cpu")
    return emitted._build(dict(tensors), stored=False)


def _verify_cpu(ref: list[torch.Tensor], model: nn.Module, args: tuple, kwargs: dict) -> EmitNote:
    got = output_tensors(_run_restoring(model, args, kwargs, seed=0))
    if len(got) != len(ref):
        raise VerificationError(f"emitted model.py returns {len(got)} tensors, the converted model {len(ref)}; please report this bug")
    for i, (a, b) in enumerate(zip(ref, got)):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
            raise VerificationError(f"emitted model.py differs from the converted model on output {i} (max |diff| {diff:g}); please report this bug")
    return check(f"model.py reproduces the converted model bit-exactly on CPU ({len(ref)} output tensors)")


def verify_emitted(conv, out_dir: Path, *, device: str = "cpu", tensors: Optional[Mapping[str, torch.Tensor]] = None) -> EmitNote:
    """Load ``out_dir/model.py`` in-process and compare it with ``conv.module`` on the example inputs.

    ``tensors``: name -> ``conv.module``'s own tensor (``ModelSource.tensors``), attached to the
    emitted class instead of loading the weight files (which :func:`~converter.export.weights.check_weights`
    checks); without it, model.py's ``load()`` reads them.

    On CPU the outputs must be bit-identical. On CUDA the model is moved there and its outputs must
    be finite, with the CPU model's shapes and dtypes and an SQNR of at least 30 dB against it.
    Returns a one-line description of the check.
    """
    args, kwargs = conv.example_inputs
    emitted = import_file(Path(out_dir) / "model.py")
    ref = output_tensors(_run_restoring(conv.module, args, kwargs, seed=0))
    model = _emitted_model(emitted, tensors)
    if device == "cpu":
        return _verify_cpu(ref, model, args, kwargs)
    dev = torch.device(device)
    model = model.to(dev)
    got = output_tensors(_run_restoring(model, _to_device(args, dev), _to_device(kwargs, dev), seed=0))
    if len(got) != len(ref):
        raise VerificationError(f"on {device}, model.py returns {len(got)} tensors instead of {len(ref)}")
    worst = math.inf
    for i, (a, b) in enumerate(zip(ref, got)):
        if b.device.type != dev.type or a.shape != b.shape or a.dtype != b.dtype:
            raise VerificationError(f"on {device}, output {i} has {b.device}/{tuple(b.shape)}/{b.dtype}, expected {tuple(a.shape)}/{a.dtype}")
        if b.is_floating_point():
            if not torch.isfinite(b).all():
                raise VerificationError(f"on {device}, output {i} has inf/NaN values")
            worst = min(worst, sqnr_db(a, b))
    if worst < 30.0:
        raise VerificationError(f"on {device}, outputs differ from the CPU result: SQNR {worst:.1f} dB < 30 dB")
    return check(f"model.py runs on {device}; outputs match the CPU result (SQNR {worst:.1f} dB)")
