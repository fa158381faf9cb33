"""The RoundHook seam (regions/hooks.py) on a real Region over the in-memory transport: each point
runs where the module docstring says, what a hook returns is what the round uses, and a method a
hook does not define is a no-op."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions.exchange import ExchangeResult
from geofed.regions.hooks import BeforeSend, RoundHook, overrides
from geofed.regions.region import Region
from geofed.regions.messages import RoundPlan


def _cfg(names=("a",), **security):
    return config_from_mapping({
        "run": {"seed": 0, "checkpoint_every": 0}, "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": list(names)}, "network": {"emulation": {"mode": "none"}},
        "sync": {"deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 5.0}}, "security": security,
    })


class _Recorder(RoundHook):
    """Records the points it is called at; plan doubles H, report adds a key."""

    def __init__(self):
        self.calls: list[str] = []

    def plan(self, plan):
        self.calls.append("plan")
        return dataclasses.replace(plan, H=2 * plan.H)

    def after_round(self, plan, metrics):
        self.calls.append(f"after_round:{metrics['steps']}")
        return metrics

    def report(self, plan, metrics):
        self.calls.append("report")
        metrics["recorded"] = plan.H


@pytest.fixture
def region(tmp_path):
    r = Region(_cfg(), "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()))
    yield r
    r.close()


def test_the_points_run_in_order_and_what_a_hook_returns_is_what_the_round_uses(region):
    rec = _Recorder()
    region.add_hook(rec)
    m = region.run_round(RoundPlan(round=0, H=3))
    assert rec.calls == ["plan", "after_round:6", "report"]  # the planned H doubled: 6 steps ran
    assert m.steps.steps == 6 and m.extra["recorded"] == 6 and m.H == 6  # a hook's own key is in extra


def test_the_payload_point_runs_every_hook_in_order_pacing_before_dp(region):
    """Pacing's step weight and DP are the region's hooks (regions/pacing.py, regions/privacy/dp.py):
    the weighted update is the one clipped, and a hook added later sees what they made."""
    from geofed.regions.pacing import StepWeight
    from geofed.regions.privacy.dp import DpHook

    kinds = [type(h) for h in region.hooks]
    assert kinds.index(StepWeight) < kinds.index(DpHook) and region.dp in region.hooks

    class Double(RoundHook):
        def payload(self, plan, tensors, metrics):
            return [2 * t for t in tensors]

    region.add_hook(Double())
    plan = RoundPlan(round=0, H=1, dp_mode="update", dp_clip=1.0, dp_noise=0.0)
    metrics = {"steps": 1}
    out = region.payload_hooks(plan, [torch.full((4,), 1.0)], metrics)  # norm 2 clipped to 1, then doubled
    assert torch.allclose(out[0], torch.full((4,), 1.0)) and metrics["dp_clip_scale"] == 0.5


def test_a_method_a_hook_leaves_out_is_a_no_op():
    class Nothing(RoundHook):
        pass

    plan, metrics = RoundPlan(round=0, H=1), {"steps": 1}
    h = Nothing()
    assert h.plan(plan) is plan and h.after_round(plan, metrics) is metrics
    assert h.exchange(plan, [], stream="") is None and h.recover(plan, FloatingPointError(), None) is None
    tensors, peers = [torch.zeros(1)], ["b"]
    assert h.before_send(0, tensors, peers) == (tensors, peers) and h.report(plan, metrics) is None
    assert h.payload(plan, tensors, metrics) is tensors and h.aggregate(plan, tensors) is None
    assert h.mix(plan, tensors, None, metrics) is tensors
    assert not any(overrides(h, name) for name in ("plan", "payload", "aggregate", "mix", "before_send", "exchange",
                                                    "after_round", "recover", "report"))
    assert overrides(_Recorder(), "plan") and not overrides(_Recorder(), "before_send")


def test_a_non_finite_round_goes_to_recover_and_without_one_it_fails(tmp_path):
    class Rejects(RoundHook):
        def after_round(self, plan, metrics):
            raise FloatingPointError("rejected by the hook")

    class Recovers(RoundHook):
        def recover(self, plan, error, metrics):
            return {**metrics, "recovered": str(error)}

    region = Region(_cfg(rollback_on_nonfinite=False), "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()))
    try:
        region.add_hook(Rejects())
        with pytest.raises(FloatingPointError, match="rejected by the hook"):
            region.run_round(RoundPlan(round=0, H=1))
        region.add_hook(Recovers())
        m = region.run_round(RoundPlan(round=1, H=1))
        assert m.extra["recovered"] == "rejected by the hook" and m.round == 1
    finally:
        region.close()


def test_with_rollback_on_a_rejected_round_is_rolled_back(region):
    """security.rollback_on_nonfinite (the default) is the Rollback hook: it recovers a round any hook rejects."""
    class Rejects(RoundHook):
        def after_round(self, plan, metrics):
            raise FloatingPointError("rejected by the hook")

    region.add_hook(Rejects())
    m = region.run_round(RoundPlan(round=0, H=2))
    assert m.security.rolled_back["why"] == "rejected by the hook" and m.steps.steps == 0


def test_before_send_changes_what_peers_receive_and_exchange_replaces_the_exchange(tmp_path):
    cfg = _cfg(names=("a", "b"), robust_aggregation="none", rollback_on_nonfinite=False, score_updates=False)
    hub = InMemoryHub()
    regions = {r: Region(cfg, r, tmp_path, transport=InMemoryTransport(r, hub)) for r in ("a", "b")}
    got: dict[str, list[torch.Tensor]] = {}
    sent: dict[str, list[torch.Tensor]] = {}

    class Zeroes(RoundHook):  # a's update goes out as zeros
        def before_send(self, round_, tensors, out_peers):
            assert (round_, list(out_peers)) == (0, ["b"])
            return [torch.zeros_like(t) for t in tensors], out_peers

    class Alone(RoundHook):  # b's exchange is the hook's: it sends nothing and takes nothing
        def exchange(self, plan, tensors, *, stream):
            sent["b"] = [t.clone() for t in tensors]
            return ExchangeResult(received={}, own_decoded={}, missing=[])

    def validate_b(sender, round_, payload):  # what reaches b from a, decoded
        got[sender] = regions["b"]._validate(sender, round_, payload)
        return got[sender]

    try:
        for w in regions.values():
            w.start()
        for w in regions.values():
            w.connect({r: "inmem" for r in regions})
        regions["b"].transport.mailbox.set_validator(validate_b)
        regions["a"].add_hook(Zeroes())
        assert isinstance(regions["a"].exchanger.before_send, BeforeSend)
        regions["b"].add_hook(Alone())
        assert regions["b"].exchanger.before_send is None  # no hook of b changes what it sends
        with ThreadPoolExecutor(2) as pool:
            out = dict(zip("ab", pool.map(lambda r: regions[r].run_round(RoundPlan(round=0, H=2)), "ab")))
        assert got["a"] and all(not t.any() for t in got["a"])  # a trained, yet sent zeros
        assert sent["b"] and any(t.any() for t in sent["b"])  # b's own update went to its hook...
        assert out["b"].exchange.bytes_sent == 0 and out["a"].exchange.peers_missing == ["b"]  # ...and nowhere else
    finally:
        for w in regions.values():
            w.close()
