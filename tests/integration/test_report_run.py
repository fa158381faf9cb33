"""A report built from a real (small) `geofed run`: `geofed run` writes it by default, every plot
is a PNG with something on it, the page references only files that exist, Chromium renders it."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from geofed.orchestrator.cli import main
from geofed.orchestrator.report import write_report
from support.report_check import html_refs, report_problems
from test_report_html import assert_plots_rendered, fake_run_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """Two rounds of the default config on two regions, evaluated every round; `geofed run`
    writes its report at the end (the default) and prints where."""
    out = tmp_path_factory.mktemp("report-run") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["run", str(REPO / "configs" / "local-wan.yaml"), "--set", "run.rounds=2", "--set", "run.eval_every=1",
                   "--set", "regions.names=[us-east-1,eu-west-1]", "--out", str(out), "--quiet"])
    assert rc == 0, f"geofed run exited {rc}:\n{printed.getvalue()[-3000:]}"
    return out, printed.getvalue()


def test_geofed_run_writes_the_report_and_prints_its_path(real_run):
    run_dir, printed = real_run
    html = run_dir / "report" / "report.html"
    assert f"report: {html}" in printed
    assert report_problems(html) == []


def test_report_of_a_real_run_is_whole(real_run):
    run_dir, _ = real_run
    html = write_report(run_dir)
    assert html == run_dir / "report" / "report.html"
    assert report_problems(html) == []
    pngs = {r for r in html_refs(html.read_text()) if r.endswith(".png") and not r.startswith("#")}
    # What a 2-region, 2-round DiLoCo run with eval and WAN emulation must show at least.
    assert {"loss.png", "eval.png", "sync.png", "bytes_matrix.png", "bytes_cumulative.png", "utilization.png"} <= pngs
    for name in pngs:
        assert (html.parent / name).stat().st_size > 5000, name
    text = html.read_text()
    assert "us-east-1 → eu-west-1" in text and "eu-west-1 → us-east-1" in text
    assert "mlp-digits" in text and "diloco" in text


def test_cli_report_of_a_real_run_renders_in_chromium(real_run, tmp_path, capsys):
    run_dir, _ = real_run
    assert main(["report", str(run_dir), "--out", str(tmp_path / "rep")]) == 0
    html = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert html == tmp_path / "rep" / "report.html" and html.is_file()
    assert_plots_rendered(html, tmp_path)


def test_the_default_runs_report_sets_every_link_against_its_configured_rate(real_run):
    # The default config (adaptive policy, overlap, set-up probes) measures every link, so the
    # report's link table has a measured and a configured bandwidth on each row.
    run_dir, _ = real_run
    text = (run_dir / "report" / "report.html").read_text()
    assert "no bandwidth estimates in this run" not in text
    assert "measured Mbit/s" in text and "configured Mbit/s" in text


def test_a_compare_page_of_real_runs_renders_in_chromium(real_run, tmp_path, capsys):
    run_dir, _ = real_run
    other = fake_run_dir(tmp_path / "other", rounds=5)
    before = (run_dir / "report" / "report.html").read_bytes()
    assert main(["report", str(run_dir), "--compare", str(other)]) == 0
    html = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert html.parent != run_dir / "report" and html.is_file()
    assert (run_dir / "report" / "report.html").read_bytes() == before  # the run's own report is left alone
    assert report_problems(html) == []
    assert_plots_rendered(html, tmp_path)
