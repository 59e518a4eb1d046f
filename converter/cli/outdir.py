"""Checks on the output location, made before any work, and one-line messages for write failures.

The conversion can take minutes; finding out only at the end that ``--out`` cannot be written
wastes them. :func:`check_output_location` runs first: the path must be text without NUL bytes,
no part of it may be an existing file, and the nearest existing ancestor must accept a new
directory (probed by creating and removing one, which also catches read-only file systems and
root-owned locations that ``os.access`` misjudges). :func:`writing` turns an ``OSError`` raised
while the output is written (a full disk, a location that became read-only) into an
:class:`OutputLocationError` with one line naming the cause and the fix.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import uuid
from pathlib import Path
from typing import Iterator, Union

from converter.ir.errors import MpconvertError

__all__ = ["OutputLocationError", "check_output_location", "check_text", "writing"]


class OutputLocationError(MpconvertError, ValueError):
    """The output location cannot be used (exit 2); the message is one line."""


_FIXES = {
    errno.ENOSPC: "the disk is full; free some space or choose another --out",
    errno.EFBIG: "a file-size limit (ulimit -f) or the file system's largest file was reached; raise the limit or choose another --out",
    errno.EDQUOT: "the disk quota is exceeded; free some space or choose another --out",
    errno.EROFS: "the file system is read-only; choose another --out",
    errno.EACCES: "permission denied; choose a writable --out",
    errno.EPERM: "the operation is not permitted there; choose a writable --out",
    errno.ENAMETOOLONG: "the name is too long; choose a shorter --out",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another --out",
}


def check_text(value: str, what: str) -> None:
    """Refuse text that no file system accepts (NUL bytes) or that is not valid Unicode."""
    if "\x00" in value:
        raise OutputLocationError(f"{what} contains a NUL byte; remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise OutputLocationError(f"{what} {value!r} is not valid text (undecodable bytes); rename it") from None


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and not probe.is_symlink():
        if probe.parent == probe:
            break
        probe = probe.parent
    return probe


def check_output_location(out: Union[str, Path], *, force: bool) -> None:
    """Raise :class:`OutputLocationError` unless a directory can be published at ``out``.

    An existing ``out`` is left to the caller's existing-directory check (``force``); this checks
    what lies above it.
    """
    out = Path(os.path.abspath(out))
    check_text(str(out), "--out")
    if out.exists() and not out.is_dir():
        raise OutputLocationError(f"--out {out} is an existing file, not a directory; choose another --out")
    parent = out.parent
    anchor = _nearest_existing(parent)
    if not anchor.is_dir():
        raise OutputLocationError(f"--out {out} lies under {anchor}, which is a file, not a directory; choose another --out")
    probe = anchor / f".{out.name[:64]}.probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError as exc:
        raise OutputLocationError(f"cannot write the output under {anchor} ({_reason(exc)})") from None
    with contextlib.suppress(OSError):
        probe.rmdir()


def _reason(exc: OSError) -> str:
    fix = _FIXES.get(exc.errno or -1)
    text = exc.strerror or str(exc) or type(exc).__name__
    return f"{text}: {fix}" if fix else f"{text}; check the path and permissions or choose another --out"


@contextlib.contextmanager
def writing(out: Union[str, Path]) -> Iterator[None]:
    """Turn an ``OSError`` raised while writing ``out`` into one :class:`OutputLocationError` line."""
    try:
        yield
    except OSError as exc:
        name = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        raise OutputLocationError(f"writing {out} failed{name}: {_reason(exc)}; nothing was written") from exc
    except Exception as exc:
        # the safetensors writer reports the system's error as text: "I/O error: No space left on device (os error 28)"
        found = re.search(r"\(os error (\d+)\)", str(exc)) if type(exc).__name__ == "SafetensorError" else None
        if found is None:
            raise
        code = int(found.group(1))
        raise OutputLocationError(f"writing {out} failed: {_reason(OSError(code, os.strerror(code)))}; nothing was written") from exc
