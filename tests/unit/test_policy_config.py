"""sync.policy configs: defaults, value checks naming the key, strict loading through the schema."""

import pytest

from geofed.orchestrator.config import strict
from geofed.orchestrator.config import SyncSection
from geofed.orchestrator.policies import (AdacommPolicyConfig, BandwidthPolicyConfig, FixedPolicyConfig,
                                          policy_config_class)
from geofed.orchestrator.config.strict import ConfigError


def test_registry_knows_every_kind():
    assert policy_config_class("fixed") is FixedPolicyConfig
    assert policy_config_class("bandwidth") is BandwidthPolicyConfig
    assert policy_config_class("adacomm") is AdacommPolicyConfig
    with pytest.raises(KeyError, match="known: adacomm, bandwidth, fixed"):
        policy_config_class("deco")


@pytest.mark.parametrize("kwargs, key", [
    ({"target_comm_fraction": 0.0}, "target_comm_fraction"),
    ({"target_comm_fraction": 1.0}, "target_comm_fraction"),
    ({"H_min": 0}, "H_min"),
    ({"H_min": 20, "H_max": 10}, "H_min"),
    ({"initial_H": 20_000}, "initial_H"),
    ({"target_H": 0}, "target_H"),
    ({"overlap_margin": 0.5}, "overlap_margin"),
    ({"rtt_factor": -1.0}, "rtt_factor"),
    ({"hysteresis": 1.0}, "hysteresis"),
    ({"hold_rounds": -1}, "hold_rounds"),
])
def test_bandwidth_config_rejects_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ValueError) as exc:
        BandwidthPolicyConfig(**kwargs)
    assert str(exc.value).startswith(f"{key}: ")


@pytest.mark.parametrize("kwargs, key", [
    ({"interval_rounds": 0}, "interval_rounds"),
    ({"interval_s": 0.0}, "interval_s"),
    ({"lr_exponent": -0.5}, "lr_exponent"),
    ({"H_min": 5, "H_max": 4}, "H_min"),
    ({"base": AdacommPolicyConfig()}, "base"),
])
def test_adacomm_config_rejects_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ValueError) as exc:
        AdacommPolicyConfig(**kwargs)
    assert str(exc.value).startswith(f"{key}: ")


def test_strict_loader_builds_nested_adacomm_base():
    sync = strict.build(SyncSection, {"policy": {"kind": "adacomm", "interval_s": 30,
                                                 "base": {"kind": "bandwidth", "target_H": 200}}})
    assert isinstance(sync.policy, AdacommPolicyConfig)
    assert isinstance(sync.policy.base, BandwidthPolicyConfig)
    assert sync.policy.base.target_H == 200 and sync.policy.interval_s == 30.0
    assert isinstance(strict.build(SyncSection, {"policy": "bandwidth"}).policy, BandwidthPolicyConfig)


@pytest.mark.parametrize("policy, key", [
    ({"kind": "bandwidth", "target_comm_fraction": 1.5}, "sync.policy.target_comm_fraction"),
    ({"kind": "bandwidth", "hold_round": 3}, "sync.policy.hold_round"),
    ({"kind": "adacomm", "base": {"kind": "fixed", "H": 0}}, "sync.policy.base.H"),
    ({"kind": "adacomm", "base": "adacomm"}, "sync.policy.base.kind"),
    ({"kind": "fixed", "target_H": 3}, "sync.policy.target_H"),
])
def test_strict_loader_errors_carry_the_dotted_key(policy, key):
    with pytest.raises(ConfigError) as exc:
        strict.build(SyncSection, {"policy": policy}, "sync")
    assert exc.value.key == key


def test_the_examples_in_docs_policies_md_load():
    import pathlib
    import re

    from geofed.orchestrator.config import CompressionSection

    text = (pathlib.Path(__file__).parents[2] / "docs" / "policies.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    for block in blocks:
        data = strict.parse_yaml(block, source="docs/policies.md")
        sync = strict.build(SyncSection, data["sync"], "sync")
        assert sync.policy.kind in ("bandwidth", "adacomm")
        if "compression" in data:
            assert len(strict.build(CompressionSection, data["compression"], "compression").ladder) == 4
