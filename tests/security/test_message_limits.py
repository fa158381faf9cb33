"""Issue 15, finding 4: `network.max_message_mb` defaulted to 1024 whatever the model, and a push
could stay open for 3600 s. A region now sizes what it accepts from its own model
(regions/limits.py); the config keeps an explicit override."""

from __future__ import annotations

import pytest

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.limits import MiB, encoded_bytes, wire_limits
from geofed.regions.sync import GossipSync
from geofed.regions.region import Region

REGIONS = ["a", "b", "c"]


def _cfg(**sections):
    base = {"task": {"kind": "mlp-digits", "hidden": 16}, "regions": {"names": REGIONS},
            "network": {"emulation": {"mode": "none"}}}
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return config_from_mapping(base)


def test_the_default_message_cap_follows_the_model_not_a_gigabyte():
    assert _cfg().network.max_message_mb is None  # main: 1024
    big = [(10_000_000,)]  # 10 M parameters: 40 MB in fp32, 20 MB in fp16 (the default codec)
    lim = wire_limits(_cfg(), big)
    assert lim.max_message_bytes == pytest.approx(1.5 * 20e6, rel=0.01)
    assert lim.decode_bytes >= 40_000_000
    # The least compressing codec the policy may pick decides.
    laddered = wire_limits(_cfg(compression={"codec": "int8", "ladder": ["fp16", "int8"]}), big)
    assert laddered.max_message_bytes == pytest.approx(1.5 * 20e6, rel=0.01)
    assert encoded_bytes("int8", big) < encoded_bytes("fp16", big) < encoded_bytes("identity", big)
    # A small model still gets 1 MiB; an explicit value wins.
    assert wire_limits(_cfg(), [(64, 16), (16,)]).max_message_bytes == MiB
    assert wire_limits(_cfg(network={"max_message_mb": 7}), big).max_message_bytes == 7 * MiB
    # Gossip with gradient tracking sends the parameters twice (its wire_shapes say so).
    tracking = _cfg(sync={"algorithm": "gossip", "topology": "ring", "gossip": {"tracking": True}},
                    compression={"error_feedback": False})
    assert GossipSync.wire_shapes(tracking.sync, big) == big * 2
    assert wire_limits(tracking, GossipSync.wire_shapes(tracking.sync, big)).max_message_bytes == pytest.approx(2 * lim.max_message_bytes, rel=0.01)


def test_secure_aggregation_sizes_the_cap_for_its_masked_update():
    # The masked update is secagg_bits per value whatever the codec: a 1M-parameter model's 32-bit
    # masks (4.2 MB) were refused against the int8-sized cap (found by geofed bench memory, issue 39).
    big = [(1_000_000,)]
    plain = wire_limits(_cfg(compression={"codec": "int8"}), big).max_message_bytes
    for bits in (8, 16, 32):
        lim = wire_limits(_cfg(compression={"codec": "int8"},
                               security={"secure_aggregation": True, "secagg_bits": bits}), big)
        assert lim.max_message_bytes >= bits // 8 * 1_000_000 * 1.5
        assert lim.max_message_bytes >= plain
    assert wire_limits(_cfg(compression={"codec": "int8"}, security={"secure_aggregation": True}), big
                       ).max_message_bytes == pytest.approx(1.5 * 4e6, rel=0.01)


def test_the_memory_budget_and_the_longest_call_are_bounded():
    lim = wire_limits(_cfg(), [(10_000_000,)])
    # 2 messages in flight + round_window + 1 decoded (fp32) updates waiting.
    assert lim.peer_budget_bytes == 2 * lim.max_message_bytes + 3 * 40_000_000
    assert wire_limits(_cfg(network={"peer_memory_mb": 300}), [(10,)]).peer_budget_bytes == 300 * MiB
    assert lim.max_rpc_s == 150.0  # sync.deadline.max_s (120) + 30, not 3600
    assert wire_limits(_cfg(sync={"deadline": {"initial_s": 2, "min_s": 1, "max_s": 4}}), [(10,)]).max_rpc_s == 60.0
    with pytest.raises(Exception, match="network.peer_memory_mb: must be in"):
        _cfg(network={"peer_memory_mb": 0})


def test_a_region_builds_its_transport_with_its_own_limits(tmp_path):
    w = Region(_cfg(security={"tls": False}), "a", tmp_path)
    try:
        t = w.transport
        assert t.mailbox.max_message_bytes == MiB == w.limits.max_message_bytes
        assert t.mailbox.peer_budget_bytes == w.limits.peer_budget_bytes
        assert t._servicer.max_rpc_s == w.limits.max_rpc_s
        assert t.max_workers >= 2 * (4 + 2 + 1)
    finally:
        w.close()
