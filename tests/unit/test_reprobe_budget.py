"""The re-prober's egress budget (regions/link_probe.py, Reprober; the rule in docs/p2p.md).

Real Exchanger, real in-memory transports and real LinkEstimators; only the clock is ours, so that
estimates go stale without waiting STALE_S seconds.
"""

from __future__ import annotations

import torch

from geofed.compression import CodecSpec
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.estimator import STALE_S, LinkEstimator
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions import link_probe
from geofed.regions.exchange import Exchanger


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _region(peers: list[str], clock: _Clock) -> tuple[Exchanger, list[InMemoryTransport]]:
    hub = InMemoryHub()
    transports = {r: InMemoryTransport(r, hub) for r in ["a", *peers]}
    addrs = {r: t.start() for r, t in transports.items()}
    for r, t in transports.items():
        t.mailbox.set_validator(lambda sender, round, payload: len(payload))
        t.connect({p: a for p, a in addrs.items() if p != r})
    ex = Exchanger(transports["a"], error_feedback=False, deadline=AdaptiveDeadline(0.05, 0.01, 1.0, 3.0),
                   send_timeout_s=5.0)
    ex.reprober = link_probe.Reprober(ex.links, ex.pool, send_timeout_s=ex.send_timeout_s, max_bytes=1 << 20,
                                      clock=clock)
    for p in peers:
        est = ex.estimators[p] = LinkEstimator(clock=clock)
        est.observe_rtt(0.05)
        est.set_bandwidth(20e6)
    return ex, list(transports.values())


def test_reprobes_of_many_stale_links_stay_within_the_budget_of_few_update_bytes():
    """Eight stale links, 200-byte updates for 60 (clock) seconds: each link is re-probed once (its
    free probe) and then only as the updates' bytes earn it. Before the budget: 24 re-probes (48
    probes), 24.0 MB against 0.30 MB of updates, a budget of 8.5 MB (every due link every
    REPROBE_MIN_INTERVAL_S)."""
    clock = _Clock()
    peers = [f"p{i}" for i in range(8)]
    ex, transports = _region(peers, clock)
    try:
        clock.t += 3 * STALE_S  # every estimate stale: confidence 1/8
        tensors, fp16 = [torch.randn(100)], CodecSpec.parse("fp16")
        records, update_bytes = [], 0
        for r in range(120):
            for t in transports[1:]:  # the peers take this round from `a` (each its own receiver)
                t.mailbox.expect(r, ["a"])
            res = ex.exchange(r, tensors, out_peers=peers, in_peers=[], codecs={}, default_codec=fp16)
            assert not res.send_failures, res.send_failures
            update_bytes += res.bytes_sent
            ex.reprober.wait(5.0)
            records += [t for t in res.transfers if t.get("reprobe")]
            clock.t += 0.5
        records += ex.reprober.take_records()
        probe_bytes = sum(t["bytes"] for t in records)
        first_pair: dict[str, int] = {}
        for t in records:  # each link's first re-probe (two probes) is the one it may always have
            if sum(1 for u in records[: records.index(t)] if u["peer"] == t["peer"]) < 2:
                first_pair[t["peer"]] = first_pair.get(t["peer"], 0) + t["bytes"]
        budget = link_probe.REPROBE_BUDGET_FRACTION * update_bytes + sum(first_pair.values())
        assert probe_bytes <= budget, (probe_bytes, update_bytes, len(records))
        assert set(first_pair) == set(peers)  # yet every stale link was checked once
        # Nothing else changes: the links the budget left unprobed keep their age and low confidence.
        assert all(ex.estimators[p].confidence < 0.5 for p in peers if p not in first_pair)
    finally:
        ex.close()
        for t in transports:
            t.close()


def test_a_doubted_link_is_reprobed_before_a_merely_stale_one():
    """The stale link's confidence (0.18, 2.5 STALE_S old) is under the doubted one's (0.25: 3 doubts,
    STALE_S / 2 old). Before: the least confident went first, the stale link."""
    clock = _Clock()
    ex, transports = _region(["stale", "doubted"], clock)
    try:
        clock.t += 2.0 * STALE_S
        ex.estimators["doubted"].set_bandwidth(20e6)
        clock.t += 0.5 * STALE_S
        ex.estimators["doubted"].doubts = 3
        assert ex.estimators["stale"].confidence < ex.estimators["doubted"].confidence < 0.5
        ex.reprober.after_round(["stale", "doubted"], [])
        ex.reprober.wait(5.0)
        assert {t["peer"] for t in ex.reprober.take_records()} == {"doubted"}
    finally:
        ex.close()
        for t in transports:
            t.close()


def test_update_bytes_earn_a_link_its_next_reprobe():
    """Past its first re-probe a stale link waits until 10% of the update bytes cover two probes;
    then it is probed again (the budget bounds re-probes, it does not end them). Before: the second
    re-probe went out on the interval alone (and Reprober had no count_updates / put_off)."""
    clock = _Clock()
    ex, transports = _region(["p0"], clock)
    try:
        rp = ex.reprober
        for _ in range(2):  # the first re-probe (free), then one the budget does not allow
            clock.t += 3 * STALE_S
            ex.estimators["p0"].set_bandwidth(20e6)  # the in-memory probe's reading is no link's: reset it
            clock.t += 3 * STALE_S
            rp.after_round(["p0"], [])
            rp.wait(5.0)
        assert len(rp.take_records()) == 2 and rp.put_off == 1
        rp.count_updates(int(rp.spent_bytes / link_probe.REPROBE_BUDGET_FRACTION))
        rp.after_round(["p0"], [])
        rp.wait(5.0)
        assert len(rp.take_records()) == 2 and rp.budget_left() >= 0
    finally:
        ex.close()
        for t in transports:
            t.close()
