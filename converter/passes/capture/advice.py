"""Capture's errors and the plain advice it gives: :class:`CaptureError`, what to do about a branch on
tensor values (:func:`control_flow_advice`) or a returned key/value cache (:func:`cache_advice`), and
where in the user's code a node or a failure comes from (:func:`user_location`, :func:`user_frame`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch

from converter.ir.errors import MpconvertError

__all__ = ["CaptureError", "short_reason", "SKIP_FRAMES", "user_location", "control_flow_advice", "user_frame",
           "cache_advice", "failure_location", "break_reason"]


class CaptureError(MpconvertError, RuntimeError):
    """Neither tracer could capture the model; ``reasons`` maps tracer name to a one-line reason."""

    def __init__(self, reasons: dict[str, str], *, advice: Optional[str] = None, location: str = "",
                 reason: str = ""):
        self.reasons = dict(reasons)
        #: plain words on what to change in the model (data-dependent control flow), or None
        self.advice = advice
        #: the user's ``file:line`` that broke capture ("" when no frame of the user's was found)
        self.location = location
        #: the cause in one phrase ("data-dependent control flow", ...), what a graph break reports
        self.reason = reason or next(iter(self.reasons.values()), "")
        if advice is not None:
            super().__init__(f"could not capture the model (tracer {' and '.join(reasons)}): {advice}")
            return
        detail = "; ".join(f"{name}: {why}" for name, why in reasons.items())
        hint = "try --tracer export" if "export" not in reasons else "make the model traceable by torch.export (see its error)"
        super().__init__(f"could not capture the model ({detail}); {hint}")


def short_reason(exc: BaseException) -> str:
    """The first line of ``exc`` with its type, at most 200 characters: a tracer's one-line failure."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200]


#: where frames of torch and of this package live: a user's location is the first frame outside them
SKIP_FRAMES = (f"{torch.__path__[0]}", str(Path(__file__).resolve().parents[2]))


def user_location(frame) -> str:
    """``file:line`` of the first frame from ``frame`` outwards outside torch and this package ("" if none)."""
    while frame is not None and frame.f_code.co_filename.startswith(SKIP_FRAMES):
        frame = frame.f_back
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}" if frame is not None else ""


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n(?: {3,}(\S[^\n]*))?')
_BRANCH = re.compile(r"^\s*(if|elif|while|assert)\b|\bif\b.*\belse\b")


def control_flow_advice(exc: BaseException) -> Optional[str]:
    """Plain advice for Python code that needs a tensor's value (None for any other failure)."""
    text = str(exc)
    data_dependent = (
        "GuardOnDataDependent" in type(exc).__name__
        or "data-dependent" in text
        or "data dependent" in text
        or "cannot be used as inputs to control flow" in text
    )
    if not data_dependent:
        return None
    location, code = failure_location(exc)
    where = f" at {location}" if location else ""
    shown = f" (`{code.strip()}`)" if code.strip() else ""
    if not code.strip() or _BRANCH.search(code):
        return (
            f"data-dependent control flow{where}{shown}: forward branches on the values inside a tensor, which a "
            "captured graph cannot record. Write the branch with torch.cond(pred, true_fn, false_fn, operands), move "
            "it out of forward (decide before calling the model), or split the model at that point and convert each part"
        )
    return (
        f"forward reads a tensor's value in Python{where}{shown} (float(), int(), .item(), .tolist()), which a "
        "captured graph cannot record. Keep it a tensor operation, move it out of forward (compute it before or "
        "after calling the model), or split the model at that point and convert each part; a branch on it needs torch.cond"
    )


def failure_location(exc: BaseException) -> tuple[str, str]:
    """(``file:line``, the code on that line) of the user's frame where a tracer failed, or ("", "").

    torch.export prints the user's stack into its message (the last ``File ..., line N`` is the
    innermost); otherwise the traceback's innermost frame outside torch and this package. An mpconvert error
    that carries a ``location`` field (:class:`CaptureError`, ``RandomAtTraceTime``) gives it; its message is
    never read."""
    own = getattr(exc, "location", None) if isinstance(exc, MpconvertError) else None
    if isinstance(own, str) and own:
        return own, ""
    found = _USER_FRAME.findall(str(exc))
    found = [f for f in found if not f[0].startswith(SKIP_FRAMES) and "/transformers/" not in f[0]] or found
    if found:
        path, line, _, code = found[-1]
        return f"{path.rsplit('/', 1)[-1]}:{line}", code or ""
    frame = user_frame(exc.__traceback__)
    if frame is not None:
        return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}", frame.line or ""
    return "", ""


def break_reason(exc: BaseException) -> str:
    """Why a tracer failed, in one phrase (a graph break's ``reason``)."""
    advice = control_flow_advice(exc)
    if advice is not None:
        return advice.split(" at ", 1)[0].split(":", 1)[0].split(" (", 1)[0]
    text = short_reason(exc)
    if "numpy" in text.lower():
        return f"numpy in forward ({text[:120]})"
    return text[:160]


def user_frame(tb) -> Optional[Any]:
    """The innermost traceback frame outside torch, transformers and this package."""
    import traceback

    skip = SKIP_FRAMES + ("<",)
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(skip) and "/transformers/" not in f.filename]
    return frames[-1] if frames else None


def cache_advice(errors: dict, asked: str = "") -> Optional[str]:
    """Plain advice when a tracer failed because forward returned a cache object; ``asked``: what in the
    example asks for the cache (:func:`~converter.passes.capture.cache.cache_request`), or ""."""
    if not any("Cache" in why and "in output" in why for why in errors.values()):
        return None
    if asked:
        return (f"forward returns a key/value cache object (the example passes {asked}), which a graph cannot return: "
                "leave use_cache and the cache out of the example (training does not use them; mpconvert then "
                "captures with use_cache=False)")
    return ("forward returns a key/value cache object although the example asks for none (config.use_cache is true "
            "in a config mpconvert could not switch off), which a graph cannot return: pass use_cache=False in the "
            "example, or set use_cache=False on the config the model reads")
