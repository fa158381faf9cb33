"""`geofed bench churn`'s plan of faults and its numbers, from run directories written here (the
runs themselves: `geofed bench churn --quick`, by hand; docs/reliability.md has its figures)."""

from __future__ import annotations

import json

import pytest

from geofed.bench import churn
from geofed.bench.churn_faults import KINDS, Fault, Timing, outage_event, plan_faults, region_pids
from geofed.orchestrator.config import config_from_mapping

REGIONS = ["a", "b", "c", "d"]


def test_faults_come_in_rotation_never_on_the_first_region_and_end_inside_the_run():
    plan = plan_faults(REGIONS, until_s=200, timing=Timing(every_s=30))
    assert [f.kind for f in plan] == [*KINDS, "region-kill"]  # 30 .. 180 s; the leave at 210 would end after 200
    assert [f.at_s for f in plan] == [30, 60, 90, 120, 150, 180]
    assert all(f.region != "a" for f in plan) and [f.region for f in plan[:3]] == ["b", "c", "d"]
    outage = plan[3]
    assert outage.kind == "link-outage" and outage.peer == "a"
    # a leave whose join would come after the end of the run is not planned
    assert [f.kind for f in plan_faults(REGIONS, until_s=80, timing=Timing(every_s=30))] == ["region-kill"]


def test_a_plan_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="at least 3"):
        plan_faults(["a", "b"], until_s=100, timing=Timing())
    with pytest.raises(ValueError, match="kinds"):
        plan_faults(REGIONS, until_s=100, timing=Timing(), kinds=["meteor"])


def test_a_link_outage_is_scheduled_by_round_so_a_resumed_driver_keeps_it():
    ev = outage_event(Fault(at_s=90, kind="link-outage", region="c", peer="a"), round_s=0.6, outage_s=10)
    assert ev == {"link": "c->a", "at_round": 150, "outage_s": 10}
    mapping = churn.run_mapping(churn.Setup(task="digits", regions=4, rounds=300, H=200, timing=Timing()),
                                name="x", schedule=[{**ev, "link": "eu-west-1->us-east-1"}])
    cfg = config_from_mapping(mapping)
    assert cfg.sync.policy.kind == "fixed" and cfg.sync.policy.H == 200 and cfg.run.rounds == 300
    assert cfg.run.checkpoint_every == 1  # a driver kill resumes from the last round
    (event,) = cfg.network.emulation.schedule
    assert event.at_round == 150 and event.outage_s == 10


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_region_pids_follow_starts_restarts_joins_and_leaves(tmp_path):
    _write(tmp_path / "events.jsonl", [
        {"event": "started", "regions": {"a": {"pid": 1}, "b": {"pid": 2}, "c": {"pid": 3}}},
        {"event": "region_rejoined", "region": "b", "pid": 20},
        {"event": "region_left", "region": "c"},
        {"event": "region_joined", "region": "c", "pid": 30},
    ])
    assert region_pids(tmp_path) == {"a": 1, "b": 20, "c": 30}
    with (tmp_path / "events.jsonl").open("a") as f:  # a resumed driver starts every region anew
        f.write(json.dumps({"event": "started", "regions": {"a": {"pid": 7}, "b": {"pid": 8}, "c": {"pid": 9}}}) + "\n")
    assert region_pids(tmp_path) == {"a": 7, "b": 8, "c": 9}


def _run_dir(tmp_path, name, *, steps, rss, value, lost=()):
    d = tmp_path / name
    d.mkdir()
    _write(d / "metrics.jsonl", [{"region": r, "round": k, "steps": steps, "rss_mb": rss + k}
                                 for k in range(3) for r in ("a", "b")])
    _write(d / "events.jsonl", [{"event": "started"}] + ([{"event": "started"}, {"event": "resumed", "lost_rounds": list(lost)}]
                                                        if lost else []))
    (d / "summary.json").write_text(json.dumps({"rounds": 3, "eval": {"metric": "accuracy", "value": value,
                                                                      "higher_is_better": True}}))
    return d


def test_measure_counts_each_round_once_over_the_whole_wall_time(tmp_path):
    calm = churn.measure(_run_dir(tmp_path, "calm", steps=100, rss=400, value=0.97), wall_s=10.0, batch_size=32)
    hurt = churn.measure(_run_dir(tmp_path, "hurt", steps=100, rss=410, value=0.955, lost=[5, 6]), wall_s=12.5,
                         batch_size=32)
    assert calm["examples"] == 6 * 100 * 32 and calm["examples_per_s"] == 1920.0
    assert hurt["rounds_redone"] == 2 and hurt["driver_launches"] == 2 and hurt["peak_rss_mb"] == 412
    r = churn.ratios(calm, hurt)
    assert r == {"throughput_ratio": 0.8, "metric_delta_points": -1.5, "rounds_redone_after_driver_kill": 2,
                 "rss_growth_mb": 10.0}
    doc = churn.document([{"undisturbed": calm, "churn": hurt}] * 3, quick=False, faults=[[], [], []],
                         setup=churn.Setup(task="digits", regions=4, rounds=3, H=200, timing=Timing()))
    assert doc["ratios"]["throughput_ratio"] == 0.8 and doc["spread"]["throughput_ratio"]["n"] == 3
    assert doc["targets_met"] == {"throughput_ratio": False, "metric_delta_points": False,
                                  "rounds_redone_after_driver_kill": False, "rss_growth_mb": True}
    assert [a["name"] for a in doc["arms"]] == ["undisturbed", "churn"]


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--rounds", "3"], ["--every", "0"], ["--set", "sync.inner.lr=-1"]])
def test_bad_arguments_exit_2_before_any_run(argv, capsys):
    assert churn.main(argv) == 2
    assert "geofed bench churn" in capsys.readouterr().err
