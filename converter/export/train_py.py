"""Generate train.py, and pick the safe name under which the model file is copied next to it.

train.py is ``templates/train.py.tmpl`` with five literals filled in: the precision, the name of
the model file's copy in the output directory (:data:`USER_MODEL_FILE`), the model file's original
base name (for messages), a description of the example inputs for synthetic data, and the fp8
summary (``report.records.fp8``'s recipe and layer count, or None): an fp8 conversion trains as bf16
(the trainer's precision; fp8 is compute only, in model.py's ``fp8_linear`` calls) and says so. It reads
nothing outside its own directory: no absolute path recorded at conversion time, no repository
path. Each value enters as a ``repr`` literal, so no file name can inject code.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch

from converter.export.source_text import render_template

__all__ = ["render_train_py", "USER_MODEL_FILE", "model_file_to_copy"]

#: the name of the model file's copy in the output directory (train.py imports it from there)
USER_MODEL_FILE = "user_model.py"


def model_file_to_copy(model_file: Optional[str]) -> Optional[Path]:
    """The model file to copy next to train.py: a regular ``.py`` file, or None (a folder, nothing)."""
    if not model_file:
        return None
    path = Path(model_file)
    return path if path.is_file() and path.suffix == ".py" else None


def _input_spec(value: Any) -> Any:
    """A literal description of one example input, for synthetic data in train.py."""
    if isinstance(value, torch.Tensor):
        entry: dict[str, Any] = {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
        if value.numel() and not value.is_floating_point() and not value.is_complex() and not value.is_meta:
            entry["low"] = int(value.min())
            entry["high"] = int(value.max())
        return {"tensor": entry}
    if isinstance(value, (tuple, list)):
        return {"list" if isinstance(value, list) else "tuple": [_input_spec(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): _input_spec(v) for k, v in value.items()}}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}  # a literal nan/inf would not read back
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"value": None, "unsupported": type(value).__name__}


def render_train_py(conv, *, model_file: Optional[str] = None) -> str:
    """The source of train.py for ``conv``; ``model_file`` is the file the conversion came from."""
    args, kwargs = conv.example_inputs
    spec = {"args": [_input_spec(a) for a in args], "kwargs": {str(k): _input_spec(v) for k, v in kwargs.items()}}
    copied = model_file_to_copy(model_file)
    return render_template(
        "train.py.tmpl",
        precision=repr(str(conv.precision)),
        user_model=repr(USER_MODEL_FILE if copied is not None else None),
        model_file_name=repr(Path(model_file).name if model_file else None),
        example_inputs=repr(spec),
        fp8=repr(_fp8_summary(conv)),
    )


def _fp8_summary(conv) -> Optional[dict]:
    """``{"recipe": ..., "count": ...}`` of an fp8 conversion (the linears whose GEMMs run in fp8), else None."""
    fp8 = conv.report.records.fp8
    return {"recipe": fp8.recipe, "count": fp8.count} if fp8 is not None else None
