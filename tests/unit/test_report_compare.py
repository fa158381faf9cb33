"""Comparing runs: time-to-target and bytes-to-target, and the comparison page of the benches."""

from __future__ import annotations

import json

import pytest
from geofed.orchestrator.report import (
    RunDirError,
    load_run,
    write_comparison,
    write_report,
)
from support.report_check import html_refs, report_problems
from geofed.orchestrator.report.facts import default_target, to_target
from test_report_fakerun import REGIONS, fake_run_dir


def _tiny_run(path, losses, bytes_per_round=100, dt=1.0, t0=0.0):
    path.mkdir()
    recs = [{"round": i, "t_start": t0 + i * dt, "t_end": t0 + (i + 1) * dt, "H": 10, "mean_train_loss": v,
             "bytes_sent": bytes_per_round} for i, v in enumerate(losses)]
    (path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return load_run(path)


def test_to_target_counts_time_and_bytes_through_the_first_round_at_or_below(tmp_path):
    run = _tiny_run(tmp_path / "r", [2.0, 1.0, 0.5, 0.6, 0.4])
    hit = to_target(run, 0.5)
    assert (hit.round, hit.seconds, hit.bytes) == (2, 3.0, 300)
    assert to_target(run, 2.0).round == 0
    missed = to_target(run, 0.1)
    assert (missed.round, missed.seconds, missed.bytes) == (None, None, None)


def test_to_target_leaves_out_start_up_time(tmp_path):
    # The run clock starts before Ray is up; 20 s of start-up must not count against a method.
    run = _tiny_run(tmp_path / "r", [2.0, 1.0, 0.5], t0=20.0)
    assert to_target(run, 0.5).seconds == 3.0


def test_default_target_is_a_loss_every_run_reached(tmp_path):
    a = _tiny_run(tmp_path / "a", [2.0, 0.3])
    b = _tiny_run(tmp_path / "b", [2.0, 0.4, 0.45])
    assert default_target([a, b]) == 0.4
    assert all(to_target(r, 0.4).round is not None for r in (a, b))
    assert default_target([a, _tiny_run(tmp_path / "c", [])]) is None


def test_write_comparison_tables_and_overlays(tmp_path):
    fast = fake_run_dir(tmp_path / "fast", rounds=8, regions=REGIONS[:2], name="adaptive")
    slow = fake_run_dir(tmp_path / "slow", rounds=8, regions=REGIONS[:2], name="perstep", policy="fixed",
                        loss_rate=0.02, bytes_per_update=2_000_000)
    html = write_comparison([fast, slow], ["adaptive H", "per-step sync"], tmp_path / "cmp",
                            target_loss=1.0, title="bench wan")
    assert html == tmp_path / "cmp" / "report.html"
    assert report_problems(html) == []
    text = html.read_text()
    assert "bench wan" in text and "adaptive H" in text and "per-step sync" in text
    assert "mean train loss ≤ 1" in text
    assert "not reached" in text  # the slow run's loss stays above 1.0 in 8 rounds
    assert text.count("(1.00×)") == 2  # ratios are to the first run: its own time and bytes
    pngs = {r for r in html_refs(text) if r.endswith(".png")}
    assert {"compare_loss.png", "compare_sync.png", "compare_eval.png"} == pngs


def test_write_comparison_refuses_mismatched_labels_and_bad_dirs(tmp_path):
    run = fake_run_dir(tmp_path / "r", rounds=2, regions=REGIONS[:1])
    with pytest.raises(ValueError, match="1 run directories but 2 labels"):
        write_comparison([run], ["a", "b"], tmp_path / "out")
    with pytest.raises(ValueError, match="no run directories"):
        write_comparison([], [], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="not a run directory"):
        write_comparison([run, tmp_path / "empty"], ["a", "b"], tmp_path / "out")


def test_report_with_compare_overlays_the_other_runs(tmp_path):
    a = fake_run_dir(tmp_path / "a", rounds=4, regions=REGIONS[:2], name="adaptive")
    b = fake_run_dir(tmp_path / "b", rounds=4, regions=REGIONS[:2], name="adaptive", seed=3)  # same name twice
    html = write_report(a, compare=[b])
    assert report_problems(html) == []
    text = html.read_text()
    assert "<h2>Comparison</h2>" in text
    assert "adaptive-20261129T200000Z (2)" in text  # two runs with one name stay apart
    assert "compare_loss.png" in text and "loss.png" in text


def test_compare_writes_to_its_own_folder_and_leaves_the_run_report(tmp_path):
    """Issue 19: `geofed report A --compare B` overwrote A's own report.html."""
    from geofed.orchestrator import cli

    a = fake_run_dir(tmp_path / "a", rounds=4, regions=REGIONS[:2], name="adaptive")
    b = fake_run_dir(tmp_path / "b", rounds=4, regions=REGIONS[:2], name="fixed", seed=3)
    own = write_report(a)
    before = own.read_text()
    assert cli.main(["report", str(a), "--compare", str(b)]) == 0
    assert own.read_text() == before and "<h2>Comparison</h2>" not in before
    page = a / "compare-vs-b" / "report.html"
    assert "<h2>Comparison</h2>" in page.read_text() and report_problems(page) == []
    assert (a / "report" / "loss.png").is_file()  # the run's own plots are still there
