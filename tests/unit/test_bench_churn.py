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


def test_the_ceiling_counts_what_leaves_and_stops_take_by_construction():
    """A 30 s leave and a 10 s stop of 4 regions over 200 s of undisturbed training: 40 region-seconds
    of 800 out, a ceiling of 0.95; a failed action, a kill and an outage take nothing by construction."""
    calm = {"train_s": 200.0}
    acts = [{"kind": "leave", "ok": True}, {"kind": "join", "ok": True},
            {"kind": "region-stop", "ok": True, "stop_s": 10.0}, {"kind": "region-stop", "ok": False, "stop_s": 10.0},
            {"kind": "region-kill", "ok": True}, {"kind": "link-outage", "ok": True, "outage_s": 10.0}]
    got = churn.ceiling(calm, acts, regions=4, timing=Timing())
    assert got == {"absent_region_s": 40.0, "throughput_ceiling": 0.95}
    assert churn.ceiling({"train_s": None}, acts, regions=4, timing=Timing())["throughput_ceiling"] is None
    hurt = {"examples_per_s": 0.855, "final_metric": 0.97, "metric": "accuracy", "rounds_redone": 0, "peak_rss_mb": 1.0}
    doc = churn.document([{"undisturbed": {**calm, "examples_per_s": 1.0, "final_metric": 0.97, "metric": "accuracy",
                                           "rounds_redone": 0, "peak_rss_mb": 1.0}, "churn": hurt}],
                         quick=False, faults=[acts], setup=churn.Setup(task="digits", regions=4, rounds=3, H=200, timing=Timing()))
    assert doc["ceiling"]["throughput_ceiling"] == 0.95 and doc["ceiling"]["throughput_of_ceiling"] == 0.9


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--rounds", "3"], ["--every", "0"], ["--set", "sync.inner.lr=-1"]])
def test_bad_arguments_exit_2_before_any_run(argv, capsys):
    assert churn.main(argv) == 2
    assert "geofed bench churn" in capsys.readouterr().err


def _timeline(d, rounds, *, missing=(), launches=((5.0, None),)):
    """A run directory of regions a, b, c (10 steps each a round unless `missing`: (round, region))
    with `rounds` (round, t_start, t_end) and one setup_done per launch (its process age at its first
    round, and the checkpoint a resume started from)."""
    d.mkdir()
    _write(d / "rounds.jsonl", [{"round": n, "t_start": s, "t_end": e} for n, s, e in rounds])
    _write(d / "metrics.jsonl", [{"region": g, "round": n, "steps": 10} for n, _, _ in rounds for g in "abc"
                                 if (n, g) not in missing])
    events = []
    for age, ckpt in launches:
        events += ([{"event": "resumed", "from_checkpoint": ckpt}] if ckpt is not None else [])
        events.append({"event": "setup_done", "process_to_round0_s": age})
    _write(d / "events.jsonl", events)
    return d


def test_fault_costs_split_round_time_missing_examples_and_a_driver_kills_gap(tmp_path):
    from geofed.bench.churn_costs import fault_costs

    calm = _timeline(tmp_path / "calm", [(n, float(n), n + 1.0) for n in range(10)])  # 1 s rounds, 60 examples each
    # region b is killed at 7.5 s (run clock 2.5): round 3 lasts 1.5 s without it. The driver is killed at 11 s
    # in round 5 and resumed from the checkpoint of round 4 (wall 10.5); its first round ends at wall 16.
    hurt = _timeline(tmp_path / "hurt", [(0, 0.0, 1.0), (1, 1.0, 2.0), (2, 2.0, 3.0), (3, 3.0, 4.5), (4, 4.5, 5.5),
                                         (5, 6.0, 7.0), (6, 7.0, 8.0), (7, 8.0, 9.0)],
                     missing={(3, "b")}, launches=((5.0, None), (4.0, 4)))
    actions = [{"t_s": 7.5, "kind": "region-kill", "region": "b", "ok": True},
               {"t_s": 9.0, "kind": "region-stop", "region": "c", "ok": False},  # did not act: not a fault
               {"t_s": 11.0, "kind": "driver-kill", "region": None, "ok": True},
               {"t_s": 17.5, "kind": "link-outage", "region": "c", "ok": True}]
    got = fault_costs(calm, hurt, actions, batch_size=2, regions=["a", "b", "c"])
    assert got["steady"]["period_s"] == 1.0 and got["steady"]["rate"] == 60.0
    kill, driver, outage = got["faults"]
    assert (kill["kind"], kill["round_s"], kill["examples"], kill["seconds"]) == ("region-kill", 0.5, 20, 0.83)
    assert (driver["gap_s"], driver["seconds"]) == (4.5, 4.5)  # 16 - 10.5 - one round's 1 s
    assert outage["seconds"] == 0.0 and got["unattributed_s"] == 0.0
    assert got["by_kind"]["region-kill"] == {"count": 1, "seconds_each": [0.83], "round_s": 0.5, "examples_s": 0.33,
                                             "gap_s": 0.0, "median_s": 0.83, "total_s": 0.83}
    assert sorted(got["by_kind"]) == ["driver-kill", "link-outage", "region-kill"]


def test_faults_start_at_the_runs_first_round_and_wait_for_a_resumed_drivers_set_up(tmp_path):
    import time
    from types import SimpleNamespace

    from geofed.bench.churn_faults import Injector

    killed = []

    def kill_and_resume():
        killed.append(time.monotonic())
        driver.launches += 1
        return 42

    driver = SimpleNamespace(run_dir=tmp_path, kill_and_resume=kill_and_resume, launches=1)

    def set_up_done():
        with (tmp_path / "events.jsonl").open("a") as f:
            f.write(json.dumps({"event": "setup_done"}) + "\n")

    def wait_kills(n):
        deadline = time.monotonic() + 5
        while len(killed) < n and time.monotonic() < deadline:
            time.sleep(0.02)

    _write(tmp_path / "events.jsonl", [{"event": "started"}])
    t0 = time.monotonic()
    faults = [Fault(at_s=0.1, kind="driver-kill", region="b"), Fault(at_s=0.2, kind="driver-kill", region="c")]
    injector = Injector(driver, faults, t0=t0, timing=Timing()).start()
    time.sleep(0.4)
    assert killed == []  # still setting up: no fault yet
    set_up_done()
    wait_kills(1)
    time.sleep(0.4)
    assert len(killed) == 1  # the resumed driver is setting up: the next fault waits for it
    set_up_done()
    wait_kills(2)
    injector.join(5)
    assert injector.round0_s >= 0.4 and killed[0] - t0 >= injector.round0_s + 0.1 and killed[1] - killed[0] >= 0.4
    assert [(a["kind"], a["ok"], a["pid"]) for a in injector.actions] == [("driver-kill", True, 42)] * 2
