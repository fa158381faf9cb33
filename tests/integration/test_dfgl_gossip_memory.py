"""GossipSync (CHOCO + gradient tracking) on real Regions over the in-memory transport
(geofed.regions.inprocess, what `geofed bench dfgl --in-process` runs): the same mailbox,
validator and exchanger as gRPC, without sockets or Ray, so lost messages and rejoins can be
staged exactly. The runtime over gRPC is in test_dfgl_runtime.py."""

from __future__ import annotations

import pytest
import torch
from geofed.compression import encode_update
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.summary import evaluate_average
from geofed.bench.dfgl_baselines import local_only
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.tasks import make_task
from geofed.regions.messages import RoundPlan

REGIONS = ["a", "b", "c", "d"]


def _cfg(path, regions, **sync):
    return config_from_mapping({
        "run": {"seed": 0},
        "task": {"kind": "gcn-planetoid", "path": str(path)},
        "regions": {"names": regions},
        "network": {"emulation": {"mode": "none"}},
        "sync": {"algorithm": "gossip", "topology": "ring", "inner": {"kind": "adamw", "lr": 0.01},
                 "gossip": {"choco": True, "gamma": 1.0, "tracking": True},
                 "deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 2.0}, **sync},
        "compression": {"codec": "int8", "error_feedback": False},
    })


class Cluster(InProcessRegions):
    """The workers of one run on one hub, with the rounds and checks these tests stage."""

    def round(self, r, *, alive=None, H=5):
        alive = tuple(alive or self.workers)
        # Gossip's keys (resynced, stale_peers, resync_bytes) are in the record's extra: tests read records.
        return {reg: m.to_record() for reg, m in self.run_round({reg: RoundPlan(round=r, H=H, alive=alive)
                                                                  for reg in alive}).items()}

    def copies_match(self):
        """Every region's copy of each in-neighbour equals that neighbour's own public copy."""
        out = {}
        for reg, w in self.workers.items():
            for peer, hat in w.algorithm.choco._hats.items():
                own = self.workers[peer].algorithm.choco.public_copy()
                out[f"{peer} at {reg}"] = all(torch.equal(x, y) for x, y in zip(hat, own))
        return out

    def average_accuracy(self):
        avg, _ = evaluate_average(self.cfg, self.call(lambda r: r.get_params()))
        return avg["value"]


@pytest.fixture
def cora(cora_npz):
    return cora_npz


@pytest.fixture
def cluster(cora, tmp_path):
    torch.set_num_threads(1)
    c = Cluster(_cfg(cora, REGIONS), tmp_path)
    yield c
    c.close()


def test_a_lost_message_is_resynced_and_leaves_every_copy_exact(cluster):
    # Round 3's message a -> b is lost: b must leave a out and resync its copy of a, not keep
    # applying a's later differences to a copy that missed one.
    resyncs = []
    for r in range(12):
        cluster.hub.set_link("a", "b", down=(r == 3))
        ms = cluster.round(r)
        if r == 3:
            assert ms["b"]["peers_missing"] == ["a"] and ms["b"]["stale_peers"] == ["a"]
            # a's public copy moved and b's copy of it did not: exactly what must not be mixed.
            assert cluster.copies_match() == {**{k: True for k in cluster.copies_match()}, "a at b": False}
        resyncs += [(r, reg, peer) for reg, m in ms.items() for peer in m["resynced"]]
        assert all(m["resync_bytes"] > 0 for m in ms.values() if m["resynced"])
    assert resyncs and {(reg, peer) for _, reg, peer in resyncs} == {("b", "a")}
    assert min(r for r, _, _ in resyncs) >= 4
    assert all(cluster.copies_match().values()), cluster.copies_match()
    task = make_task(cluster.cfg.task)
    assert cluster.average_accuracy() > local_only(task, 4, epochs=60, seed=0)["acc"] + 0.25


def test_a_region_that_rejoins_from_a_donor_is_resynced_by_its_neighbours(cluster):
    for r in range(4):
        cluster.round(r)
    cluster.round(4, alive=["a", "b", "d"])  # c has crashed
    c = cluster.restart("c")  # a crashed region comes back as a fresh worker
    _, donor_round = c.catch_up(["b", "d"])
    assert donor_round == 4 and c.algorithm.rejoined
    first = cluster.round(5)
    assert first["c"]["bytes_sent"] == 0  # rejoin round: silent, so that b and d see it missing
    assert "c" in first["b"]["peers_missing"] and "c" in first["d"]["peers_missing"]
    assert set(first["c"]["resynced"]) == {"b", "d"}  # c's copies came from the donor: pulled anew
    later = [cluster.round(r) for r in range(6, 12)]
    assert {reg for reg, m in later[0].items() if "c" in m["resynced"]} == {"b", "d"}
    assert all(cluster.copies_match().values()), cluster.copies_match()
    assert not any(m["stale_peers"] for m in later[-1].values())


def test_tracking_mixes_the_tracker_with_the_parameters(cora, tmp_path):
    # Two regions, exact (identity) gossip, gamma 1: one round leaves both with the same
    # parameters and the same y (exact averaging), and y is the average of the two regions' first gradients.
    cfg = _cfg(cora, ["a", "b"])
    cfg = config_from_mapping({**_mapping(cfg), "compression": {"codec": "identity", "error_feedback": False}})
    c = Cluster(cfg, tmp_path)
    try:
        c.round(0, H=3)
        a, b = (c.workers[r].algorithm for r in ("a", "b"))
        # (x + (x' - x) / 2 on each side: equal up to float rounding)
        assert torch.allclose(a.tracker.y, b.tracker.y, rtol=0, atol=1e-7)
        assert torch.allclose(a.tracker.y, (a.tracker.h + b.tracker.h) / 2, rtol=0, atol=1e-7)
        assert not torch.equal(a.tracker.h, b.tracker.h)  # the regions' gradients differ (non-IID)
        for pa, pb in zip(c.workers["a"].params, c.workers["b"].params):
            assert torch.allclose(pa, pb, rtol=0, atol=1e-6)
        # A message without the tracker half is refused by the validator.
        short = encode_update("identity", [p.detach() for p in c.workers["a"].params])
        with pytest.raises(ValueError, match="undecodable"):
            c.workers["b"]._validate("a", 1, memoryview(short))
    finally:
        c.close()


def _mapping(cfg):
    from geofed.orchestrator.config import to_mapping

    return to_mapping(cfg)
