"""regions.shard_exchange's config: accepted with regions.workers > 1, and what it does not carry refused
with the file and the key named (regions/shards.py, docs/regions-as-clusters.md)."""

from __future__ import annotations

import pytest

from geofed.orchestrator.config import config_from_mapping

REGIONS = ["us-east-1", "eu-west-1"]


def test_shard_exchange_refusals_name_the_key():
    """What the sharded exchange does not carry is refused with regions.shard_exchange named."""
    base = {"run": {"name": "t"}, "task": {"kind": "mlp-digits"},
            "regions": {"names": REGIONS, "workers": 2, "shard_exchange": True},
            "security": {"score_updates": False}, "network": {"emulation": {"mode": "none"}}}
    config_from_mapping(base)  # accepted as it is
    for extra, words in [({"sync": {"overlap": True}}, "sync.overlap"),
                         ({"sync": {"fragments": 2}}, "sync.fragments"),
                         ({"security": {"score_updates": True}}, "security.score_updates"),
                         ({"network": {"emulation": {"mode": "proxy"}}}, "network.emulation.mode")]:
        cfg = {k: ({**v, **extra[k]} if k in extra else v) for k, v in base.items()}
        cfg.update({k: v for k, v in extra.items() if k not in cfg})
        with pytest.raises(ValueError, match=rf"<config>: regions.shard_exchange: .*{words}"):
            config_from_mapping(cfg)


def test_shard_exchange_is_off_by_default_and_inert_with_one_worker():
    """Default false; with regions.workers 1 the key changes nothing (no group, no shards)."""
    cfg = config_from_mapping({"run": {"name": "t"}, "task": {"kind": "mlp-digits"}, "regions": {"names": REGIONS}})
    assert cfg.regions.shard_exchange is False
    one = config_from_mapping({"run": {"name": "t"}, "task": {"kind": "mlp-digits"},
                               "regions": {"names": REGIONS, "shard_exchange": True, "workers": 1},
                               "sync": {"overlap": True}})
    assert one.regions.shard_exchange is True and one.regions.workers == 1
