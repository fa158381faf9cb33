"""Issue 36, N4: clipping was only a log line. Every region's round reports `clipped` (updates
scaled down, by sender) in metrics.jsonl; summary.json adds them up next to the refusals (by
region and by sender) and the report shows them."""

from __future__ import annotations

import json

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.summary import build_summary
from geofed.orchestrator.report import write_report
from test_report_fakerun import REGIONS, fake_run_dir


def _with_clips(run_dir):
    """Every region but the last clips the last one's update each round; the first region also
    clipped one honest update of the second once (above the round's median norm)."""
    path = run_dir / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    hostile = REGIONS[3]
    for r in recs:
        r["clipped"] = {} if r["region"] == hostile else {hostile: 1}
        if r["region"] == REGIONS[0] and r["round"] == 0:
            r["clipped"][REGIONS[1]] = 1
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_summary_counts_clipped_updates_by_region_and_sender(tmp_path):
    """Before: summary.json had no clipped count at all (refusals 0 under an attack at the bound)."""
    run_dir = fake_run_dir(tmp_path / "run", rounds=5, regions=REGIONS[:4])
    _with_clips(run_dir)
    cfg = config_from_mapping({"task": {"kind": "mlp-digits", "hidden": 16}, "regions": {"names": REGIONS[:4]},
                               "network": {"emulation": {"mode": "none"}}})
    s = build_summary(cfg, run_dir, eval_avg=None, eval_per_region={}, consensus=None, transport_stats={},
                      faults={}, placement={}, emulator=None, wall_s=1.0)
    clipped = s["refusals"]["clipped"]
    assert clipped["total"] == 3 * 5 + 1
    assert clipped["by_sender"] == {REGIONS[3]: 15, REGIONS[1]: 1}
    assert clipped["by_region"] == {REGIONS[0]: 6, REGIONS[1]: 5, REGIONS[2]: 5}
    assert s["refusals"]["total"] == 0  # a clip is not a refusal


def test_the_report_shows_clipped_updates(tmp_path):
    """Before: the report's tiles and faults table showed refusals only."""
    run_dir = fake_run_dir(tmp_path / "run", rounds=3, regions=REGIONS[:4])
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["refusals"] = {"total": 0, "by_reason": {}, "by_region": {},
                           "clipped": {"total": 9, "by_region": {REGIONS[0]: 3}, "by_sender": {REGIONS[3]: 9}}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    html = write_report(run_dir).read_text()
    assert "clipped updates" in html
    assert f"clipped from {REGIONS[3]}" in html


def test_summary_counts_harmful_refusals_by_sender(tmp_path):
    """Updates the gauntlet refused (regions/gauntlet.py) are refusals by reason (`harmful`) and, as
    clipped ones are, by region and by sender, so an honest sender refused shows apart from the member.
    Before: summary.json had no `harmful` by sender (KeyError)."""
    run_dir = fake_run_dir(tmp_path / "run", rounds=4, regions=REGIONS[:4])
    path = run_dir / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        r["harmful"] = {} if r["region"] == REGIONS[3] else {REGIONS[3]: 1}
        r["refusals"] = {} if r["region"] == REGIONS[3] else {"harmful": 1}
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = config_from_mapping({"task": {"kind": "mlp-digits", "hidden": 16}, "regions": {"names": REGIONS[:4]},
                               "network": {"emulation": {"mode": "none"}}})
    s = build_summary(cfg, run_dir, eval_avg=None, eval_per_region={}, consensus=None, transport_stats={},
                      faults={}, placement={}, emulator=None, wall_s=1.0)
    assert s["refusals"]["by_reason"] == {"harmful": 12}
    assert s["refusals"]["harmful"]["by_sender"] == {REGIONS[3]: 12}
    assert s["refusals"]["harmful"]["by_region"] == {REGIONS[0]: 4, REGIONS[1]: 4, REGIONS[2]: 4}
