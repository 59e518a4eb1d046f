"""Errors of the export stage (each one is bad input or a failed check, never an internal error)."""
from __future__ import annotations

from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError

__all__ = ["EmitError", "OutputExistsError", "VerificationError"]


class EmitError(MpconvertError, ValueError):
    """The artifacts cannot be written; the message names the cause and a fix."""


class OutputExistsError(EmitError):
    """The output directory exists (or appeared while converting) and ``force`` was not given."""


class VerificationError(EmitError):
    """The emitted model.py does not reproduce ``conv.module``."""

    exit_code = EXIT_CHECK_FAILED
