"""Import a model file (docs/model-file.md) and find the model and its inputs, with precise errors.

A model file is a Python file that defines:

* the model: ``build_model()`` returning an ``nn.Module``, or a module-level ``model``
  (``entry="NAME"`` picks another function or module-level instance);
* the example inputs: ``example_inputs()`` returning a tuple of positional arguments or an
  ``(args_tuple, kwargs_dict)`` pair, or a module-level ``example_inputs``;
* optionally ``calibration_inputs()`` (an iterable of inputs in the same form, for ``--calibrate``),
  and ``loss_fn(output, batch)`` with ``train_batches()`` (for the emitted ``train.py``; each item of
  ``train_batches()`` is an ``(inputs, batch)`` pair), and ``dynamic_shapes()`` (torch.export-style
  dynamic dims for the example inputs; without it every input dim the model allows is dynamic).

The file is imported under a unique module name with its own directory on ``sys.path`` during the
import (so it can import its neighbours). Every problem raises a subclass of
:class:`ModelFileError` whose message is one line: what is wrong, where, and how to fix it.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import torch
from torch import nn

from converter.ir.errors import MpconvertError

__all__ = [
    "ModelFile",
    "ModelFileError",
    "ModelFileNotFoundError",
    "ModelFileSyntaxError",
    "ModelFileImportError",
    "NoModelError",
    "EntryError",
    "NotAModuleError",
    "ExampleInputsError",
    "load_model_file",
    "import_model_file",
    "check_arity",
    "eager_failure",
    "MODEL_NAMES",
    "INPUT_NAMES",
]

#: what is looked for, in order, when no ``entry`` is given
MODEL_NAMES = ("build_model", "model")
INPUT_NAMES = ("example_inputs",)


class ModelFileError(MpconvertError, ValueError):
    """The model file cannot be used; the message is one line naming the problem and the fix."""


class ModelFileNotFoundError(ModelFileError):
    """The path does not name a readable file."""


class ModelFileSyntaxError(ModelFileError):
    """The file (or a file it imports) is not valid Python."""


class ModelFileImportError(ModelFileError):
    """Importing the file raised an exception."""


class NoModelError(ModelFileError):
    """Neither ``build_model`` nor ``model`` (nor the ``--entry`` name) is defined."""


class EntryError(ModelFileError):
    """Calling the model factory (or ``example_inputs()``) raised an exception."""


class NotAModuleError(ModelFileError):
    """The model factory returned something that is not an ``nn.Module``."""


class ExampleInputsError(ModelFileError):
    """The example inputs are missing, malformed, or do not fit the model's forward."""


@dataclass
class ModelFile:
    """What a model file provides (see the module docstring)."""

    path: Path
    module: Optional[ModuleType]  # None: a save_pretrained folder (converter.cli.hfmodel)
    model: nn.Module
    entry: str
    example_inputs: tuple  # (args, kwargs)
    calibration_inputs: Optional[Callable[[], Any]] = None
    loss_fn: Optional[Callable] = None
    train_batches: Optional[Callable] = None
    dynamic_shapes: Optional[Callable[[], Any]] = None
    #: where the model came from when it is not a model file (a save_pretrained folder: what was
    #: built and how, the inputs made, use_cache); the CLI writes it into report.json and model.py
    source: Optional[dict] = None
    #: more inputs of the example's form, by seed (made from a folder's config; None for model files)
    make_inputs: Optional[Callable[[int], tuple]] = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def has_training(self) -> bool:
        return self.loss_fn is not None and self.train_batches is not None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _where_in(path: Path, tb) -> str:
    """``file:line`` of the innermost traceback frame inside ``path`` (else the innermost frame)."""
    frames = traceback.extract_tb(tb)
    target = str(path.resolve())
    inside = [f for f in frames if Path(f.filename).resolve().as_posix() == Path(target).as_posix()]
    frame = inside[-1] if inside else (frames[-1] if frames else None)
    if frame is None:
        return str(path)
    name = path.name if inside else frame.filename
    return f"{name}:{frame.lineno}"


def _exc_text(exc: BaseException) -> str:
    text = _one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _weights_file_kind(data: bytes) -> Optional[str]:
    """What kind of weights file ``data`` starts like (None: none we know). Read from the bytes only:
    nothing is unpickled or parsed."""
    if data[:4] == b"PK\x03\x04":
        return "a zip archive such as a PyTorch checkpoint"
    if len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5:
        return "a pickle file such as a legacy PyTorch checkpoint"
    if len(data) >= 9 and data[8:9] == b"{" and int.from_bytes(data[:8], "little") <= len(data) - 8:
        return "a safetensors file"
    if data[:4] == b"GGUF":
        return "a GGUF file"
    return None


def import_model_file(path: str | Path) -> ModuleType:
    """Import ``path`` under a unique module name; raise a :class:`ModelFileError` on failure."""
    path = Path(path)
    if not path.exists():
        raise ModelFileNotFoundError(f"{path}: no such file; pass the path of a Python file that defines build_model() (see mpconvert --help)")
    if path.is_dir():
        weights = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))[:2]
        has = f" (it has {', '.join(weights)} but no config.json)" if weights else " without config.json"
        raise ModelFileNotFoundError(
            f"{path} is a folder{has}; pass a checkpoint folder that save_pretrained wrote (with its config.json), "
            f"or a Python model file that defines build_model(), e.g. {path / 'model.py'}")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise ModelFileNotFoundError(f"{path}: cannot read it ({exc.strerror or exc}); check its permissions") from None
    kind = _weights_file_kind(source)
    if kind is not None:
        raise ModelFileSyntaxError(
            f"{path} is {kind} (weights), not a model file: mpconvert needs the model's code; pass a Python file whose "
            "build_model() builds the model and loads these weights (torch.load(..., weights_only=True) or "
            "safetensors), or a save_pretrained folder with config.json")
    try:
        compile(source, str(path), "exec")
    except SyntaxError as exc:
        line = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        raise ModelFileSyntaxError(f"{line}: syntax error: {_one_line(exc.msg)}; fix the Python syntax on that line") from None
    except ValueError as exc:  # e.g. null bytes
        raise ModelFileSyntaxError(f"{path}: not a Python source file ({_one_line(str(exc))}); pass a .py model file") from None
    digest = hashlib.sha1(str(path.resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:10]
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"_mpconvert_model_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        from importlib.machinery import SourceFileLoader

        spec = importlib.util.spec_from_loader(name, SourceFileLoader(name, str(path)))
    assert spec is not None and spec.loader is not None  # (spec_from_loader with a loader)
    module = importlib.util.module_from_spec(spec)
    directory = str(path.resolve().parent)
    sys.modules[name] = module
    sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:  # in a file it imports
        sys.modules.pop(name, None)
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else str(path)
        raise ModelFileSyntaxError(f"{where}: syntax error: {_one_line(exc.msg)} (imported by {path.name}); fix the Python syntax on that line") from None
    except (KeyboardInterrupt, SystemExit) as exc:
        sys.modules.pop(name, None)
        if isinstance(exc, SystemExit):
            raise ModelFileImportError(f"{path.name} called sys.exit({exc.code!r}) on import; guard script code with `if __name__ == \"__main__\":`") from None
        raise
    except BaseException as exc:
        sys.modules.pop(name, None)
        where = _where_in(path, exc.__traceback__)
        raise ModelFileImportError(
            f"{path.name} raised {_exc_text(exc)} on import (at {where}); fix the error so that `python {path}` imports cleanly"
        ) from exc
    finally:
        try:
            sys.path.remove(directory)
        except ValueError:
            pass
    return module


def _public_names(module: ModuleType) -> list[str]:
    return [n for n in vars(module) if not n.startswith("_")]


def _find_model(module: ModuleType, path: Path, entry: Optional[str]) -> tuple[nn.Module, str]:
    names = (entry,) if entry else MODEL_NAMES
    for name in names:
        if not hasattr(module, name):
            continue
        value = getattr(module, name)
        label = f"{name}()" if callable(value) and not isinstance(value, nn.Module) else name
        if isinstance(value, nn.Module):
            return value, name
        if isinstance(value, type) and issubclass(value, nn.Module):
            try:
                built = value()
            except Exception as exc:
                raise EntryError(
                    f"{path.name}: {name} is the class {value.__name__}, and {name}() raised {_exc_text(exc)}; "
                    f"define build_model() returning an instance"
                ) from exc
            return built, name
        if callable(value):
            try:
                built = value()
            except Exception as exc:
                where = _where_in(path, exc.__traceback__)
                raise EntryError(f"{path.name}: {label} raised {_exc_text(exc)} (at {where}); fix it so that it returns the model") from exc
            if not isinstance(built, nn.Module):
                raise NotAModuleError(
                    f"{path.name}: {label} returned {type(built).__name__}, not a torch.nn.Module; return the model instance"
                )
            return built, name
        raise NotAModuleError(f"{path.name}: {name} is a {type(value).__name__}, not a torch.nn.Module or a function returning one")
    looked = ", ".join(f"{n}()" if n == "build_model" else n for n in names)
    close = difflib.get_close_matches(entry or "build_model", _public_names(module), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    if entry:
        raise NoModelError(f"{path.name} defines no {entry!r} (looked for the --entry name: {entry}){hint}; pass an existing name to --entry")
    raise NoModelError(
        f"{path.name} defines no model: looked for {looked}{hint}; define build_model() returning an nn.Module, or pass --entry NAME"
    )


def _normalize(value: Any, label: str, path: Path) -> tuple[tuple, dict]:
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        if len(value) == 2 and isinstance(value[0], (tuple, list)) and isinstance(value[1], dict):
            return tuple(value[0]), dict(value[1])
        return tuple(value), {}
    raise ExampleInputsError(
        f"{path.name}: {label} gave a {type(value).__name__}; return a tuple of positional arguments or an (args, kwargs) pair"
    )


def _find_inputs(module: ModuleType, path: Path) -> tuple[tuple, dict]:
    if not hasattr(module, "example_inputs"):
        raise ExampleInputsError(
            f"{path.name} defines no example inputs: looked for example_inputs() and a module-level example_inputs; "
            "define example_inputs() returning a tuple of the forward's arguments"
        )
    value = module.example_inputs
    label = "example_inputs"
    if callable(value) and not isinstance(value, (torch.Tensor, tuple, list, dict)):
        label = "example_inputs()"
        try:
            value = value()
        except Exception as exc:
            where = _where_in(path, exc.__traceback__)
            raise EntryError(f"{path.name}: example_inputs() raised {_exc_text(exc)} (at {where}); fix it so that it returns the inputs") from exc
    return _normalize(value, label, path)


def _describe_forward(model: nn.Module, sig: inspect.Signature) -> str:
    params = ", ".join(str(p).split(":")[0].split("=")[0].strip() for p in sig.parameters.values())
    return f"{type(model).__name__}.forward({params})"


def check_arity(model: nn.Module, args: tuple, kwargs: dict, *, label: str = "example_inputs()", file: str = "") -> None:
    """Raise :class:`ExampleInputsError` when ``args``/``kwargs`` cannot bind to ``model.forward``."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    prefix = f"{file}: " if file else ""
    forward = _describe_forward(model, sig)
    if any(p.kind == p.VAR_POSITIONAL for p in params) and any(p.kind == p.VAR_KEYWORD for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    n = len(args)
    if not has_var_pos and n > len(positional):
        raise ExampleInputsError(
            f"{prefix}{label} gives {n} positional argument{'s' if n != 1 else ''} but {forward} takes at most {len(positional)}; "
            "return one value per forward argument (a tuple, or an (args, kwargs) pair)"
        )
    names = {p.name for p in params}
    for key in kwargs:
        if key not in names and not has_var_kw:
            close = difflib.get_close_matches(key, list(names), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ExampleInputsError(f"{prefix}{label} passes keyword {key!r}, which {forward} does not accept{hint}; use its argument names")
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        missing = [
            p.name
            for i, p in enumerate(params)
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and not (i < n and p.kind != p.KEYWORD_ONLY)
            and p.name not in kwargs
        ]
        if missing:
            given = f"{n} positional argument{'s' if n != 1 else ''}" + (f" and {len(kwargs)} keyword" if kwargs else "")
            raise ExampleInputsError(
                f"{prefix}{label} gives {given} but {forward} also needs {', '.join(repr(m) for m in missing)}; "
                "return one value per forward argument"
            ) from None
        raise ExampleInputsError(f"{prefix}{label} does not fit {forward}: {_one_line(str(exc))}; return one value per forward argument") from None


def load_model_file(path: str | Path, *, entry: Optional[str] = None) -> ModelFile:
    """Import ``path`` and return the model, its example inputs and the optional hooks."""
    path = Path(path)
    module = import_model_file(path)
    model, used = _find_model(module, path, entry)
    args, kwargs = _find_inputs(module, path)
    check_arity(model, args, kwargs, label="example_inputs()" if callable(getattr(module, "example_inputs", None)) else "example_inputs", file=path.name)

    def optional(name: str) -> Optional[Callable]:
        value = getattr(module, name, None)
        return value if callable(value) else None

    return ModelFile(
        path=path,
        module=module,
        model=model,
        entry=used,
        example_inputs=(args, kwargs),
        calibration_inputs=optional("calibration_inputs"),
        loss_fn=optional("loss_fn"),
        train_batches=optional("train_batches"),
        dynamic_shapes=optional("dynamic_shapes"),
    )


def eager_failure(mf: ModelFile) -> Optional[str]:
    """Why the model's own forward fails on the example inputs, run eagerly (None: it runs).

    Called only after both tracers failed: when plain ``model(*args, **kwargs)`` fails too, the
    inputs (or the model) are at fault, not the tracers, and the message says so. Run under
    ``no_grad``; a model on the meta device is not run."""
    model = mf.model
    if any(p.is_meta for p in model.parameters()):
        return None
    args, kwargs = mf.example_inputs
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as exc:  # the user's forward failed: report it, one line
        where = _where_in(mf.path, exc.__traceback__) if mf.path.is_file() else ""
        at = f" (at {where})" if where.startswith(f"{mf.path.name}:") else ""  # a line of the user's file, if any
        source = "example_inputs()" if mf.module is not None else "the example inputs made from its config"
        return (f"{mf.name}: the model's own forward fails on {source}, before any tracing: {_exc_text(exc)}{at}; "
                f"fix {source if mf.module is not None else 'the model'} so that model(*args, **kwargs) runs")
    return None
