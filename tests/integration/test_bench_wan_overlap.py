"""DiLoCo with overlap on real RegionWorkers over the in-memory transport (geofed.regions.inprocess:
the same mailbox, validator, exchanger and codecs as gRPC, no sockets): the one-round-late outer
update, what each round reports, the final flush, and compute utilisation when a link is slow."""

from __future__ import annotations

import statistics

import pytest
import torch
from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan

REGIONS = ["a", "b", "c"]


def _cfg(*, overlap: bool, momentum: float = 0.5, codec: str = "identity", hidden: int = 32):
    return config_from_mapping({
        "run": {"seed": 0},
        "task": {"kind": "mlp-digits", "hidden": hidden},
        "regions": {"names": REGIONS},
        "network": {"emulation": {"mode": "none"}},
        "sync": {"algorithm": "diloco", "overlap": overlap, "inner": {"kind": "adamw", "lr": 0.003},
                 "outer": {"lr": 0.7, "momentum": momentum},
                 "deadline": {"initial_s": 10.0, "min_s": 5.0, "max_s": 10.0}},
        "compression": {"codec": codec, "error_feedback": False},
    })


class Cluster(InProcessRegions):
    def round(self, r: int, H: int, *, final: bool = False) -> dict[str, dict]:
        return {reg: m.to_record() for reg, m in self.run_round({reg: RoundPlan(round=r, H=H, final=final)
                                                                  for reg in REGIONS}).items()}


@pytest.fixture
def cluster_factory(tmp_path):
    made = []

    def make(cfg):
        c = Cluster(cfg, tmp_path / str(len(made)))
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def test_overlap_applies_each_exchange_one_round_late_and_keeps_own_progress(cluster_factory):
    c = cluster_factory(_cfg(overlap=True))
    w = c.workers["a"]
    g0 = [g.clone() for g in w.algorithm.eval_params()]
    m0 = c.round(0, H=5)
    # Round 0's exchange is in flight: the global model has not moved, nothing was reported sent...
    assert all(torch.equal(g, h) for g, h in zip(w.algorithm.eval_params(), g0))
    assert all(m["bytes_sent"] == 0 and m["exchange_round"] is None for m in m0.values())
    # ...and the region carries on from the global model plus its own round-0 progress.
    local0 = [p.detach().clone() for p in w.params]
    assert not all(torch.equal(p, g) for p, g in zip(local0, g0))
    m1 = c.round(1, H=5)
    assert all(m["exchange_round"] == 0 and m["bytes_sent"] > 0 and not m["peers_missing"] for m in m1.values())
    assert not all(torch.equal(g, h) for g, h in zip(w.algorithm.eval_params(), g0))
    # Identity codec, full topology: every region applied the same mixed update to the same model.
    ga = w.algorithm.eval_params()
    for other in ("b", "c"):
        assert all(torch.allclose(x, y) for x, y in zip(ga, c.workers[other].algorithm.eval_params()))
    m2 = c.round(2, H=5, final=True)
    # The final round reports its own exchange too (flushed) and leaves no update behind.
    sent_per_exchange = m1["a"]["bytes_sent"]
    assert m2["a"]["bytes_sent"] == pytest.approx(2 * sent_per_exchange, rel=0.01)
    assert not w.algorithm.overlap.in_flight
    models = [[p.detach() for p in c.workers[r].params] for r in REGIONS]
    assert all(torch.allclose(x, y) for x, y in zip(models[0], models[1]))
    assert all(torch.allclose(x, y) for x, y in zip(models[0], models[2]))


def test_overlap_trains_as_well_as_serial_with_momentum(cluster_factory):
    losses = {}
    for overlap in (False, True):
        c = cluster_factory(_cfg(overlap=overlap, momentum=0.5))
        rounds = [c.round(r, H=20, final=(r == 11)) for r in range(12)]
        losses[overlap] = [sum(m["train_loss"] for m in res.values()) / len(res) for res in rounds]
    # Both learn, and the one-round delay costs little (restarting from the bare global model
    # instead diverged with momentum; regions/sync/diloco.py).
    assert losses[True][-1] < 0.3 * losses[True][0]
    assert losses[True][-1] < 2.0 * losses[False][-1] + 0.05


def test_utilisation_with_a_slow_link_serial_pays_overlap_hides(cluster_factory):
    delay = 0.3
    util = {}
    for overlap in (False, True):
        c = cluster_factory(_cfg(overlap=overlap, hidden=512))
        for src in REGIONS:
            for dst in REGIONS:
                if src != dst:
                    c.hub.set_link(src, dst, delay_s=delay)
        res = c.round(0, H=50)
        step = max(m["step_time_s"] for m in res.values())
        H = int(2.5 * delay / step) + 1  # rounds long enough to hide the link
        rounds = [c.round(r, H=H) for r in range(1, 5)][1:]  # round 1 waits on round 0's exchange
        # The median of 9 readings: one region descheduled for a moment on a busy 2-core host is not
        # what this compares (the fresh-clone CI once read a minimum of 0.54 beside medians of 0.98).
        util[overlap] = statistics.median(m["utilization"] for res in rounds for m in res.values())
        serial_wait = [m["wait_s"] for res in rounds for m in res.values()]
        if not overlap:
            # The region sat waiting on the link: the median of the 9 readings. One reading counts from
            # when this region's own sends went out, and a peer that finished its compute sooner had its
            # push on the link before that (the fresh-clone CI of 1c7369c read a minimum of 0.223 s for
            # a 0.3 s link, the rollback copy's thread then sharing 2 cores with 3 regions' encodes).
            assert statistics.median(serial_wait) >= 0.8 * delay
        else:
            assert max(m["overlap_wait_s"] for res in rounds for m in res.values()) < 0.5 * delay
    assert util[True] >= 0.9
    assert util[False] <= 1 - 0.5 * delay / (2.5 * delay + delay)
    assert util[True] > util[False] + 0.1
