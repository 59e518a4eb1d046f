"""The export stage's entry points in one place (a facade over the modules that do the work).

- :mod:`converter.export.model_py`: the standalone model.py (from ``templates/model.py.tmpl``);
- :mod:`converter.export.train_py`: train.py (from ``templates/train.py.tmpl``);
- :mod:`converter.export.artifacts`: the output directory, written and published atomically;
- :mod:`converter.export.weights`: the safetensors weight files (sharded above a size), and their check;
- :mod:`converter.export.verify`: the check that model.py reproduces the converted model.
"""
from __future__ import annotations

from converter.export.artifacts import (
    check_output_dir,
    clean_stale_temporaries,
    emit,
    emit_reports,
    publish_directory,
)
from converter.export.errors import EmitError, OutputExistsError, VerificationError
from converter.export.model_py import ModelSource, generate_model_source
from converter.export.train_py import USER_MODEL_FILE, render_train_py
from converter.export.verify import import_file, verify_emitted
from converter.export.weights import DEFAULT_MAX_SHARD_SIZE, WEIGHTS_FILE, WEIGHTS_INDEX, check_weights, write_weights

__all__ = [
    "emit",
    "emit_reports",
    "publish_directory",
    "check_output_dir",
    "clean_stale_temporaries",
    "verify_emitted",
    "import_file",
    "EmitError",
    "OutputExistsError",
    "VerificationError",
    "ModelSource",
    "generate_model_source",
    "render_train_py",
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX",
    "DEFAULT_MAX_SHARD_SIZE",
    "write_weights",
    "check_weights",
    "USER_MODEL_FILE",
]
