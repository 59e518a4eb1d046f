"""The common base of every exception mpconvert raises, and what each means for the CLI's exit status.

Each class keeps its historical bases (``ValueError``, ``RuntimeError``) for callers that catch
those, and adds :class:`MpconvertError`, whose ``exit_code`` the CLI returns: 2 for bad input
(the default), 1 for a requested check that failed, 3 for a failure inside mpconvert itself.
"""
from __future__ import annotations

from typing import ClassVar

__all__ = ["MpconvertError", "EXIT_CHECK_FAILED", "EXIT_BAD_INPUT", "EXIT_INTERNAL"]

EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class MpconvertError(Exception):
    """Base of every mpconvert exception; ``exit_code`` is the CLI's exit status for it."""

    exit_code: ClassVar[int] = EXIT_BAD_INPUT
