"""The coordinator's view of the regions' link estimates and its policy glue: what the policy sees."""

from __future__ import annotations

import pytest
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.coordinator import WARMUP_ROUNDS, Coordinator
from geofed.orchestrator.policies import BandwidthPolicyConfig
from geofed.orchestrator.policies.cost import H_for_sync, budget_for_H
from geofed.orchestrator.policies import LinkEstimate
from geofed.orchestrator.policies.links import LinkView
from support.reports import report


def test_the_view_keeps_each_links_last_known_figures():
    v = LinkView()
    v.observe_round({"a": {"links": {"a->b": {"bandwidth_mbps": 16.0, "rtt_ms": 80.0, "concurrent": 3},
                                     "a->c": {"bandwidth_mbps": None, "rtt_ms": 40.0}}}})
    assert v.links() == ["a->b", "a->c"]
    assert v.estimate("a->b") == LinkEstimate(bandwidth_bps=16e6, rtt_s=0.08, concurrent=3)
    assert v.estimate("a->c").bandwidth_bps is None and v.estimate("a->c").rtt_s == pytest.approx(0.04)
    # A restarted region reports a link it has not measured yet: the last known bandwidth stays.
    v.observe_round({"a": {"links": {"a->b": {"bandwidth_mbps": None, "rtt_ms": 81.0}}}})
    assert v.estimate("a->b").bandwidth_bps == 16e6 and v.estimate("a->b").rtt_s == pytest.approx(0.081)
    u = LinkView()
    u.load_state_dict(v.state_dict())
    assert u.estimate("a->b") == v.estimate("a->b")
    assert v.estimate("x->y") == LinkEstimate()


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


def _coordinator(policy, *, max_steps=0, rounds=100, overlap=True, eval_at_steps=(), fragments=1):
    cfg = config_from_mapping({
        "run": {"rounds": rounds, "max_steps": max_steps, "eval_at_steps": list(eval_at_steps)},
        "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["a", "b"]},
        "network": {"emulation": {"mode": "none"}},
        "sync": {"overlap": overlap, "policy": policy, "fragments": fragments},
        "compression": {"codec": "int8"},
    })
    return Coordinator(cfg, model_numel=100_000, clock=ManualClock())


def _metrics(*, wall, step=0.005, H=20):
    def one(src, dst):
        # 100 kB updates at 40 Mbit/s over 80 ms: a sync of 0.1 s
        return report(region=src, step_time_s=step, train_loss=1.0, wall_s=wall, sync_s=0.0, steps=H,
                      links={f"{src}->{dst}": {"rtt_ms": 80.0, "bandwidth_mbps": 40.0}})
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


def test_eval_at_steps_cuts_the_round_that_would_pass_a_mark_and_evaluates_it():
    c = _coordinator({"kind": "fixed", "H": 30}, max_steps=100, eval_at_steps=(45, 60))
    rounds = []
    r = 0
    while not c.done:
        plans = c.plan(r, alive=["a", "b"], evaluate=False)
        rounds.append((plans["a"].H, plans["a"].evaluate, c.steps_done))
        r += 1
    # 30, then 15 to reach 45 (evaluated), 15 to 60 (evaluated), then 40 to the budget
    assert rounds == [(30, False, 30), (15, True, 45), (15, True, 60), (40, False, 100)]
    assert "run.eval_at_steps" not in c.last_reason


def test_eval_at_steps_evaluates_a_round_that_ends_on_a_mark_without_cutting_and_cuts_fragment_rounds():
    c = _coordinator({"kind": "fixed", "H": 30}, max_steps=90, eval_at_steps=(60,))
    got = [(p["a"].H, p["a"].evaluate) for p in (c.plan(r, alive=["a", "b"], evaluate=False) for r in range(3))]
    assert got == [(30, False), (30, True), (30, False)]
    f = _coordinator({"kind": "fixed", "H": 40}, eval_at_steps=(50,), fragments=4)  # rounds of H/4 = 10 steps
    hs = [f.plan(r, alive=["a", "b"], evaluate=False)["a"] for r in range(6)]
    assert [(p.H, p.evaluate) for p in hs] == [(10, False)] * 4 + [(10, True), (10, False)]


@pytest.mark.parametrize("steps,message", [([0], "every step count must be in [1, 1e12]"),
                                           ([800, 300], "must be increasing, without repeats"),
                                           ([5, 5], "must be increasing, without repeats")])
def test_eval_at_steps_refuses_bad_lists(steps, message):
    with pytest.raises(ValueError, match=r"run\.eval_at_steps: " + message.replace("[", r"\[").replace("]", r"\]")):
        config_from_mapping({"run": {"eval_at_steps": steps}, "task": {"kind": "mlp-digits"},
                             "network": {"emulation": {"mode": "none"}}})
    with pytest.raises(ValueError, match="run.eval_at_steps: time-budget rounds"):
        config_from_mapping({"run": {"eval_at_steps": [10]}, "task": {"kind": "mlp-digits"},
                             "sync": {"pacing": {"mode": "time-budget"}}, "network": {"emulation": {"mode": "none"}}})


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
