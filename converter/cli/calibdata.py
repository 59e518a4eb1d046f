"""``--calibration-data FILE``: calibration batches from a file, for any model and for checkpoint folders.

A ``save_pretrained`` folder cannot define ``calibration_inputs()``, so the batches come from:

* ``FILE.py``: a Python file defining ``calibration_inputs()``, an iterable of inputs in the form of
  the example inputs (a tuple of positional arguments, an ``(args, kwargs)`` pair, or a dict of
  keyword inputs), as in a model file (docs/model-file.md). It is imported, never executed as a script;
* ``FILE.safetensors``: tensors named ``INPUT`` (one batch) or ``I.INPUT`` (batch ``I``, from 0), where
  INPUT is an argument name of the model's forward (``0.input_ids``, ``0.attention_mask``,
  ``1.input_ids``, ...). Read with safetensors, so no code runs and nothing is unpickled;
* ``synthetic`` (checkpoint folders only): 8 more random padded batches of the example's form, made
  from config.json (the CLI says that these are not real data).

Every batch must give the inputs the example gives (the graph takes exactly those), each with the
example's number of dims and dtype; any problem is one line (:class:`CalibrationDataError`, exit 2).
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from converter.cli.modelfile import ModelFile, ModelFileError, import_model_file

__all__ = ["CalibrationDataError", "load_calibration_data", "check_calibration_path", "SYNTHETIC", "SYNTHETIC_BATCHES"]

SYNTHETIC = "synthetic"
SYNTHETIC_BATCHES = 8
_FORMS = "a .py file defining calibration_inputs(), a .safetensors file of batches, or `synthetic` for a checkpoint folder"
_KEY = re.compile(r"^(?:(\d+)\.)?([A-Za-z_][A-Za-z0-9_]*)$")


class CalibrationDataError(ModelFileError):
    """``--calibration-data`` cannot be used; the message is one line naming the problem and the fix."""


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def check_calibration_path(value: str) -> None:
    """Checks that need no model: the word ``synthetic``, or an existing .py/.safetensors file."""
    if value == SYNTHETIC:
        return
    path = Path(value)
    if path.suffix not in (".py", ".safetensors"):
        raise CalibrationDataError(f"--calibration-data {value}: not a .py or .safetensors file; pass {_FORMS}")
    if not path.is_file():
        raise CalibrationDataError(f"--calibration-data {value}: no such file; pass {_FORMS}")


def load_calibration_data(value: str, mf: ModelFile) -> tuple[list, str]:
    """The batches ``value`` names for ``mf``'s model, checked against its example inputs, and a
    description of where they came from (report.json ``calibration.data``)."""
    check_calibration_path(value)
    if value == SYNTHETIC:
        if mf.make_inputs is None:
            raise CalibrationDataError(f"--calibration-data synthetic is for checkpoint folders; {mf.name} is a model file: "
                                       "define calibration_inputs() in it or pass a .py or .safetensors file")
        batches = [mf.make_inputs(seed) for seed in range(1, SYNTHETIC_BATCHES + 1)]
        return batches, f"synthetic: {len(batches)} random padded batches made from config.json"
    path = Path(value)
    batches = _from_python(path) if path.suffix == ".py" else _from_safetensors(path, mf)
    if not batches:
        raise CalibrationDataError(f"--calibration-data {path.name}: it gives no batches; give at least one")
    example = _normalize(mf.example_inputs, path, "the example inputs")
    for i, batch in enumerate(batches):
        _check_batch(_normalize(batch, path, f"batch {i}"), example, path, i)
    return batches, f"{path.name} ({len(batches)} batches)"


def _normalize(value: Any, path: Path, label: str) -> tuple[tuple, dict]:
    from converter.passes.capture.values import normalize_inputs

    try:
        return normalize_inputs(value)
    except TypeError:
        raise CalibrationDataError(f"--calibration-data {path.name}: {label} is a {type(value).__name__}; give a tuple of "
                                   "positional inputs, an (args, kwargs) pair or a dict of keyword inputs") from None


def _from_python(path: Path) -> list:
    try:
        module = import_model_file(path)
    except ModelFileError as exc:
        raise CalibrationDataError(f"--calibration-data: {exc}") from None
    make = getattr(module, "calibration_inputs", None)
    if not callable(make):
        raise CalibrationDataError(f"--calibration-data {path.name} defines no calibration_inputs(); define it, returning an "
                                   "iterable of inputs in the form of the example inputs (docs/model-file.md)")
    try:
        return list(make())
    except Exception as exc:
        raise CalibrationDataError(f"--calibration-data {path.name}: calibration_inputs() raised {type(exc).__name__}: "
                                   f"{_one_line(exc)}; fix it") from exc


def _from_safetensors(path: Path, mf: ModelFile) -> list:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CalibrationDataError(f"--calibration-data {path.name}: not a readable safetensors file ({_one_line(exc)}); "
                                   "write it with safetensors.torch.save_file") from None
    grouped: dict[int, dict] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise CalibrationDataError(f"--calibration-data {path.name}: tensor {key!r} is not named INPUT or I.INPUT "
                                       "(batch I, an argument name of the forward: 0.input_ids); rename it")
        grouped.setdefault(int(match.group(1) or 0), {})[match.group(2)] = tensor
    order = sorted(grouped)
    if order != list(range(len(order))):
        raise CalibrationDataError(f"--calibration-data {path.name}: the batches are numbered {order[:8]}; number them 0, 1, 2, ...")
    args, kwargs = mf.example_inputs if isinstance(mf.example_inputs, tuple) and len(mf.example_inputs) == 2 else ((), {})
    positional = _positional_names(mf.model, len(args))
    known = [*positional, *kwargs]
    for i in order:
        unknown = [name for name in grouped[i] if name not in known]
        if unknown and len(positional) == len(args):
            raise CalibrationDataError(f"--calibration-data {path.name}: batch {i} names {', '.join(unknown)}, which the example "
                                       f"inputs do not take; name the tensors {', '.join(known)} (with a batch prefix I.)")
    return [_as_inputs(grouped[i], positional) for i in order]


def _positional_names(model: Any, count: int) -> list[str]:
    """The forward's names of the example's ``count`` positional inputs (a file names them)."""
    if count == 0:
        return []
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[:count]


def _as_inputs(named: dict, positional: list[str]) -> tuple[tuple, dict]:
    args = tuple(named.pop(name) for name in positional if name in named)
    return args, named


def _check_batch(batch: tuple[tuple, dict], example: tuple[tuple, dict], path: Path, index: int) -> None:
    """The inputs the example gives, each with its number of dims and dtype."""
    import torch

    (args, kwargs), (ex_args, ex_kwargs) = batch, example
    where = f"--calibration-data {path.name}: batch {index}"
    if len(args) != len(ex_args):
        raise CalibrationDataError(f"{where} gives {len(args)} positional inputs, the example {len(ex_args)}; give the example's inputs")
    missing = [k for k in ex_kwargs if k not in kwargs]
    extra = [k for k in kwargs if k not in ex_kwargs]
    if missing or extra:
        what = "; ".join(part for part in (f"lacks {', '.join(missing)}" if missing else "",
                                           f"has {', '.join(extra)}, which the example does not" if extra else "") if part)
        raise CalibrationDataError(f"{where} {what}; give exactly the example's inputs ({', '.join(ex_kwargs) or 'positional only'})")
    pairs = [(f"input {i}", a, e) for i, (a, e) in enumerate(zip(args, ex_args))] + [(k, kwargs[k], ex_kwargs[k]) for k in ex_kwargs]
    for name, value, ref in pairs:
        if not isinstance(ref, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor):
            raise CalibrationDataError(f"{where}: {name} is a {type(value).__name__}, the example's a tensor; give a tensor")
        if value.dim() != ref.dim() or value.dtype != ref.dtype:
            raise CalibrationDataError(f"{where}: {name} is a {value.dim()}-d {value.dtype} tensor, the example's is "
                                       f"{ref.dim()}-d {ref.dtype}; give it the example's dims and dtype")
