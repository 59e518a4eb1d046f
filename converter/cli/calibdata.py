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
Calibration input is checked as model input is (docs/cli.md, "Calibration data"):

* at most :data:`MAX_CALIBRATION_BATCHES` batches are read (an endless ``calibration_inputs()`` stops
  there, and the CLI says so);
* a tensor with no elements where the example's has some, or with NaN/inf where the example's input
  is finite, is bad input naming the batch and the input (its statistics would decide nothing, or
  push every node to the fallback);
* token ids outside the model's input embeddings (``get_input_embeddings()``) are bad input;
* a batch the fp32 model itself cannot run (a wrong feature size...) is bad input naming the batch,
  the error and how its shapes differ from the example's (:func:`diagnose_batches`);
* two safetensors names for one input of one batch (``x`` and ``0.x``) are an error;
* a ``.py`` inside a checkpoint folder (a folder with config.json) is code that came with downloaded
  files: it is imported only with ``--trust-remote-code`` (:func:`check_calibration_source`).
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, Callable, Optional

from converter.cli.modelfile import ModelFile, ModelFileError, import_model_file

__all__ = ["CalibrationDataError", "load_calibration_data", "check_calibration_path", "check_calibration_source",
           "take_batches", "check_values", "diagnose_batches", "SYNTHETIC", "SYNTHETIC_BATCHES", "MAX_CALIBRATION_BATCHES"]

SYNTHETIC = "synthetic"
SYNTHETIC_BATCHES = 8
#: the most calibration batches read from a file or calibration_inputs(); the rest are not read (said)
MAX_CALIBRATION_BATCHES = 256
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


def check_calibration_source(value: str, model_path: str, *, trust_remote_code: bool) -> None:
    """A ``.py`` inside a checkpoint folder (the model's folder, or any folder above it with a
    config.json) came with downloaded files: importing it runs it, so it needs ``--trust-remote-code``."""
    path = Path(value)
    if value == SYNTHETIC or path.suffix != ".py" or trust_remote_code:
        return
    resolved = path.resolve()
    model = Path(model_path).resolve()
    folders = [model] if model.is_dir() else []
    folders += [parent for parent in resolved.parents if (parent / "config.json").is_file()]
    for folder in folders:
        if folder == resolved or folder in resolved.parents:
            raise CalibrationDataError(f"--calibration-data {value}: a .py inside the checkpoint folder {folder.name} would be "
                                       "imported and run, like remote code; pass --trust-remote-code if you trust it, or "
                                       "give the batches as a .safetensors file")


def take_batches(iterable: Any, label: str, warn: Optional[Callable[[str], None]] = None) -> list:
    """At most :data:`MAX_CALIBRATION_BATCHES` items of ``iterable`` (an endless generator stops
    there); ``warn`` is told when there were more."""
    batches: list = []
    for item in iterable:
        if len(batches) >= MAX_CALIBRATION_BATCHES:
            if warn is not None:
                warn(f"{label}: gives more than {MAX_CALIBRATION_BATCHES} batches; calibrating on the first "
                     f"{MAX_CALIBRATION_BATCHES} (the bound on calibration batches, docs/cli.md)")
            break
        batches.append(item)
    return batches


def load_calibration_data(value: str, mf: ModelFile, warn: Optional[Callable[[str], None]] = None) -> tuple[list, str]:
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
    batches = _from_python(path, warn) if path.suffix == ".py" else _from_safetensors(path, mf, warn)
    if not batches:
        raise CalibrationDataError(f"--calibration-data {path.name}: it gives no batches; give at least one")
    example = _normalize(mf.example_inputs, path, "the example inputs")
    for i, batch in enumerate(batches):
        _check_batch(_normalize(batch, path, f"batch {i}"), example, path, i)
    check_values(batches, mf, f"--calibration-data {path.name}")
    return batches, f"{path.name} ({len(batches)} batches)"


def _normalize(value: Any, path: Path, label: str) -> tuple[tuple, dict]:
    from converter.passes.capture.values import normalize_inputs

    try:
        return normalize_inputs(value)
    except TypeError:
        raise CalibrationDataError(f"--calibration-data {path.name}: {label} is a {type(value).__name__}; give a tuple of "
                                   "positional inputs, an (args, kwargs) pair or a dict of keyword inputs") from None


def _from_python(path: Path, warn: Optional[Callable[[str], None]] = None) -> list:
    try:
        module = import_model_file(path)
    except ModelFileError as exc:
        raise CalibrationDataError(f"--calibration-data: {exc}") from None
    make = getattr(module, "calibration_inputs", None)
    if not callable(make):
        raise CalibrationDataError(f"--calibration-data {path.name} defines no calibration_inputs(); define it, returning an "
                                   "iterable of inputs in the form of the example inputs (docs/model-file.md)")
    try:
        return take_batches(make(), f"--calibration-data {path.name}: calibration_inputs()", warn)
    except Exception as exc:
        raise CalibrationDataError(f"--calibration-data {path.name}: calibration_inputs() raised {type(exc).__name__}: "
                                   f"{_one_line(exc)}; fix it") from exc


def _from_safetensors(path: Path, mf: ModelFile, warn: Optional[Callable[[str], None]] = None) -> list:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CalibrationDataError(f"--calibration-data {path.name}: not a readable safetensors file ({_one_line(exc)}); "
                                   "write it with safetensors.torch.save_file") from None
    grouped: dict[int, dict] = {}
    keys: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise CalibrationDataError(f"--calibration-data {path.name}: tensor {key!r} is not named INPUT or I.INPUT "
                                       "(batch I, an argument name of the forward: 0.input_ids); rename it")
        index, name = int(match.group(1) or 0), match.group(2)
        if (index, name) in keys:  # `x` and `0.x` are both input x of batch 0: one would be dropped
            raise CalibrationDataError(f"--calibration-data {path.name}: tensors {keys[index, name]!r} and {key!r} are both "
                                       f"input {name} of batch {index}; keep one of them (INPUT alone is batch 0)")
        keys[index, name] = key
        grouped.setdefault(index, {})[name] = tensor
    if len(grouped) > MAX_CALIBRATION_BATCHES:
        if warn is not None:
            warn(f"--calibration-data {path.name}: holds {len(grouped)} batches; calibrating on the first "
                 f"{MAX_CALIBRATION_BATCHES} (the bound on calibration batches, docs/cli.md)")
        grouped = {i: grouped[i] for i in sorted(grouped)[:MAX_CALIBRATION_BATCHES]}
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


def _pairs(batch: Any, example: Any, names: list[str]) -> list[tuple[str, Any, Any]]:
    """(input name, batch value, example value) for the inputs both give."""
    from converter.passes.capture.values import normalize_inputs

    try:
        (args, kwargs), (ex_args, ex_kwargs) = normalize_inputs(batch), normalize_inputs(example)
    except TypeError:
        return []
    positional = [(names[i] if i < len(names) else f"input {i}", a, e) for i, (a, e) in enumerate(zip(args, ex_args))]
    return positional + [(k, kwargs[k], ex_kwargs[k]) for k in ex_kwargs if k in kwargs]


def _input_vocabulary(model: Any) -> Optional[int]:
    """The rows of the model's input embeddings (``get_input_embeddings()``, transformers' convention)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        rows = getattr(get(), "num_embeddings", None) if callable(get) else None
    except Exception:  # a model whose accessor fails has no vocabulary to check against
        return None
    return rows if isinstance(rows, int) else None


def check_values(batches: list, mf: Any, label: str) -> None:
    """Each batch's tensors against the example's: none empty where the example's is not, no NaN/inf
    where the example's is finite, token ids (``input_ids``) inside the input embeddings."""
    import torch

    example = mf.example_inputs
    try:
        from converter.passes.capture.values import normalize_inputs

        names = _positional_names(mf.model, len(normalize_inputs(example)[0]))
    except TypeError:
        names = []
    vocab = _input_vocabulary(mf.model)
    for index, batch in enumerate(batches):
        for name, value, ref in _pairs(batch, example, names):
            if not (isinstance(value, torch.Tensor) and isinstance(ref, torch.Tensor)) or value.is_meta:
                continue
            where = f"{label}: batch {index}: {name}"
            if value.numel() == 0 and ref.numel() > 0:
                raise CalibrationDataError(f"{where} is empty (shape {tuple(value.shape)}); give at least one sample per batch")
            if value.is_floating_point() or value.is_complex():
                bad = ~torch.isfinite(value)
                if bool(bad.any()) and bool(torch.isfinite(ref).all()):
                    nan, inf = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
                    raise CalibrationDataError(f"{where} holds {nan} NaN and {inf} inf values, the example's none; "
                                               "give finite batches (drop or clean that one)")
            elif vocab is not None and name == "input_ids" and value.numel() > 0:
                low, high = int(value.min()), int(value.max())
                if low < 0 or high >= vocab:
                    raise CalibrationDataError(f"{where} holds token ids from {low} to {high}, outside the model's vocabulary "
                                               f"of {vocab} (0..{vocab - 1}); tokenize with the model's tokenizer")


def _shape_text(value: Any) -> str:
    return "×".join(str(d) for d in value.shape) if hasattr(value, "shape") else type(value).__name__


def diagnose_batches(batches: list, mf: Any) -> Optional[str]:
    """One line for the first batch the fp32 model itself cannot run (its error, and how its shapes
    differ from the example's), or None when every batch runs (then the failure is not the data's)."""
    import torch

    from converter.ir.state import preserved_state
    from converter.passes.capture.values import normalize_inputs

    names = _positional_names(mf.model, len(normalize_inputs(mf.example_inputs)[0]))
    rows = [m.num_embeddings for m in mf.model.modules() if isinstance(m, torch.nn.Embedding)]
    for index, batch in enumerate(batches):
        args, kwargs = normalize_inputs(batch)
        try:
            with preserved_state(mf.model), torch.no_grad():
                mf.model(*args, **kwargs)
        except Exception as exc:
            pairs = _pairs(batch, mf.example_inputs, names)
            shapes = [f"{name} is {_shape_text(v)}, the example's {_shape_text(e)}" for name, v, e in pairs
                      if isinstance(v, torch.Tensor) and isinstance(e, torch.Tensor) and v.shape != e.shape]
            ids = [f"{name} holds ids up to {int(v.max())}, the model's embeddings have {min(rows)} rows" for name, v, _ in pairs
                   if isinstance(v, torch.Tensor) and rows and v.numel() and not v.is_floating_point()
                   and v.dtype != torch.bool and int(v.max()) >= min(rows)]
            detail = "; ".join(shapes + ids)
            return (f"calibration batch {index}: the fp32 model cannot run it ({type(exc).__name__}: {_one_line(exc)[:300]})"
                    f"{'; ' + detail if detail else ''}; give batches the model takes, in the form of the example")
    return None
