"""Policies register like codecs and tasks: a kind from outside geofed loads, builds and runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from geofed.compression import CodecSpec
from geofed.orchestrator.config import config_from_mapping, to_mapping
from geofed.orchestrator.driver.coordinator import Coordinator
from geofed.orchestrator.policies import (
    AdacommPolicy,
    BandwidthPolicyConfig,
    Decision,
    FixedPolicy,
    FixedPolicyConfig,
    PolicyContext,
    make_policy,
    policy_config_class,
    policy_kinds,
    register_policy,
    registry,
)
from geofed.orchestrator.config.strict import ConfigError


# ---- a policy that is not geofed's: H halves every round, every link on the strongest rung ----
@dataclass(frozen=True, kw_only=True)
class HalvingPolicyConfig:
    kind: Literal["halving"] = "halving"
    H: int = field(default=64, metadata={"doc": "H of round 0"})
    floor: int = field(default=1, metadata={"doc": "smallest H"})

    def __post_init__(self):
        if not 1 <= self.floor <= self.H:
            raise ValueError(f"floor: must be in [1, H={self.H}], got {self.floor}")


class HalvingPolicy:
    kind = "halving"

    def __init__(self, cfg: HalvingPolicyConfig, codec: CodecSpec):
        self.cfg, self.codec, self.H = cfg, codec, cfg.H

    def decide(self, m) -> Decision:
        H, self.H = self.H, max(self.cfg.floor, self.H // 2)
        return Decision(H=H, codecs={link: self.codec for link in m.links}, default_codec=self.codec,
                        reason=f"halving: H={H}")

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "H": self.H}

    def load_state_dict(self, d) -> None:
        self.H = int(d["H"])


def make_halving(cfg: HalvingPolicyConfig, ctx: PolicyContext) -> HalvingPolicy:
    return HalvingPolicy(cfg, ctx.ladder[-1] if ctx.ladder else ctx.codec)


@pytest.fixture
def halving(monkeypatch):
    # The registry as it was comes back after the test (docs/CONFIG.md lists what is registered).
    monkeypatch.setattr(registry, "_POLICIES", dict(registry._POLICIES))
    register_policy("halving", config=HalvingPolicyConfig, factory=make_halving)


class ManualClock:
    t = 0.0

    def now(self) -> float:
        return self.t


def _cfg(policy, **compression):
    return config_from_mapping({
        "task": {"kind": "mlp-digits", "hidden": 8}, "regions": {"names": ["a", "b", "c"]},
        "network": {"emulation": {"mode": "none"}}, "sync": {"policy": policy},
        "compression": {"codec": "int8", **compression}}, source="plugin.yaml")


def test_a_policy_registered_from_outside_loads_and_runs_in_the_coordinator(halving):
    cfg = _cfg({"kind": "halving", "H": 40, "floor": 8}, ladder=["int8", {"kind": "topk", "inner": "int8"}])
    assert cfg.sync.policy == HalvingPolicyConfig(H=40, floor=8)
    c = Coordinator(cfg, model_numel=10_000, clock=ManualClock())
    Hs = []
    for r in range(4):
        plans = c.plan(r, alive=["a", "b", "c"], evaluate=False)
        assert set(plans) == {"a", "b", "c"} and len({p.H for p in plans.values()}) == 1
        Hs.append(plans["a"].H)
        assert plans["b"].codecs == {"a": CodecSpec.parse("topk(fraction=0.01,inner=int8)"),
                                     "c": CodecSpec.parse("topk(fraction=0.01,inner=int8)")}
    assert Hs == [40, 20, 10, 8] and c.last_reason == "halving: H=8"
    # Its state rides the coordinator's checkpoint; the config its run directory.
    again = Coordinator(_cfg({"kind": "halving", "H": 40, "floor": 8}), model_numel=10_000, clock=ManualClock())
    again.load_state_dict(c.state_dict())
    assert again.plan(4, alive=["a", "b"], evaluate=False)["a"].H == 8
    assert config_from_mapping(to_mapping(cfg)) == cfg


def test_the_loader_checks_a_registered_config_like_its_own(halving):
    assert policy_config_class("halving") is HalvingPolicyConfig and "halving" in policy_kinds()
    with pytest.raises(ConfigError, match=r"^plugin.yaml: sync.policy.floor: must be in \[1, H=4\], got 9$"):
        _cfg({"kind": "halving", "H": 4, "floor": 9})
    with pytest.raises(ConfigError, match=r"^plugin.yaml: sync.policy.step: unknown key \(known: kind, H, floor\)$"):
        _cfg({"kind": "halving", "step": 2})
    with pytest.raises(ConfigError, match=r"sync.policy.kind: unknown policy 'halve' \(known: adacomm, bandwidth, "
                                          r"fixed, halving\)$"):
        _cfg({"kind": "halve"})


def test_unknown_kinds_list_the_built_in_ones_in_one_line():
    with pytest.raises(ConfigError) as exc:
        _cfg({"kind": "halving"})
    assert str(exc.value) == "plugin.yaml: sync.policy.kind: unknown policy 'halving' (known: adacomm, bandwidth, fixed)"


def test_the_built_in_kinds_register_themselves():
    assert {"fixed", "bandwidth", "adacomm"} <= set(policy_kinds())
    assert isinstance(make_policy(FixedPolicyConfig(H=3), codec="int8"), FixedPolicy)
    p = make_policy(policy_config_class("adacomm")(base=BandwidthPolicyConfig()), codec={"kind": "int8"})
    assert isinstance(p, AdacommPolicy) and p.base.kind == "bandwidth" and p.base.ladder.specs == [CodecSpec.parse("int8")]


def test_registering_is_checked(halving):
    register_policy("halving", config=HalvingPolicyConfig, factory=make_halving)  # the same again: nothing happens

    @dataclass(frozen=True, kw_only=True)
    class Other:
        kind: str = "halving"

    with pytest.raises(ValueError, match="kind: policy 'halving' is already registered"):
        register_policy("halving", config=Other, factory=make_halving)
    with pytest.raises(ValueError, match="config: Other needs a field `kind` that defaults to 'other'"):
        register_policy("other", config=Other, factory=make_halving)
    with pytest.raises(ValueError, match="kind: a policy kind is lowercase"):
        register_policy("Bad Kind", config=Other, factory=make_halving)
    with pytest.raises(ValueError, match="config: expected a dataclass"):
        register_policy("other", config=dict, factory=make_halving)


def test_a_factory_must_return_a_policy(monkeypatch):
    monkeypatch.setattr(registry, "_POLICIES", dict(registry._POLICIES))
    register_policy("halving", config=HalvingPolicyConfig, factory=lambda cfg, ctx: object())
    with pytest.raises(TypeError, match="the 'halving' policy factory returned object, not a Policy"):
        make_policy(HalvingPolicyConfig(), codec="int8")
    with pytest.raises(TypeError, match="no policy for config dict"):
        make_policy({"kind": "fixed"}, codec="int8")
