"""Issue 37, Why 9: `geofed run --resume` of a finished run spent 29 s starting Ray and the
regions to run no round, then rewrote summary.json with other times. Now it says the run is
finished, at which round and why, exits 0 in well under 2 s and leaves summary.json alone.

The run directories are made by the project's own writers (new_run_dir, JsonlLog, the driver
checkpoint writer, build_summary + write_json), as a finished run leaves them. Ray's address is
unreachable: a resume that went ahead anyway fails (exit 1) instead of training.

Before the fix, test_resume_of_a_finished_run_exits_0_at_once_leaving_summary_alone failed with
exit 1 ("no Ray head answers at 127.0.0.1:9"): the resume went on to start the run
(with a reachable Ray, 29 s of set-up, no round, and a rewritten summary.json).
"""

from __future__ import annotations

import json
import os
import time

import pytest
from geofed.orchestrator import cli
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import JsonlLog, new_run_dir, release_run_dir, write_json
from geofed.orchestrator.driver.summary import build_summary
from geofed.regions import checkpoint

REGIONS = ["us-east-1", "eu-west-1"]


def _base(**run):
    return {"run": {"name": "done", "rounds": 2, "report": False, **run},
            "task": {"kind": "mlp-digits", "hidden": 8},
            "regions": {"names": list(REGIONS)},
            "network": {"emulation": {"mode": "none"}},
            "ray": {"address": "127.0.0.1:9", "init_timeout_s": 1}}


def _finished_run(tmp_path, *, rounds_run=2, H=10, interrupted=None, **run):
    """A run directory as a run of `rounds_run` rounds of H steps leaves it."""
    cfg = config_from_mapping(json.loads(json.dumps(_base(**run))))
    run_dir = new_run_dir(cfg, str(tmp_path / "run"))
    metrics, rounds = JsonlLog(run_dir / "metrics.jsonl"), JsonlLog(run_dir / "rounds.jsonl")
    for r in range(rounds_run):
        for region in REGIONS:
            metrics.write({"round": r, "region": region, "H": H, "train_loss": 1.0 / (r + 1), "compute_s": 0.1,
                           "wall_s": 0.2, "bytes_sent": 100, "bytes_received": 100, "transfers": []})
        rounds.write({"round": r, "t_start": r, "t_end": r + 1, "H": H, "bytes_sent": 200, "links": {}})
        checkpoint.save_atomic(checkpoint.checkpoint_path(run_dir / "checkpoints" / "driver", r),
                               {"round": r, "clock": float(r + 1)})
    metrics.close()
    rounds.close()
    summary = build_summary(cfg, run_dir, eval_avg={"metric": "accuracy", "value": 0.9, "higher_is_better": True},
                            eval_per_region=None, consensus=0.0, transport_stats={}, faults={}, placement={},
                            emulator=None, wall_s=rounds_run + 0.5)
    summary["interrupted"] = interrupted
    write_json(run_dir / "summary.json", summary)
    release_run_dir(run_dir)  # the run's driver has ended
    return run_dir


def test_resume_of_a_finished_run_exits_0_at_once_leaving_summary_alone(tmp_path, capsys):
    run_dir = _finished_run(tmp_path)
    path = run_dir / "summary.json"
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    t0 = time.monotonic()
    code = cli.main(["run", "--resume", str(run_dir), "--quiet"])
    took = time.monotonic() - t0
    out = capsys.readouterr()
    assert code == 0, out.err
    assert took < 2.0
    assert f"run {run_dir.name} finished after 2 of 2 rounds (last round 1, run.rounds=2)" in out.out and "nothing to resume" in out.out
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
    release_run_dir(run_dir)


def test_a_run_ended_by_max_steps_is_finished_with_rounds_left(tmp_path):
    run_dir = _finished_run(tmp_path, rounds=50, max_steps=20, rounds_run=2, H=10)
    cfg = config_from_mapping(json.loads(json.dumps(_base(rounds=50, max_steps=20))))
    from geofed.orchestrator.driver.resume import finished_run

    line = finished_run(run_dir, cfg)
    assert line is not None and "run.max_steps=20" in line and "finished after 2 of 50 rounds (last round 1" in line


@pytest.mark.parametrize("case", ["interrupted", "more_rounds", "logged_after_summary", "no_summary"])
def test_runs_with_work_left_are_not_finished(tmp_path, case):
    run_dir = _finished_run(tmp_path, interrupted={"signal": "SIGTERM", "last_round": 1}
                            if case == "interrupted" else None)
    rounds = 2
    if case == "more_rounds":  # --allow-config-change run.rounds after the end: the run goes on
        rounds = 4
    elif case == "logged_after_summary":  # an extended resume killed before its own summary
        log = JsonlLog(run_dir / "rounds.jsonl")
        log.write({"round": 2, "t_start": 2, "t_end": 3, "H": 10, "bytes_sent": 200, "links": {}})
        log.close()
        rounds = 4
    elif case == "no_summary":
        os.unlink(run_dir / "summary.json")
    cfg = config_from_mapping(json.loads(json.dumps(_base(rounds=rounds))))
    from geofed.orchestrator.driver.resume import finished_run

    assert finished_run(run_dir, cfg) is None
