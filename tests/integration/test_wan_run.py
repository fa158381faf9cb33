"""A whole geofed run over the emulated 4-region AWS preset: the links are what they claim."""

from __future__ import annotations

import pytest

from geofed.orchestrator.config import config_from_mapping, load_config
from geofed.orchestrator.driver.run import Runner

pytestmark = pytest.mark.usefixtures("ray_session")


def test_run_over_the_preset_measures_every_link_near_its_configured_bandwidth(tmp_path):
    # 8192 hidden units: 2.4 MB fp32 updates, far above the estimator's 256 KiB floor, so each
    # transfer measures bandwidth (a small update measures only latency).
    cfg = load_config(None, ["run.rounds=4", "run.eval_every=0", "run.report=false", "task.hidden=8192",
                             "compression.codec=identity", "network.emulation.bandwidth_scale=0.05",
                             "sync.policy={kind: fixed, H: 20}", "sync.overlap=false"])
    runner = Runner(cfg, tmp_path, show_progress=False)
    try:
        summary = runner.run()
    finally:
        runner.shutdown()
    assert summary["rounds"] == 4
    links = summary["links"]
    assert len(links) == 12
    ratios = {name: link["bandwidth_mbps"] / link["configured_bandwidth_mbps"] for name, link in links.items()}
    # On a quiet machine every link lands within 4% (docs/results.md, "WAN emulation"). Under heavy CPU load the
    # sender's clock starts late now and then and one windowed-max sample reads high, so the
    # test holds every link to 15% and the typical link to 10%.
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios
    assert sorted(ratios.values())[len(ratios) // 2] == pytest.approx(1.0, abs=0.1), ratios
    for name, link in links.items():
        # RTT: a loaded event loop adds a few ms to every probe, which matters on a 20 ms link.
        assert 0.9 * link["configured_rtt_ms"] <= link["rtt_ms"] <= 1.2 * link["configured_rtt_ms"] + 15, (name, link)
    # The preset's geometry survives the scale: trans-Pacific slower than within Europe.
    assert links["eu-west-1->eu-central-1"]["configured_bandwidth_mbps"] > links["us-east-1->ap-northeast-1"]["configured_bandwidth_mbps"]
    assert summary["config"]["emulation"] == "proxy"


def test_config_mapping_roundtrip_keeps_the_preset():
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "network": {"emulation": {"preset": "aws"}}})
    assert cfg.network.emulation.preset == "aws"
