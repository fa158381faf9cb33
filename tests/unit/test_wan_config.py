"""WAN emulator config, presets and link resolution (no sockets)."""

from __future__ import annotations

import logging

import pytest
import yaml

from geofed.orchestrator.config import strict
from geofed.p2p.wan import EmulationConfig, LinkSpec, ScheduleEvent, WanEmulator, load_preset, preset_names
from geofed.p2p.wan.links import LinkTable

REGIONS4 = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"]


def build(text: str) -> EmulationConfig:
    return strict.build(EmulationConfig, yaml.safe_load(text), "network.emulation")


def test_defaults_build_and_every_field_documented():
    cfg = build("{}")
    assert cfg.mode == "proxy" and cfg.preset == "aws" and cfg.bandwidth_scale == 1.0
    undocumented = [k for k, _, _, doc in strict.field_docs(EmulationConfig) if not doc]
    assert undocumented == []


@pytest.mark.parametrize("text, key", [
    ("bandwidth_scale: 0", "network.emulation.bandwidth_scale"),
    ("links: {'a-b': {latency_ms: 1}}", "network.emulation.links"),
    ("links: {'a->a': {latency_ms: 1}}", "network.emulation.links"),
    ("links: {'a->b': {bandwidth_mbps: 0}}", "network.emulation.links.a->b.bandwidth_mbps"),
    ("links: {'a->b': {loss: 1.0}}", "network.emulation.links.a->b.loss"),
    ("links: {'a->b': {latency_ms: -1}}", "network.emulation.links.a->b.latency_ms"),
    ("schedule: [{link: 'a->b'}]", "network.emulation.schedule.0.at_s"),
    ("schedule: [{link: 'a->b', at_s: 1, at_round: 2, outage_s: 1}]", "network.emulation.schedule.0.at_s"),
    ("schedule: [{link: 'a->b', at_s: 1}]", "network.emulation.schedule.0.set"),
    ("schedule: [{link: 'a->b', at_s: 1, outage_s: 0}]", "network.emulation.schedule.0.outage_s"),
    ("schedule: [{link: 'a->b', at_s: 1, outage_s: 1, end_outage: true}]", "network.emulation.schedule.0.end_outage"),
    ("schedule: [{link: 'a->b', at_s: 1, outage_s: 1, outage_mode: cut}]", "network.emulation.schedule.0.outage_mode"),
    ("schedule: [{link: 'ab', at_s: 1, outage_s: 1}]", "network.emulation.schedule.0"),
    ("default: {latency_ms: 5}", "network.emulation.default"),
    ("netns_prefix: 'Bad-Prefix'", "network.emulation.netns_prefix"),
    ("mode: netem", "network.emulation.mode"),
    ("speed: 3", "network.emulation.speed"),
])
def test_bad_values_name_the_dotted_key(text, key):
    with pytest.raises(strict.ConfigError) as err:
        build(text)
    assert err.value.key == key, str(err.value)


def test_full_config_from_yaml():
    cfg = build("""
        preset: aws
        bandwidth_scale: 0.1
        links: {'us-east-1<->eu-west-1': {bandwidth_mbps: 300, jitter_ms: 2}}
        schedule:
          - {link: 'us-east-1->eu-west-1', at_s: 5, set: {bandwidth_mbps: 20}}
          - {link: '*', at_round: 3, outage_s: 2.5, outage_mode: reset}
    """)
    assert cfg.links["us-east-1<->eu-west-1"] == LinkSpec(bandwidth_mbps=300.0, jitter_ms=2.0)
    assert cfg.schedule[1] == ScheduleEvent(link="*", at_round=3, outage_s=2.5, outage_mode="reset")


def test_aws_preset_has_the_field_notes_figures_symmetrically():
    p = load_preset("aws")
    assert "aws" in preset_names()
    # (a, b, RTT ms, Gbit/s) from FIELD-NOTES (DT-FM)
    for a, b, rtt, gbps in [("us-east-1", "eu-west-1", 67, 1.05), ("us-east-1", "eu-central-1", 90, 1.02),
                            ("us-west-2", "us-east-1", 67, 0.79), ("ap-northeast-1", "eu-central-1", 223, 0.36),
                            ("us-east-1", "us-east-2", 11, 1.12), ("ap-southeast-2", "eu-central-1", 265, 0.33)]:
        for s, d in ((a, b), (b, a)):
            spec = p.link(s, d)
            assert spec is not None, (s, d)
            assert spec.latency_ms == pytest.approx(rtt / 2) and spec.bandwidth_mbps == pytest.approx(gbps * 1000)
        assert p.sources[(a, b)] == "dtfm"
    assert p.link("Virginia", "ireland") == p.link("us-east-1", "eu-west-1")
    assert p.link("us-east-1", "mars-1") is None
    # Every pair among the 4 default regions is known, so a default run never falls back.
    assert all(p.link(a, b) is not None for a in REGIONS4 for b in REGIONS4 if a != b)
    for (a, b), spec in p.pairs.items():
        assert p.pairs[(b, a)] == spec
        assert 0 < spec.latency_ms < 200 and 300 <= spec.bandwidth_mbps <= 1200


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="known: aws"):
        load_preset("gcp")


def test_resolution_order_preset_then_links_then_schedule_then_scale():
    cfg = EmulationConfig(
        preset="aws", bandwidth_scale=0.5,
        default=LinkSpec(latency_ms=40, bandwidth_mbps=50, jitter_ms=1, loss=0.0),
        links={"us-east-1<->eu-west-1": LinkSpec(bandwidth_mbps=300, jitter_ms=3),
               "us-east-1->eu-west-1": LinkSpec(bandwidth_mbps=200)},
        schedule=(ScheduleEvent(link="eu-west-1->us-east-1", at_round=1, set=LinkSpec(latency_ms=100)),))
    t = LinkTable(cfg, REGIONS4, load_preset("aws"))
    fwd, back = t.configured("us-east-1", "eu-west-1"), t.configured("eu-west-1", "us-east-1")
    assert fwd == LinkSpec(latency_ms=33.5, bandwidth_mbps=100.0, jitter_ms=3.0, loss=0.0)   # 'a->b' beats 'a<->b'
    assert back == LinkSpec(latency_ms=33.5, bandwidth_mbps=150.0, jitter_ms=3.0, loss=0.0)
    assert t.configured("us-east-1", "ap-northeast-1") == LinkSpec(latency_ms=71.5, bandwidth_mbps=260.0, jitter_ms=1.0, loss=0.0)
    touched = t.apply(cfg.schedule[0], now_s=0.0)
    assert touched == [("eu-west-1", "us-east-1")]
    assert t.configured("eu-west-1", "us-east-1").latency_ms == 100.0
    assert t.configured("eu-west-1", "us-east-1").bandwidth_mbps == 150.0
    assert t.configured("us-east-1", "eu-west-1").latency_ms == 33.5


def test_pairs_the_preset_lacks_use_default(caplog):
    cfg = EmulationConfig(default=LinkSpec(latency_ms=7, bandwidth_mbps=9))
    t = LinkTable(cfg, ["us-east-1", "r-local"], load_preset("aws"))
    assert t.configured("r-local", "us-east-1") == LinkSpec(latency_ms=7, bandwidth_mbps=9, jitter_ms=0.0, loss=0.0)
    assert "no figures for" in caplog.text


def test_the_links_a_preset_lacks_are_named_in_one_warning_per_table(caplog):
    caplog.set_level(logging.WARNING, logger="geofed.p2p.wan.links")
    regions = ["us-east-1", "eu-west-1", "eu-central-1", "r-9"]
    t = LinkTable(EmulationConfig(), regions, load_preset("aws"))
    (line,) = [r.getMessage() for r in caplog.records if "no figures" in r.getMessage()]
    assert "has no figures for 6 links (us-east-1->r-9, " in line and "they use network.emulation.default" in line
    caplog.clear()
    t.add_region("r-10")  # a joiner under a new name: its 8 links, one line
    (line,) = [r.getMessage() for r in caplog.records if "no figures" in r.getMessage()]
    assert "for 8 links" in line and "and 2 more" in line
    caplog.clear()
    LinkTable(EmulationConfig(), regions[:3], load_preset("aws"))
    assert "no figures" not in caplog.text


def test_links_and_schedule_must_name_run_regions():
    with pytest.raises(ValueError, match=r"links\.us-east-1->mars-1: region 'mars-1'"):
        LinkTable(EmulationConfig(links={"us-east-1->mars-1": LinkSpec(latency_ms=1)}), REGIONS4, None)
    with pytest.raises(ValueError, match=r"schedule\.0\.link: region 'x'"):
        LinkTable(EmulationConfig(schedule=(ScheduleEvent(link="x->eu-west-1", at_s=1, outage_s=1),)), REGIONS4, None)
    with pytest.raises(ValueError, match="regions: names must be unique"):
        LinkTable(EmulationConfig(), ["a", "a"], None)


def test_outage_windows_and_their_sum():
    t = LinkTable(EmulationConfig(preset=None), ["a", "b", "c"], None)
    ev = ScheduleEvent(link="a<->b", at_s=1, outage_s=2.0)
    assert sorted(t.apply(ev, now_s=1.0)) == [("a", "b"), ("b", "a")]
    assert t.outage("a", "b", 0.5) is None
    assert t.outage("a", "b", 1.5).mode == "stall" and t.outage("b", "a", 2.9) is not None
    assert t.outage("a", "c", 1.5) is None
    assert t.outage("a", "b", 3.0) is None
    t.apply(ScheduleEvent(link="a->b", at_s=2, outage_s=2.0, outage_mode="reset"), now_s=2.0)   # overlaps the first
    assert t.outage("a", "b", 2.5).mode == "reset"
    assert t.outage_seconds("a", "b", now_s=10.0) == pytest.approx(3.0)
    assert t.outage_seconds("b", "a", now_s=2.0) == pytest.approx(1.0)


def test_an_open_ended_outage_ends_by_event():
    cfg = EmulationConfig(preset=None, schedule=(
        ScheduleEvent(link="a<->b", at_round=5, outage_s=1e9),
        ScheduleEvent(link="a->b", at_round=8, end_outage=True)))
    emu = WanEmulator(cfg, ["a", "b"])
    emu.set_round(5)
    assert emu.link_stats()["a->b"]["in_outage"] and emu.link_stats()["b->a"]["in_outage"]
    emu.set_round(8)
    assert not emu.link_stats()["a->b"]["in_outage"]
    assert emu.link_stats()["b->a"]["in_outage"]   # only the named direction was restored
    emu.stop()


def test_set_round_fires_each_event_once_in_round_order():
    cfg = EmulationConfig(preset=None, default=LinkSpec(latency_ms=10, bandwidth_mbps=50), schedule=(
        ScheduleEvent(link="a->b", at_round=4, set=LinkSpec(bandwidth_mbps=40)),
        ScheduleEvent(link="a->b", at_round=2, set=LinkSpec(bandwidth_mbps=5)),
        ScheduleEvent(link="*", at_round=3, set=LinkSpec(latency_ms=70)),
        ScheduleEvent(link="a->b", at_s=100, set=LinkSpec(bandwidth_mbps=1)),
    ))
    emu = WanEmulator(cfg, ["a", "b"])   # not started: round events still apply (clock 0)
    emu.set_round(1)
    assert emu.configured("a", "b").bandwidth_mbps == 50
    emu.set_round(3)   # round 2 skipped: its event still fires, before round 3's
    assert emu.configured("a", "b") == LinkSpec(latency_ms=70, bandwidth_mbps=5, jitter_ms=0.0, loss=0.0)
    assert emu.configured("b", "a").latency_ms == 70
    emu.set_round(4)
    assert emu.configured("a", "b").bandwidth_mbps == 40
    emu.set_round(2)   # going back fires nothing again
    assert emu.configured("a", "b").bandwidth_mbps == 40
    stats = emu.link_stats()
    assert set(stats) == {"a->b", "b->a"}
    assert stats["a->b"]["configured_bandwidth_mbps"] == 40 and stats["a->b"]["bytes"] == 0
    emu.stop()
    emu.stop()


def test_round_outage_shows_in_stats():
    cfg = EmulationConfig(preset=None, schedule=(ScheduleEvent(link="a->b", at_round=1, outage_s=30),))
    emu = WanEmulator(cfg, ["a", "b"])
    try:
        emu.start()
        assert not emu.link_stats()["a->b"]["in_outage"]
        emu.set_round(1)
        st = emu.link_stats()
        assert st["a->b"]["in_outage"] and st["a->b"]["outage_mode"] == "stall" and not st["b->a"]["in_outage"]
    finally:
        emu.stop()


def test_route_checks_and_mode_none():
    emu = WanEmulator(EmulationConfig(mode="none", preset=None), ["a", "b"]).start()
    assert emu.route("a", "b", "127.0.0.1:5000") == "127.0.0.1:5000"
    with pytest.raises(ValueError, match="no link a->c"):
        emu.route("a", "c", "127.0.0.1:5000")
    emu.stop()
    proxy = WanEmulator(EmulationConfig(preset=None), ["a", "b"])
    with pytest.raises(ValueError, match="target: expected 'host:port'"):
        proxy.route("a", "b", "localhost")
    addr = proxy.route("a", "b", "127.0.0.1:5000")   # before start(): bound now, served at start()
    assert addr.startswith("127.0.0.1:") and addr != "127.0.0.1:5000"
    assert proxy.route("a", "b", "127.0.0.1:5000") == addr
    assert proxy.route("b", "a", "127.0.0.1:5000") != addr
    proxy.stop()
    with pytest.raises(RuntimeError, match="after stop"):
        proxy.route("a", "b", "127.0.0.1:5001")


def test_kernel_mode_says_what_is_missing(monkeypatch):
    import os
    import shutil

    from geofed.p2p.wan import kernel
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match=r"mode: kernel needs root \(euid is 1000\); use mode: proxy"):
        WanEmulator(EmulationConfig(mode="kernel", preset=None), ["a", "b"])
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "tc" else "/usr/sbin/" + name)
    assert kernel.kernel_unavailable() == "needs `tc` (iproute2) on PATH"


def test_timed_outages_are_in_place_from_start_and_end_outage_spares_later_windows():
    cfg = EmulationConfig(preset=None, schedule=(
        ScheduleEvent(link="a->b", at_s=100, outage_s=10),
        ScheduleEvent(link="a->b", at_round=1, outage_s=1e9),
        ScheduleEvent(link="a->b", at_round=2, end_outage=True)))
    emu = WanEmulator(cfg, ["a", "b"])
    emu.start()
    try:
        t = emu.table
        assert t.outage("a", "b", 105.0) is not None   # known ahead of its timer
        assert t.outage("a", "b", 99.0) is None and t.outage("a", "b", 110.0) is None
        emu.set_round(1)
        emu.set_round(2)
        assert not emu.link_stats()["a->b"]["in_outage"]
        assert t.outage("a", "b", 105.0) is not None   # the later window survives the end_outage
    finally:
        emu.stop()
