"""Shared look of the report's figures: one palette, readable units, headless rendering.

Figures are made with ``matplotlib.figure.Figure`` and saved through the Agg canvas, never
through pyplot: pyplot keeps global state and picks a GUI backend when a display exists, and
`geofed run` calls the report from a process that may have one.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

# tab10 without its grey (kept for "other") and with black reserved for the mean.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
MEAN_COLOR = "#111111"
DPI = 110
RC = {
    "font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold", "axes.labelsize": 10,
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
    "legend.fontsize": 8.5, "legend.frameon": False, "figure.facecolor": "white",
}


@dataclass(frozen=True)
class Plot:
    """One PNG of the report: its file name (next to report.html), a title and a caption."""

    file: str
    title: str
    caption: str


def color(i: int) -> str:
    """The i-th colour of the report's palette (cycling)."""
    return PALETTE[i % len(PALETTE)]


def region_style(i: int, n_regions: int, region: str) -> dict:
    """Colour and legend label of region i; past the palette every region is the same grey with
    one legend entry, since 40 colours and a 40-line legend read as none."""
    if n_regions <= len(PALETTE):
        return {"color": color(i), "label": region}
    return {"color": "#9a9a9a", "label": f"each of {n_regions} regions" if i == 0 else None}


def new_figure(width: float, height: float) -> Figure:
    """A matplotlib Figure with its own Agg canvas (no pyplot: no global state, no display needed)."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, out_dir: Path, name: str) -> str:
    """Save `fig` as `name` in `out_dir` (white background); returns `name`. Written to a new file
    beside it and renamed over it: a link planted at `name` is replaced, never written through."""
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=Path(name).suffix.lstrip(".") or "png", dpi=DPI, facecolor="white")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_dir / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return name


def human_bytes(n: float) -> str:
    """Decimal units, like link bandwidths in Mbit/s, so the two compare at a glance."""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    """Seconds as s, min or h, whichever reads best, to 3 significant digits."""
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


def bytes_formatter() -> FuncFormatter:
    """A tick formatter writing bytes in decimal units (human_bytes)."""
    return FuncFormatter(lambda v, _pos: human_bytes(v) if v else "0")


def time_unit(max_seconds: float) -> tuple[float, str]:
    """(divisor, axis label) so that a 3-hour run is not labelled in thousands of seconds."""
    if max_seconds >= 3 * 3600:
        return 3600.0, "wall-clock time (h)"
    if max_seconds >= 300:
        return 60.0, "wall-clock time (min)"
    return 1.0, "wall-clock time (s)"


def maybe_log(ax, values: Iterable[float], *, ratio: float = 20.0) -> None:
    """Log scale when positive values span more than `ratio`: losses fall by orders of magnitude.
    Zeros (a train loss that underflowed) are left out of the decision and drawn at the bottom edge."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    pos = [v for v in vals if v > 0]
    if pos and min(vals) >= 0 and max(pos) / min(pos) > ratio:
        ax.set_yscale("log", nonpositive="clip")
        readable_log(ax.yaxis, span=max(pos) / min(pos))
        if len(pos) < len(vals):
            ax.set_ylim(bottom=min(pos) / 3)


def readable_log(axis, fmt=lambda v: f"{v:g}", *, span: float = 100.0) -> None:
    """Over up to three decades, ticks at 1-2-5 labelled 0.2, 0.5, 1 rather than 10^-1 alone (a
    loss axis spanning one decade otherwise gets a single label); wider, one tick per decade."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if span <= 1e3 else (1.0,), numticks=12))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(v)))
    axis.set_minor_formatter(NullFormatter())


def markers_for(n_points: int) -> dict:
    """Sparse series get markers so one point (a one-round run) is still visible."""
    return {"marker": "o", "markersize": 4} if n_points <= 30 else {}
