"""The ``mpconvert`` command (DESIGN §7); ``python -m converter`` runs it too.

::

    mpconvert MODEL.py [--precision bf16|fp16] [--rules F ...] [--out DIR] [--tracer auto|fx|export]
                       [--calibrate] [--tolerance DB] [--onnx] [--onnx-precision fp16|bf16]
                       [--device cpu|cuda] [--force] [-q] [--json] [--debug] [--entry NAME]
    mpconvert audit MODEL.py [...]         the report only (no model.py); writes report.json/.md/.html
    mpconvert explain MODEL.py NODE [...]  every rule that matched NODE, and why the winner won
    mpconvert rules check FILE...          validate rule files

Exit status: 0 success; 1 a requested check failed (tolerance not met, ONNX verification failed,
the emitted model does not reproduce the conversion); 2 bad input (usage, model file, rules,
untraceable model, existing output directory): one line on stderr naming the problem and the fix,
no traceback (``--debug`` shows it) and nothing written; 3 an internal error (a bug: please report
it with the ``--debug`` output); 130 interrupted.

Output: quiet on success apart from the summary line and the output path (stdout). Progress and
tables go to stderr through rich (``-q`` silences them and prints only the path). ``--json``
prints one machine-readable JSON object on stdout instead of the text.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from converter.ir.meta import META_DECISION
from converter.ir.errors import MpconvertError
from converter.ir.precision import PrecisionError, half_precision

__all__ = ["main", "build_parsers", "UsageError", "EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_BAD_INPUT", "EXIT_INTERNAL"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130

PRECISION_HELP = "fp16 or bf16 (aliases: float16, half, 16-mixed, bfloat16, bf16-mixed); default bf16"

_EPILOG = """\
commands:
  mpconvert MODEL.py [options]        convert; writes MODEL_mp/ (model.py, weights.pt, train.py, reports)
  mpconvert audit MODEL.py [options]  the report only; writes MODEL_audit/ (report.json, .md, .html)
  mpconvert explain MODEL.py NODE     every rule that matched NODE, its precedence, and the winner
  mpconvert rules check FILE...       validate rule files (exit 2 on the first problem of each file)

the model file defines build_model() (or a module-level `model`) and example_inputs(); optionally
calibration_inputs() for --calibrate, and loss_fn(output, batch) + train_batches() for train.py.

examples:
  mpconvert samples/mlp.py                          bf16 conversion into ./mlp_mp/
  mpconvert samples/tiny_transformer.py --precision fp16 --rules llm --out tt_fp16 --force
  mpconvert samples/hf_gpt2.py --onnx               also write and verify model.onnx
  mpconvert samples/mlp.py --calibrate --tolerance 30   re-decide overflow-prone nodes; keep SQNR >= 30 dB
  mpconvert audit samples/cnn.py --json             machine-readable summary on stdout
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
    p.add_argument("--rules", nargs="+", action="extend", default=None, metavar="F",
                   help="rule files layered over the defaults, later wins (a bare name such as `llm` is a built-in file)")
    p.add_argument("--tracer", choices=("auto", "fx", "export"), default="auto",
                   help="auto tries torch.fx then torch.export (default auto)")
    p.add_argument("--entry", metavar="NAME", default=None, help="the model factory (or module-level model) to use instead of build_model/model")
    p.add_argument("--opt-level", dest="opt_level", choices=("O1", "O2"), default="O1",
                   help="how parameters will be stored for training: O1 fp32 (weight casts count in placement), "
                        "O2 half where every consumer is half, with fp32 master weights in the trainer (default O1)")
    p.add_argument("--tune-for", dest="tune_for", choices=("cpu", "cuda"), default=None,
                   help="the device the model will train on: enables its lowerings (cpu: bf16 attention as "
                        "matmul/softmax/matmul, 2-4x faster than the CPU flash kernel). Default: a portable graph")
    p.add_argument("--no-measure", dest="no_measure", action="store_true",
                   help="skip measuring memory and numerics against fp32 and torch.autocast for the report")
    p.add_argument("--static", action="store_true",
                   help="fix every input dim to the example's size (default: batch, sequence and other input dims "
                        "stay dynamic under torch.export, or as the model file's dynamic_shapes() says)")


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
    convert.add_argument("model", metavar="MODEL.py", help="the model file (DESIGN §3)")
    _model_options(convert)
    convert.add_argument("--out", metavar="DIR", default=None, help="output directory (default ./MODEL_mp)")
    convert.add_argument("--calibrate", action="store_true", help="run calibration_inputs() and re-decide nodes that would overflow")
    convert.add_argument("--tolerance", metavar="DB", default=None,
                         help="with calibration: minimum SQNR in dB against fp32 (implies --calibrate); exit 1 if not met")
    convert.add_argument("--onnx", action="store_true", help="also export model.onnx and verify its casts and outputs")
    convert.add_argument("--onnx-precision", type=_precision_arg, default=None, metavar="P",
                         help="precision of model.onnx (default: the conversion's; bf16 exports fp16, since ONNX Runtime's CPU provider lacks bf16)")
    convert.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the emitted model is checked (default cpu)")
    convert.add_argument("--force", action="store_true", help="replace an existing output directory")
    convert.add_argument("--version", action="version", version=f"mpconvert {__version__}")
    _common(convert)

    audit = _Parser(prog="mpconvert audit", description="Report what each node would run in and why, and the casts a conversion would insert, "
                    "without writing the model. "
                    "Writes report.json, report.md and report.html.")
    audit.add_argument("model", metavar="MODEL.py")
    _model_options(audit)
    audit.add_argument("--out", metavar="DIR", default=None, help="report directory (default ./MODEL_audit)")
    audit.add_argument("--force", action="store_true", help="replace an existing report directory")
    _common(audit)

    explain = _Parser(prog="mpconvert explain", description="Show the decision chain of one node: every rule that matched, "
                      "its precedence level, the winner and why.")
    explain.add_argument("model", metavar="MODEL.py")
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
            print(text, file=sys.stdout, flush=True)

    def warn(self, text: str) -> None:
        if not self.quiet and not self.json:
            self.err(f"mpconvert: warning: {_one_line(text)}")

    def emit_json(self, payload: dict) -> None:
        if self.json:
            print(json.dumps(payload, indent=2, default=str), file=sys.stdout, flush=True)


# ---------------------------------------------------------------------------------------------
# shared steps


def _precision_arg(value: str) -> str:
    """argparse ``type=``: the canonical half precision, or the shared one-line message."""
    try:
        return half_precision(value)
    except PrecisionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _precision(value: str) -> str:
    try:
        return half_precision(value)
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


def _load_model(path: str, entry: Optional[str]):
    from converter.cli.modelfile import load_model_file

    return load_model_file(path, entry=entry)


def _dynamic_shapes(mf):
    """The model file's optional ``dynamic_shapes()`` (None: the default dynamic dims)."""
    if getattr(mf, "dynamic_shapes", None) is None:
        return None
    try:
        return mf.dynamic_shapes()
    except Exception as exc:  # the user's hook failed: one line, exit 2
        raise UsageError(f"{mf.name}: dynamic_shapes() raised {type(exc).__name__}: {_one_line(exc)}; "
                         "return torch.export-style dims for the example inputs, or remove it") from exc


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
    from converter.api import convert
    from converter.passes.capture import CaptureError

    with ui.status(f"Converting {mf.name} to {precision}…"):
        try:
            conv = convert(mf.model, mf.example_inputs, precision=precision, rules=rules, tracer=ns.tracer,
                           calibration=calibration, calibration_options=calibration_options,
                           opt_level=getattr(ns, "opt_level", "O1"), device=getattr(ns, "tune_for", None),
                           dynamic=not getattr(ns, "static", False), dynamic_shapes=_dynamic_shapes(mf))
        except CaptureError as exc:
            raise UsageError(_capture_message(exc, type(mf.model).__name__, mf.name, ns.tracer)) from exc
    if measure and not getattr(ns, "no_measure", False):
        from converter.numerics.measure import measure as _measure

        with ui.status("Measuring memory and numerics against fp32 and torch.autocast…"):
            conv.report.add_measurements(_measure(conv))
    return conv


def _default_out(model: str, suffix: str) -> Path:
    return Path.cwd() / f"{Path(model).stem}{suffix}"


# ---------------------------------------------------------------------------------------------
# commands


def _cmd_convert(ns, ui: _UI) -> int:
    from converter.export.emit import check_output_dir, emit

    precision = _precision(ns.precision)
    tolerance = _tolerance(ns.tolerance) if ns.tolerance is not None else None
    if ns.onnx_precision and not ns.onnx:
        raise UsageError("--onnx-precision needs --onnx; add --onnx or drop --onnx-precision")
    if ns.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda was given but CUDA is not available on this machine; use --device cpu (the default)")
    if ns.onnx:
        import importlib.util

        missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
        if missing:
            raise UsageError(f"--onnx is not available: {', '.join(missing)} cannot be imported; pip install 'mpconvert[onnx]' or drop --onnx")
    rules = _load_rules(ns.rules)
    out = Path(ns.out) if ns.out else _default_out(ns.model, "_mp")
    check_output_dir(out, force=ns.force)
    mf = _load_model(ns.model, ns.entry)

    calibration = None
    options = None
    if ns.calibrate or ns.tolerance is not None:
        if mf.calibration_inputs is None:
            raise UsageError(
                f"--calibrate needs calibration inputs, but {mf.name} defines no calibration_inputs(); "
                "define it (an iterable of inputs like example_inputs()) or drop --calibrate/--tolerance"
            )
        try:
            calibration = list(mf.calibration_inputs())
        except Exception as exc:
            raise UsageError(f"{mf.name}: calibration_inputs() raised {type(exc).__name__}: {_one_line(exc)}; fix it or drop --calibrate") from exc
        if not calibration:
            raise UsageError(f"{mf.name}: calibration_inputs() gave no inputs; return at least one or drop --calibrate")
        from converter.numerics.options import CalibrationOptions

        options = CalibrationOptions(progress=not (ui.quiet or ui.json), loss_fn=mf.loss_fn, tolerance=tolerance)

    from converter.numerics.calibrate import ToleranceNotMet

    try:
        conv = _convert(ns, ui, mf, precision, rules, calibration=calibration, calibration_options=options)
    except ToleranceNotMet as exc:
        raise _CheckFailed(
            f"{_one_line(exc)}; nothing written. Relax --tolerance, add rules that keep more ops in fp32, or use bf16",
            {"best_sqnr": exc.best_sqnr},
        ) from exc

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
        emit(conv, out, force=ns.force, model_file=str(Path(ns.model)), device=ns.device, extra=export_into, messages=notes)

    for note in notes:
        if note.startswith("model.py reproduces") or note.startswith("model.py runs on"):
            if ns.device != "cpu" and not (ui.quiet or ui.json):
                ui.err(f"mpconvert: {note}")
            continue
        ui.warn(note)
    payload = {
        "ok": True,
        "command": "convert",
        "exit_code": EXIT_OK,
        "model": str(Path(ns.model)),
        "out": str(out),
        "precision": conv.precision,
        "tracer": conv.tracer,
        "line": conv.report.line,
        "summary": conv.report.summary,
        "files": sorted(p.name for p in out.iterdir()),
        "checks": notes,
        "timings": conv.timings,
    }
    code = EXIT_OK
    failure = None
    if ns.onnx:
        result = onnx_result.get("result")
        if result is not None:
            payload["onnx"] = result.to_dict() if hasattr(result, "to_dict") else {"ok": bool(result.ok), "summary": result.summary}
            if not result.ok:
                failure = f"ONNX verification failed: {_one_line(result.summary)}"
        else:
            payload["onnx"] = {"ok": False, "error": onnx_result.get("error", "ONNX export did not run")}
            failure = onnx_result.get("error", "ONNX export did not run")
    if failure:
        code = EXIT_CHECK_FAILED
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


def _tolerance(text: str) -> Any:
    """``--tolerance``: an SQNR in dB (``30``), or ``sqnr=30`` / ``rtol=1e-2,atol=1e-3``."""
    fix = "give an SQNR in dB such as 30, or rtol=1e-2,atol=1e-3"
    try:
        value = float(text)
    except ValueError:
        parts: dict[str, float] = {}
        for item in str(text).split(","):
            key, sep, number = item.partition("=")
            key = key.strip().lower()
            try:
                parts[key] = float(number)
            except ValueError:
                raise UsageError(f"--tolerance {text!r} is not understood; {fix}") from None
            if not sep or key not in ("sqnr", "rtol", "atol") or not math.isfinite(parts[key]):
                raise UsageError(f"--tolerance {text!r} is not understood; {fix}")
        if "sqnr" in parts and len(parts) > 1:
            raise UsageError(f"--tolerance {text!r} mixes sqnr with rtol/atol; {fix}")
        return parts
    if not math.isfinite(value):
        raise UsageError(f"--tolerance must be a finite SQNR in dB, got {text!r}; {fix}")
    return value


def _cmd_audit(ns, ui: _UI) -> int:
    from converter.export.emit import check_output_dir, emit_reports

    precision = _precision(ns.precision)
    rules = _load_rules(ns.rules)
    out = Path(ns.out) if ns.out else _default_out(ns.model, "_audit")
    check_output_dir(out, force=ns.force)
    mf = _load_model(ns.model, ns.entry)
    from converter.api import audit
    from converter.passes.capture import CaptureError

    with ui.status(f"Auditing {mf.name} ({precision})…"):
        try:
            report = audit(mf.model, mf.example_inputs, precision=precision, rules=rules, tracer=ns.tracer,
                           device=getattr(ns, "tune_for", None), dynamic=not getattr(ns, "static", False),
                           dynamic_shapes=_dynamic_shapes(mf))
        except CaptureError as exc:
            raise UsageError(_capture_message(exc, type(mf.model).__name__, mf.name, ns.tracer)) from exc
    notes: list[str] = []
    emit_reports(report, out, force=ns.force, messages=notes)
    for note in notes:
        ui.warn(note)
    if ui.json:
        ui.emit_json({"ok": True, "command": "audit", "exit_code": EXIT_OK, "model": str(Path(ns.model)), "out": str(out),
                      "precision": report.precision, "tracer": report.tracer, "line": report.line, "summary": report.summary,
                      "files": sorted(p.name for p in out.iterdir())})
        return EXIT_OK
    if not ui.quiet:
        _print_table(report, ui)
        ui.out(report.line)
    ui.out(str(out))
    return EXIT_OK


def _print_table(report, ui: _UI) -> None:
    from converter.report.render import print_report  # rich tables: imported only when printing

    print_report(report, ui.console)


def _cmd_explain(ns, ui: _UI) -> int:
    precision = _precision(ns.precision)
    rules = _load_rules(ns.rules)
    mf = _load_model(ns.model, ns.entry)
    conv = _convert(ns, ui, mf, precision, rules, measure=False)
    nodes = {n.name: n for n in conv.module.graph.nodes}
    node = nodes.get(ns.node)
    if node is None or META_DECISION not in node.meta:
        decided = [n for n, v in nodes.items() if META_DECISION in v.meta]
        close = difflib.get_close_matches(ns.node, decided, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        what = "has no decision (it is an input, a weight, an inserted cast or a non-float node)" if node is not None else "is not a node of the converted graph"
        raise UsageError(f"{ns.node!r} {what}; {hint}list the node names with `mpconvert audit {ns.model}` (report.md)")
    text = _explain_text(conv, ns.node)
    if ui.json:
        decision = node.meta[META_DECISION]
        ui.emit_json({
            "ok": True, "command": "explain", "exit_code": EXIT_OK, "node": ns.node,
            "precision": decision.precision, "requested": decision.requested, "rule": str(decision.rule), "reason": decision.reason,
            "notes": [[stage, note] for stage, note in decision.notes],
            "matches": [{"rule": str(m.rule), "precision": m.precision, "level": m.level, "level_name": m.level_name,
                         "scope": m.scope, "reason": m.reason} for m in decision.matches],
            "text": text,
        })
        return EXIT_OK
    print(text)
    return EXIT_OK


def _explain_text(conv, node_name: str) -> str:
    from converter.report.render import explain

    return explain(conv, node_name)


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
            try:
                ns = parser.parse_args(rest)
            except SystemExit as exc:  # --help / --version
                return int(exc.code or 0)
            ui.quiet, ui.json, ui.debug = ns.quiet, ns.json, ns.debug
            if not (ui.quiet or ui.json):
                ui.console  # bind rich to the real stderr before it is captured
            with _captured_stderr(not ns.debug) as captured:
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
    for code_, message, exc, payload in failure:
        if debug and exc is not None:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        print(_error_line(message), file=sys.stderr, flush=True)
        if json_mode:
            print(json.dumps({"ok": False, "exit_code": code_, "error": _one_line(message), **(payload or {})}, default=str), flush=True)
    return code


def _classify(exc: BaseException) -> tuple[int, str]:
    """Exit status and one-line message for an exception: every mpconvert error carries its own."""
    if isinstance(exc, MpconvertError) and exc.exit_code == EXIT_CHECK_FAILED:
        return EXIT_CHECK_FAILED, f"{exc}; nothing was written"
    if isinstance(exc, MpconvertError) and exc.exit_code == EXIT_BAD_INPUT:
        return EXIT_BAD_INPUT, str(exc)
    return EXIT_INTERNAL, f"internal error: {type(exc).__name__}: {exc}; rerun with --debug and report it"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
