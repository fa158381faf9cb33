"""Issue 41, leave: over the session's Ray (mutual-TLS gRPC, 3 regions, digits), `geofed leave
RUN_DIR NAME` asks the live run's driver through RUN_DIR/control; the region delivers its round,
leaves for good (its process ends, no restart) and the others go on to the end, planned without
it; events.jsonl and summary.json name it (orchestrator/driver/membership.py)."""

from __future__ import annotations

import json
import threading

import pytest
from geofed.orchestrator.cli import main
from geofed.orchestrator.driver.rundir import read_json_file, read_jsonl
from reliability_harness import REGIONS3, BackgroundRun, events, pid_alive, small_config, wait_for

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240),
              pytest.mark.slow]  # slow: 3 region actors and 6 rounds, ~40 s after Ray's start on the loaded 2-core host

LEAVER = "eu-west-1"
ROUNDS = 6


def test_a_region_leaves_a_live_run_and_the_others_go_on(tmp_path, capsys):
    cfg = small_config(rounds=ROUNDS, H=5, run={"name": "leave", "rounds": ROUNDS, "checkpoint_every": 0},
                       sync={"deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 3.0}})
    run = BackgroundRun(cfg, tmp_path / "run").start()
    run.wait_rounds(2, timeout_s=120)
    pid = run.runner.actors.info[LEAVER]["pid"]
    codes: list[int] = []
    cli = threading.Thread(target=lambda: codes.append(main(["leave", str(run.run_dir), LEAVER, "--wait", "60"])))
    cli.start()
    cli.join(90)
    summary = run.join(timeout_s=180)
    assert run.error is None, run.error
    assert codes == [0]
    answer = json.loads(capsys.readouterr().out)
    assert answer["event"] == "region_left" and answer["region"] == LEAVER and answer["why"] == "request"
    left_after = answer["last_round"]
    others = [r for r in REGIONS3 if r != LEAVER]
    assert answer["alive"] == others

    # Its process is gone for good: killed with no restart, never revived.
    wait_for(lambda: not pid_alive(pid), 20, f"the leaver's process {pid} to end")
    assert not events(run.run_dir, "region_rejoined") and not events(run.run_dir, "region_failed")
    assert LEAVER not in run.runner.actors.handles

    # It ran its rounds up to the leave, and none after; the others ran every round, planned without it.
    rounds = read_jsonl(run.run_dir / "rounds.jsonl")
    assert [r["round"] for r in rounds] == list(range(ROUNDS))
    for rec in rounds:
        expect = REGIONS3 if rec["round"] <= left_after else others
        assert rec["alive"] == expect and rec["regions_reported"] == sorted(expect), rec["round"]
        if rec["round"] > left_after:
            assert rec["codecs"] and not any(LEAVER in link for link in rec["codecs"]), rec["codecs"]  # the planned links
    metrics = read_jsonl(run.run_dir / "metrics.jsonl")
    assert max(m["round"] for m in metrics if m["region"] == LEAVER) == left_after

    # The summary names it; the final evaluation is the remaining regions'.
    assert summary["left"] == {LEAVER: {"round": left_after, "why": "request", "request": answer["request"]}}
    assert summary == read_json_file(run.run_dir / "summary.json")
    assert set(summary["eval_per_region"]) == set(others) and summary["eval"]["value"] > 0.3
    assert summary["consensus_distance"] < 1e-4  # DiLoCo over full: the two that remain hold one model (sketch rounding)
