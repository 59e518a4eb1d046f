"""The report's matplotlib plots, rendered to inline SVG for report.html (no file, no network, stable ids)."""
from __future__ import annotations

import io
import re
from typing import Any

from converter.report.common import COLORS, ORDER, ReportView, fmt_flops, module_bytes, precision_class

__all__ = ["plots_html"]

_RC: dict[Any, Any] = {"svg.fonttype": "none", "svg.hashsalt": "mpconvert", "text.parse_math": False, "font.size": 9,
       "font.family": ["DejaVu Sans", "sans-serif"], "axes.spines.top": False, "axes.spines.right": False,
       "axes.edgecolor": "#9aa3ad", "axes.labelcolor": "#39424d", "xtick.color": "#5f6b78", "ytick.color": "#39424d"}


def plots_html(report: ReportView) -> str:
    """Two plots side by side: the share of FLOPs/nodes/bytes by precision, and output bytes per module."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - matplotlib is a dependency of the HTML report
        return "<p class=note>matplotlib is not installed: no plots.</p>"
    with matplotlib.rc_context(_RC):
        out = [_svg_figure(_share_figure(report), "pa-"), _svg_figure(_module_bytes_figure(report), "pb-")]
    return '<div class="plots">' + "".join(f"<div>{svg}</div>" for svg in out) + "</div>"


def _share_figure(report: ReportView):
    """Horizontal stacked bars: the share of FLOPs, compute nodes and output bytes in each precision."""
    import matplotlib.ticker
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    metrics = {"FLOPs": "flops", "compute nodes": None, "output bytes": "out_bytes"}
    fig = Figure(figsize=(6.4, 2.5), dpi=100)
    ax = fig.add_subplot()
    for y, key in enumerate(metrics.values()):
        totals = {p: 0.0 for p in ORDER}
        for r in report.nodes:
            totals[precision_class(r["precision"])] += 1 if key is None else r[key]
        total = sum(totals.values()) or 1.0
        left = 0.0
        for p in ORDER:
            share = totals[p] / total
            if share <= 0:
                continue
            ax.barh(y, share, left=left, color=COLORS[p], height=0.62)
            if share >= 0.07:
                ax.text(left + share / 2, y, f"{100 * share:.0f}%", ha="center", va="center", color="white", fontsize=8.5, fontweight="bold")
            left += share
    ax.set_yticks(range(len(metrics)), list(metrics))
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_title(f"Share by precision ({fmt_flops(report.summary['flops'])} total)", fontsize=10, loc="left")
    present = [p for p in ORDER if any(precision_class(r["precision"]) == p for r in report.nodes)]
    if present:
        ax.legend([Patch(color=COLORS[p]) for p in present], present, ncol=len(present), frameon=False,
                  loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, handlelength=1.0)
    fig.tight_layout()
    return fig


def _module_bytes_figure(report: ReportView):
    """Output bytes per module group (the 18 largest), stacked by precision."""
    from matplotlib.figure import Figure

    groups = module_bytes(report)[:18]
    fig = Figure(figsize=(6.4, max(2.4, 0.32 * len(groups) + 1.0)), dpi=100)
    ax = fig.add_subplot()
    names = [g if len(g) <= 34 else "…" + g[-33:] for g, _ in groups]
    scale, unit = _byte_unit(max((sum(v.values()) for _, v in groups), default=1))
    for i, (_, values) in enumerate(groups):
        left = 0.0
        for p in ORDER:
            v = values[p] / scale
            if v > 0:
                ax.barh(i, v, left=left, color=COLORS[p], height=0.66, label=p if p not in ax.get_legend_handles_labels()[1] else None)
                left += v
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"output bytes per forward ({unit})")
    ax.set_title("Activation bytes per module", fontsize=10, loc="left")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, ncol=len(labels), frameon=False, fontsize=8, handlelength=1.0,
                  loc="lower right", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def _svg_figure(fig, prefix: str) -> str:
    """A matplotlib figure as inline SVG: no XML prolog, no metadata, no namespace URLs, unique ids."""
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    buf = io.StringIO()
    FigureCanvasSVG(fig).print_svg(buf, metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    svg = re.sub(r'\s+version="1\.1"', "", svg)
    ids = re.findall(r'\bid="([^"]+)"', svg)
    for ident in sorted(set(ids), key=len, reverse=True):
        svg = svg.replace(f'id="{ident}"', f'id="{prefix}{ident}"').replace(f"#{ident})", f"#{prefix}{ident})") \
                 .replace(f'"#{ident}"', f'"#{prefix}{ident}"')
    return re.sub(r'<svg([^>]*?)\swidth="[^"]*"\s+height="[^"]*"', r"<svg\1", svg, count=1)


def _byte_unit(n: float) -> tuple[float, str]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return float(size), unit
    return 1.0, "B"
