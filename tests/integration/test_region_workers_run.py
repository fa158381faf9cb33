"""regions.workers: a region of several worker actors (regions/workers.py) over the session's Ray:
2 regions x 2 workers, data-parallel inner steps, worker 0's exchange broadcast to the other."""

from __future__ import annotations

import pytest
import ray
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.cluster import PlacementError, region_cpus
from geofed.orchestrator.driver.coordinator import Coordinator
from geofed.orchestrator.driver.rundir import Clock, read_jsonl
from geofed.orchestrator.driver.run import Runner
from geofed.regions.inprocess import InProcessRegions

pytestmark = pytest.mark.usefixtures("ray_session")

REGIONS = ["us-east-1", "eu-west-1"]


def _cfg(workers: int, batch: int):
    return config_from_mapping({
        # a checkpoint every round: worker 0 checks there that its workers hold its model bitwise
        "run": {"name": "t", "rounds": 2, "report": False, "seed": 3, "checkpoint_every": 1},
        "task": {"kind": "mlp-digits", "hidden": 16},
        # 4 actors on the session's 4 CPUs
        "regions": {"names": REGIONS, "num_cpus": 0.5, "workers": workers, "group_timeout_s": 30},
        "network": {"emulation": {"mode": "none"}, "probe_s": 0},
        "compression": {"codec": "identity"},
        # a loaded host must not make an update late: the comparison needs every region's every round
        "sync": {"policy": {"kind": "fixed", "H": 3}, "inner": {"lr": 0.01, "batch_size": batch},
                 "deadline": {"min_s": 30}},
    })


def _params(actors, region):
    """Worker 0's parameters, then the other workers'."""
    return ([ray.get(actors.handles[region].get_params.remote(), timeout=60)]
            + [ray.get(w.get_params.remote(), timeout=60) for w in actors.workers.get(region, [])])


def _run(cfg, run_dir):
    """Run `cfg`; each region's parameters after the run, and its records. Then each region's worker
    0 restores its round-0 checkpoint (its state changes beyond a step: the whole state goes to
    the other workers before the next step or check) and checkpoints again (the check passes only
    if the other worker took it): their parameters are round 0's, equal again."""
    runner = Runner(cfg, run_dir, show_progress=False)
    try:
        runner.run()
        actors = runner.opened.actors
        params = {r: _params(actors, r) for r in REGIONS}
        for r in REGIONS:
            assert ray.get(actors.handles[r].restore_checkpoint.remote(0), timeout=60)["round"] == 0
            ray.get(actors.handles[r].save_checkpoint.remote(), timeout=60)
            lead, *others = _params(actors, r)
            assert not all(torch.equal(a, b) for a, b in zip(lead, params[r][0]))  # round 0's model, not the last
            assert all(torch.equal(a, b) for other in others for a, b in zip(lead, other))
    finally:
        runner.shutdown()
    return params, read_jsonl(run_dir / "metrics.jsonl")


def _run_in_process(cfg, run_dir):
    """The same rounds, 1 worker a region, without Ray (regions/inprocess.py: the same Regions
    over the in-memory transport; its runs match Ray's): its parameters and reports."""
    with InProcessRegions(cfg, run_dir) as group:
        coordinator = Coordinator(cfg, model_numel=1, clock=Clock())
        reports = []
        for r in range(cfg.run.rounds):
            results = group.run_round(coordinator.plan(r, alive=REGIONS, evaluate=False))
            coordinator.observe(results)
            reports += [m.to_record() for m in results.values()]
        return {r: [p] for r, p in group.call(lambda w: w.get_params()).items()}, reports


def test_two_workers_a_region_match_one_worker_with_twice_the_batch(tmp_path):
    """One run of each, asserted several ways. Workers of a region hold bitwise-equal models after
    every round (worker 0's checkpoint each round compares every worker's digest, and fails the
    run otherwise) and at the end (their parameters compared here); and 2 workers x batch 8 give the model 1 worker x batch 16 gives: each step's
    examples are the same 16 (worker k takes every 2nd batch of the region's stream), the mean
    gradient of two halves differs from the whole's only by float rounding (atol 1e-5 after 6
    AdamW steps and 2 outer steps; measured ~1e-7)."""
    two, two_metrics = _run(_cfg(2, 8), tmp_path / "two")
    one, one_metrics = _run_in_process(_cfg(1, 16), tmp_path / "one")
    for r in REGIONS:
        lead, other = two[r]
        assert all(torch.equal(a, b) for a, b in zip(lead, other)), f"{r}: its workers' parameters differ"
        assert list((tmp_path / "two" / "checkpoints" / r).glob("*")), "no checkpoint: no check of the workers ran"
        assert len(one[r]) == 1
        for a, b in zip(lead, one[r][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert not all(torch.equal(a, b) for a, b in zip(lead, one[r][0])), "suspiciously bitwise equal"
    # The region's loss is the mean over its workers' batches: the 16-example loss, within rounding.
    for a, b in zip(sorted(two_metrics, key=lambda m: (m["round"], m["region"])),
                    sorted(one_metrics, key=lambda m: (m["round"], m["region"]))):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
        assert a["steps"] == b["steps"] == 3 and not a["peers_missing"] and not b["peers_missing"]
        # worker 0 sends the region's whole update (gRPC's and the in-memory hub's framing differ by a few bytes)
        assert a["bytes_sent"] == pytest.approx(b["bytes_sent"], rel=0.01) and a["bytes_sent"] > 0


def test_every_worker_counts_in_the_cpus_asked_of_ray():
    """region_cpus: N workers a region ask N x what one does; the error's arithmetic says so."""
    total = ray.cluster_resources()["CPU"]
    names = [f"r{i}" for i in range(4)]
    base = {"run": {"name": "cpus"}, "task": {"kind": "mlp-digits"}, "network": {"emulation": {"mode": "none"}}}
    fitted = region_cpus(config_from_mapping({**base, "regions": {"names": names, "workers": 4}}), pin=False)
    assert fitted == min(0.5, total / 16) and 16 * fitted <= total
    too_many = config_from_mapping({**base, "regions": {"names": names, "workers": 4, "num_cpus": total / 8}})
    with pytest.raises(PlacementError, match=rf"4 regions x regions.workers 4 x regions.num_cpus {total / 8:g} = "
                                             rf"{2 * total:g} CPUs requested"):
        region_cpus(too_many, pin=False)
