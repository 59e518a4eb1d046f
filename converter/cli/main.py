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

This module is the entry point only: it parses (:mod:`converter.cli.parsers`), runs the command
(:mod:`converter.cli.commands`) with its output queued on a :class:`~converter.cli.terminal.Terminal`,
and maps what it raised to the exit status and one line.
"""
from __future__ import annotations

import json
import re
import sys
import traceback
from typing import Optional, Sequence

from converter.cli.commands import COMMANDS, CheckFailed
from converter.cli.parsers import UsageError, build_parsers, parse, refuse_nul, tune_for
from converter.cli.terminal import Terminal, captured_stderr, error_line, one_line, sigterm_as_interrupt, stdout_to_stderr
from converter.ir.errors import MpconvertError  # torch-free: `explain OUT_DIR` must not import torch

__all__ = ["main", "build_parsers", "UsageError", "EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_BAD_INPUT", "EXIT_INTERNAL"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``mpconvert`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    as_script = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    json_mode = "--json" in args
    ui = Terminal(quiet="-q" in args or "--quiet" in args, json_mode=json_mode, debug=debug)
    failure: list = []

    def fail(code: int, message: str, exc: Optional[BaseException] = None, payload: Optional[dict] = None) -> int:
        failure.append((code, message, exc, payload))
        return code

    code = EXIT_INTERNAL
    with sigterm_as_interrupt(as_script):
        try:
            try:
                command, ns, notes = parse(args)
            except SystemExit as exc:  # --help / --version
                return int(exc.code or 0)
            ui.quiet, ui.json, ui.debug = ns.quiet, ns.json, ns.debug
            refuse_nul(vars(ns))
            if getattr(ns, "tune_for", None) is not None:  # the deprecated spelling of --device
                ns.device, note = tune_for(ns.tune_for, ns.device)
                notes.append(note)
            for note in notes:
                ui.warn(note)
            if not (ui.quiet or ui.json) and command in ("convert", "audit"):
                _ = ui.console  # bind rich to the real stderr before it is captured (explain never needs rich)
            with captured_stderr(not ns.debug) as captured, stdout_to_stderr():
                try:
                    code = COMMANDS[command](ns, ui)
                except KeyboardInterrupt as exc:
                    code = fail(EXIT_INTERRUPTED, "interrupted; nothing was written", exc)
                except CheckFailed as exc:
                    code = fail(EXIT_CHECK_FAILED, str(exc), exc, exc.payload)
                except Exception as exc:  # classify: bad input (2), failed check (1) or a bug (3)
                    code = fail(*_classify(exc), exc)
            noise = captured[0] if captured else ""
            if noise.strip() and not failure and code == EXIT_OK and not (ui.quiet or ui.json):
                count = len(noise.strip().splitlines())
                ui.warn(f"the model file and torch printed {count} line{'s' if count != 1 else ''} on stderr (hidden; --debug shows them)")
        except KeyboardInterrupt as exc:
            code = fail(EXIT_INTERRUPTED, "interrupted; nothing was written", exc)
        except CheckFailed as exc:
            code = fail(EXIT_CHECK_FAILED, str(exc), exc, exc.payload)
        except Exception as exc:
            code = fail(*_classify(exc), exc)
        finally:
            ui.close()
    ui.flush_err()
    ui.flush_out()
    for code_, message, error, payload in failure:
        if debug and error is not None:
            traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        print(error_line(message), file=sys.stderr, flush=True)
        if json_mode:
            print(json.dumps({"ok": False, "exit_code": code_, "error": one_line(message), **(payload or {})}, default=str), flush=True)
    return code


#: what torch's allocators and Python say when memory runs out
_OOM_TEXT = ("can't allocate memory", "out of memory", "DefaultCPUAllocator", "Cannot allocate memory",
             "failed to map segment from shared object")  # the last: a library cannot be loaded under a memory limit


def _out_of_memory(exc: Optional[BaseException]) -> Optional[BaseException]:
    """The out-of-memory error in ``exc``'s chain (a pass error wraps the allocator's), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        torch = sys.modules.get("torch")  # loaded by whatever ran out of memory (explain never imports it)
        if isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)) or (
                isinstance(exc, (RuntimeError, ImportError)) and any(text in str(exc) for text in _OOM_TEXT)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _failed_at(exc: BaseException) -> str:
    """``stage 'calibrate' at node 'linear'``: where a conversion failed, read from the fields of the errors in
    ``exc``'s chain (:class:`~converter.api.PassError`'s ``stage``, any error's ``node``); "" when none says."""
    stage, node = "", ""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        stage = stage or str(getattr(current, "stage", "") or "")
        node = node or str(getattr(current, "node", "") or "")
        current = current.__cause__ or current.__context__
    parts = ([f"stage {stage!r}"] if stage else []) + ([f"at node {node!r}"] if node else [])
    return " ".join(parts)


def _classify(exc: BaseException) -> tuple[int, str]:
    """Exit status and one-line message for an exception: every mpconvert error carries its own."""
    oom = _out_of_memory(exc)
    if oom is not None:  # the model or its inputs are too large for this machine: bad input, not our bug
        asked = re.search(r"tried to allocate (\d+) bytes", str(oom))
        size = f"an allocation of {int(asked.group(1)) / 2**30:,.1f} GiB failed" if asked else one_line(str(oom))[:160]
        where = _failed_at(exc)
        return EXIT_BAD_INPUT, (f"out of memory{' (' + where + ')' if where else ''}: {size or type(oom).__name__}; "
                                "the model or its inputs are too large for this machine: use smaller example inputs "
                                "(--batch, --seq-len for a checkpoint folder), --empty-weights, or --no-measure")
    if isinstance(exc, MpconvertError) and exc.exit_code == EXIT_CHECK_FAILED:
        return EXIT_CHECK_FAILED, f"{exc}; nothing was written"
    if isinstance(exc, MpconvertError) and exc.exit_code == EXIT_BAD_INPUT:
        return EXIT_BAD_INPUT, str(exc)
    return EXIT_INTERNAL, f"internal error: {type(exc).__name__}: {exc}; rerun with --debug and report it"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
