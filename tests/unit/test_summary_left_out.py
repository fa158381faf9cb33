"""Issue 37, Why 8: a region that stalled for 10 s sat out rounds, yet the final table read
"region restarts / peers left out 0 / 0": peers_left_out counts only updates a participant
missed, and a stalled region is no participant (the rounds go on without it), so nothing showed.

Now summary.json's faults count the region-rounds each region was out (failed or stalled: not
in the round's `alive`), and the table shows stalls, failures and restarts, and region-rounds out
beside missed updates. Before the fix this failed: the table had no "region stalls" row and
faults had no region_rounds_out (KeyError).
"""

from __future__ import annotations

import json

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.progress import print_summary
from geofed.orchestrator.driver.rundir import JsonlLog
from geofed.orchestrator.driver.summary import build_summary

REGIONS = ["us-east-1", "eu-west-1", "ap-south-1"]


def test_a_stalled_region_shows_in_the_final_table(tmp_path, capsys):
    cfg = config_from_mapping(json.loads(json.dumps({"regions": {"names": REGIONS}, "task": {"kind": "mlp-digits"},
                                                      "network": {"emulation": {"mode": "none"}}})))
    metrics, rounds = JsonlLog(tmp_path / "metrics.jsonl"), JsonlLog(tmp_path / "rounds.jsonl")
    for r in range(4):
        # ap-south-1 stalls in round 1 (the gather goes on without it) and rejoins in round 3
        alive = REGIONS if r in (0, 3) else REGIONS[:2]
        for region in alive:
            metrics.write({"round": r, "region": region, "train_loss": 1.0, "compute_s": 0.1, "wall_s": 0.2,
                           "bytes_sent": 10, "bytes_received": 10, "transfers": [], "peers_missing": []})
        rounds.write({"round": r, "t_start": r, "t_end": r + 1, "H": 5, "alive": alive,
                      "regions_reported": alive, "links": {}})
    metrics.close()
    rounds.close()
    faults = {"region_restarts": 0, "region_failures": 0, "peers_left_out": 0, "late_dropped": 0, "region_stalls": 1}
    summary = build_summary(cfg, tmp_path, eval_avg=None, eval_per_region=None, consensus=None, transport_stats={},
                            faults=faults, placement={}, emulator=None, wall_s=4.0)
    assert summary["faults"]["region_rounds_out"] == 2
    print_summary(summary, str(tmp_path))
    out = capsys.readouterr().out
    assert "region stalls / failures / restarts" in out and "1 / 0 / 0" in out
    assert "region-rounds out / updates missed" in out and "2 / 0" in out


def test_the_report_shows_stalls_and_region_rounds_out(tmp_path):
    """The report's tiles had only "peers left out" (1 here): a stall showed nowhere. Before the fix
    this failed: no "region stalls" tile."""
    from geofed.orchestrator.report import write_report
    from test_report_fakerun import fake_run_dir

    run_dir = fake_run_dir(tmp_path / "run")
    s = json.loads((run_dir / "summary.json").read_text())
    s["faults"].update(region_stalls=1, region_rounds_out=2)
    (run_dir / "summary.json").write_text(json.dumps(s))
    page = write_report(run_dir).read_text()
    assert '<div class="k">region stalls / rounds out</div><div class="v">1 / 2</div>' in page


def test_a_region_that_left_the_run_is_no_fault(tmp_path):
    """Issue 41: ap-south-1 left after round 0 and joined again in round 3 (rounds.jsonl's
    members_out, driver/membership.py); eu-west-1 stalled in round 2. Only the stall counts."""
    cfg = config_from_mapping({"regions": {"names": REGIONS}, "task": {"kind": "mlp-digits"},
                               "network": {"emulation": {"mode": "none"}}})
    rounds = JsonlLog(tmp_path / "rounds.jsonl")
    for r, alive, out in [(0, REGIONS, []), (1, REGIONS[:2], ["ap-south-1"]), (2, REGIONS[:1], ["ap-south-1"]),
                          (3, REGIONS, [])]:
        rounds.write({"round": r, "t_start": r, "t_end": r + 1, "H": 5, "alive": alive, "regions_reported": alive,
                      "links": {}, **({"members_out": out} if out else {})})
    rounds.close()
    summary = build_summary(cfg, tmp_path, eval_avg=None, eval_per_region=None, consensus=None, transport_stats={},
                            faults={}, placement={}, emulator=None, wall_s=4.0)
    assert summary["faults"]["region_rounds_out"] == 1
