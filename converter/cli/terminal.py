"""Where ``mpconvert`` writes: results on stdout, progress and tables on stderr through rich, errors as one line.

:class:`Terminal` queues both streams while a command runs; :func:`captured_stderr` and
:func:`stdout_to_stderr` keep whatever the user's model file, torch or the tracers print away from them.
Imports no torch and no rich until a console is needed.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from typing import Any

__all__ = ["Terminal", "one_line", "error_line", "print_table", "captured_stderr", "stdout_to_stderr", "sigterm_as_interrupt"]


def one_line(text: Any) -> str:
    """Collapse every kind of line break and run of whitespace: error messages are one line."""
    return " ".join(str(text).split())


def error_line(message: str) -> str:
    """``mpconvert: error: MESSAGE`` on one line, its control bytes escaped (converter/ir/text.py)."""
    from converter.ir.text import printable

    return f"mpconvert: error: {printable(one_line(message))}"


class Terminal:
    """Where text goes: results on stdout, status/tables on stderr via rich, errors as one line.

    While a command runs (and without ``--debug``), whatever the model file, torch or the tracers
    print on stderr is captured (see :func:`captured_stderr`), so that an error is one line. Our
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
        from converter.ir.text import printable

        for line in self.lines:  # names are data: an ESC in a module name is shown, not obeyed
            print(printable(line), file=sys.stderr, flush=True)
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
        from converter.ir.text import printable

        for text in self.results:
            print(printable(text), file=sys.stdout, flush=True)
        self.results.clear()

    def warn(self, text: str) -> None:
        if not self.quiet and not self.json:
            self.err(f"mpconvert: warning: {one_line(text)}")

    def emit_json(self, payload: dict) -> None:
        if self.json:
            self.results.append(json.dumps(payload, indent=2, default=str))


def print_table(report: Any, ui: Terminal) -> None:
    """The report's tables on the terminal (rich; imported only when printing)."""
    from converter.report.render import print_report

    print_report(report, ui.console)


@contextlib.contextmanager
def sigterm_as_interrupt(enabled: bool):
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
def captured_stderr(enabled: bool):
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
        if saved_fd is not None and tmp is not None:  # a death Python never sees is still said (export/watchdog.py)
            from converter.export.watchdog import reporting

            with reporting(saved_fd, tmp.fileno()):
                yield captured
        else:
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
def stdout_to_stderr():
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
