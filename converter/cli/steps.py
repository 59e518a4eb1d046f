"""The steps the ``mpconvert`` commands share, each taking typed values (never the parsed namespace):
loading the rules and the model, checking the output location, turning a failed capture into one line,
and reading ``--tolerance``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from converter.cli.parsers import UsageError
from converter.cli.terminal import Terminal, one_line
from converter.options import ConvertOptions

__all__ = ["ModelSource", "load_rules", "load_model", "with_model_file", "output_dir", "default_out", "writing",
           "capture_error", "capture_message", "parse_tolerance"]


@dataclass(frozen=True)
class ModelSource:
    """What MODEL names and how to build it: a model file (``entry``: its factory) or a save_pretrained
    folder (``batch``, ``seq_len``, ``trust_remote_code``, ``empty_weights``, ``allow_missing_weights``: how its model
    and inputs are made)."""

    path: str
    entry: Optional[str] = None
    batch: Optional[int] = None
    seq_len: Optional[int] = None
    trust_remote_code: bool = False
    empty_weights: Optional[bool] = None
    allow_missing_weights: bool = False

    @property
    def model_file(self) -> Optional[str]:
        """The model file train.py takes loss_fn/train_batches from (none for a checkpoint folder)."""
        return None if Path(self.path).is_dir() else str(Path(self.path))


def load_rules(files: Optional[Sequence[str]]):
    """The rules of ``--rules`` (None: the defaults); an unreadable file is one line of bad input."""
    from converter.rules.loader import load_rules as load

    try:
        return load(list(files) if files else None)
    except UnicodeDecodeError as exc:
        name = "a rules file"
        for item in files or ():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                Path(item).read_text(encoding="utf-8") if Path(item).is_file() else None
                continue
            name = str(item)
            break
        raise UsageError(f"{name}: not UTF-8 text (byte {exc.start}: {exc.reason}); save the rules file as UTF-8 TOML") from exc
    except OSError as exc:
        raise UsageError(f"{exc.filename or 'a rules file'}: cannot read it ({exc.strerror or exc}); check the path and permissions") from exc


def load_model(source: ModelSource, ui: Terminal):
    """The model file (or ``save_pretrained`` folder) named on the command line, with example inputs.

    Whatever the user's code prints while it is imported and built goes to stderr (see
    :func:`converter.cli.terminal.stdout_to_stderr`), so it can never corrupt ``--json`` output.
    """
    from converter.cli.outdir import OutputLocationError, check_text

    try:
        check_text(source.path, "the model path")
    except OutputLocationError as exc:
        raise UsageError(str(exc)) from None
    path = Path(source.path)
    if path.is_dir() and (path / "config.json").is_file():
        from converter.cli.hfmodel import load_pretrained_folder, without_weights

        empty, why = without_weights(path, source.empty_weights)
        loaded = load_pretrained_folder(path, batch=source.batch, seq_len=source.seq_len, empty=empty,
                                        trust_remote_code=source.trust_remote_code,
                                        allow_missing_weights=source.allow_missing_weights)
        invented = (loaded.source or {}).get("initialised_randomly") or []
        if invented:
            ui.warn(f"{path}: the checkpoint lacks {len(invented)} tensor(s), initialised randomly (--allow-missing-weights): "
                    + ", ".join(invented))
        if empty:
            ui.warn(f"{path}: converted without its weights ({why}); model.py loads them with load(weights={str(path)!r}), "
                    "and the report has no measurements")
        return loaded
    if source.batch is not None or source.seq_len is not None:
        ui.warn("--batch and --seq-len apply to checkpoint folders only; a model file's example_inputs() sets its sizes")
    from converter.cli.modelfile import load_model_file

    return load_model_file(path, entry=source.entry)


def with_model_file(options: ConvertOptions, mf) -> ConvertOptions:
    """``options`` completed with what the model file says: its optional ``dynamic_shapes()``."""
    if getattr(mf, "dynamic_shapes", None) is None:
        return options
    try:
        shapes = mf.dynamic_shapes()
    except Exception as exc:  # the user's hook failed: one line, exit 2
        raise UsageError(f"{mf.name}: dynamic_shapes() raised {type(exc).__name__}: {one_line(exc)}; "
                         "return torch.export-style dims for the example inputs, or remove it") from exc
    return dataclasses.replace(options, dynamic_shapes=shapes)


def default_out(model: str, suffix: str) -> Path:
    """./MODEL_mp or ./MODEL_audit for MODEL (a file's stem, a folder's name)."""
    path = Path(model)
    stem = path.resolve().name if path.is_dir() else path.stem
    return Path.cwd() / f"{stem}{suffix}"


def output_dir(out: Optional[str], model: str, suffix: str, *, force: bool, inputs: Sequence[Optional[str]]) -> Path:
    """``--out`` (default ./MODEL_mp or ./MODEL_audit), checked before any work is done; ``--force`` never
    deletes this run's own ``inputs`` (the model file or folder, rule files, calibration data)."""
    from converter.cli.outdir import OutputLocationError, check_output_location
    from converter.export.emit import check_output_dir

    directory = Path(out) if out else default_out(model, suffix)
    try:
        check_output_location(directory, force=force)
    except OutputLocationError as exc:
        raise UsageError(str(exc)) from None
    check_output_dir(directory, force=force, inputs=[item for item in inputs if item])
    return directory


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """A full disk or an unwritable location while writing ``out`` is bad input (exit 2), not a bug."""
    from converter.cli.outdir import OutputLocationError
    from converter.cli.outdir import writing as guarded

    try:
        with guarded(out):
            yield
    except OutputLocationError as exc:
        raise UsageError(str(exc)) from exc


def capture_error(exc, mf, tracer: str) -> UsageError:
    """The one-line error for a failed capture: the inputs' fault when the model's own forward fails on
    them too (a shape mismatch in example_inputs() is not the tracers' fault), else the tracers' reasons."""
    from converter.cli.modelfile import eager_failure

    why = eager_failure(mf)
    return UsageError(why if why is not None else capture_message(exc, type(mf.model).__name__, mf.name, tracer))


def capture_message(exc, model_name: str, model_file: str, tracer: str) -> str:
    """What each tracer said, and which ``--tracer`` to try."""
    reasons = getattr(exc, "reasons", {}) or {}
    advice = getattr(exc, "advice", None)
    if advice:  # Python code that needs a tensor's value: plain advice, then any other tracer's reason
        head = "neither tracer could capture" if tracer == "auto" else f"the {tracer} tracer could not capture"
        others = "; ".join(f"{name}: {one_line(why)}" for name, why in reasons.items() if why != advice)
        return f"{model_file}: {head} {model_name}: {advice}" + (f" (also {others})" if others else "")
    detail = "; ".join(f"{name}: {one_line(why)}" for name, why in reasons.items()) or one_line(exc)
    if tracer == "auto":
        fix = "fix the code each tracer names (--debug shows more), or pick one with --tracer fx|export"
        return f"{model_file}: neither tracer could capture {model_name} ({detail}); {fix}"
    other = "export" if tracer == "fx" else "fx"
    return f"{model_file}: the {tracer} tracer could not capture {model_name} ({detail}); try --tracer {other} or --tracer auto"


def parse_tolerance(text: str) -> Any:
    """``--tolerance``: an SQNR in dB (``30``), or ``sqnr=30`` / ``rtol=1e-2,atol=1e-3``."""
    fix = "give an SQNR in dB such as 30, or rtol=1e-2,atol=1e-3"
    value = _float_or_none(text)
    if value is None:
        return _tolerance_parts(text, fix)
    if not math.isfinite(value):
        raise UsageError(f"--tolerance must be a finite SQNR in dB, got {text!r}; {fix}")
    return value


def _float_or_none(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _tolerance_parts(text: str, fix: str) -> dict[str, float]:
    """``sqnr=30`` or ``rtol=1e-2,atol=1e-3``: finite numbers for known keys."""
    parts: dict[str, float] = {}
    for item in str(text).split(","):
        key, sep, number = item.partition("=")
        key = key.strip().lower()
        value = _float_or_none(number)
        if value is None or not sep or key not in ("sqnr", "rtol", "atol") or not math.isfinite(value):
            raise UsageError(f"--tolerance {text!r} is not understood; {fix}")
        parts[key] = value
    if "sqnr" in parts and len(parts) > 1:
        raise UsageError(f"--tolerance {text!r} mixes sqnr with rtol/atol; {fix}")
    return parts
