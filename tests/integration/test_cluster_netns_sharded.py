"""The sharded exchange on a real multi-node Ray cluster over shaped links (issue 39, "sharding on real
links"): 2 regions of 2 nodes each, every node in its own network namespace with its own tbf-shaped
egress (benchmarks/bench/netns_cluster.py, ShapedNodesCluster), 40 ms one way between regions, none
inside one. `geofed run --address` from the head's namespace with regions.workers 2 and
regions.shard_exchange: worker k of a region runs on a node of its own and exchanges its shard with
worker k of the other region over its own gRPC server. Counted on the wire by the user-space router
(TCP payload to geofed's server ports on the other region's nodes): each node sends about half of its
region's WAN bytes (within 10%).

The exchange's wall time against one node a region is a bench, not asserted here (docs/regions-as-clusters.md).
Needs root and iproute2 (skipped with the reason otherwise); every process and namespace it started is
stopped by pid in the finalizer.
"""

from __future__ import annotations

import json
import secrets

import pytest

from geofed.bench.cluster_arms import common_mapping, write_config
from geofed.p2p.wan.kernel import kernel_unavailable

REASON = kernel_unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.skipif(REASON is not None, reason=f"the shaped cluster {REASON}")]

REGIONS = ("us-east-1", "eu-west-1")
ROUNDS = 4
SHARE_TOLERANCE = 0.10


def _mapping():
    m = common_mapping(regions=REGIONS, max_steps=0, rounds=ROUNDS)
    m["run"]["eval_every"] = ROUNDS
    m["regions"].update({"workers": 2, "shard_exchange": True, "num_cpus": 1})
    # no set-up probe: worker 0's would add bytes its followers do not send
    m["network"]["probe_s"] = 0
    m["security"]["score_updates"] = False
    m["sync"]["overlap"] = False
    m["sync"]["policy"] = {"kind": "fixed", "H": 20}
    m["compression"] = {"codec": "int8", "error_feedback": True}
    return m


def test_each_node_sends_half_its_regions_wan_bytes(tmp_path):
    from geofed.bench.netns_cluster import ShapedNodesCluster
    from geofed.orchestrator.config import config_from_mapping
    from geofed.orchestrator.launch.plan import build_plan

    mapping = _mapping()
    config = write_config(mapping, tmp_path / "sharded.yaml", target=None)
    plan = build_plan(config_from_mapping(json.loads(json.dumps(mapping)), source="sharded"))
    cluster = ShapedNodesCluster(plan, egress_mbps=50.0, latency_ms=40.0, prefix="gfs" + secrets.token_hex(2))
    with cluster:
        run = cluster.run(config, tmp_path / "run", timeout_s=240)
        run.check()
        sent = cluster.wan_bytes_by_node(run)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == ROUNDS * len(REGIONS) and all(not m["peers_missing"] for m in records)
    print(f"WAN payload by node: {sent}")
    for region in REGIONS:
        nodes = {n: b for n, b in sent.items() if cluster.region_of[n] == region}
        total = sum(nodes.values())
        counted = sum(m["bytes_sent"] for m in records if m["region"] == region)
        assert len(nodes) == 2 and total > 0
        # the wire carries geofed's counted bytes (its framing and TLS within a few percent)
        assert total == pytest.approx(counted, rel=0.10), (region, total, counted)
        for node, b in nodes.items():
            assert b == pytest.approx(total / 2, rel=SHARE_TOLERANCE), (region, node, nodes)
