"""The report's egress dollars: cumulative cost over time and the links table's $/GB and totals."""

from __future__ import annotations

import json

import pytest

from geofed.orchestrator.report import write_report
from geofed.orchestrator.report.load import load_run
from geofed.orchestrator.report.plots_cost import GB, cost_points

from test_report_fakerun import fake_run_dir


def _priced(run_dir, usd_per_gb=0.02, probes_usd=0.001):
    s = json.loads((run_dir / "summary.json").read_text())
    total = 0.0
    for v in s["links"].values():
        v["usd_per_gb"], v["egress_usd"] = usd_per_gb, v["bytes"] / GB * usd_per_gb
        total += v["egress_usd"]
    s["egress_usd"], s["egress"] = total + probes_usd, {"provider": "aws"}
    (run_dir / "summary.json").write_text(json.dumps(s))
    return total


def test_cumulative_cost_starts_at_the_probes_and_ends_at_the_total(tmp_path):
    run_dir = fake_run_dir(tmp_path / "run", policy="fixed")
    updates = _priced(run_dir)
    pts = cost_points(load_run(run_dir))
    assert pts[0][1] == pytest.approx(0.001) and pts[-1][1] == pytest.approx(updates + 0.001)
    assert all(b[1] >= a[1] and b[0] >= a[0] for a, b in zip(pts, pts[1:]))


def test_report_shows_egress_per_link_and_the_cost_plot(tmp_path):
    run_dir = fake_run_dir(tmp_path / "run", policy="fixed")
    _priced(run_dir)
    html = write_report(run_dir).read_text()
    assert "egress_cumulative.png" in html and "egress $" in html and "$/GB" in html and "egress cost" in html
    assert (run_dir / "report" / "egress_cumulative.png").stat().st_size > 1000


def test_an_unpriced_run_has_no_cost_plot(tmp_path):
    run_dir = fake_run_dir(tmp_path / "run", policy="fixed")
    assert cost_points(load_run(run_dir)) == []
    assert "egress_cumulative.png" not in write_report(run_dir).read_text()
