"""The coordinator's link tracker and its policy glue: what the policy sees from region metrics."""

from __future__ import annotations

import pytest
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.coordinator import WARMUP_ROUNDS, Coordinator
from geofed.orchestrator.policies import BandwidthPolicyConfig
from geofed.orchestrator.policies.cost import H_for_sync, budget_for_H
from geofed.orchestrator.policies.links import LinkTracker


def test_small_transfers_measure_bandwidth_once_the_rtt_is_known():
    t = LinkTracker()
    t.observe("a->b", rtt_s=0.08, transfers=[(50_000, 0.08 + 50_000 * 8 / 5e6)])  # 50 kB at 5 Mbit/s
    est = t.estimate("a->b")
    assert est.rtt_s == pytest.approx(0.08)
    assert est.bandwidth_bps == pytest.approx(5e6, rel=1e-6)


def test_a_latency_bound_transfer_adds_no_bandwidth_sample():
    t = LinkTracker(min_exposed_fraction=0.25)
    t.observe("a->b", rtt_s=0.08, transfers=[(150_000, 0.08 + 150_000 * 8 / 25e6)])  # 48 ms exposed
    # 5 kB 3 ms over one RTT: p2p's fallback would read 0.5 Mbit/s, bits/exposed 13 Mbit/s; both noise.
    t.observe("a->b", rtt_s=0.08, transfers=[(5_000, 0.083)])
    assert t.estimate("a->b").bandwidth_bps == pytest.approx(25e6)
    u = LinkTracker()
    u.observe("a->b", rtt_s=0.08, transfers=[(5_000, 0.083)])
    assert u.estimate("a->b").bandwidth_bps is None and u.estimate("a->b").rtt_s == pytest.approx(0.08)


def test_an_inflated_rtt_is_bounded_by_the_transfers_themselves():
    t = LinkTracker()
    t.observe("a->b", rtt_s=0.33, transfers=[(20_000, 0.09)])  # a ping under load read 330 ms
    assert t.estimate("a->b").rtt_s == pytest.approx(0.09)
    t.observe("a->b", rtt_s=0.081, transfers=[(20_000, 0.09)])
    assert t.estimate("a->b").rtt_s == pytest.approx(0.081)


def test_a_large_drop_shows_at_once_noise_within_the_window_and_a_rise_at_once():
    t = LinkTracker(window=3, drop_ratio=3.0)
    fast, slow = 0.08 + 100_000 * 8 / 25e6, 0.08 + 100_000 * 8 / 2.5e6
    for _ in range(3):
        t.observe("a->b", rtt_s=0.08, transfers=[(100_000, fast)])
    t.observe("a->b", rtt_s=0.08, transfers=[(100_000, slow)])       # 10x: the link fell
    assert t.estimate("a->b").bandwidth_bps == pytest.approx(2.5e6)
    t.observe("a->b", rtt_s=0.08, transfers=[(100_000, fast)])       # a rise: at once
    assert t.estimate("a->b").bandwidth_bps == pytest.approx(25e6)
    noisy = 0.08 + 100_000 * 8 / 15e6                                # a loaded host: 40% slower
    seen = []
    for _ in range(3):
        t.observe("a->b", rtt_s=0.08, transfers=[(100_000, noisy)])
        seen.append(t.estimate("a->b").bandwidth_bps)
    assert seen[0] == pytest.approx(25e6) and seen[-1] == pytest.approx(15e6)  # the window's maximum


def test_observe_round_reads_region_metrics():
    t = LinkTracker()
    t.observe_round({"a": {"links": {"a->b": {"rtt_ms": 80.0}, "a->c": {"rtt_ms": 40.0}},
                           "transfers": [{"peer": "b", "direction": "send", "bytes": 200_000, "seconds": 0.16},
                                         {"peer": "b", "direction": "recv", "bytes": 9, "seconds": 9.0}]}})
    assert t.links() == ["a->b", "a->c"]
    assert t.estimate("a->b").bandwidth_bps == pytest.approx(200_000 * 8 / 0.08)
    assert t.estimate("a->c").bandwidth_bps is None and t.estimate("a->c").rtt_s == pytest.approx(0.04)
    state = t.state_dict()
    u = LinkTracker()
    u.load_state_dict(state)
    assert u.estimate("a->b") == t.estimate("a->b")


def test_overhead_raises_H_with_overlap_and_counts_as_sync_when_serial():
    # 10 ms of control plane per round at 5 ms steps, at most 5% of a round: 190 ms of compute.
    assert H_for_sync(0.1, 0.005, overlap=True, comm_fraction=0.05, margin=1.2, overhead=0.01) == pytest.approx(38)
    assert H_for_sync(0.1, 0.005, overlap=True, comm_fraction=0.05, margin=1.2, overhead=0.0) == pytest.approx(24)
    serial = H_for_sync(0.1, 0.005, overlap=False, comm_fraction=0.1, margin=1.2, overhead=0.02)
    assert serial == pytest.approx((0.1 + 0.02) * 9 / 0.005)
    assert budget_for_H(serial, 0.005, overlap=False, comm_fraction=0.1, margin=1.2, overhead=0.02) == pytest.approx(0.1)


class ManualClock:
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t


def _coordinator(policy, *, max_steps=0, rounds=100, overlap=True):
    cfg = config_from_mapping({
        "run": {"rounds": rounds, "max_steps": max_steps},
        "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["a", "b"]},
        "network": {"emulation": {"mode": "none"}},
        "sync": {"overlap": overlap, "policy": policy},
        "compression": {"codec": "int8"},
    })
    return Coordinator(cfg, model_numel=100_000, clock=ManualClock())


def _metrics(*, wall, step=0.005, H=20, transfer_s=0.1):
    def one(src, dst):
        return {"step_time_s": step, "train_loss": 1.0, "wall_s": wall, "sync_s": 0.0, "steps": H,
                "links": {f"{src}->{dst}": {"rtt_ms": 80.0}},
                "transfers": [{"peer": dst, "direction": "send", "bytes": 100_000, "seconds": transfer_s}]}
    return {"a": one("a", "b"), "b": one("b", "a")}


def test_max_steps_cuts_the_last_round_and_marks_it_final():
    c = _coordinator({"kind": "fixed", "H": 30}, max_steps=100)
    Hs, finals = [], []
    r = 0
    while not c.done:
        plans = c.plan(r, alive=["a", "b"], evaluate=False)
        Hs.append(plans["a"].H)
        finals.append(plans["a"].final)
        r += 1
    # 30, 30, then 40 (a remainder of 10 < H/2 joins the last round instead of a round of its own)
    assert Hs == [30, 30, 40] and sum(Hs) == 100
    assert finals == [False, False, True]
    assert "what is left of run.max_steps=100" in c.last_reason


def test_the_last_configured_round_is_final_without_a_step_budget():
    c = _coordinator({"kind": "fixed", "H": 5}, rounds=2)
    assert [c.plan(r, alive=["a", "b"], evaluate=False)["b"].final for r in range(2)] == [False, True]


def test_control_plane_overhead_reaches_the_policy_after_warmup():
    c = _coordinator({"kind": "bandwidth", "initial_H": 20, "hold_rounds": 0, "hysteresis": 0.0,
                      "target_comm_fraction": 0.05})
    assert isinstance(c.policy.cfg, BandwidthPolicyConfig)
    for r in range(WARMUP_ROUNDS + 5):
        plans = c.plan(r, alive=["a", "b"], evaluate=False)
        c.clock.t += 0.25  # the driver's cycle: the slowest region's 0.24 s + 10 ms of control plane
        c.observe(_metrics(wall=0.24, H=plans["a"].H))
    assert c.round_overhead_s == pytest.approx(0.01)
    rec = c.last_record["policy"]
    assert rec["round_overhead_s"] == pytest.approx(0.01)
    # sync 0.1 s (80 ms RTT + 20 ms of bytes) hides behind 24 steps; 10 ms at <= 5% needs 38 steps.
    assert rec["bound_by"] == "overhead" and c.last_H == 38
