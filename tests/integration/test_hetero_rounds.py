"""Issue 20 on the real stack (Ray actors, mutual-TLS gRPC on 127.0.0.1): one region 6x slower
(regions.emulation.slowdown), one absent for two rounds (availability), under quorum and
time-budget rounds (sync.pacing)."""

from __future__ import annotations

import pytest

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner
from geofed.regions.pacing import stale_weight

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400)]

FAST, SLOW, AWAY = "us-east-1", "eu-west-1", "ap-northeast-1"
REGIONS = [FAST, SLOW, AWAY]


def _run(tmp_path, pacing: dict, *, rounds: int = 9, absent: bool = False, overlap: bool = False):
    availability = {"schedule": [{"region": AWAY, "from_round": 3, "to_round": 4}]} if absent else {}
    cfg = config_from_mapping({
        "run": {"name": "hetero", "rounds": rounds, "report": False, "checkpoint_every": 1, "seed": 1,
                "eval_every": 1},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": REGIONS, "num_cpus": 0.5,
                    "emulation": {"slowdown": {SLOW: 6.0}, "availability": availability}},
        "network": {"emulation": {"mode": "none"}},
        "sync": {"policy": {"kind": "fixed", "H": 20}, "inner": {"lr": 0.003}, "outer": {"momentum": 0.5},
                 "pacing": pacing, "overlap": overlap, "deadline": {"initial_s": 30.0, "min_s": 20.0, "max_s": 60.0}},
        "compression": {"codec": "int8"},
    })
    runner = Runner(cfg, tmp_path, show_progress=False)
    try:
        summary = runner.run()
    finally:
        runner.shutdown()
    return (summary, read_jsonl(tmp_path / "rounds.jsonl"), read_jsonl(tmp_path / "metrics.jsonl"),
            read_jsonl(tmp_path / "events.jsonl"))


def test_quorum_rounds_close_without_the_slow_region_and_apply_its_late_update(tmp_path):
    # The slowdown stretches measured steps, and a fast host runs 20 steps of this small model in
    # ~6 ms: with a 50 ms grace quiet CI hosts ran the slow region's round (6x) within it, and no
    # round closed without it. A 10 ms grace leaves it >=25 ms behind there. A larger slowdown is no
    # cure: the whole run takes ~0.6 s, and at 8x the slow region's first round outlasted it 1 time in
    # 3 (at 12x always), so no late update could be applied.
    summary, rounds, metrics, events = _run(tmp_path, {"mode": "quorum", "quorum": 2, "grace_s": 0.01}, absent=True)
    assert [r["round"] for r in rounds] == list(range(9))
    # Rounds closed at k with the slow region still running its round.
    closed_early = [r for r in rounds if SLOW in r["in_flight"]]
    # Rounds 3-4 have two participants (a quorum of both); on a loaded host the slow region may
    # finish in time in some others.
    assert len(closed_early) >= 2, [(r["round"], r["in_flight"]) for r in rounds]
    for r in closed_early:
        assert len(r["regions_reported"]) >= 1 and SLOW not in r["regions_reported"]
    late = [e for e in events if e["event"] == "late_round"]
    assert late and all(e["region"] == SLOW for e in late)
    # Its update reached the others late and was applied with the staleness weight.
    applied = [(m["round"], s) for m in metrics if m["region"] != SLOW and not m.get("late")
               for s in m.get("stale_applied", [])]
    assert applied, "no late update was applied"
    for round_, s in applied:
        assert s["peer"] == SLOW and s["round"] < round_
        assert s["weight"] == pytest.approx(stale_weight(round_ - s["round"], 0.5), abs=1e-4)
    # The absent region sat out rounds 3-4 (not a fault), then took the model from a peer once:
    # one state fetch, no resync storm.
    assert [e["round"] for e in events if e["event"] == "absent"] == [3, 4]
    assert all(AWAY not in r["participants"] for r in rounds if r["round"] in (3, 4))
    assert AWAY in rounds[5]["participants"]
    rejoin = [e for e in events if e["event"] == "caught_up" and e["region"] == AWAY and e["round"] == 5]
    assert len(rejoin) == 1 and rejoin[0]["donor"] != AWAY
    assert not [e for e in events if e["event"] in ("resync", "region_failed", "region_rejoined")]
    assert summary["faults"]["region_failures"] == 0 and summary["faults"]["region_restarts"] == 0
    assert summary["pacing"]["absent_region_rounds"] == 2 and summary["pacing"]["late_rounds"] >= 1
    assert summary["eval"]["value"] > 0.85


@pytest.mark.slow  # the default suite's 20 minutes; CI runs it in the slow pass
def test_time_budget_rounds_give_fast_regions_more_steps(tmp_path):
    # FedNova scaling stays at its default (off): with 4x scaling one fresh-clone CI run ended at
    # 0.83 accuracy; docs/heterogeneity.md has the A/B runs behind that default. 9 rounds: with 6 a
    # quiet fresh-clone CI host, whose budgets hold fewer steps of the slow region, ended at 0.838.
    summary, rounds, metrics, _ = _run(tmp_path, {"mode": "time-budget"}, rounds=9)
    steps = {(m["round"], m["region"]): m["steps"] for m in metrics}
    # Round 0 calibrates: the set-up warm-up's pass times give the slow region fewer steps than the fast.
    assert steps[(0, FAST)] > steps[(0, SLOW)], steps
    assert all(m["step_time_steady_s"] > 0 for m in metrics)
    budgeted = [m for m in metrics if m["round"] >= 1]
    assert not any("fednova_scale" in m for m in budgeted)
    # Summed over rounds (one round on a loaded host can starve a fast region of its cores).
    fast = sum(m["steps"] for m in budgeted if m["region"] == FAST)
    slow = sum(m["steps"] for m in budgeted if m["region"] == SLOW)
    assert fast >= 2 * slow, steps
    # Everyone stops at the budget: the slow region's compute is no longer 6x the fast one's (as it
    # is in barrier rounds of H steps). Rounds where a region stopped at the step cap (4 x H) are
    # left out: it stopped before the budget by design. One fresh-clone CI run's round 2 had a
    # budget sized on round 1's cold one-step rounds: the fast regions hit the cap in 0.17 and 0.09 s
    # while the slow one used its 0.45 s budget, and that round alone put the sums 2.5x apart.
    cap = 4 * 20
    capped = {m["round"] for m in budgeted if m["steps"] >= cap}
    compute = {reg: sum(m["compute_s"] for m in budgeted if m["region"] == reg and m["round"] not in capped)
               for reg in REGIONS}
    assert len(capped) <= 3, capped
    assert max(compute.values()) < 2.0 * min(compute.values()), (compute, capped)
    assert summary["eval"]["value"] > 0.85


@pytest.mark.slow  # the default suite's 20 minutes; CI runs it in the slow pass
def test_with_overlap_fast_regions_fill_the_gaps_between_time_budget_rounds(tmp_path):
    summary, rounds, metrics, _ = _run(tmp_path, {"mode": "time-budget"}, rounds=6, overlap=True)
    assert [r["round"] for r in rounds] == list(range(6))
    filled = [m for m in metrics if m.get("fill_steps")]
    # Between rounds (the driver gathers and plans; round 0 waits for the slow region) the fast
    # regions step; those steps are the next round's first: its steps and compute include them.
    assert {m["region"] for m in filled} >= {FAST, AWAY}, [(m["round"], m["region"], m.get("fill_steps")) for m in metrics]
    assert all(m["round"] >= 1 for m in filled)
    for m in filled:
        assert 0 < m["fill_steps"] < m["steps"] and 0 < m["fill_s"] < m["compute_s"]
    assert summary["eval"]["value"] > 0.85
