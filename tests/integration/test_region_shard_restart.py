"""Issue 39: a worker SIGKILLed inside a region whose exchange is sharded (regions.shard_exchange,
regions/shards.py): the region fails (named, with the worker), the run goes on without it, and it is
rebuilt as an unsharded one is (orchestrator/driver/regroup.py). The rebuilt region's followers serve
their shards on new servers: the driver hands every region's worker 0 the new shard peers at the
rejoin's reconnect (orchestrator/driver/shards.py), so after it each worker of both regions
exchanges its shard again (both send, none missing). A follower's death first, then worker 0's in
the other region. One run of 4 actors (2 regions x 2 workers); the unsharded variant with an
undisturbed run alongside is test_region_workers_restart.py."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import ray
from geofed.orchestrator.driver.rundir import read_jsonl
from reliability_harness import BackgroundRun, events, pid_alive, small_config, wait_for

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow, pytest.mark.timeout(900)]

REGIONS = ["us-east-1", "eu-west-1"]
# No emulated WAN (the sharded exchange refuses the proxy: it shapes one link a pair of regions); a
# compute slowdown paces the rounds instead (x10 a step: ~0.2-0.4 s a round), so that the rebuilds
# (16-30 s each at load 20) end well before the run does.
ROUNDS = 250


def _cfg():
    cfg = small_config(regions=REGIONS, rounds=ROUNDS, H=10, run={"name": "shard-kill", "rounds": ROUNDS},
                       security={"score_updates": False},
                       sync={"policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.003, "lr_decay": "cosine"},
                             "deadline": {"initial_s": 3.0, "min_s": 0.5, "max_s": 4.0}})
    return dataclasses.replace(cfg, regions=dataclasses.replace(
        cfg.regions, workers=2, group_timeout_s=20, shard_exchange=True,
        emulation=dataclasses.replace(cfg.regions.emulation, slowdown={r: 10.0 for r in REGIONS})))


def _rejoined(run: BackgroundRun, region: str, n: int) -> bool:
    return len([e for e in events(run.run_dir, "region_rejoined") if e["region"] == region]) >= n


def test_a_killed_worker_of_a_sharded_region_is_rebuilt_and_exchanges_its_shard_again(tmp_path):
    run = BackgroundRun(_cfg(), tmp_path / "hurt").start()
    run.wait_rounds(4, timeout_s=240)
    actors = run.runner.actors
    follower_pid = ray.get(actors.workers["eu-west-1"][0].node_info.remote(), timeout=30)["pid"]
    lead_pids = {r: actors.info[r]["pid"] for r in REGIONS}
    os.kill(follower_pid, signal.SIGKILL)
    wait_for(lambda: _rejoined(run, "eu-west-1", 1) or run.rounds_done() >= ROUNDS, 240, "eu-west-1 to rejoin")
    os.kill(lead_pids["us-east-1"], signal.SIGKILL)
    wait_for(lambda: _rejoined(run, "us-east-1", 1) or run.rounds_done() >= ROUNDS, 300, "us-east-1 to rejoin")
    assert _rejoined(run, "us-east-1", 1), f"us-east-1 was not back before the run's end ({ROUNDS} rounds)"
    summary = run.join(timeout_s=300)
    assert run.error is None, run.error
    assert not pid_alive(follower_pid) and not pid_alive(lead_pids["us-east-1"])

    failed = {e["region"]: e for e in events(run.run_dir, "region_failed")}
    regrouped = {e["region"]: e for e in events(run.run_dir, "region_regrouped")}
    rejoined = {e["region"]: e for e in events(run.run_dir, "region_rejoined")}
    assert len(events(run.run_dir, "region_failed")) == 2 and set(failed) == set(REGIONS), failed
    assert failed["eu-west-1"]["worker"] == 1 and "worker 1 of 2 died" in failed["eu-west-1"]["why"], failed
    assert failed["us-east-1"]["worker"] == 0, failed
    assert regrouped["eu-west-1"]["replaced"] == [1] and regrouped["us-east-1"]["replaced"] == [], regrouped
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    both_back = max(rejoined[r]["round"] for r in REGIONS)
    for region, peer in (("eu-west-1", "us-east-1"), ("us-east-1", "eu-west-1")):
        back = rejoined[region]
        assert back["after"] == "restart" and back["donor"] == peer, back
        # worker 0 checked its workers' digests at every checkpoint after the rebuild (a mismatch fails the run)
        kept = sorted(int(p.stem.split("-")[1]) for p in (run.run_dir / "checkpoints" / region).glob("ckpt-*.pt"))
        assert kept and kept[-1] == ROUNDS - 1, kept
        # after both came back, every round of the region: both workers sent their shard, and got the peer's
        # (on a loaded 2-core host a round now and then misses its peer, sharded or not: at load 10, 29 of
        # 466 records, a peer left out as stalled or late; the shard mesh itself must be whole again)
        later = [m for m in records if m["region"] == region and m["round"] > both_back + 1]
        assert len(later) >= 50, (region, both_back, len(later))
        assert all(len(m["worker_bytes_sent"]) == 2 for m in later)
        whole = [m for m in later if min(m["worker_bytes_sent"]) > 0 and min(m["worker_bytes_received"]) > 0
                 and not m["peers_missing"]]
        assert len(whole) >= 0.8 * len(later), (region, len(whole), len(later))
        assert any(min(m["worker_bytes_sent"]) > 0 for m in later[-5:]), later[-5:]
    assert summary["faults"]["region_failures"] == 2 and summary["faults"]["region_restarts"] == 2
    assert summary["live_regions"] == {"started": REGIONS, "ended": REGIONS}
    assert summary["eval"]["value"] > 0.85, summary["eval"]  # it learned through both rebuilds
