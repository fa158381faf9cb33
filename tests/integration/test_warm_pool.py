"""Issue 14, faster start: with ray.warm_pool_s the region actors outlive their run and the next
run on the same cluster adopts them (the same processes, no new Python and imports); a reused
actor that is SIGKILLed is restarted by Ray into the run that holds it now (its saved assignment,
not its creation arguments), rejoins, and the run trains on; idle pooled actors end themselves
after ray.warm_pool_s, and a run without the pool ends those it finds idle (their CPUs)."""

from __future__ import annotations

import os
import signal

import pytest
import ray
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner
from geofed.orchestrator.driver.warmpool import claim_pooled
from geofed.regions.warm import POOL_NAMESPACE, job_alive
from reliability_harness import BackgroundRun, events, pid_alive, small_config, wait_for

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(420)]

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1"]
VICTIM = "eu-west-1"
# 100 ms each way paces a round at >= ~0.3 s, so the run lasts >= 60 s and a restart (10-20 s
# here: a new Python with torch) happens well inside it. Three regions: with two, the survivor's
# rounds had no exchange to pace them once the victim was down, and a quiet host ran the rest of
# the run in 3 s, before the restarted region was back.
ROUNDS = 200


def _cfg(warm_s: float, *, rounds: int, seed: int = 0):
    return small_config(regions=REGIONS, rounds=rounds, ray={"warm_pool_s": warm_s},
                        run={"name": "warm", "rounds": rounds, "seed": seed, "eval_every": rounds},
                        network={"emulation": {"mode": "proxy", "preset": None,
                                               "default": {"latency_ms": 100, "bandwidth_mbps": 200, "jitter_ms": 0,
                                                           "loss": 0}}})


def _pooled() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == POOL_NAMESPACE]


def _pids(run_dir) -> dict[str, int]:
    started = events(run_dir, "started")[0]
    return {r: i["pid"] for r, i in started["regions"].items()}


@pytest.mark.slow  # ~70 s (200 paced rounds while a region restarts): the default suite's longest test
def test_second_run_reuses_warm_actors_and_a_restarted_one_joins_the_current_run(tmp_path):
    first = Runner(_cfg(60, rounds=3), tmp_path / "first", show_progress=False)
    try:
        first.run()
    finally:
        first.shutdown()
    first_pids = _pids(tmp_path / "first")
    assert all(pid_alive(p) for p in first_pids.values())  # kept for the next run
    assert len(_pooled()) == len(REGIONS)

    # Another run (its own seed, RUN_DIR, TLS material) on the same cluster: the same processes.
    second = BackgroundRun(_cfg(3, rounds=ROUNDS, seed=1), tmp_path / "second").start()
    second.wait_rounds(4, timeout_s=180)
    pids = _pids(tmp_path / "second")
    assert sorted(pids.values()) == sorted(first_pids.values())  # any region may get any idle actor
    starts = events(tmp_path / "second", "started")[0]["regions"]
    assert all(i["start"]["reused"] for i in starts.values())
    os.kill(pids[VICTIM], signal.SIGKILL)
    summary = second.join(timeout_s=300)
    assert second.error is None, second.error

    back = events(tmp_path / "second", "region_rejoined")
    assert [e["region"] for e in back] == [VICTIM] and back[0]["pid"] != pids[VICTIM]
    # Restarted into this run: it restored this run's checkpoint and trained to its last round.
    assert 0 <= back[0]["restored_round"] < back[0]["round"]
    victim_rounds = [m["round"] for m in read_jsonl(tmp_path / "second" / "metrics.jsonl") if m["region"] == VICTIM]
    assert victim_rounds[-1] == ROUNDS - 1
    assert summary["eval"]["value"] > 0.5  # ten digits: chance is 0.1

    # Idle after the run: each ends itself after ray.warm_pool_s (3 s), the restarted one too.
    last_pids = [second.runner.actors.info[r]["pid"] for r in REGIONS]
    wait_for(lambda: not any(pid_alive(p) for p in last_pids) and not _pooled(), 60, "idle pooled actors to end",
             every_s=0.5)


def test_a_run_without_the_pool_ends_idle_pooled_actors(tmp_path):
    first = Runner(_cfg(600, rounds=2), tmp_path / "first", show_progress=False)
    try:
        first.run()
    finally:
        first.shutdown()
    pids = _pids(tmp_path / "first")
    assert all(pid_alive(p) for p in pids.values()) and len(_pooled()) == len(REGIONS)
    # What a run with ray.warm_pool_s 0 does before it creates its actors.
    taken, _ = claim_pooled(_cfg(0, rounds=2), 0.5, pin=False)
    assert taken == {}
    wait_for(lambda: not any(pid_alive(p) for p in pids.values()) and not _pooled(), 60,
             "idle pooled actors to be ended", every_s=0.5)


def test_a_held_actor_tells_a_live_driver_from_a_gone_one():
    # What a held actor's watchdog asks every few seconds: a crashed `geofed run` never releases it.
    assert job_alive(ray.get_runtime_context().get_job_id())
    assert not job_alive("ffffffff") and not job_alive(None)
