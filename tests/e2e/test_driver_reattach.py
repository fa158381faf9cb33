"""Issue 41, item 3, end to end: regions outlive their driver (run.orphan_timeout_s,
orchestrator/driver/reattach.py).

`geofed run` joins the session's Ray (ray.address: a cluster that outlives its driver), so its
region actors are detached and named from the run. One run, hurt twice, asserted several ways:

1. its driver is SIGKILLed mid-run: the region processes live on; `--resume` re-attaches to
   them (the same pids, no new actor, no checkpoint restore) and redoes no round;
2. the resumed driver (which shortened run.orphan_timeout_s) is SIGKILLed too and nobody resumes
   within the timeout: the regions end themselves within the bound;
3. the next `--resume` finds them gone and falls back to the regions' checkpoints.

At the end the run equals an undisturbed one with the same seed (serial DiLoCo, digits, fixed H),
trained beside it in this process, every round logged once, and no region actor is left.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import yaml
from conftest import TEST_NODE_LABEL, TEST_NODE_VALUE
from e2e_harness import rounds_logged, start_geofed, train_reference, wait_rounds
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.reattach import RUN_NAMESPACE
from geofed.orchestrator.driver.rundir import read_jsonl

pytestmark = [pytest.mark.timeout(600)]

REGIONS = ["us-east-1", "eu-west-1"]
ROUNDS = 16
# The first driver's regions wait long enough for a resume to start on a loaded host (its look-up came
# 8-30 s after its launch at load averages of 25-50); the resumes shorten it (a key a resume may
# change, and the claim hands the new value to the live regions), so the second kill's orphans end soon.
FIRST_ORPHAN_S, ORPHAN_S = 180.0, 4.0
SHORTER = ["--set", f"run.orphan_timeout_s={ORPHAN_S:g}", "--allow-config-change", "run.orphan_timeout_s"]
# The orphan's watch (regions/warm.py): the driver's job is seen dead within _OWNER_CHECK_S (5 s) and a
# tick, then the timeout runs; Ray then takes a moment to end the process.
ORPHAN_BOUND_S = ORPHAN_S + 5.0 + 1.0 + 10.0


def _config() -> dict:
    return {
        "run": {"name": "reattach", "rounds": ROUNDS, "report": False, "checkpoint_every": 1, "seed": 5,
                "orphan_timeout_s": FIRST_ORPHAN_S},
        "task": {"kind": "mlp-digits", "hidden": 32},
        # 40x slower steps (a sleep: the same arithmetic) make a round last about a second, so each kill lands mid-run.
        "regions": {"names": REGIONS, "num_cpus": 0.5, "label_key": TEST_NODE_LABEL,
                    "labels": {r: TEST_NODE_VALUE for r in REGIONS},
                    "emulation": {"slowdown": {r: 40.0 for r in REGIONS}}},
        "network": {"emulation": {"mode": "none"}, "max_message_mb": 4},
        "sync": {"algorithm": "diloco", "policy": {"kind": "fixed", "H": 24}, "inner": {"lr": 0.003},
                 # Generous: a deadline miss would make the run differ from the reference.
                 "deadline": {"initial_s": 20.0, "min_s": 10.0, "max_s": 30.0}},
    }


def _events(run_dir, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_when(proc, run_dir, rounds: int, log) -> None:
    wait_rounds(proc, run_dir, rounds, timeout_s=240, log=log)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


@pytest.mark.slow  # a killed driver, two resumes and an orphan timeout beside a reference run: 2-3 minutes
@pytest.mark.usefixtures("ray_session")
def test_a_killed_drivers_regions_are_reattached_then_reaped_when_nobody_resumes(tmp_path):
    mapping = _config()
    address = ray.get_runtime_context().gcs_address
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**mapping, "ray": {"address": address}}))
    run_dir = tmp_path / "run"
    procs = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(train_reference, config_from_mapping(json.loads(json.dumps(mapping))), tmp_path / "reference")
        try:
            # 1. the first driver, killed after 4 rounds: its regions live on
            log = tmp_path / "first.log"
            procs.append(start_geofed(["run", str(config), "--out", str(run_dir), "--quiet", "--no-report"],
                                      cwd=tmp_path, log=log))
            _kill_when(procs[-1], run_dir, 4, log)
            (started,) = _events(run_dir, "started")
            pids = {r: i["pid"] for r, i in started["regions"].items()}
            time.sleep(1.0)
            assert all(_alive(p) for p in pids.values()), pids

            # ... and --resume re-attaches to them: same processes, same servers, state kept, no round redone
            log = tmp_path / "resume1.log"
            procs.append(start_geofed(["run", "--resume", str(run_dir), "--quiet", "--no-report", *SHORTER],
                                      cwd=tmp_path, log=log))
            logged = rounds_logged(run_dir)
            _kill_when(procs[-1], run_dir, logged + 3, log)
            (attached,) = _events(run_dir, "regions_reattached")
            assert attached["pids"] == pids and sorted(attached["regions"]) == sorted(REGIONS), attached
            assert attached["restored"] == [] and attached["gone"] == {}
            (resumed,) = _events(run_dir, "resumed")
            assert resumed["lost_rounds"] == []  # 0 rounds redone
            second = _events(run_dir, "started")[-1]
            assert {r: i["pid"] for r, i in second["regions"].items()} == pids
            assert ({r: i["grpc_address"] for r, i in second["regions"].items()}
                    == {r: i["grpc_address"] for r, i in started["regions"].items()})
            assert not any(e["who"] != "driver" for e in _events(run_dir, "checkpoint_skipped"))
            # every region re-attached: the checkpoint's link estimates stand, no set-up probes (setup.links_kept)
            probed = _events(run_dir, "links_probed")
            assert len(probed) == 2 and probed[1]["probes"] == {} and "re-attached" in probed[1]["skipped"], probed

            # 2. nobody resumes the second kill: the orphans end themselves within the bound
            t0 = time.monotonic()
            while any(_alive(p) for p in pids.values()) and time.monotonic() - t0 < ORPHAN_BOUND_S + 10:
                time.sleep(0.2)
            orphaned_s = time.monotonic() - t0
            print(f"orphans ended {orphaned_s:.1f} s after their driver's kill (run.orphan_timeout_s {ORPHAN_S:g})")
            assert not any(_alive(p) for p in pids.values()), f"orphans alive after {orphaned_s:.1f}s"
            assert ORPHAN_S <= orphaned_s <= ORPHAN_BOUND_S, orphaned_s

            # 3. a resume that came too late falls back to the regions' checkpoints, in new actors
            log = tmp_path / "resume2.log"
            procs.append(start_geofed(["run", "--resume", str(run_dir), "--quiet", "--no-report", *SHORTER],
                                      cwd=tmp_path, log=log))
            assert procs[-1].wait(300) == 0, log.read_text()[-4000:]
        finally:
            for p in procs:
                p.kill()
        ref_summary = reference.result()

    late = _events(run_dir, "regions_reattached")[-1]
    assert late["regions"] == [] and sorted(late["gone"]) == sorted(REGIONS) and sorted(late["restored"]) == sorted(REGIONS)
    assert len(_events(run_dir, "resumed")[-1]["lost_rounds"]) <= 1
    third = _events(run_dir, "started")[-1]
    assert not set(i["pid"] for i in third["regions"].values()) & set(pids.values())
    last_probes = _events(run_dir, "links_probed")[-1]  # new actors: their links measured again
    assert "skipped" not in last_probes and last_probes["probes"], last_probes
    # Every round once, and the run is the undisturbed one: state kept (1.) and restored (3.) exactly.
    rounds, ref_rounds = read_jsonl(run_dir / "rounds.jsonl"), read_jsonl(tmp_path / "reference" / "rounds.jsonl")
    assert [x["round"] for x in rounds] == list(range(ROUNDS))
    for got, want in zip(rounds, ref_rounds):
        assert got["mean_train_loss"] == pytest.approx(want["mean_train_loss"], rel=1e-5), got["round"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["value"] == pytest.approx(ref_summary["eval"]["value"], abs=1e-9)
    # The run's end kills its regions: no named actor of it is left, no process.
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == RUN_NAMESPACE]
    assert not names, names
    deadline = time.monotonic() + 20
    while any(_alive(i["pid"]) for i in third["regions"].values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(i["pid"]) for i in third["regions"].values())


@pytest.mark.slow  # a driver, a join under a new name, a kill and a resume that finishes the run: about a minute
@pytest.mark.usefixtures("ray_session")
def test_a_region_that_joined_mid_run_outlives_the_killed_driver_and_is_reattached(tmp_path, capsys):
    from geofed.orchestrator.cli import main

    # rounds to spare: the joiner's actor starts while the rounds go on (a few rounds, more on a loaded host)
    joiner, rounds = "ap-northeast-1", 16
    mapping = _config()
    mapping["run"].update({"name": "reattach-join", "rounds": rounds})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**mapping, "ray": {"address": ray.get_runtime_context().gcs_address}}))
    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    procs = [start_geofed(["run", str(config), "--out", str(run_dir), "--quiet", "--no-report"], cwd=tmp_path, log=log)]
    try:
        wait_rounds(procs[0], run_dir, 2, timeout_s=240, log=log)
        capsys.readouterr()
        assert main(["join", str(run_dir), "--region", joiner, "--label", TEST_NODE_VALUE, "--wait", "180"]) == 0
        joined = json.loads(capsys.readouterr().out)
        assert joined["event"] == "region_joined" and joined["new"] is True
        _kill_when(procs[0], run_dir, joined["first_round"] + 2, log)
        assert _alive(joined["pid"])  # detached: the driver's death did not take it

        log = tmp_path / "resume.log"
        procs.append(start_geofed(["run", "--resume", str(run_dir), "--quiet", "--no-report"], cwd=tmp_path, log=log))
        assert procs[-1].wait(300) == 0, log.read_text()[-4000:]
    finally:
        for p in procs:
            p.kill()
    (attached,) = _events(run_dir, "regions_reattached")
    # the joiner is looked up with the starting regions and kept as they are: same process, no restore
    assert sorted(attached["regions"]) == sorted([*REGIONS, joiner]), attached
    assert attached["pids"][joiner] == joined["pid"] and attached["restored"] == [] and attached["gone"] == {}
    assert _events(run_dir, "resumed")[-1]["lost_rounds"] == []
    assert not [e for e in _events(run_dir, "region_left") if e["region"] == joiner]
    rounds_run = read_jsonl(run_dir / "rounds.jsonl")
    assert [x["round"] for x in rounds_run] == list(range(rounds))
    assert joiner in rounds_run[-1]["regions_reported"]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == RUN_NAMESPACE]
    assert not names, names  # the run's end ended the joiner's named actor too
