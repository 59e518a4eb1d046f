"""Deaths no Python code sees: a watcher removes the temporary output and says what happened.

:func:`~converter.export.artifacts.publish_directory` removes its temporary folder on any Python
exception, but some failures never reach Python: under a memory limit OpenBLAS calls ``exit(1)``
("Memory allocation still failed"), glibc ``_exit(127)`` ("cannot allocate memory for thread-local
data") when a library starts a thread, and SIGKILL ends anything. And the CLI captures stderr while
it works (the one-line contract), so such a library's own message would be lost with the process.

:func:`guarded` starts a tiny watcher process (plain Python, no torch: a few MiB) holding the read end
of a pipe. When the block ends the writer says ``done`` and the watcher exits. When the writer dies
inside the block (the pipe closes unsaid), the watcher removes the temporary folder (if one was
given) and writes one line on the real stderr: that the run died, the last line the libraries
printed (``OpenBLAS error: Memory allocation still failed ...``), and that nothing was written.
The CLI's stderr capture runs its whole command under :func:`reporting`, so a death anywhere is
said; inside it the publication's watcher only removes the folder (one message, not two). Where no
watcher can be started (the memory limit itself), the folder is still removed by the next run to
the same output (its PID no longer runs).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["guarded", "reporting"]

#: (real stderr fd, capture fd) of the CLI's stderr capture, innermost last
_CAPTURES: list[tuple[int, int]] = []

_WATCHER = r"""
import os, shutil, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the writer, which cleans up itself
signal.signal(signal.SIGTERM, signal.SIG_IGN)
said = sys.stdin.buffer.read()
if b"done" not in said:
    tmp, out, real, capture, speak = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    removed = False
    if tmp and os.path.isdir(tmp) and not os.path.islink(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        removed = True
    if speak:
        last = ""
        if capture >= 0:
            try:
                size = os.fstat(capture).st_size
                data = os.pread(capture, 65536, max(0, size - 65536)).decode("utf-8", "replace")
                lines = [" ".join(x.split()) for x in data.splitlines() if x.strip()]
                last = lines[-1][:300] if lines else ""
            except OSError:
                pass
        where = f" while writing {out}" if out else ""
        why = f": {last}" if last else " (out of memory, or killed)"
        folder = "its temporary output was removed and " if removed else ""
        line = (f"mpconvert: error: the run died{where}{why}; {folder}nothing was written; "
                "give it more memory (or find what killed it) and rerun\n")
        try:
            os.write(real if real >= 0 else 2, line.encode("utf-8", "replace"))
        except OSError:
            pass
"""


def _start(tmp: Optional[Path], out: Optional[Path], *, speak: bool) -> Optional[subprocess.Popen]:
    real, capture = _CAPTURES[-1] if _CAPTURES else (-1, -1)
    argv = [sys.executable, "-S", "-E", "-c", _WATCHER, os.fspath(tmp) if tmp else "", os.fspath(out) if out else "",
            str(real), str(capture), "1" if speak else "0"]
    try:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                pass_fds=tuple(fd for fd in (real, capture) if fd >= 0))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _stop(watcher: Optional[subprocess.Popen]) -> None:
    if watcher is None:
        return
    stdin = watcher.stdin
    assert stdin is not None  # (started with stdin=PIPE)
    with contextlib.suppress(OSError, ValueError):
        stdin.write(b"done")
    with contextlib.suppress(OSError, ValueError):
        stdin.close()
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        watcher.wait(timeout=30)


@contextlib.contextmanager
def guarded(tmp: Path, out: Path) -> Iterator[None]:
    """Run the block with a watcher that removes ``tmp`` should this process die inside it (and says
    so, unless the CLI's :func:`reporting` watcher already will)."""
    watcher = _start(tmp, out, speak=not _CAPTURES)
    try:
        yield
    finally:
        _stop(watcher)


@contextlib.contextmanager
def reporting(real_fd: int, capture_fd: int) -> Iterator[None]:
    """While stderr goes to ``capture_fd``: a death inside the block is said on ``real_fd``, with the
    last line captured."""
    _CAPTURES.append((real_fd, capture_fd))
    watcher = _start(None, None, speak=True)
    try:
        yield
    finally:
        _stop(watcher)
        _CAPTURES.pop()
