"""Every rendering of the audit in one place, and :func:`write_reports`, which writes the three report files.

Each rendering lives in its own module; this one gathers their entry points:

* :func:`~converter.report.markdown.to_markdown` — report.md (:mod:`converter.report.markdown`);
* :func:`~converter.report.html.to_html` — report.html, one self-contained page (:mod:`converter.report.html`);
* :func:`~converter.report.terminal.print_report` — rich tables (:mod:`converter.report.terminal`);
* :func:`~converter.report.explain.explain` — the decision chain of one node (:mod:`converter.report.explain`);
* :func:`write_reports` — report.json, report.md and report.html into a directory.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

from converter.report.common import COLORS, ReportView
from converter.report.explain import explain
from converter.report.html import to_html
from converter.report.markdown import md_escape, to_markdown
from converter.report.terminal import print_report

__all__ = ["to_markdown", "to_html", "print_report", "write_reports", "explain", "md_escape", "COLORS"]


def write_reports(report: ReportView, out_dir: Union[str, Path]) -> list[Path]:
    """Write report.json, report.md and report.html into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md", out / "report.html"]
    paths[0].write_text(report.to_json() + "\n", encoding="utf-8")
    # backslashreplace: a path that is not valid UTF-8 (a lone surrogate in Python) is shown escaped
    paths[1].write_text(to_markdown(report), encoding="utf-8", errors="backslashreplace")
    paths[2].write_text(to_html(report), encoding="utf-8", errors="backslashreplace")
    return paths
