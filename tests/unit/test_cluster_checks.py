"""cluster_checks: how a run on the shaped cluster is held against its links (no cluster needed)."""

from __future__ import annotations

import json

import pytest

from geofed.bench.wan_arms import base_mapping

from geofed.bench.cluster_arms import common_mapping, write_config
from geofed.bench.cluster_checks import (
    LinkTruth,
    estimator_check,
    flow_class,
    ray_check,
    replay_H,
    traffic,
)
from geofed.orchestrator.config import load_config
from geofed.orchestrator.launch.plan import build_plan
from geofed.bench.netns_cluster import DriverRun, Snapshot

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"]
ADDR = {r: f"10.7.0.{i + 1}" for i, r in enumerate(REGIONS)}
LINKS = [f"{a}->{b}" for a in REGIONS for b in REGIONS if a != b]
TRUTH = LinkTruth(egress_mbps=50.0, payload_efficiency=1448 / 1500, rtt_ms={k: 81.0 for k in LINKS})


@pytest.fixture
def plan(tmp_path):
    return build_plan(load_config(write_config(common_mapping(), tmp_path / "c.yaml", target=None)))


def test_the_true_rate_is_the_egress_after_headers_shared_by_concurrent_pushes():
    assert TRUTH.rate_mbps(3) == pytest.approx(50 * 1448 / 1500 / 3) == pytest.approx(16.089, abs=1e-3)
    assert TRUTH.rate_mbps(1) == pytest.approx(48.267, abs=1e-3)


def test_flows_are_geofeds_by_its_grpc_ports_and_rays_by_the_plans(plan):
    from geofed.bench.cluster_checks import ray_ports

    named, workers = ray_ports(plan)
    g = tuple(plan.ports["between_nodes"]["geofed_grpc"])
    assert flow_class(("a", "b", 6, 40000, g[0]), g, named, workers) == "geofed"
    assert flow_class(("a", "b", 6, g[0], 40000), g, named, workers) == "geofed"
    assert flow_class(("a", "b", 6, 40000, 6379), g, named, workers) == "ray:gcs"
    assert flow_class(("a", "b", 6, 8077, 40000), g, named, workers) == "ray:object_manager"
    assert flow_class(("a", "b", 6, 40000, workers[0] + 3), g, named, workers) == "ray:worker"
    assert flow_class(("a", "b", 6, 40000, 40001), g, named, workers) == "other"


def test_traffic_puts_bytes_to_links_classes_and_phases(plan, tmp_path):
    g = plan.ports["between_nodes"]["geofed_grpc"][0]
    us, eu = ADDR["us-east-1"], ADDR["eu-west-1"]
    push = (us, eu, 6, 41000, g)        # us-east-1's channel to eu-west-1's server
    reply = (eu, us, 6, g, 41000)
    gcs = (eu, us, 6, 42000, 6379)      # eu-west-1's node to the head's GCS
    snaps = [Snapshot("launch", 0.0, {}),
             Snapshot("started", 10.0, {gcs: (10, 5000, 4000)}),
             Snapshot("round 0", 11.0, {gcs: (12, 6000, 4800), push: (70, 100_000, 96_000), reply: (30, 2000, 400)}),
             Snapshot("end", 13.0, {gcs: (14, 7000, 5600), push: (71, 100_200, 96_100), reply: (31, 2100, 420)})]
    run = DriverRun(run_dir=tmp_path, returncode=0, output="", snapshots=snaps)
    t = traffic(run, plan, ADDR, "started", "round 0")
    assert t["us-east-1->eu-west-1"]["geofed"] == {"ip": 100_000, "payload": 96_000, "packets": 70}
    assert t["eu-west-1->us-east-1"]["geofed:replies"]["payload"] == 400
    assert t["eu-west-1->us-east-1"]["ray:gcs"]["ip"] == 1000
    r = ray_check(run, plan, ADDR)
    assert r["rounds"] == 1
    assert r["phases"]["startup"]["ray_by_port"] == {"ray:gcs": 5000}
    assert r["phases"]["training"]["ray_ip"] == 1000 and r["phases"]["training"]["geofed_ip"] == 102_000
    assert r["phases"]["end"]["ray_ip"] == 1000 and r["phases"]["end"]["seconds"] == 2.0


def _run_dir(tmp_path, rounds):
    d = tmp_path / "run"
    d.mkdir()
    write_config(common_mapping(), d / "config.yaml", target=None)
    (d / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    return d


def _round(i, H, mbps, *, step=0.0045, overhead=None):
    links = {k: {"bandwidth_mbps": mbps, "rtt_ms": 81.0} for k in LINKS}
    policy = {"links": links} if mbps is None else {"links": links, "step_time_s": step, "round_overhead_s": overhead}
    return {"round": i, "H": H, "t_start": float(i), "t_end": i + 1.0, "policy": policy, "links": {}}


def test_the_estimate_by_the_end_of_round_1_is_what_round_2_is_decided_with(tmp_path):
    d = _run_dir(tmp_path, [_round(0, 50, None), _round(1, 509, 3.7), _round(2, 509, 15.0)])
    est = estimator_check(d, TRUTH)
    assert est["decides_round"] == 2 and len(est["links"]) == 12
    assert {e["ratio"] for e in est["links"].values()} == {round(15.0 / TRUTH.rate_mbps(3), 4)}


def test_H_is_replayed_with_the_true_rates_on_the_runs_step_times(tmp_path):
    # what issue 14 saw: 3.7 Mbit/s read after round 0 sent H from 50 to ~500; at 16 Mbit/s the
    # same policy on the same step time wants about half
    d = _run_dir(tmp_path, [_round(0, 50, None), _round(1, 509, 3.7), _round(2, 509, 12.0)])
    rows = replay_H(d, TRUTH)
    initial = base_mapping("multi-region.yaml")["sync"]["policy"]["initial_H"]
    assert [r["H_true_rates"] for r in rows][0] == initial      # round 0: no step time measured either way
    assert rows[1]["H"] == 509 and rows[1]["H_true_rates"] < 509 / 1.25
    assert rows[1]["ratio"] == pytest.approx(509 / rows[1]["H_true_rates"], abs=1e-3)
