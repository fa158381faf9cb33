"""Issue 20: `geofed run` SIGKILLed mid-run under quorum and time-budget rounds (one region 4x
slower), then `geofed run --resume RUN_DIR` finishes the run: every round once, the region that
was behind (in flight, or without a checkpoint of the last round) caught up from a peer."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from e2e_harness import kill_driver_and_resume, start_geofed
from geofed.orchestrator.driver.rundir import read_jsonl

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1"]


ROUNDS = 12


def test_sigkilled_paced_runs_resume_and_finish(tmp_path):
    """Both modes at once, each a driver and a Ray of its own in its own folder (they were two
    tests run one after the other): the rounds are paced by the emulated latency, not the CPU."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {mode: pool.submit(_kill_and_resume, tmp_path / mode, mode) for mode in ("quorum", "time-budget")}
    for mode, future in futures.items():
        _assert_resumed_and_finished(future.result(), mode)


def _kill_and_resume(tmp_path, mode):
    tmp_path.mkdir()
    rounds = ROUNDS
    cfg = {
        "run": {"name": "paced", "rounds": rounds, "report": False, "checkpoint_every": 1, "seed": 2, "eval_every": 2},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": REGIONS, "num_cpus": 0.5, "emulation": {"slowdown": {"eu-west-1": 4.0}}},
        # 30 ms each way paces the rounds, so the kill lands mid-run.
        "network": {"emulation": {"mode": "proxy", "preset": None,
                                  "default": {"latency_ms": 30, "bandwidth_mbps": 200, "jitter_ms": 0, "loss": 0}}},
        "sync": {"policy": {"kind": "fixed", "H": 40}, "inner": {"lr": 0.003}, "outer": {"momentum": 0.5},
                 # time-budget with overlap: the regions fill the gaps between rounds (and the kill lands in one)
                 "pacing": {"mode": mode, "quorum": 2}, "overlap": mode == "time-budget", "deadline": {"initial_s": 20.0, "min_s": 10.0, "max_s": 30.0}},
        "compression": {"codec": "int8"},
        "ray": {"num_cpus": 4},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    kill_driver_and_resume(lambda log: start_geofed(["run", str(path), "--out", str(run_dir), "--quiet", "--no-report"],
                                                    cwd=tmp_path, log=log),
                           lambda log: start_geofed(["run", "--resume", str(run_dir), "--quiet", "--no-report"],
                                                    cwd=tmp_path, log=log),
                           run_dir=run_dir, after_rounds=5, tmp_path=tmp_path)
    return run_dir


def _assert_resumed_and_finished(run_dir, mode):
    rounds = ROUNDS
    events = read_jsonl(run_dir / "events.jsonl")
    (resumed_event,) = [e for e in events if e["event"] == "resumed"]
    assert resumed_event["from_checkpoint"] >= 2
    assert [r["round"] for r in read_jsonl(run_dir / "rounds.jsonl")] == list(range(rounds))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == rounds and summary["pacing"]["mode"] == mode
    assert summary["eval"]["value"] > 0.85
    assert summary["faults"]["region_failures"] == 0
    if mode == "time-budget":
        steps = {(m["round"], m["region"]): m["steps"] for m in read_jsonl(run_dir / "metrics.jsonl")}
        last = rounds - 1
        assert steps[(last, "us-east-1")] > steps[(last, "eu-west-1")]  # still budgeted after the resume
