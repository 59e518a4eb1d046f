"""The ``mpconvert`` commands: ``convert`` (``mpconvert MODEL``), ``audit``, ``explain`` and ``rules check``.

Each command entry point (``cmd_*``) reads its parsed namespace once, at the top, into one
:class:`~converter.options.ConvertOptions` and the few CLI-only values it honours (a
:class:`~converter.cli.steps.ModelSource`, the output location, the calibration and ONNX flags); every
helper below takes those typed values, never the namespace. Parsers live in :mod:`converter.cli.parsers`,
terminal output in :mod:`converter.cli.terminal`, the shared steps in :mod:`converter.cli.steps`.
"""
from __future__ import annotations

import argparse
import dataclasses
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, cast

from converter.cli.parsers import UsageError
from converter.cli.steps import (
    ModelSource,
    capture_error,
    load_model,
    load_rules,
    output_dir,
    parse_tolerance,
    with_model_file,
    writing,
)
from converter.cli.terminal import Terminal, error_line, one_line, print_table
from converter.ir.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, MpconvertError
from converter.ir.records import SourceFacts
from converter.options import ConvertOptions

__all__ = ["COMMANDS", "CheckFailed", "Artifacts", "EXIT_OK", "cmd_convert", "cmd_audit", "cmd_explain", "cmd_rules_check",
           "cmd_profile",
           "convert_model", "audit_line"]

EXIT_OK = 0


class CheckFailed(MpconvertError):
    """A requested check failed (exit 1); carries the message and any JSON payload."""

    exit_code = EXIT_CHECK_FAILED

    def __init__(self, message: str, payload: Optional[dict] = None):
        super().__init__(message)
        self.payload = payload or {}


@dataclass(frozen=True)
class Artifacts:
    """What ``mpconvert MODEL`` writes and checks besides the conversion itself."""

    out: Path
    force: bool = False
    onnx: bool = False
    onnx_precision: Optional[str] = None
    max_shard_size: Optional[int] = None


def _source(path: str, entry: Optional[str], batch: Optional[int], seq_len: Optional[int], trust_remote_code: bool,
            empty_weights: Optional[bool], allow_missing_weights: bool = False) -> ModelSource:
    return ModelSource(path, entry=entry, batch=batch, seq_len=seq_len, trust_remote_code=trust_remote_code,
                       empty_weights=empty_weights, allow_missing_weights=allow_missing_weights)


def model_of_output(path: str, ui: Terminal) -> str:
    """``path``, or for an output directory of mpconvert (report.json and model.py, no config.json) the model
    file it was converted from, which it keeps as user_model.py: ``mpconvert audit MODEL_mp`` audits that model
    again (a folder conversion keeps none: one line naming the folder it came from)."""
    folder = Path(path)
    if not (folder.is_dir() and (folder / "report.json").is_file() and (folder / "model.py").is_file()
            and not (folder / "config.json").is_file()):
        return path
    copied = folder / "user_model.py"
    if copied.is_file():
        ui.err(f"mpconvert: {folder} is an output directory of mpconvert: using {copied}, the model file it was converted from")
        return str(copied)
    raise UsageError(f"{folder} is an output directory of mpconvert with no copy of its model file (it was converted from "
                     f"a save_pretrained folder or a model object); its report.json is that conversion's audit (mpconvert "
                     f"explain {folder} NODE answers from it), or pass the model it was converted from")


# ---------------------------------------------------------------------------------------------
# convert


def cmd_convert(ns: argparse.Namespace, ui: Terminal) -> int:
    """``mpconvert MODEL``: convert, then write MODEL_mp/ (model.py, weights, train.py, reports)."""
    options = ConvertOptions(precision=ns.precision, tracer=ns.tracer, opt_level=ns.opt_level, device=ns.device,
                             dynamic=not ns.static, strict_modes=ns.strict_modes, partial=not ns.no_breaks,
                             **_profile_option(ns.device_profile))
    source = _source(model_of_output(ns.model, ui), ns.entry, ns.batch, ns.seq_len, ns.trust_remote_code,
                     ns.empty_weights, ns.allow_missing_weights)
    calibrating = ns.calibrate or ns.tolerance is not None or ns.calibration_data is not None
    rule_files, calibration_data, measure = ns.rules, ns.calibration_data, not ns.no_measure
    tolerance = check_convert_flags(tolerance=ns.tolerance, calibration_data=calibration_data, onnx=ns.onnx,
                                    onnx_precision=ns.onnx_precision)
    if calibration_data is not None:  # a .py from a checkpoint folder runs code: --trust-remote-code first
        from converter.cli.calibdata import check_calibration_source

        check_calibration_source(calibration_data, source.path, trust_remote_code=source.trust_remote_code)
    rules = load_rules(rule_files)
    artifacts = Artifacts(output_dir(ns.out, source.path, "_mp", force=ns.force, inputs=[source.path, *(rule_files or []), calibration_data]),
                          force=ns.force, onnx=ns.onnx, onnx_precision=ns.onnx_precision, max_shard_size=ns.max_shard_size)
    check_device = _check_device(options.device, ui)
    mf = load_model(source, ui)
    options = with_model_file(options, mf)
    calibration = None
    described = ""
    if calibrating:
        calibration, described = _calibration_batches(calibration_data, ui, mf)
        from converter.numerics.options import CalibrationOptions

        calibration_options = CalibrationOptions(progress=not (ui.quiet or ui.json), loss_fn=mf.loss_fn, tolerance=tolerance)
        options = dataclasses.replace(options, calibration_options=calibration_options)
    conv = _convert_checked(ui, mf, options, rules, calibration, measure=measure)
    if calibration is not None:
        conv.report.calibration = {**conv.report.calibration, "data": described}
    return _write_conversion(ui, conv, source, artifacts, check_device)


def check_convert_flags(*, tolerance: Optional[str], calibration_data: Optional[str], onnx: bool,
                        onnx_precision: Optional[str]) -> Optional[Any]:
    """Flag checks that need no model; returns the parsed ``--tolerance``."""
    parsed = parse_tolerance(tolerance) if tolerance is not None else None
    if calibration_data is not None:  # before the model is built: a wrong path fails at once
        from converter.cli.calibdata import check_calibration_path

        check_calibration_path(calibration_data)
    if onnx_precision and not onnx:
        raise UsageError("--onnx-precision needs --onnx; add --onnx or drop --onnx-precision")
    if onnx:
        import importlib.util

        missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
        if missing:
            raise UsageError(f"--onnx is not available: {', '.join(missing)} cannot be imported; pip install 'mpconvert[onnx]' or drop --onnx")
    return parsed


def _write_failure(exc: BaseException) -> Optional[BaseException]:
    """The OSError of a failed write (or the MemoryError) in ``exc``'s chain (an exporter may wrap it), or None:
    then nothing is published (exit 2), rather than the other artifacts with a failed ONNX check (exit 1)."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if (isinstance(current, OSError) and current.errno is not None) or isinstance(current, MemoryError):
            return current
        if any(text in str(current) for text in ("MemoryError", "failed to map segment", "Cannot allocate memory")):
            return MemoryError(one_line(current)[:300])  # a library that cannot be loaded or an exporter out of memory
        current = current.__cause__ or current.__context__
    return None


def _check_device(device: Optional[str], ui: Terminal) -> str:
    """Where model.py is checked: the training device when this machine has it, else cpu (with a note)."""
    if device != "cuda":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    ui.warn("--device cuda: CUDA is not available here, so the graph is lowered for cuda but model.py is checked on cpu only")
    return "cpu"


def _calibration_batches(calibration_data: Optional[str], ui: Terminal, mf) -> tuple[list, str]:
    """The calibration batches and where they came from: ``--calibration-data``, else the model
    file's ``calibration_inputs()``. A checkpoint folder has no calibration_inputs(): without
    ``--calibration-data`` it is bad input naming the option (random batches are not calibration)."""
    if calibration_data is not None:
        from converter.cli.calibdata import SYNTHETIC, load_calibration_data

        batches, described = load_calibration_data(calibration_data, mf, ui.warn)
        if calibration_data == SYNTHETIC:  # the flag, not the description, says the batches are random
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
    from converter.cli.calibdata import check_values, take_batches

    try:
        calibration = take_batches(mf.calibration_inputs(), f"{mf.name}: calibration_inputs()", ui.warn)
    except Exception as exc:
        raise UsageError(f"{mf.name}: calibration_inputs() raised {type(exc).__name__}: {one_line(exc)}; fix it or drop --calibrate") from exc
    if not calibration:
        raise UsageError(f"{mf.name}: calibration_inputs() gave no inputs; return at least one or drop --calibrate")
    check_values(calibration, mf, f"{mf.name}: calibration_inputs()")
    return calibration, f"calibration_inputs() of {mf.name} ({len(calibration)} batches)"


def convert_model(ui: Terminal, mf, options: ConvertOptions, rules, *, calibration: Optional[list] = None,
                  measure: bool = True):
    """:func:`converter.api.convert` on the loaded model, its report's warnings said on stderr, measured
    against fp32 and autocast unless ``measure`` is False (or the model has no weights)."""
    from converter import api, partition
    from converter.passes.capture import CaptureError
    from converter.report.common import header_warnings

    with ui.status(f"Converting {mf.name} to {options.precision}…"), warnings.catch_warnings():
        warnings.simplefilter("ignore", api.SlowHalfWarning)  # said once below, from the report
        try:
            conv = partition.convert(mf.model, mf.example_inputs, rules=rules, calibration=calibration, options=options)
        except CaptureError as exc:
            raise capture_error(exc, mf, options.tracer) from exc
    for warning in header_warnings(conv.report):  # what report.md/html put first, one line each
        if warning.kind == "speed":
            ui.warn(warning.text)
        elif warning.kind == "modes":
            ui.warn(f"{mf.name}: {warning.text}; training with it runs without its train-mode ops (dropout...); "
                    "--strict-modes makes this an error")
        else:
            ui.warn(f"{mf.name}: {warning.text}")
    _keep_source(conv.report, mf)
    if measure and not any(p.is_meta for p in mf.model.parameters()):
        from converter.numerics.gap import BelowAutocastWarning
        from converter.numerics.measure import measure as measured

        with ui.status("Measuring memory and numerics against fp32 and torch.autocast…"), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BelowAutocastWarning)
            conv.report.add_measurements(measured(conv))
        for said in caught:  # said once, on stderr; the summary repeats it (report.terminal)
            if issubclass(said.category, BelowAutocastWarning):
                ui.warn(f"{mf.name}: {said.message}")
            else:
                warnings.warn_explicit(said.message, said.category, said.filename, said.lineno)
    return conv


def _calibration_misfit(what: str) -> UsageError:
    return UsageError(f"a calibration batch does not fit the captured graph ({what}); give batches of the example's "
                      "form within the sizes it serves (report.json: dynamic_dims), or a larger --seq-len/example")


def _convert_checked(ui: Terminal, mf, options: ConvertOptions, rules, calibration: Optional[list], *, measure: bool):
    """:func:`convert_model`, with a calibration tolerance that is not met turned into exit 1."""
    from converter.api import PassError
    from converter.numerics.calibrate import ToleranceNotMet
    from converter.passes.capture.served import ShapeNotServedError

    try:
        return convert_model(ui, mf, options, rules, calibration=calibration, measure=measure)
    except ShapeNotServedError as exc:  # a calibration batch of sizes the graph's guards refuse: the user's data
        if calibration is None:
            raise
        raise _calibration_misfit(f"{', '.join(f'{k} of shape {tuple(v)}' for k, v in exc.shapes.items())}: the graph "
                                  f"holds only where {exc.guard}") from exc
    except PassError as exc:  # a batch outside the sizes the graph serves is the user's data, not a bug
        cause = exc.__cause__
        if calibration is not None and exc.stage == "calibrate" and isinstance(cause, AssertionError) \
                and str(cause).startswith("Guard failed"):  # torch's guard message, not ours
            raise _calibration_misfit(one_line(cause)) from exc
        if calibration is not None and exc.stage == "calibrate":  # a batch the fp32 model cannot run is the data's fault
            from converter.cli.calibdata import diagnose_batches

            message = diagnose_batches(calibration, mf)
            if message is not None:
                raise UsageError(message) from exc
        raise
    except ToleranceNotMet as exc:
        raise CheckFailed(
            f"{one_line(exc)}; nothing written. Relax --tolerance, add rules that keep more ops in fp32, or use bf16",
            {"best_sqnr": exc.best_sqnr},
        ) from exc


def _write_conversion(ui: Terminal, conv, source: ModelSource, artifacts: Artifacts, check_device: str) -> int:
    """Emit the artifacts (and model.onnx), then print the result; returns the exit status."""
    from converter.export.emit import emit

    out = artifacts.out
    notes: list = []
    onnx_result: dict = {}
    if artifacts.onnx:  # an ONNX export of an fp8 conversion that cannot be written is refused before anything is (exit 2)
        from converter.export.onnx_fp8 import check_fp8_export

        check_fp8_export(conv.module, fp8=conv.options.fp8_recipe is not None, precision=artifacts.onnx_precision,
                         example_inputs=conv.example_inputs)

    def export_into(directory: Path) -> None:
        if not artifacts.onnx:
            return
        try:
            onnx_result["result"] = conv.export_onnx(directory / "model.onnx", precision=artifacts.onnx_precision)
        except Exception as exc:  # the ONNX step failing is a failed check; the rest is still written
            written = _write_failure(exc)
            if isinstance(written, OSError):  # a failed write (file-size limit, full disk) publishes nothing: exit 2
                raise OSError(written.errno, written.strerror, str(directory / "model.onnx")) from exc
            if written is not None:  # out of memory: exit 2 naming it, nothing published
                raise MemoryError(f"exporting model.onnx: {one_line(written) or 'MemoryError'}") from exc
            if ui.debug:
                traceback.print_exc()
            for torn in ("model.onnx", "model.onnx.data"):  # a half-written export is never published
                (directory / torn).unlink(missing_ok=True)
            onnx_result["error"] = f"ONNX export failed: {type(exc).__name__}: {one_line(exc)}"

    with ui.status(f"Writing {out}" + (" and exporting model.onnx…" if artifacts.onnx else "…")):
        with writing(out):
            shard = artifacts.max_shard_size
            emit(conv, out, force=artifacts.force, model_file=source.model_file, device=check_device, extra=export_into,
                 messages=notes, **({} if shard is None else {"max_shard_size": cast(Any, shard)}))
    for note in notes:
        # passed checks are results, not warnings (they are in --json's "checks"); emit tags each note
        if note.kind == "check":
            if check_device != "cpu" and not (ui.quiet or ui.json):
                ui.err(f"mpconvert: {note}")
            continue
        ui.warn(note)
    payload = {
        "ok": True, "command": "convert", "exit_code": EXIT_OK, "model": str(Path(source.path)), "out": str(out),
        "precision": conv.precision, "tracer": conv.tracer, "device": conv.options.device, "line": conv.report.line,
        "summary": conv.report.summary, "files": sorted(p.name for p in out.iterdir()), "checks": notes,
        "timings": conv.timings,
    }
    failure = _onnx_failure(artifacts.onnx, onnx_result, payload)
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
                ui.out(one_line(result.summary))
        ui.out(str(out))
    if failure:
        ui.err(error_line(f"{failure}; the other artifacts were written to {out}"))
    return code


def _onnx_failure(onnx: bool, onnx_result: dict, payload: dict) -> Optional[str]:
    """Put the ONNX result into ``payload``; return the failure message, if the check failed."""
    if not onnx:
        return None
    result = onnx_result.get("result")
    if result is None:
        payload["onnx"] = {"ok": False, "error": onnx_result.get("error", "ONNX export did not run")}
        return onnx_result.get("error", "ONNX export did not run")
    payload["onnx"] = result.to_dict() if hasattr(result, "to_dict") else {"ok": bool(result.ok), "summary": result.summary}
    return None if result.ok else f"ONNX verification failed: {one_line(result.summary)}"


# ---------------------------------------------------------------------------------------------
# audit


def cmd_audit(ns: argparse.Namespace, ui: Terminal) -> int:
    """``mpconvert audit MODEL``: the report only, written to MODEL_audit/."""
    options = ConvertOptions(precision=ns.precision, tracer=ns.tracer, opt_level=ns.opt_level, device=ns.device,
                             dynamic=not ns.static, strict_modes=ns.strict_modes, partial=not ns.no_breaks,
                             **_profile_option(ns.device_profile))
    source = _source(model_of_output(ns.model, ui), ns.entry, ns.batch, ns.seq_len, ns.trust_remote_code,
                     ns.empty_weights, ns.allow_missing_weights)
    rules = load_rules(ns.rules)
    out = output_dir(ns.out, source.path, "_audit", force=ns.force, inputs=[source.path, *(ns.rules or [])])
    force = ns.force
    mf = load_model(source, ui)
    report = _audit(ui, mf, with_model_file(options, mf), rules)
    from converter.export.emit import emit_reports

    notes: list = []
    with writing(out):
        emit_reports(report, out, force=force, messages=notes)
    for note in notes:
        ui.warn(note)
    line = audit_line(report.summary, report.precision)
    if ui.json:
        ui.emit_json({"ok": True, "command": "audit", "exit_code": EXIT_OK, "model": str(Path(source.path)), "out": str(out),
                      "precision": report.precision, "tracer": report.tracer, "line": line, "summary": report.summary,
                      "files": sorted(p.name for p in out.iterdir())})
        return EXIT_OK
    if not ui.quiet:
        print_table(report, ui)
        ui.out(line)
    ui.out(str(out))
    return EXIT_OK


def _audit(ui: Terminal, mf, options: ConvertOptions, rules):
    """:func:`converter.api.audit` on the loaded model (its folder source recorded in the report)."""
    from converter.partition import audit
    from converter.passes.capture import CaptureError

    with ui.status(f"Auditing {mf.name} ({options.precision})…"):
        try:
            report = audit(mf.model, mf.example_inputs, rules=rules, options=options)
        except CaptureError as exc:
            raise capture_error(exc, mf, options.tracer) from exc
    _keep_source(report, mf)
    return report


def _keep_source(report: Any, mf: Any) -> None:
    """A checkpoint folder: what was built and its inputs, on the report (report.json, model.py's docstring)."""
    if getattr(mf, "source", None) and report.records.source is None:
        report.records = dataclasses.replace(report.records, source=SourceFacts(dict(mf.source)))


def audit_line(summary: dict, precision: str) -> str:
    """The audit's one-line result: what would run in half, and what it would cost in casts."""
    by = summary.get("by_precision", {})
    half = by.get("fp16", 0) + by.get("bf16", 0)
    return (
        f"Audit ({precision}): {half}/{summary['compute_nodes']} compute nodes "
        f"({100 * summary['half_flop_fraction']:.1f}% of FLOPs) would run in half, {by.get('fp32', 0)} stay fp32; "
        f"{summary['casts']} casts, {summary['cast_bytes'] / 2**20:.2f} MiB per forward; "
        f"{len(summary.get('unmatched_ops', []))} unmatched op types; nothing was converted"
    )


# ---------------------------------------------------------------------------------------------
# explain


def cmd_explain(ns: argparse.Namespace, ui: Terminal) -> int:
    """Answer from a saved report.json when one fits (instant, no torch); else audit the model in memory."""
    from converter.cli.explain import ReportNotUsable, fresh_report, read_report, report_dir_of

    options = ConvertOptions(precision=ns.precision, tracer=ns.tracer, opt_level=ns.opt_level, device=ns.device,
                             dynamic=not ns.static)  # normalised once, without torch: `bfloat16` is a report's `bf16`
    source = _source(ns.model, ns.entry, ns.batch, ns.seq_len, ns.trust_remote_code, ns.empty_weights,
                     ns.allow_missing_weights)
    rule_files, node = list(ns.rules or ()), ns.node
    target = Path(source.path)
    directory = report_dir_of(target)
    if directory is None and target.is_dir() and not (target / "config.json").is_file():
        raise UsageError(f"{target} has no report.json; pass an output directory of mpconvert or mpconvert audit, "
                         "a model file, or a save_pretrained folder")
    if directory is None:
        path = fresh_report(target, options, rules=rule_files, entry=source.entry, cwd=Path.cwd())
    else:
        path = directory / "report.json"
    try:
        report = read_report(path) if path is not None else None
    except ReportNotUsable as exc:
        raise UsageError(str(exc)) from None
    if report is None:
        rules = load_rules(rule_files)
        mf = load_model(source, ui)
        audited = _audit(ui, mf, with_model_file(options, mf), rules)
        report = {"nodes": audited.nodes, "casts": audited.casts}
        source_text = "a fresh audit (no saved report fits; `mpconvert audit` saves one for instant answers)"
    else:
        source_text = str(path)
    return _answer(ui, report["nodes"], report.get("casts", []), node, source.path, source_text)


def _answer(ui: Terminal, nodes: list, casts: list, node: str, model: str, source: str) -> int:
    """Print the decision chain of ``node`` (an unknown name is bad input naming the closest ones)."""
    from converter.report.explain import closest_names, explain_rows

    if not (any(r["name"] == node for r in nodes) or any(c["name"] == node for c in casts)):
        close = closest_names(node, nodes, casts, n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise UsageError(f"{node!r} is not a compute node or cast of {model} (read from {source}; {len(nodes)} compute nodes); "
                         f"{hint}{_where_names(model)}")
    text = explain_rows(nodes, casts, node)
    if ui.json:
        row: dict[str, Any] = next((r for r in nodes if r["name"] == node), {})
        ui.emit_json({"ok": True, "command": "explain", "exit_code": EXIT_OK, "node": node, "source": source,
                      **{key: row.get(key) for key in ("precision", "requested", "rule", "reason", "notes", "matches")}, "text": text})
        return EXIT_OK
    ui.out(text)
    if not ui.quiet:
        ui.err(f"mpconvert: explained from {source}")
    return EXIT_OK


def _where_names(target: str) -> str:
    path = Path(target)
    if path.is_dir() and (path / "report.json").is_file():
        return f"{path / 'report.md'} lists the node names"
    return f"`mpconvert audit {target}` lists the node names (report.md)"


# ---------------------------------------------------------------------------------------------
# rules check


def cmd_rules_check(ns: argparse.Namespace, ui: Terminal) -> int:
    """``mpconvert rules check FILE...``: validate each rule file; exit 2 when any is bad."""
    from converter.rules.loader import RulesError
    from converter.rules.loader import load_rules as load

    results = []
    for name in ns.files:
        path = Path(name)
        try:
            rules = load([path])
            own = [r for r in rules.rules if r.file in (path.name, str(path))]
            results.append({"file": name, "ok": True, "rules": len(own)})
        except RulesError as exc:
            results.append({"file": name, "ok": False, "error": one_line(exc)})
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
        ui.err(error_line(r["error"]))
    return code


# ---------------------------------------------------------------------------------------------
# profile


def _profile_option(value: Optional[str]) -> dict[str, Any]:
    """``--device-profile PATH|auto|none`` as a ConvertOptions keyword; not given: the option's default (auto)."""
    return {} if value is None else {"device_profile": value}


def cmd_profile(ns: argparse.Namespace, ui: Terminal) -> int:
    """``mpconvert profile -o FILE``: measure this machine's device profile and save it."""
    from converter.numerics.profile import DeviceProfile

    output = Path(ns.output)
    if output.is_dir():
        raise UsageError(f"-o {output} is a directory; give a file name such as {output / 'profile.json'}")
    if not output.parent.is_dir():
        raise UsageError(f"-o {output}: the folder {output.parent} does not exist; create it or pick another path")
    profile = DeviceProfile.measure()
    profile.save(output)
    if ui.json:
        ui.emit_json({"ok": True, "command": "profile", "exit_code": EXIT_OK, "path": str(output),
                      "device_profile": profile.to_dict()})
    elif ui.quiet:
        ui.out(str(output))
    else:
        seconds = ", ".join(f"{name} {value * 1e6:.0f} us" for name, value in profile.matmul_seconds)
        ui.out(f"wrote {output}: {profile.cpu} ({profile.cores} cores, torch {profile.torch_version}); "
               f"128x128 matmul {seconds}" + (f"; CUDA {profile.cuda_device}" if profile.cuda_device else ""))
    return EXIT_OK


#: command name -> entry point (the only functions that read a parsed namespace)
COMMANDS: dict[str, Callable[[argparse.Namespace, Terminal], int]] = {
    "convert": cmd_convert,
    "audit": cmd_audit,
    "explain": cmd_explain,
    "rules check": cmd_rules_check,
    "profile": cmd_profile,
}
