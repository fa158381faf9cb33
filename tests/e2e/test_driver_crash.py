"""Issue 9, point 2, end to end: `geofed run` SIGKILLed, then `geofed run --resume RUN_DIR`;
and Ctrl-C (SIGINT to the process group, as a terminal sends it) or SIGTERM: a clean stop.

The driver runs as its own process with its own local Ray. Its process tree (gcs, raylet,
region actors) is recorded from /proc before it is hurt; the tests assert that tree is gone
afterwards and, whatever happens, kill exactly those processes (pid + start time) on the way out.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from e2e_harness import (
    alive,
    descendants,
    kill_exactly,
    rounds_logged,
    start_geofed,
    train_reference,
    wait_gone,
    wait_rounds,
)
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.resume import load_driver_checkpoint
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.regions import checkpoint

pytestmark = [pytest.mark.timeout(600)]

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1"]


def _config(rounds: int, *, latency_ms: float = 0.0) -> dict:
    emulation = ({"mode": "none"} if not latency_ms else
                 {"mode": "proxy", "preset": None,
                  "default": {"latency_ms": latency_ms, "bandwidth_mbps": 200, "jitter_ms": 0, "loss": 0}})
    return {
        "run": {"name": "e2e", "rounds": rounds, "report": False, "checkpoint_every": 1, "seed": 3},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": REGIONS, "num_cpus": 0.5},
        "network": {"emulation": emulation, "max_message_mb": 4},
        # AdaComm's H follows the loss relative to the loss it saw first (its F0): a resume that
        # lost the policy state would start over at the base H.
        "sync": {"policy": {"kind": "adacomm", "base": {"kind": "fixed", "H": 24}, "interval_rounds": 2},
                 "inner": {"lr": 0.003},
                 # Generous: a deadline miss would make the run differ from the reference.
                 "deadline": {"initial_s": 20.0, "min_s": 10.0, "max_s": 30.0}},
        "ray": {"num_cpus": 4},
    }


def _write(tmp_path, mapping) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(mapping))
    return str(path)


def _per_round(records, key):
    return [(r["round"], r[key]) for r in records]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_sigkilled_driver_resumes_from_its_last_round_with_the_same_policy_state(tmp_path):
    cfg_map = _config(rounds=14)
    # The undisturbed reference, in this process (the session's Ray), trains beside the killed
    # run (its own driver and Ray): generous deadlines keep both runs' every update on time.
    ref_dir = tmp_path / "reference"
    with ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(train_reference, config_from_mapping(json.loads(json.dumps(cfg_map))), ref_dir)
        before, r = _kill_and_resume(tmp_path, cfg_map)
        ref_summary = reference.result()
    run_dir = tmp_path / "run"
    rounds = read_jsonl(run_dir / "rounds.jsonl")
    ref_rounds = read_jsonl(ref_dir / "rounds.jsonl")
    assert [x["round"] for x in rounds] == list(range(14))  # every round once: resumed, not restarted
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert sorted((m["round"], m["region"]) for m in metrics) == sorted((i, g) for i in range(14) for g in REGIONS)
    # Appended: the lines of the rounds kept are the very bytes written before the crash.
    kept = b"".join(line + b"\n" for line in before.splitlines() if json.loads(line)["round"] <= r)
    assert (run_dir / "metrics.jsonl").read_bytes().startswith(kept)

    # The same policy state: AdaComm's F0 and interval carried over, so H matches round for round.
    assert _per_round(rounds, "H") == _per_round(ref_rounds, "H")
    f0 = {x["policy"]["F0"] for x in rounds[1:]}  # round 0 has no loss yet
    assert len(f0) == 1 and None not in f0 and f0 == {x["policy"]["F0"] for x in ref_rounds[1:]}
    assert len({x["H"] for x in rounds}) >= 3  # H did move with the loss: the state mattered
    # Nothing else was lost either: model, optimizers, data position and codec residuals were
    # restored exactly, so the resumed run is the undisturbed one.
    for got, want in zip(rounds, ref_rounds):
        assert got["mean_train_loss"] == pytest.approx(want["mean_train_loss"], rel=1e-5), got["round"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["value"] == pytest.approx(ref_summary["eval"]["value"], abs=1e-9)
    assert summary["rounds"] == 14


def _kill_and_resume(tmp_path, cfg_map):
    """`geofed run` SIGKILLed after 6 rounds, then --resume to the end; returns what the test
    compares after: metrics.jsonl before the resume and the round it resumed from."""
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    proc = start_geofed(["run", _write(tmp_path, cfg_map), "--out", str(run_dir), "--quiet", "--no-report"],
                        cwd=tmp_path, log=log)
    tree: dict = {}
    try:
        wait_rounds(proc, run_dir, 6, timeout_s=240, log=log)
        tree = descendants(proc.pid)
        core = {i for i, cmd in tree.items() if "gcs_server" in cmd or "raylet" in cmd or "RegionActor" in cmd}
        assert len(core) == 2 + len(REGIONS), tree
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        # gcs and raylet notice their driver is gone and take the region actors (and their gRPC
        # servers) with them; Ray's agents linger longer: the resume ends them.
        assert not wait_gone(core, timeout_s=30), f"outlived the killed driver: {alive(core)}"
        before = (run_dir / "metrics.jsonl").read_bytes()
        logged_before = rounds_logged(run_dir)

        log2 = tmp_path / "resume.log"
        resumed = start_geofed(["run", "--resume", str(run_dir), "--quiet", "--no-report"], cwd=tmp_path, log=log2)
        assert resumed.wait(300) == 0, log2.read_text()[-4000:]
        assert not alive(set(tree)), f"left running after the resume: {alive(set(tree))}"
    finally:
        proc.kill()
        kill_exactly(set(tree))

    reaped = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "reaped_previous_driver"]
    assert all(p["pid"] not in {pid for pid, _ in core} for e in reaped for p in e["processes"])
    (resume_event,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resumed"]
    r = resume_event["from_checkpoint"]
    assert r >= logged_before - 2 and resume_event["lost_rounds"] == list(range(r + 1, logged_before))
    assert len(resume_event["lost_rounds"]) <= 1  # at most one round lost
    return before, r


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


# SIGTERM takes the same stop path as Ctrl-C (the signal's name and exit code differ): its run, a
# driver and a Ray of its own (17 s in CI), goes with the slow tests; Ctrl-C stays in the default suite.
@pytest.mark.parametrize("how", ["ctrl-c", pytest.param("sigterm", marks=pytest.mark.slow)])
def test_signal_stops_cleanly_with_a_checkpoint_and_no_orphans(tmp_path, how):
    # 40 ms each way paces rounds, so the signal lands mid-run.
    cfg_map = _config(rounds=400, latency_ms=40)
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_geofed(["run", _write(tmp_path, cfg_map), "--out", str(run_dir), "--no-report"], cwd=tmp_path, log=log)
    tree: dict = {}
    try:
        wait_rounds(proc, run_dir, 3, timeout_s=240, log=log)
        tree = descendants(proc.pid)
        started = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "started")
        addresses = [r["grpc_address"] for r in started["regions"].values()]
        assert all(_listening(a) for a in addresses)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # the whole foreground group, as a terminal does
        else:
            os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        code = proc.wait(120)
        text = log.read_text()
        assert code == (130 if how == "ctrl-c" else 143), text[-4000:]
        assert time.monotonic() - t0 < 90
        assert "stopping after the round in flight" in text and f"--resume {run_dir}" in text
        assert not wait_gone(set(tree), timeout_s=30), f"outlived a clean stop: {alive(set(tree))}"
        assert not any(_listening(a) for a in addresses)  # no gRPC server left behind
    finally:
        proc.kill()
        kill_exactly(set(tree))

    (stopped,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stopped"]
    last = stopped["last_round"]
    assert stopped["signal"] == ("SIGINT" if how == "ctrl-c" else "SIGTERM")
    assert [x["round"] for x in read_jsonl(run_dir / "rounds.jsonl")] == list(range(last + 1))
    # The round in flight finished and was checkpointed: nothing is lost.
    ckpt = checkpoint.load_latest(run_dir / "checkpoints" / "driver")
    assert ckpt is not None and ckpt[0] == last
    for region in REGIONS:
        assert checkpoint.list_rounds(run_dir / "checkpoints" / region)[-1] == last
    # A scheduler's stop still leaves the run's summary, marked as interrupted.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] == {"signal": stopped["signal"], "last_round": last}
    assert summary["rounds"] == last + 1 and summary["bytes_sent"] > 0
    # What --resume takes up (the same function, without starting Ray again): that round, with
    # nothing lost. (A full resume runs in the SIGKILL test above.)
    taken = load_driver_checkpoint(run_dir)
    assert taken.round == last and taken.lost == [] and taken.skipped == []
