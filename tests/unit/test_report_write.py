"""report.html and its PNGs for whole runs and for the runs with pieces missing."""

from __future__ import annotations

import json

import pytest
from geofed.orchestrator.report import write_report
from support.report_check import html_refs, report_problems
from test_report_fakerun import REGIONS, fake_run_dir

ALL_RUN_PLOTS = {"loss.png", "eval.png", "sync.png", "bytes_matrix.png", "bytes_cumulative.png",
                 "links_bandwidth.png", "links_rtt.png", "utilization.png"}


def _pngs(html_path):
    return {r for r in html_refs(html_path.read_text()) if r.endswith(".png") and not r.startswith("#")}


def test_full_run_report_has_every_plot_and_is_whole(tmp_path):
    run = fake_run_dir(tmp_path / "run", rounds=6)
    html = write_report(run)
    assert html == run / "report" / "report.html"
    assert _pngs(html) == ALL_RUN_PLOTS
    assert report_problems(html) == []
    text = html.read_text()
    # the summary table on top: config highlights, counts, faults and refusals
    for needle in ("mlp-digits", "diloco", "bandwidth", "proxy", "refused: round_window", "peers left out", "fake-20261129T200000Z"):
        assert needle in text, needle
    # the policy's decision shows up where H changed (round 3 of 6), with its reason
    assert "bandwidth: round 3" in text and "bandwidth: round 2" not in text
    assert "http://" not in text and "https://" not in text


@pytest.mark.parametrize("kwargs, present, absent", [
    ({"regions": REGIONS[:1]}, {"loss.png", "sync.png", "utilization.png"},
     {"bytes_matrix.png", "links_bandwidth.png", "links_rtt.png"}),
    ({"rounds": 1}, {"loss.png", "sync.png", "bytes_matrix.png", "links_bandwidth.png"}, set()),
    ({"eval_every": None}, {"loss.png"}, {"eval.png"}),
    ({"emulated": False}, {"links_bandwidth.png"}, set()),
    ({"algorithm": "gossip", "policy": "fixed"}, {"consensus.png", "loss.png"}, set()),
    ({"summary": False, "events": False}, {"loss.png", "bytes_matrix.png", "utilization.png"}, set()),
], ids=["one-region", "one-round", "no-eval", "no-emulation", "gossip", "no-summary"])
def test_runs_with_pieces_missing_still_render(tmp_path, kwargs, present, absent):
    run = fake_run_dir(tmp_path / "run", **{"rounds": 3, "regions": REGIONS[:3], **kwargs})
    html = write_report(run)
    assert report_problems(html) == []
    shown = _pngs(html)
    assert present <= shown, present - shown
    assert not (absent & shown), absent & shown
    for name in absent:  # not drawn, and no stale file either
        assert not (html.parent / name).exists()


def test_no_emulation_says_measured_only(tmp_path):
    html = write_report(fake_run_dir(tmp_path / "run", rounds=2, regions=REGIONS[:2], emulated=False))
    text = html.read_text()
    assert "WAN emulation</td><td>none" in text
    assert "configured Mbit/s" in text  # the column stays, empty, so tables line up across runs


def test_run_with_no_rounds_yet_renders_a_page_that_says_so(tmp_path):
    (tmp_path / "rounds.jsonl").write_text("")
    html = write_report(tmp_path)
    text = html.read_text()
    assert "No rounds recorded yet" in text
    assert _pngs(html) == set()


def test_only_summary_json(tmp_path):
    # What survives of a run whose per-round files were cleaned up: the headline still shows.
    fake_run_dir(tmp_path / "full", rounds=3, regions=REGIONS[:2])
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "summary.json").write_text((tmp_path / "full" / "summary.json").read_text())
    html = write_report(tmp_path / "s")
    text = html.read_text()
    assert report_problems(html) == []
    assert _pngs(html) == {"bytes_matrix.png", "utilization.png"}  # the two the summary alone can draw
    assert "mlp-digits" in text and "round_window" in text


@pytest.mark.parametrize("out", ["folder", "page.html"])
def test_out_is_a_folder_or_an_html_path(tmp_path, out):
    run = fake_run_dir(tmp_path / "run", rounds=2, regions=REGIONS[:2])
    html = write_report(run, out=tmp_path / "o" / out)
    expected = tmp_path / "o" / ("folder/report.html" if out == "folder" else "page.html")
    assert html == expected and html.is_file()
    assert (html.parent / "loss.png").is_file()
    assert not (run / "report").exists()


def test_rewriting_a_report_removes_plots_it_no_longer_draws(tmp_path):
    run = fake_run_dir(tmp_path / "run", rounds=3, regions=REGIONS[:2])
    html = write_report(run)
    assert (html.parent / "eval.png").is_file()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        m.pop("eval", None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    s = json.loads((run / "summary.json").read_text())
    s.pop("eval"), s.pop("eval_per_region")
    (run / "summary.json").write_text(json.dumps(s))
    write_report(run)
    assert not (html.parent / "eval.png").exists()
    assert report_problems(html) == []


def test_text_from_the_run_is_escaped(tmp_path):
    run = fake_run_dir(tmp_path / "run", rounds=2, regions=REGIONS[:2], events=False)
    (run / "events.jsonl").write_text(json.dumps({"t": 1.0, "kind": "<script>alert(1)</script>"}) + "\n")
    text = write_report(run).read_text()
    assert "<script>" not in text and "&lt;script&gt;" in text


def test_many_regions_cap_link_panels_and_bars(tmp_path):
    regions = tuple(f"r{i:02d}" for i in range(17))  # 272 directed links
    html = write_report(fake_run_dir(tmp_path / "run", rounds=2, regions=regions, eval_every=None))
    assert report_problems(html) == []
    text = html.read_text()
    assert "Showing the 16 of 272 links" in text
    assert "72 more rows not shown" in text  # the links table stops at 200 rows
