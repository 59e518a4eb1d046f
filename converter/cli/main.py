"""The ``mpconvert`` command (docs/cli.md); ``python -m converter`` runs it too.

::

    mpconvert MODEL [--precision bf16|fp16] [--rules F]... [--out DIR] [--tracer auto|fx|export]
                    [--device cpu|cuda] [--calibrate] [--calibration-data FILE] [--tolerance DB]
                    [--onnx] [--onnx-precision fp16|bf16]
                    [--batch N] [--seq-len T] [--force] [-q] [--json] [--debug] [--entry NAME]
    mpconvert audit MODEL [...]                the report only (no model.py); writes report.json/.md/.html
    mpconvert explain OUT_DIR|MODEL NODE [...] every rule that matched NODE, and why the winner won
    mpconvert rules check FILE...              validate rule files

MODEL is a model file or a ``save_pretrained`` folder (with config.json).

Exit status: 0 success; 1 a requested check failed (tolerance not met, ONNX verification failed,
the emitted model does not reproduce the conversion); 2 bad input (usage, model file, rules,
untraceable model, existing or unwritable output location, full disk): one line on stderr naming the problem and the fix,
no traceback (``--debug`` shows it) and nothing written; 3 an internal error (a bug: please report
it with the ``--debug`` output); 130 interrupted.

Output: quiet on success apart from the summary line and the output path (stdout). Progress and
tables go to stderr through rich (``-q`` silences them and prints only the path). ``--json``
prints one machine-readable JSON object on stdout instead of the text.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from converter.ir.errors import MpconvertError  # torch-free: `explain OUT_DIR` must not import torch

__all__ = ["main", "build_parsers", "UsageError", "EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_BAD_INPUT", "EXIT_INTERNAL"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130

PRECISION_HELP = "fp16 or bf16 (aliases: float16, half, 16-mixed, bfloat16, bf16-mixed); default bf16"

_EPILOG = """\
commands:
  mpconvert MODEL [options]             convert; writes MODEL_mp/ (model.py, model.safetensors, train.py, reports)
  mpconvert audit MODEL [options]       the report only; writes MODEL_audit/ (report.json, .md, .html)
  mpconvert explain OUT_DIR|MODEL NODE  every rule that matched NODE, its precedence, and the winner
  mpconvert rules check FILE...         validate rule files (exit 2 on the first problem of each file)

MODEL is a model file defining build_model() (or a module-level `model`) and example_inputs(), and
optionally calibration_inputs() for --calibrate, loss_fn(output, batch) + train_batches() for
train.py (docs/model-file.md); or a save_pretrained folder with config.json (built offline with
transformers' Auto classes; its example inputs are the ones its forward takes, made from the config:
input_ids with a padded attention_mask, token_type_ids, decoder_input_ids, pixel_values, ...; --batch
and --seq-len size them; --calibrate on it needs --calibration-data FILE). Full contract: docs/cli.md.

examples:
  mpconvert samples/mlp.py                          bf16 conversion into ./mlp_mp/
  mpconvert samples/tiny_transformer.py --precision fp16 --rules llm --out tt_fp16 --force
  mpconvert --rules llm --rules my.toml samples/mlp.py   one file per --rules; repeat it
  mpconvert samples/tiny_transformer.py --device cpu     the model will train on the CPU: its lowerings
  mpconvert path/to/checkpoint --batch 4 --seq-len 128   a save_pretrained folder, offline
  mpconvert path/to/checkpoint --precision fp16 --calibration-data calib.safetensors   calibrated on your batches
  mpconvert samples/hf_gpt2.py --onnx               also write and verify model.onnx
  mpconvert samples/mlp.py --calibrate --tolerance 30   re-decide overflow-prone nodes; keep SQNR >= 30 dB
  mpconvert audit samples/cnn.py --json             machine-readable summary on stdout
  mpconvert explain cnn_audit b1_conv                instant: reads cnn_audit/report.json
  mpconvert explain samples/tiny_transformer.py layers_0_attn_qkv
  mpconvert rules check rules/llm.toml my_rules.toml
  python mlp_mp/train.py --steps 5                  train the emitted model

exit status: 0 ok, 1 a requested check failed, 2 bad input (one line on stderr; --debug for the
traceback; nothing written), 3 internal error.
"""


class UsageError(MpconvertError, ValueError):
    """Bad command-line usage; the message is one line."""


class _CheckFailed(MpconvertError):
    """A requested check failed (exit 1); carries the message and any JSON payload."""

    exit_code = EXIT_CHECK_FAILED

    def __init__(self, message: str, payload: Optional[dict] = None):
        super().__init__(message)
        self.payload = payload or {}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (raised, not printed) so that main() controls the output."""

    def error(self, message: str):  # noqa: D102
        raise UsageError(f"{message}; see `{self.prog} --help`")


def _one_line(text: Any) -> str:
    """Collapse every kind of line break and run of whitespace: error messages are one line."""
    return " ".join(str(text).split())


# ---------------------------------------------------------------------------------------------
# parsers


def _common(p: argparse.ArgumentParser, *, out: bool = True, json_help: str = "print a JSON summary on stdout instead of text") -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or tables; print only the output path")
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default="bf16", metavar="P", help=PRECISION_HELP)
    p.add_argument("--rules", action="append", default=None, metavar="F",
                   help="a rule file layered over the defaults; repeat the flag for more (--rules a --rules b), later wins. "
                        "A bare name such as `llm` is a built-in file")
    p.add_argument("--tracer", choices=("auto", "fx", "export"), default="auto",
                   help="auto tries torch.fx then torch.export (default auto)")
    p.add_argument("--entry", metavar="NAME", default=None, help="the model factory (or module-level model) to use instead of build_model/model")
    p.add_argument("--batch", type=_positive_int, default=None, metavar="N",
                   help="checkpoint folders only: the batch size of the example inputs made from config.json (default 2)")
    p.add_argument("--seq-len", dest="seq_len", type=_positive_int, default=None, metavar="T",
                   help="checkpoint folders only: the sequence length of text inputs (default 16; audio: samples)")
    p.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                   help="checkpoint folders only: allow a folder's own Python code (config.json's auto_map) to run while "
                        "building the model; without it such a folder is refused. Read that code first")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--empty-weights", dest="empty_weights", action="store_const", const=True, default=None,
                         help="checkpoint folders only: build the model without its weights (parameters on the meta device); "
                              "model.py then loads them with load(weights=FOLDER). Default when the folder has no weight "
                              "files or they exceed a quarter of this machine's memory")
    weights.add_argument("--load-weights", dest="empty_weights", action="store_const", const=False,
                         help="checkpoint folders only: load the weights even when they are large (model.py is then checked "
                              "bit-exactly and the report measured)")
    p.add_argument("--opt-level", dest="opt_level", choices=("O1", "O2"), default="O1",
                   help="how parameters will be stored for training: O1 fp32 (weight casts count in placement), "
                        "O2 half where every consumer is half, with fp32 master weights in the trainer (default O1)")
    p.add_argument("--max-shard-size", dest="max_shard_size", type=_shard_size, default=None, metavar="SIZE",
                   help="split the safetensors weights into files of at most SIZE bytes (500MB, 2GiB, or a number) "
                        "listed in model.safetensors.index.json (default 2GiB)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the device the model will train on. It enables that device's lowerings (cpu: bf16 attention as "
                        "matmul/softmax/matmul, 2-4x faster than the CPU flash kernel), and model.py is also checked there "
                        "when it is available. Default: a portable graph, checked on cpu")
    p.add_argument("--tune-for", dest="tune_for", choices=("cpu", "cuda"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-measure", dest="no_measure", action="store_true",
                   help="skip measuring memory and numerics against fp32 and torch.autocast for the report")
    p.add_argument("--strict-modes", dest="strict_modes", action="store_true",
                   help="refuse (exit 2) a model whose train mode cannot be traced, instead of converting it frozen in "
                        "one mode where train()/eval() change nothing (default: converted, with a warning)")
    p.add_argument("--static", action="store_true",
                   help="fix every input dim to the example's size (default: batch, sequence and other input dims "
                        "stay dynamic under torch.export, or as the model file's dynamic_shapes() says)")


def _shard_size(text: str) -> int:
    from converter.export.weights import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 500MB, 2GiB or a number of bytes") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1 or value > 1_000_000:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 1 and 1000000")
    return value


def build_parsers(only: Optional[str] = None) -> dict[str, argparse.ArgumentParser]:
    """The parsers of every command (or just ``only``), keyed by command name (``convert``,
    ``audit``, ``explain``, ``rules check``)."""
    from converter._version import __version__

    if only == "rules check":
        rules = _Parser(prog="mpconvert rules check", description="Validate rule files: TOML syntax, tables, keys, precisions and op names.")
        rules.add_argument("files", nargs="+", metavar="FILE")
        _common(rules)
        return {"rules check": rules}

    convert = _Parser(
        prog="mpconvert",
        description="Convert a PyTorch model to mixed precision with rules you can read, and write a standalone "
        "rewritten model, its weights, a training script and an audit report.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("model", metavar="MODEL",
                         help="the model file (docs/model-file.md), or a folder written by save_pretrained (with config.json)")
    _model_options(convert)
    convert.add_argument("--out", metavar="DIR", default=None, help="output directory (default ./MODEL_mp)")
    convert.add_argument("--calibrate", action="store_true",
                         help="run calibration_inputs() (or --calibration-data) and re-decide nodes that would overflow")
    convert.add_argument("--calibration-data", dest="calibration_data", metavar="FILE", default=None,
                         help="calibration batches (implies --calibrate): a .py file defining calibration_inputs() (docs/model-file.md), "
                              "a .safetensors file of tensors named INPUT or I.INPUT (batch I), or `synthetic` (checkpoint folders: "
                              "random padded batches made from config.json). Needed for --calibrate on a checkpoint folder; "
                              "replaces a model file's calibration_inputs()")
    convert.add_argument("--tolerance", metavar="DB", default=None,
                         help="with calibration: minimum SQNR in dB against fp32 (implies --calibrate); exit 1 if not met")
    convert.add_argument("--onnx", action="store_true", help="also export model.onnx and verify its casts and outputs")
    convert.add_argument("--onnx-precision", type=_precision_arg, default=None, metavar="P",
                         help="precision of model.onnx (default: the conversion's; bf16 exports fp16, since ONNX Runtime's CPU provider lacks bf16)")
    convert.add_argument("--force", action="store_true", help="replace an existing output directory")
    convert.add_argument("--version", action="version", version=f"mpconvert {__version__}")
    _common(convert)

    audit = _Parser(prog="mpconvert audit", description="Report what each node would run in and why, and the casts a conversion would insert, "
                    "without writing the model. "
                    "Writes report.json, report.md and report.html.")
    audit.add_argument("model", metavar="MODEL", help="the model file, or a save_pretrained folder")
    _model_options(audit)
    audit.add_argument("--out", metavar="DIR", default=None, help="report directory (default ./MODEL_audit)")
    audit.add_argument("--force", action="store_true", help="replace an existing report directory")
    _common(audit)

    explain = _Parser(prog="mpconvert explain", description="Show the decision chain of one node: every rule that matched, "
                      "its precedence level, the winner and why.")
    explain.add_argument("model", metavar="MODEL.py|OUT_DIR",
                         help="an output directory of convert or audit (read its report.json: instant), or a model file "
                              "(its fresh MODEL_mp/ or MODEL_audit/ report is reused; else it is audited)")
    explain.add_argument("node", metavar="NODE", help="a node name as listed by `mpconvert audit` (report.md, report.json)")
    _model_options(explain)
    _common(explain)

    rules = _Parser(prog="mpconvert rules check", description="Validate rule files: TOML syntax, tables, keys, precisions and op names.")
    rules.add_argument("files", nargs="+", metavar="FILE")
    _common(rules)
    return {"convert": convert, "audit": audit, "explain": explain, "rules check": rules}


# ---------------------------------------------------------------------------------------------
# output


class _UI:
    """Where text goes: results on stdout, status/tables on stderr via rich, errors as one line.

    While a command runs (and without ``--debug``), whatever the model file, torch or the tracers
    print on stderr is captured (see :func:`_captured_stderr`), so that an error is one line. Our
    own stderr lines are queued in ``lines`` and printed after the capture ends; rich writes to a
    duplicate of the original stderr so that its status spinner stays visible.
    """

    def __init__(self, *, quiet: bool, json_mode: bool, debug: bool):
        self.quiet = quiet
        self.json = json_mode
        self.debug = debug
        self.lines: list[str] = []
        self.results: list[str] = []
        self._console = None
        self._stream = None

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            stream = sys.stderr
            try:
                if sys.stderr.isatty():
                    self._stream = stream = os.fdopen(os.dup(sys.stderr.fileno()), "w")
            except (AttributeError, OSError, ValueError):
                pass
            self._console = Console(file=stream, stderr=True, highlight=False)
        return self._console

    def close(self) -> None:
        if self._stream is not None:
            with contextlib.suppress(OSError):
                self._stream.close()
            self._stream = None

    def err(self, line: str) -> None:
        self.lines.append(line)

    def flush_err(self) -> None:
        for line in self.lines:
            print(line, file=sys.stderr, flush=True)
        self.lines.clear()

    def status(self, text: str):
        if self.quiet or self.json:
            return contextlib.nullcontext()
        console = self.console
        if not console.is_terminal:
            return contextlib.nullcontext()
        return console.status(text)

    def out(self, text: str) -> None:
        if not self.json:
            self.results.append(text)

    def flush_out(self) -> None:
        """Print the results on the real stdout (after the user's code has stopped running)."""
        for text in self.results:
            print(text, file=sys.stdout, flush=True)
        self.results.clear()

    def warn(self, text: str) -> None:
        if not self.quiet and not self.json:
            self.err(f"mpconvert: warning: {_one_line(text)}")

    def emit_json(self, payload: dict) -> None:
        if self.json:
            self.results.append(json.dumps(payload, indent=2, default=str))


# ---------------------------------------------------------------------------------------------
# shared steps


def _precision_arg(value: str) -> str:
    """argparse ``type=``: the canonical half precision, or the shared one-line message."""
    from converter.ir.precision import PrecisionError, half_precision

    try:
        return half_precision(value)
    except PrecisionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _precision(value: str) -> str:
    from converter.ir.precision import PrecisionError, half_precision

    try:
        return half_precision(value)
    except PrecisionError as exc:
        raise UsageError(str(exc)) from None


def _precision_name(value: str) -> str:
    """:func:`_precision` without importing torch (``explain`` decides with it whether a saved report fits)."""
    from converter.ir.precision_names import PrecisionError, half_name

    try:
        return half_name(value)
    except PrecisionError as exc:
        raise UsageError(str(exc)) from None


def _load_rules(files: Optional[Sequence[str]]):
    from converter.rules.loader import load_rules

    try:
        return load_rules(list(files) if files else None)
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


def _load_model(ns, ui: "_UI"):
    """The model file (or ``save_pretrained`` folder) named on the command line, with example inputs.

    Whatever the user's code prints while it is imported and built goes to stderr (see
    :func:`_stdout_to_stderr`), so it can never corrupt ``--json`` output.
    """
    from converter.cli.outdir import OutputLocationError, check_text

    try:
        check_text(ns.model, "the model path")
    except OutputLocationError as exc:
        raise UsageError(str(exc)) from None
    path = Path(ns.model)
    if path.is_dir() and (path / "config.json").is_file():
        from converter.cli.hfmodel import load_pretrained_folder, without_weights

        empty, why = without_weights(path, getattr(ns, "empty_weights", None))
        loaded = load_pretrained_folder(path, batch=ns.batch, seq_len=ns.seq_len, empty=empty,
                                        trust_remote_code=getattr(ns, "trust_remote_code", False))
        if empty:
            ui.warn(f"{path}: converted without its weights ({why}); model.py loads them with load(weights={str(path)!r}), "
                    "and the report has no measurements")
        return loaded
    if ns.batch is not None or ns.seq_len is not None:
        ui.warn("--batch and --seq-len apply to checkpoint folders only; a model file's example_inputs() sets its sizes")
    from converter.cli.modelfile import load_model_file

    return load_model_file(path, entry=ns.entry)


def _model_file_for_emit(ns) -> Optional[str]:
    """The model file train.py takes loss_fn/train_batches from (none for a checkpoint folder)."""
    path = Path(ns.model)
    return None if path.is_dir() else str(path)


def _output_dir(ns, suffix: str) -> Path:
    """``--out`` (default ./MODEL_mp or ./MODEL_audit), checked before any work is done."""
    from converter.cli.outdir import OutputLocationError, check_output_location
    from converter.export.emit import check_output_dir

    out = Path(ns.out) if ns.out else _default_out(ns.model, suffix)
    try:
        check_output_location(out, force=ns.force)
    except OutputLocationError as exc:
        raise UsageError(str(exc)) from None
    # --force never deletes this run's own inputs: the model file or folder, rule files, calibration data
    inputs = [ns.model, *(ns.rules or []), getattr(ns, "calibration_data", None)]
    check_output_dir(out, force=ns.force, inputs=[item for item in inputs if item])
    return out


@contextlib.contextmanager
def _writing(out: Path):
    """A full disk or an unwritable location while writing ``out`` is bad input (exit 2), not a bug."""
    from converter.cli.outdir import OutputLocationError, writing

    try:
        with writing(out):
            yield
    except OutputLocationError as exc:
        raise UsageError(str(exc)) from exc


def _dynamic_shapes(mf):
    """The model file's optional ``dynamic_shapes()`` (None: the default dynamic dims)."""
    if getattr(mf, "dynamic_shapes", None) is None:
        return None
    try:
        return mf.dynamic_shapes()
    except Exception as exc:  # the user's hook failed: one line, exit 2
        raise UsageError(f"{mf.name}: dynamic_shapes() raised {type(exc).__name__}: {_one_line(exc)}; "
                         "return torch.export-style dims for the example inputs, or remove it") from exc


def _capture_error(exc, mf, tracer: str) -> UsageError:
    """The one-line error for a failed capture: the inputs' fault when the model's own forward fails on
    them too (a shape mismatch in example_inputs() is not the tracers' fault), else the tracers' reasons."""
    from converter.cli.modelfile import eager_failure

    why = eager_failure(mf)
    return UsageError(why if why is not None else _capture_message(exc, type(mf.model).__name__, mf.name, tracer))


def _capture_message(exc, model_name: str, model_file: str, tracer: str) -> str:
    reasons = getattr(exc, "reasons", {}) or {}
    advice = getattr(exc, "advice", None)
    if advice:  # Python code that needs a tensor's value: plain advice, then any other tracer's reason
        head = "neither tracer could capture" if tracer == "auto" else f"the {tracer} tracer could not capture"
        others = "; ".join(f"{name}: {_one_line(why)}" for name, why in reasons.items() if why != advice)
        return f"{model_file}: {head} {model_name}: {advice}" + (f" (also {others})" if others else "")
    detail = "; ".join(f"{name}: {_one_line(why)}" for name, why in reasons.items()) or _one_line(exc)
    if tracer == "auto":
        fix = "fix the code each tracer names (--debug shows more), or pick one with --tracer fx|export"
        return f"{model_file}: neither tracer could capture {model_name} ({detail}); {fix}"
    other = "export" if tracer == "fx" else "fx"
    return f"{model_file}: the {tracer} tracer could not capture {model_name} ({detail}); try --tracer {other} or --tracer auto"


def _convert(ns, ui: _UI, mf, precision: str, rules, *, calibration=None, calibration_options=None, measure=True):
    from converter.api import SlowHalfWarning, convert
    from converter.passes.capture import CaptureError
    from converter.report.common import header_warnings

    with ui.status(f"Converting {mf.name} to {precision}…"), warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowHalfWarning)  # said once below, from the report
        try:
            conv = convert(mf.model, mf.example_inputs, precision=precision, rules=rules, tracer=ns.tracer,
                           calibration=calibration, calibration_options=calibration_options,
                           opt_level=getattr(ns, "opt_level", "O1"), device=ns.device,
                           dynamic=not getattr(ns, "static", False), dynamic_shapes=_dynamic_shapes(mf),
                           strict_modes=getattr(ns, "strict_modes", False))
        except CaptureError as exc:
            raise _capture_error(exc, mf, ns.tracer) from exc
    for warning in header_warnings(conv.report):  # what report.md/html put first, one line each
        if warning.kind == "speed":
            ui.warn(warning.text)
        elif warning.kind == "modes":
            ui.warn(f"{mf.name}: {warning.text}; training with it runs without its train-mode ops (dropout...); "
                    "--strict-modes makes this an error")
        else:
            ui.warn(f"{mf.name}: {warning.text}")
    if getattr(mf, "source", None):  # a checkpoint folder: what was built and its inputs (report.json, model.py)
        conv.report.extra.setdefault("source", mf.source)
    if measure and not getattr(ns, "no_measure", False) and not any(p.is_meta for p in mf.model.parameters()):
        from converter.numerics.measure import measure as _measure

        with ui.status("Measuring memory and numerics against fp32 and torch.autocast…"):
            conv.report.add_measurements(_measure(conv))
    return conv


def _default_out(model: str, suffix: str) -> Path:
    path = Path(model)
    stem = path.resolve().name if path.is_dir() else path.stem
    return Path.cwd() / f"{stem}{suffix}"


# ---------------------------------------------------------------------------------------------
# commands


def _check_convert_options(ns) -> Optional[Any]:
    """Option checks that need no model; returns the parsed ``--tolerance``."""
    tolerance = _tolerance(ns.tolerance) if ns.tolerance is not None else None
    if ns.calibration_data is not None:  # before the model is built: a wrong path fails at once
        from converter.cli.calibdata import check_calibration_path

        check_calibration_path(ns.calibration_data)
    if ns.onnx_precision and not ns.onnx:
        raise UsageError("--onnx-precision needs --onnx; add --onnx or drop --onnx-precision")
    if ns.onnx:
        import importlib.util

        missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
        if missing:
            raise UsageError(f"--onnx is not available: {', '.join(missing)} cannot be imported; pip install 'mpconvert[onnx]' or drop --onnx")
    return tolerance


def _check_device(ns, ui: _UI) -> str:
    """Where model.py is checked: the training device when this machine has it, else cpu (with a note)."""
    if ns.device != "cuda":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    ui.warn("--device cuda: CUDA is not available here, so the graph is lowered for cuda but model.py is checked on cpu only")
    return "cpu"


def _cmd_convert(ns, ui: _UI) -> int:
    precision = _precision(ns.precision)
    tolerance = _check_convert_options(ns)
    rules = _load_rules(ns.rules)
    out = _output_dir(ns, "_mp")
    check_device = _check_device(ns, ui)
    mf = _load_model(ns, ui)

    calibration = None
    options = None
    described = ""
    if ns.calibrate or ns.tolerance is not None or ns.calibration_data is not None:
        calibration, described = _calibration_batches(ns, ui, mf)
        from converter.numerics.options import CalibrationOptions

        options = CalibrationOptions(progress=not (ui.quiet or ui.json), loss_fn=mf.loss_fn, tolerance=tolerance)

    conv = _convert_checked(ns, ui, mf, precision, rules, calibration, options)
    if calibration is not None:
        conv.report.calibration = {**conv.report.calibration, "data": described}
    return _write_conversion(ns, ui, conv, out, check_device)


def _calibration_batches(ns, ui: _UI, mf) -> tuple[list, str]:
    """The calibration batches and where they came from: ``--calibration-data``, else the model
    file's ``calibration_inputs()``. A checkpoint folder has no calibration_inputs(): without
    ``--calibration-data`` it is bad input naming the option (random batches are not calibration)."""
    if ns.calibration_data is not None:
        from converter.cli.calibdata import SYNTHETIC, load_calibration_data

        batches, described = load_calibration_data(ns.calibration_data, mf)
        if ns.calibration_data == SYNTHETIC:  # the flag, not the description, says the batches are random
            ui.warn(f"{mf.name}: calibrating on {described}: the overflow decisions follow random inputs, not your data; "
                    "pass --calibration-data FILE with real batches for decisions you can trust")
        return batches, described
    if mf.calibration_inputs is None:
        if getattr(mf, "source", None):
            raise UsageError(f"--calibrate on the checkpoint folder {mf.name} needs --calibration-data FILE (a .py defining "
                             "calibration_inputs(), a .safetensors of batches, or `synthetic`); see docs/cli.md")
        raise UsageError(
            f"--calibrate needs calibration inputs, but {mf.name} defines no calibration_inputs(); "
            "define it (an iterable of inputs like example_inputs()), pass --calibration-data FILE, or drop --calibrate/--tolerance"
        )
    try:
        calibration = list(mf.calibration_inputs())
    except Exception as exc:
        raise UsageError(f"{mf.name}: calibration_inputs() raised {type(exc).__name__}: {_one_line(exc)}; fix it or drop --calibrate") from exc
    if not calibration:
        raise UsageError(f"{mf.name}: calibration_inputs() gave no inputs; return at least one or drop --calibrate")
    return calibration, f"calibration_inputs() of {mf.name} ({len(calibration)} batches)"


def _convert_checked(ns, ui: _UI, mf, precision: str, rules, calibration, options):
    """:func:`_convert`, with a calibration tolerance that is not met turned into exit 1."""
    from converter.api import PassError
    from converter.numerics.calibrate import ToleranceNotMet

    try:
        return _convert(ns, ui, mf, precision, rules, calibration=calibration, calibration_options=options)
    except PassError as exc:  # a batch outside the sizes the graph serves is the user's data, not a bug
        cause = exc.__cause__
        if calibration is not None and "'calibrate'" in str(exc) and isinstance(cause, AssertionError) \
                and str(cause).startswith("Guard failed"):
            raise UsageError(f"a calibration batch does not fit the captured graph ({_one_line(cause)}); give batches of the "
                             "example's form within the sizes it serves (report.json: dynamic_dims), or a larger --seq-len/example") from exc
        raise
    except ToleranceNotMet as exc:
        raise _CheckFailed(
            f"{_one_line(exc)}; nothing written. Relax --tolerance, add rules that keep more ops in fp32, or use bf16",
            {"best_sqnr": exc.best_sqnr},
        ) from exc


def _write_conversion(ns, ui: _UI, conv, out: Path, check_device: str) -> int:
    """Emit the artifacts (and model.onnx), then print the result; returns the exit status."""
    from converter.export.emit import emit

    notes: list[str] = []
    onnx_result: dict = {}

    def export_into(directory: Path) -> None:
        if not ns.onnx:
            return
        try:
            onnx_result["result"] = conv.export_onnx(directory / "model.onnx", precision=ns.onnx_precision)
        except Exception as exc:  # the ONNX step failing is a failed check; the rest is still written
            if ui.debug:
                traceback.print_exc()
            onnx_result["error"] = f"ONNX export failed: {type(exc).__name__}: {_one_line(exc)}"

    with ui.status(f"Writing {out}" + (" and exporting model.onnx…" if ns.onnx else "…")):
        with _writing(out):
            shard = getattr(ns, "max_shard_size", None)
            emit(conv, out, force=ns.force, model_file=_model_file_for_emit(ns), device=check_device, extra=export_into, messages=notes,
                 **({} if shard is None else {"max_shard_size": shard}))
    for note in notes:
        # passed checks are results, not warnings (they are in --json's "checks"); emit tags each note
        if note.kind == "check":
            if check_device != "cpu" and not (ui.quiet or ui.json):
                ui.err(f"mpconvert: {note}")
            continue
        ui.warn(note)
    payload = {
        "ok": True, "command": "convert", "exit_code": EXIT_OK, "model": str(Path(ns.model)), "out": str(out),
        "precision": conv.precision, "tracer": conv.tracer, "device": ns.device, "line": conv.report.line,
        "summary": conv.report.summary, "files": sorted(p.name for p in out.iterdir()), "checks": notes,
        "timings": conv.timings,
    }
    failure = _onnx_failure(ns, onnx_result, payload)
    code = EXIT_CHECK_FAILED if failure else EXIT_OK
    if failure:
        payload.update(ok=False, exit_code=code, error=failure)
    if ui.json:
        ui.emit_json(payload)
    else:
        if not ui.quiet:
            ui.out(conv.report.line)
            result = onnx_result.get("result")
            if result is not None and result.ok:
                ui.out(_one_line(result.summary))
        ui.out(str(out))
    if failure:
        ui.err(_error_line(f"{failure}; the other artifacts were written to {out}"))
    return code


def _onnx_failure(ns, onnx_result: dict, payload: dict) -> Optional[str]:
    """Put the ONNX result into ``payload``; return the failure message, if the check failed."""
    if not ns.onnx:
        return None
    result = onnx_result.get("result")
    if result is None:
        payload["onnx"] = {"ok": False, "error": onnx_result.get("error", "ONNX export did not run")}
        return onnx_result.get("error", "ONNX export did not run")
    payload["onnx"] = result.to_dict() if hasattr(result, "to_dict") else {"ok": bool(result.ok), "summary": result.summary}
    return None if result.ok else f"ONNX verification failed: {_one_line(result.summary)}"


def _tolerance(text: str) -> Any:
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


def _cmd_audit(ns, ui: _UI) -> int:
    from converter.api import audit
    from converter.export.emit import emit_reports
    from converter.passes.capture import CaptureError

    precision = _precision(ns.precision)
    rules = _load_rules(ns.rules)
    out = _output_dir(ns, "_audit")
    mf = _load_model(ns, ui)
    with ui.status(f"Auditing {mf.name} ({precision})…"):
        try:
            report = audit(mf.model, mf.example_inputs, precision=precision, rules=rules, tracer=ns.tracer,
                           device=ns.device, dynamic=not getattr(ns, "static", False), dynamic_shapes=_dynamic_shapes(mf),
                           opt_level=ns.opt_level)
        except CaptureError as exc:
            raise _capture_error(exc, mf, ns.tracer) from exc
    if getattr(mf, "source", None):
        report.extra.setdefault("source", mf.source)
    notes: list[str] = []
    with _writing(out):
        emit_reports(report, out, force=ns.force, messages=notes)
    for note in notes:
        ui.warn(note)
    line = _audit_line(report.summary, report.precision)
    if ui.json:
        ui.emit_json({"ok": True, "command": "audit", "exit_code": EXIT_OK, "model": str(Path(ns.model)), "out": str(out),
                      "precision": report.precision, "tracer": report.tracer, "line": line, "summary": report.summary,
                      "files": sorted(p.name for p in out.iterdir())})
        return EXIT_OK
    if not ui.quiet:
        _print_table(report, ui)
        ui.out(line)
    ui.out(str(out))
    return EXIT_OK


def _audit_line(summary: dict, precision: str) -> str:
    """The audit's one-line result: what would run in half, and what it would cost in casts."""
    by = summary.get("by_precision", {})
    half = by.get("fp16", 0) + by.get("bf16", 0)
    return (
        f"Audit ({precision}): {half}/{summary['compute_nodes']} compute nodes "
        f"({100 * summary['half_flop_fraction']:.1f}% of FLOPs) would run in half, {by.get('fp32', 0)} stay fp32; "
        f"{summary['casts']} casts, {summary['cast_bytes'] / 2**20:.2f} MiB per forward; "
        f"{len(summary.get('unmatched_ops', []))} unmatched op types; nothing was converted"
    )


def _print_table(report, ui: _UI) -> None:
    from converter.report.render import print_report  # rich tables: imported only when printing

    print_report(report, ui.console)


def _cmd_explain(ns, ui: _UI) -> int:
    """Answer from a saved report.json when one fits (instant, no torch); else audit the model in memory."""
    from converter.cli.explain import ReportNotUsable, fresh_report, read_report, report_dir_of

    target = Path(ns.model)
    directory = report_dir_of(target)
    if directory is None and target.is_dir() and not (target / "config.json").is_file():
        raise UsageError(f"{target} has no report.json; pass an output directory of mpconvert or mpconvert audit, "
                         "a model file, or a save_pretrained folder")
    if directory is None:  # normalised once, without torch: a report stores `bf16` for `--precision bfloat16`
        precision = _precision_name(ns.precision)
        path = fresh_report(ns, cwd=Path.cwd(), precision=precision)
    else:
        path = directory / "report.json"
    try:
        report = read_report(path) if path is not None else None
    except ReportNotUsable as exc:
        raise UsageError(str(exc)) from None
    if report is None:
        report = _audit_for_explain(ns, ui, precision)
        source = "a fresh audit (no saved report fits; `mpconvert audit` saves one for instant answers)"
    else:
        source = str(path)
    nodes, casts = report["nodes"], report.get("casts", [])
    _check_node(ns, nodes, casts, source)
    from converter.report.explain import explain_rows

    text = explain_rows(nodes, casts, ns.node)
    if ui.json:
        row = next((r for r in nodes if r["name"] == ns.node), {})
        ui.emit_json({"ok": True, "command": "explain", "exit_code": EXIT_OK, "node": ns.node, "source": source,
                      **{key: row.get(key) for key in ("precision", "requested", "rule", "reason", "notes", "matches")}, "text": text})
        return EXIT_OK
    ui.out(text)
    if not ui.quiet:
        ui.err(f"mpconvert: explained from {source}")
    return EXIT_OK


def _check_node(ns, nodes: list, casts: list, source: str) -> None:
    """An unknown node name is bad input: name the closest ones."""
    from converter.report.explain import closest_names

    if any(r["name"] == ns.node for r in nodes) or any(c["name"] == ns.node for c in casts):
        return
    close = closest_names(ns.node, nodes, casts, n=3)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    raise UsageError(f"{ns.node!r} is not a compute node or cast of {ns.model} (read from {source}; {len(nodes)} compute nodes); "
                     f"{hint}{_where_names(ns.model)}")


def _where_names(target: str) -> str:
    path = Path(target)
    if path.is_dir() and (path / "report.json").is_file():
        return f"{path / 'report.md'} lists the node names"
    return f"`mpconvert audit {target}` lists the node names (report.md)"


def _audit_for_explain(ns, ui: _UI, precision: str) -> dict:
    """Audit the model in memory (nothing written) and return the report's dict; ``precision`` is canonical."""
    from converter.api import audit
    from converter.passes.capture import CaptureError

    rules = _load_rules(ns.rules)
    mf = _load_model(ns, ui)
    with ui.status(f"Auditing {mf.name} ({precision})…"):
        try:
            report = audit(mf.model, mf.example_inputs, precision=precision, rules=rules, tracer=ns.tracer,
                           device=ns.device, dynamic=not ns.static, dynamic_shapes=_dynamic_shapes(mf),
                           opt_level=ns.opt_level)
        except CaptureError as exc:
            raise _capture_error(exc, mf, ns.tracer) from exc
    return {"nodes": report.nodes, "casts": report.casts}


def _cmd_rules_check(ns, ui: _UI) -> int:
    from converter.rules.loader import RulesError, load_rules

    results = []
    for name in ns.files:
        path = Path(name)
        try:
            rules = load_rules([path])
            own = [r for r in rules.rules if r.file in (path.name, str(path))]
            results.append({"file": name, "ok": True, "rules": len(own)})
        except RulesError as exc:
            results.append({"file": name, "ok": False, "error": _one_line(exc)})
        except UnicodeDecodeError as exc:
            results.append({"file": name, "ok": False,
                            "error": f"{name}: not UTF-8 text (byte {exc.start}: {exc.reason}); save the rules file as UTF-8 TOML"})
        except OSError as exc:
            results.append({"file": name, "ok": False, "error": f"{name}: cannot read it ({exc.strerror or exc}); check the path and permissions"})
    bad = [r for r in results if not r["ok"]]
    code = EXIT_BAD_INPUT if bad else EXIT_OK
    if ui.json:
        ui.emit_json({"ok": not bad, "command": "rules check", "exit_code": code, "files": results})
    else:
        for r in results:
            if r["ok"] and not ui.quiet:
                ui.out(f"ok: {r['file']} ({r['rules']} rule{'s' if r['rules'] != 1 else ''})")
    for r in bad:
        ui.err(_error_line(r["error"]))
    return code


# ---------------------------------------------------------------------------------------------
# entry point


_COMMANDS: dict[str, Callable] = {
    "convert": _cmd_convert,
    "audit": _cmd_audit,
    "explain": _cmd_explain,
    "rules check": _cmd_rules_check,
}


def _split_command(argv: list[str]) -> tuple[str, list[str]]:
    if not argv:
        raise UsageError("missing MODEL.py: usage: mpconvert MODEL.py [options], or mpconvert audit|explain|rules check ...; see `mpconvert --help`")
    head = argv[0]
    if head in ("audit", "explain"):
        return head, argv[1:]
    if head == "rules":
        if len(argv) < 2 or argv[1] != "check":
            raise UsageError("unknown rules command; use `mpconvert rules check FILE...`")
        return "rules check", argv[2:]
    return "convert", argv


_POSITIONALS = {"convert": 1, "audit": 1, "explain": 2, "rules check": None}


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of ``parser`` that take a value (``--out DIR``), as opposed to flags."""
    return {opt for action in parser._actions if action.nargs != 0 for opt in action.option_strings}


def _legacy_rules(argv: list[str], parser: argparse.ArgumentParser, command: str) -> tuple[list[str], list[str]]:
    """Rewrite the old ``--rules A B`` spelling (several files after one flag) to ``--rules A --rules B``.

    Only positional words beyond what the command takes, right after a ``--rules`` value, are read
    as more rule files, so ``mpconvert --rules llm MODEL.py`` keeps MODEL.py as the model. Returns
    the rewritten argv and the deprecation messages.
    """
    wanted = _POSITIONALS.get(command)
    if wanted is None or "--rules" not in argv:
        return argv, []
    takes_value = _value_options(parser)
    positions: list[int] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            positions.extend(range(i + 1, len(argv)))
            break
        if token.startswith("-") and token != "-":
            i += 2 if token in takes_value else 1
            continue
        positions.append(i)
        i += 1
    surplus = len(positions) - wanted
    extra: set[int] = set()
    for i, token in enumerate(argv[:-1]):
        if token != "--rules" or surplus <= 0:
            continue
        j = i + 2
        while surplus > 0 and j in positions:
            extra.add(j)
            surplus -= 1
            j += 1
    if not extra:
        return argv, []
    out: list[str] = []
    for i, token in enumerate(argv):
        out.extend(["--rules", token] if i in extra else [token])
    moved = " ".join(argv[i] for i in sorted(extra))
    return out, [f"`--rules F1 F2 ...` is deprecated (read {moved} as rule files); repeat the flag instead: --rules F1 --rules F2"]


def _check_no_nul(ns) -> None:
    """No file system or Python name accepts a NUL byte: refuse it in any argument, naming the option."""
    for key, value in vars(ns).items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and "\x00" in v for v in values):
            what = {"model": "the model path", "node": "the node name", "files": "a rules file name"}.get(key, f"--{key.replace('_', '-')}")
            raise UsageError(f"{what} contains a NUL byte; remove it")


def _deprecations(ns) -> list[str]:
    """Map deprecated options onto their replacements; returns the messages."""
    notes = []
    tune_for = getattr(ns, "tune_for", None)
    if tune_for is not None:
        if ns.device is not None and ns.device != tune_for:
            raise UsageError(f"--tune-for {tune_for} contradicts --device {ns.device}; drop --tune-for (it is now --device)")
        ns.device = tune_for
        notes.append(f"--tune-for is deprecated; use --device {tune_for} (the device the model will train on)")
    return notes


def _error_line(message: str) -> str:
    return f"mpconvert: error: {_one_line(message)}"


@contextlib.contextmanager
def _sigterm_as_interrupt(enabled: bool):
    """As the console script, SIGTERM cleans up like Ctrl-C (emit removes its temporary directory)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _captured_stderr(enabled: bool):
    """Capture everything written to stderr (Python objects and file descriptor 2) while active.

    Yields a list that receives the captured text when the block ends. Used so that warnings,
    log lines and graph dumps that torch and the tracers print do not break the one-line error
    contract; ``--debug`` turns it off.
    """
    captured: list[str] = []
    if not enabled:
        yield captured
        return
    import io
    import tempfile

    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved_sys = sys.stderr
    saved_fd = None
    tmp = None
    try:
        tmp = tempfile.TemporaryFile()
        saved_fd = os.dup(2)
        os.dup2(tmp.fileno(), 2)
    except OSError:  # no usable fd 2 (embedded interpreters): Python-level capture only
        saved_fd = None
    buffer = io.StringIO()
    sys.stderr = buffer
    try:
        yield captured
    finally:
        sys.stderr = saved_sys
        if saved_fd is not None:
            with contextlib.suppress(OSError):
                os.dup2(saved_fd, 2)
                os.close(saved_fd)
        text = buffer.getvalue()
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.seek(0)
                text += tmp.read().decode("utf-8", "replace")
                tmp.close()
        captured.append(text)


@contextlib.contextmanager
def _stdout_to_stderr():
    """While a command runs, stdout (the Python object and file descriptor 1) goes to stderr.

    stdout carries only mpconvert's results (the summary, the path, the ``--json`` object), which
    are queued on the UI and printed afterwards; whatever the user's model file, torch or the
    tracers print can never corrupt them.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    saved_fd = None
    try:
        saved_fd = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no usable fd 1: Python-level redirection only
        saved_fd = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if saved_fd is not None:
            with contextlib.suppress(OSError):
                os.dup2(saved_fd, 1)
                os.close(saved_fd)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``mpconvert`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    as_script = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    json_mode = "--json" in args
    ui = _UI(quiet="-q" in args or "--quiet" in args, json_mode=json_mode, debug=debug)
    failure: list = []

    def fail(code: int, message: str, exc: Optional[BaseException] = None, payload: Optional[dict] = None) -> int:
        failure.append((code, message, exc, payload))
        return code

    code = EXIT_INTERNAL
    with _sigterm_as_interrupt(as_script):
        try:
            command, rest = _split_command(args)
            parser = build_parsers(command)[command]
            rest, notes = _legacy_rules(rest, parser, command)
            try:
                ns = parser.parse_args(rest)
            except SystemExit as exc:  # --help / --version
                return int(exc.code or 0)
            ui.quiet, ui.json, ui.debug = ns.quiet, ns.json, ns.debug
            _check_no_nul(ns)
            for note in notes + _deprecations(ns):
                ui.warn(note)
            if not (ui.quiet or ui.json) and command in ("convert", "audit"):
                _ = ui.console  # bind rich to the real stderr before it is captured (explain never needs rich)
            with _captured_stderr(not ns.debug) as captured, _stdout_to_stderr():
                try:
                    code = _COMMANDS[command](ns, ui)
                except KeyboardInterrupt as exc:
                    code = fail(EXIT_INTERRUPTED, "interrupted; nothing was written", exc)
                except _CheckFailed as exc:
                    code = fail(EXIT_CHECK_FAILED, str(exc), exc, exc.payload)
                except Exception as exc:  # classify: bad input (2), failed check (1) or a bug (3)
                    code = fail(*_classify(exc), exc)
            noise = captured[0] if captured else ""
            if noise.strip() and not failure and code == EXIT_OK and not (ui.quiet or ui.json):
                count = len(noise.strip().splitlines())
                ui.warn(f"the model file and torch printed {count} line{'s' if count != 1 else ''} on stderr (hidden; --debug shows them)")
        except KeyboardInterrupt as exc:
            code = fail(EXIT_INTERRUPTED, "interrupted; nothing was written", exc)
        except _CheckFailed as exc:
            code = fail(EXIT_CHECK_FAILED, str(exc), exc, exc.payload)
        except Exception as exc:
            code = fail(*_classify(exc), exc)
        finally:
            ui.close()
    ui.flush_err()
    ui.flush_out()
    for code_, message, exc, payload in failure:
        if debug and exc is not None:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        print(_error_line(message), file=sys.stderr, flush=True)
        if json_mode:
            print(json.dumps({"ok": False, "exit_code": code_, "error": _one_line(message), **(payload or {})}, default=str), flush=True)
    return code


#: what torch's allocators and Python say when memory runs out
_OOM_TEXT = ("can't allocate memory", "out of memory", "DefaultCPUAllocator", "Cannot allocate memory")


def _out_of_memory(exc: BaseException) -> Optional[BaseException]:
    """The out-of-memory error in ``exc``'s chain (a pass error wraps the allocator's), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        torch = sys.modules.get("torch")  # loaded by whatever ran out of memory (explain never imports it)
        if isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)) or (
                isinstance(exc, RuntimeError) and any(text in str(exc) for text in _OOM_TEXT)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _classify(exc: BaseException) -> tuple[int, str]:
    """Exit status and one-line message for an exception: every mpconvert error carries its own."""
    oom = _out_of_memory(exc)
    if oom is not None:  # the model or its inputs are too large for this machine: bad input, not our bug
        asked = re.search(r"tried to allocate (\d+) bytes", str(oom))
        size = f"an allocation of {int(asked.group(1)) / 2**30:,.1f} GiB failed" if asked else _one_line(str(oom))[:160]
        where = re.match(r"(.*? at node '[^']+')", _one_line(str(exc)))
        return EXIT_BAD_INPUT, (f"out of memory{' (' + where.group(1) + ')' if where else ''}: {size or type(oom).__name__}; "
                                "the model or its inputs are too large for this machine: use smaller example inputs "
                                "(--batch, --seq-len for a checkpoint folder), --empty-weights, or --no-measure")
    if isinstance(exc, MpconvertError) and exc.exit_code == EXIT_CHECK_FAILED:
        return EXIT_CHECK_FAILED, f"{exc}; nothing was written"
    if isinstance(exc, MpconvertError) and exc.exit_code == EXIT_BAD_INPUT:
        return EXIT_BAD_INPUT, str(exc)
    return EXIT_INTERNAL, f"internal error: {type(exc).__name__}: {exc}; rerun with --debug and report it"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
