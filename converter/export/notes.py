"""What :func:`converter.export.artifacts.emit` says, tagged where it is said: a passed check or a warning.

The CLI prints warnings as ``mpconvert: warning: ...`` and passed checks as results; it reads
:attr:`EmitNote.kind`, never the wording. An :class:`EmitNote` is a ``str`` (its text), so the
``messages`` list that ``emit``/``emit_reports`` fill stays a list of strings for callers that print
it or search it, and JSON writes it as its text.
"""
from __future__ import annotations

from typing import Literal

__all__ = ["EmitNote", "EmitNoteKind", "check", "warning"]

EmitNoteKind = Literal["check", "warning"]


class EmitNote(str):
    """One line of ``emit``'s messages with its :attr:`kind` (``check``: a check that passed;
    ``warning``: something the user should read)."""

    kind: EmitNoteKind

    def __new__(cls, text: str, kind: EmitNoteKind) -> "EmitNote":
        if kind not in ("check", "warning"):
            raise ValueError(f"EmitNote kind {kind!r} is not 'check' or 'warning'")
        note = super().__new__(cls, text)
        note.kind = kind
        return note

    def __reduce__(self):  # pickle/copy keep the kind
        return (EmitNote, (str(self), self.kind))


def check(text: str) -> EmitNote:
    """A check that passed (model.py reproduces the module, the weight files hold every tensor)."""
    return EmitNote(text, "check")


def warning(text: str) -> EmitNote:
    """Something the user should read (printed as ``mpconvert: warning: ...``)."""
    return EmitNote(text, "warning")
