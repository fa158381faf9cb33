"""regions.per_process: 4 regions in 2 Ray actor processes (regions/host.py) over the session's Ray,
gRPC with mutual TLS between every pair as with an actor a region; the same model as 4 processes."""

from __future__ import annotations

import pytest
import ray
import torch

from conftest import TEST_NODE_LABEL, TEST_NODE_VALUE

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.cluster import PlacementError, check_label_cpus
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner

pytestmark = pytest.mark.usefixtures("ray_session")

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"]


def _cfg(per_process: int):
    return config_from_mapping({
        "run": {"name": "t", "rounds": 3, "report": False, "seed": 5},
        "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": REGIONS, "num_cpus": 0.5, "per_process": per_process},
        "network": {"emulation": {"mode": "none"}, "probe_s": 0},
        "compression": {"codec": "identity"},
        # every region's every update in time on a loaded host: the two runs must mix the same updates
        "sync": {"topology": "ring", "policy": {"kind": "fixed", "H": 4}, "inner": {"lr": 0.01},
                 "deadline": {"min_s": 30}},
        "security": {"tls": True},
    })


def _run(cfg, run_dir):
    """Run `cfg`: each region's parameters at the end, the run's `started` event and its metrics."""
    runner = Runner(cfg, run_dir, show_progress=False)
    try:
        runner.run()
        handles = runner.opened.actors.handles
        params = {r: ray.get(handles[r].get_params.remote(), timeout=60) for r in REGIONS}
    finally:
        runner.shutdown()
    started = next(e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "started")
    return params, started, read_jsonl(run_dir / "metrics.jsonl")


def test_four_regions_in_two_processes_train_the_model_of_four(tmp_path):
    """2 processes host the 4 regions (the `started` event's pids), their rounds run side by side
    (a ring round waits on both neighbours, one of them in the same process: served one at a
    time, the exchange would wait out its 30 s deadline and mix fewer updates), and each region
    ends with the parameters it has as a process of its own, to float tolerance: the same seed, the
    same updates, each region's own torch generator (regions/inprocess.py's swap)."""
    packed, started, metrics = _run(_cfg(2), tmp_path / "packed")
    pids = {r: started["regions"][r]["pid"] for r in REGIONS}
    assert pids["us-east-1"] == pids["eu-west-1"] != pids["ap-northeast-1"] == pids["eu-central-1"]
    addresses = {started["regions"][r]["grpc_address"] for r in REGIONS}
    assert len(addresses) == 4  # a gRPC server each
    assert len(metrics) == 3 * 4
    for m in metrics:  # served one at a time, a region would miss its co-hosted neighbour, or wait 30 s for it
        assert m["peers_missing"] == [] and m["wait_s"] < 15, m
    alone, started_alone, _ = _run(_cfg(1), tmp_path / "alone")
    assert len({started_alone["regions"][r]["pid"] for r in REGIONS}) == 4
    for r in REGIONS:
        for a, b in zip(packed[r], alone[r]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_pinned_runs_cpus_are_counted_by_process():
    """On a cluster (pinned regions) the CPUs a label's nodes must hold are its processes': 4 regions
    of 1.5 CPUs in 2 processes fit the session's 4-CPU node, in 4 actors they do not."""
    def cfg(per_process):
        return config_from_mapping({
            "run": {"name": "t"}, "task": {"kind": "mlp-digits"},
            "regions": {"names": REGIONS, "num_cpus": 1.5, "per_process": per_process, "label_key": TEST_NODE_LABEL,
                        "labels": {r: TEST_NODE_VALUE for r in REGIONS}}})

    check_label_cpus(cfg(2), 1.5)
    with pytest.raises(PlacementError, match=f"{TEST_NODE_LABEL}={TEST_NODE_VALUE}: 4 region.s. x regions.num_cpus "
                                             "1.5 = 6 CPUs requested, its nodes have 4"):
        check_label_cpus(cfg(1), 1.5)
    with pytest.raises(PlacementError, match="3 process.es. of regions.per_process 2 x regions.num_cpus 1.5 = 4.5"):
        check_label_cpus(config_from_mapping({
            "run": {"name": "t"}, "task": {"kind": "mlp-digits"},
            "regions": {"names": REGIONS + ["sa-east-1", "us-west-2"], "num_cpus": 1.5, "per_process": 2,
                        "label_key": TEST_NODE_LABEL,
                        "labels": {r: TEST_NODE_VALUE for r in REGIONS + ["sa-east-1", "us-west-2"]}}}), 1.5)
