"""Issue 9, point 3: an outage of one directed link (the WAN emulator's schedule, stall mode: a
black hole, bytes stop) during a real run. The run goes on; the cut-off receiver leaves the
sender out of each round by its deadline; the sender does not wait out its stalled push; the
receiver takes the model of a peer after each such round (resync) and receives the sender again
once the link is back. The 30 s outage of the issue is soak-marked (by hand: `pytest -m soak`); a 6 s one always runs."""

from __future__ import annotations

import pytest
from reliability_harness import REGIONS3, events, small_config

from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner

pytestmark = [pytest.mark.usefixtures("ray_session")]

SRC, DST = "us-east-1", "eu-west-1"  # the cut link: SRC's pushes to DST stall
START = 3
MAX_S = 2.0  # sync.deadline.max_s: also each push's timeout


def _run(tmp_path, outage_s: float, rounds: int) -> dict:
    network = {"emulation": {"mode": "proxy", "preset": None,
                             "default": {"latency_ms": 10, "bandwidth_mbps": 100, "jitter_ms": 2, "loss": 0},
                             "schedule": [{"link": f"{SRC}->{DST}", "at_round": START, "outage_s": outage_s}]}}
    cfg = small_config(rounds=rounds, H=10, network=network,
                       sync={"policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.003},
                             "deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": MAX_S}})
    runner = Runner(cfg, tmp_path, show_progress=False)
    try:
        return runner.run()
    finally:
        runner.shutdown()


def _check(tmp_path, summary, outage_s: float, rounds: int) -> None:
    rounds_log = read_jsonl(tmp_path / "rounds.jsonl")
    assert [r["round"] for r in rounds_log] == list(range(rounds))  # the run went on to the end
    t = {r["round"]: (r["t_start"], r["t_end"]) for r in rounds_log}
    for r in rounds_log:  # no round hung: a deadline, a grace for the sender, a resync
        assert r["t_end"] - r["t_start"] < 4 * MAX_S + 3, r
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    at_dst = {m["round"]: m for m in metrics if m["region"] == DST}
    at_src = {m["round"]: m for m in metrics if m["region"] == SRC}
    cut = [r for r, m in sorted(at_dst.items()) if SRC in m["peers_missing"]]
    t_back = t[START][0] + outage_s
    # Left out by the deadline from the round the outage began, in every round whose deadline
    # passed inside the outage...
    assert cut and cut[0] == START, cut
    surely_cut = [r for r in range(START, rounds) if t[r][0] + MAX_S + 0.5 < t_back]
    assert set(surely_cut) <= set(cut), (surely_cut, cut)
    # ...and only then (a round that starts just as the link comes back may still miss: the
    # stalled bytes drain first, within one deadline).
    assert all(t[r][0] < t_back + MAX_S + 1.0 for r in cut), (cut, t_back)
    # Only that pair was affected. (SRC may miss DST too: DST's pushes reach SRC but their acks
    # travel the cut direction, so DST skips SRC while such a push hangs, as TCP itself would.)
    misses = [(m["round"], m["region"], p) for m in metrics for p in m["peers_missing"]]
    in_window = [x for x in misses if t[x[0]][0] < t_back]
    assert all({x[1], x[2]} == {SRC, DST} for x in in_window), in_window
    stray = [x for x in misses if t[x[0]][0] >= t_back]
    assert len(stray) <= 2, stray  # (a rare deadline miss on a busy machine is not the outage)
    # The sender did not wait out its stalled pushes: it skipped DST while one was in flight.
    assert any(DST in at_src[r]["send_failures"] for r in cut)
    # Back after the outage: DST hears SRC again in every round that starts once the stalled
    # bytes have drained.
    after = [r for r in range(rounds) if t[r][0] > t_back + 1.0]
    assert len(after) >= 5, (after, t_back)
    assert all(SRC not in at_dst[r]["peers_missing"] for r in after)
    # Caught up: DST took a peer's model after each round it missed SRC, so every region ends on
    # one model (to fp16 rounding: own updates are mixed at full precision).
    resynced = [e["round"] - 1 for e in events(tmp_path, "resync") if e["region"] == DST]
    assert set(cut) <= set(resynced)
    assert summary["consensus_distance"] < 1e-4
    assert summary["faults"]["peers_left_out"] >= len(cut)
    evals = {r: v["value"] for r, v in summary["eval_per_region"].items()}
    assert set(evals) == set(REGIONS3) and max(evals.values()) - min(evals.values()) <= 0.005


@pytest.mark.timeout(300)
def test_short_outage_left_out_by_deadline_then_caught_up(tmp_path):
    rounds = 30
    summary = _run(tmp_path, outage_s=6.0, rounds=rounds)
    _check(tmp_path, summary, 6.0, rounds)


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_30s_outage_left_out_by_deadline_then_caught_up(tmp_path):
    rounds = 70
    summary = _run(tmp_path, outage_s=30.0, rounds=rounds)
    _check(tmp_path, summary, 30.0, rounds)
