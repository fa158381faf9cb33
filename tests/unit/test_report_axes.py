"""Issue 37, Why 8 (report plots, matplotlib Agg): the compare page's "loss vs bytes" x-axis
labels overlapped, the egress y-axis did not start at 0 (it started at the set-up probes' cost,
so the rounds' dollars looked like most of the run's bill), and the per-region cumulative-bytes
lines hid each other (regions of a full topology send the same bytes: one line on top of the
others, same style).

Before the fix: the figure builders did not exist (ImportError), and in the figures the plot
functions drew, the bytes axis carried 9 labels over two decades whose boxes overlapped, the
egress axis's bottom was the probes' cost (> 0), and every region's line was solid with the same
marker.
"""

from __future__ import annotations

import json

from geofed.orchestrator.report.compare import compare_loss_figure, compare_rows
from geofed.orchestrator.report.load import load_run
from geofed.orchestrator.report.plots import bytes_cumulative_figure
from geofed.orchestrator.report.plots_cost import egress_cumulative_figure
from test_report_egress import _priced
from test_report_fakerun import REGIONS, fake_run_dir


def _tiny_run(path, losses, bytes_per_round):
    path.mkdir()
    recs = [{"round": i, "t_start": float(i), "t_end": i + 1.0, "H": 10, "mean_train_loss": v,
             "bytes_sent": bytes_per_round} for i, v in enumerate(losses)]
    (path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return load_run(path)


def _visible_labels(ax, fig):
    """The x tick labels drawn inside the axis's limits, with their boxes on the canvas."""
    renderer = fig.canvas.get_renderer()
    lo, hi = sorted(ax.get_xlim())
    out = []
    for tick in ax.xaxis.get_major_ticks():
        label = tick.label1
        if label.get_visible() and label.get_text() and lo <= tick.get_loc() <= hi:
            out.append((label.get_text(), label.get_window_extent(renderer)))
    return out


def _assert_readable(ax, fig):
    labels = _visible_labels(ax, fig)
    assert 2 <= len(labels) <= 6, [t for t, _ in labels]
    boxes = sorted((b for _, b in labels), key=lambda b: b.x0)
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 < b.x0, f"tick labels overlap: {[t for t, _ in labels]}"


def test_compare_loss_vs_bytes_has_few_labels_that_do_not_overlap(tmp_path):
    # Two decades of bytes (log axis: 1-2-5 ticks gave 9 labels) and, apart, one linear span.
    wide = [_tiny_run(tmp_path / "a", [2.0, 1.5, 1.0, 0.8, 0.6, 0.5, 0.45, 0.4], 400_000),
            _tiny_run(tmp_path / "b", [2.0, 1.2, 0.9, 0.7, 0.5, 0.45, 0.4, 0.35], 40_000_000)]
    narrow = [_tiny_run(tmp_path / "c", [2.0, 1.0, 0.5] * 4, 3_456_789),
              _tiny_run(tmp_path / "d", [2.0, 1.1, 0.6] * 4, 2_345_678)]
    for runs in (wide, narrow):
        rows = compare_rows(runs, ["a run with a long label", "another run"], None)
        fig = compare_loss_figure(rows, None)
        fig.canvas.draw()
        _assert_readable(fig.axes[1], fig)


def test_egress_axis_starts_at_zero(tmp_path):
    run_dir = fake_run_dir(tmp_path / "run", policy="fixed")
    _priced(run_dir, probes_usd=0.5)  # probes dominate: the axis's bottom was near 0.5
    fig = egress_cumulative_figure(load_run(run_dir))
    fig.canvas.draw()
    assert fig.axes[0].get_ylim()[0] == 0.0


def test_per_region_cumulative_bytes_lines_differ_in_style_and_marker(tmp_path):
    run_dir = fake_run_dir(tmp_path / "run", regions=REGIONS[:3], rounds=8, policy="fixed")
    fig = bytes_cumulative_figure(load_run(run_dir))
    lines = [ln for ln in fig.axes[0].get_lines() if str(ln.get_label()).startswith("sent by ")]
    assert len(lines) == 3
    assert len({ln.get_linestyle() for ln in lines}) == 3
    assert len({ln.get_marker() for ln in lines}) == 3
