"""write_report and write_comparison: load the runs, draw the PNGs, write report.html."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import matplotlib

from . import compare as cmp
from . import plots, plots_cost, plots_links
from .facts import default_target
from .html import comparison_section, page, render_run
from ..driver.rundir import output_dir
from .load import Run, load_run
from .style import RC, Plot

REPORT_NAME = "report.html"
# Every PNG name the report may write: a re-run in the same folder deletes the ones it did not
# redraw this time, so a stale eval.png never sits next to a report that has no eval.
PNG_NAMES = ("loss.png", "eval.png", "sync.png", "bytes_matrix.png", "bytes_cumulative.png", "links_bandwidth.png",
             "links_rtt.png", "utilization.png", "consensus.png", "compare_loss.png", "compare_sync.png", "compare_eval.png")


def _resolve_out(out: str | Path | None, default_dir: Path) -> Path:
    """`out` is a folder (the CLI's --out) or, when it ends in .html, the page itself."""
    if out is None:
        return default_dir / REPORT_NAME
    out = Path(out)
    return out if out.suffix.lower() in (".html", ".htm") else out / REPORT_NAME


def compare_dir(run_dir: Path, others: Sequence[Path]) -> Path:
    """Where `geofed report RUN_DIR --compare OTHER ...` writes by default: RUN_DIR/compare-vs-<OTHER
    names joined by +> (a short hash of their paths instead when that name would be long)."""
    name = "compare-vs-" + "+".join(Path(o).name for o in others)
    if len(name) > 100:
        digest = hashlib.sha256("\0".join(str(Path(o).resolve()) for o in others).encode()).hexdigest()[:10]
        name = f"compare-vs-{len(others)}-runs-{digest}"
    return Path(run_dir) / name


def run_plots(run: Run, out_dir: Path) -> list[Plot]:
    """Draw every plot the run's data supports into `out_dir`; returns those drawn, in report order."""
    makers = [plots.plot_loss, plots.plot_eval, plots.plot_sync, plots.plot_bytes_matrix, plots.plot_bytes_cumulative,
              plots_cost.plot_egress_cumulative,
              lambda r, o: plots_links.plot_link(r, o, "bandwidth"), lambda r, o: plots_links.plot_link(r, o, "rtt"),
              plots_links.plot_utilization, plots_links.plot_consensus]
    return [p for p in (make(run, out_dir) for make in makers) if p is not None]


def _comparison(runs: Sequence[Run], labels: Sequence[str], out_dir: Path, target: float | None) -> tuple[str, list[Plot]]:
    target = default_target(list(runs)) if target is None else target
    rows = cmp.compare_rows(runs, labels, target)
    made = [cmp.plot_compare_loss(rows, out_dir, target), cmp.plot_compare_sync(rows, out_dir),
            cmp.plot_compare_eval(rows, out_dir)]
    made = [p for p in made if p is not None]
    return comparison_section(rows, made, target), made


def _write_page(path: Path, text: str, made: Sequence[Plot]) -> Path:
    keep = {p.file for p in made}
    for name in PNG_NAMES:
        if name not in keep:
            (path.parent / name).unlink(missing_ok=True)
    # Write-then-rename: a browser refreshing during `geofed run` never sees half a page.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".report-", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def write_report(run_dir: str | Path, *, compare: Sequence[str | Path] = (), out: str | Path | None = None) -> Path:
    """Write report.html and its PNGs for one run (default RUN_DIR/report/report.html); with
    `compare`, the other runs are overlaid on it, by default in a folder of its own (compare_dir). Raises RunDirError (a ConfigError) when a
    directory is not a run directory. Returns the path of report.html."""
    run = load_run(run_dir)
    others = [load_run(c) for c in compare]
    if out is None:
        # A comparison gets a folder of its own: the run's own report.html stays what it was. Inside
        # the run directory (anyone's) that folder must not be a planted link to elsewhere.
        name = compare_dir(run.path, [o.path for o in others]).name if others else "report"
        path = output_dir(run.path, name, mode=0o755) / REPORT_NAME
    else:
        path = _resolve_out(out, run.path / "report")
        path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context(RC):
        made = run_plots(run, path.parent)
        section = ""
        if others:
            everyone = [run, *others]
            section, extra = _comparison(everyone, cmp.unique_labels(everyone), path.parent, None)
            made += extra
    return _write_page(path, render_run(run, made, section), made)


def write_comparison(run_dirs: Sequence[Path], labels: Sequence[str], out: Path, *,
                     target_loss: float | None = None, title: str = "") -> Path:
    """A comparison-only report (the benches'): overlaid curves and a table of time-to-target,
    bytes-to-target and final loss. `out` is a folder or an .html path; returns the page's path.
    target_loss None: the highest of the runs' best mean train losses (one every run reached)."""
    if len(labels) != len(run_dirs):
        raise ValueError(f"write_comparison: {len(run_dirs)} run directories but {len(labels)} labels")
    if not run_dirs:
        raise ValueError("write_comparison: no run directories to compare")
    runs = [load_run(d) for d in run_dirs]
    path = _resolve_out(out, Path(out))
    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context(RC):
        section, made = _comparison(runs, list(labels), path.parent, target_loss)
    subtitle = ", ".join(str(r.path) for r in runs)
    return _write_page(path, page(title or f"geofed comparison of {len(runs)} runs", subtitle, section), made)
