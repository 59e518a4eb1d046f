"""Decision notes: the stages that add them and how each is labelled when shown.

Torch-free on purpose: ``mpconvert explain OUT_DIR NODE`` formats the notes stored in report.json
without importing torch. :mod:`converter.ir.meta` re-exports these names.
"""
from __future__ import annotations

from typing import Literal

__all__ = ["NoteStage", "NOTE_LABELS", "note_text"]

#: the stage that added a note to a decision (``Decision.notes``)
NoteStage = Literal["lower", "place"]
#: how a note is labelled when shown (``explain``, the report's reason column)
NOTE_LABELS: dict[str, str] = {"lower": "lowered", "place": "placement"}


def note_text(stage: str, text: str) -> str:
    """One note as shown: ``placement: min-cut chose bf16``."""
    return f"{NOTE_LABELS.get(stage, stage)}: {text}"
