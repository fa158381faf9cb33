"""Issue 23 on the real stack: the planner's prediction of a 2-region emulated run (Ray actors,
mutual-TLS gRPC through the proxy WAN emulator) against the run, and the run's egress dollars."""

from __future__ import annotations

import pytest

from geofed.bench.plan_results import measure, predict_cell
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.run import Runner
from geofed.orchestrator.plan.inputs import probe_task
from geofed.p2p.wan.prices import GB

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(400), pytest.mark.slow]


def test_plan_predicts_a_two_region_emulated_run_and_summary_prices_its_bytes(tmp_path):
    # 20 Mbit/s, 100 ms RTT; fp16 of a 38k-parameter MLP is 77 KB: ~0.13 s of sync a round, serial.
    cfg = config_from_mapping({
        "run": {"name": "plan", "rounds": 6, "report": False, "checkpoint_every": 0},
        "task": {"kind": "mlp-digits", "hidden": 512},
        "regions": {"names": ["us-east-1", "ap-southeast-2"], "num_cpus": 0.5},
        "network": {"emulation": {"mode": "proxy", "preset": None,
                                  "default": {"latency_ms": 50, "bandwidth_mbps": 20, "jitter_ms": 0, "loss": 0}},
                    "egress": {"usd_per_gb": {"us-east-1->ap-southeast-2": 0.5}}},
        "sync": {"overlap": False, "policy": {"kind": "fixed", "H": 40}},
        "compression": {"codec": "fp16"},
    })
    runner = Runner(cfg, tmp_path, show_progress=False)
    try:
        summary = runner.run()
    finally:
        runner.shutdown()
    m = measure(tmp_path)
    # As the bench does: the run's contention is its step time over the probe's alone on this machine.
    p = predict_cell(cfg, m["step_s"], m["compute_spread"], alone_step_s=probe_task(cfg).step_s)
    assert abs(p["pred_round_s"] - m["round_s"]) / m["round_s"] <= 0.25, (p, m)
    assert abs(p["pred_bytes_per_round"] - m["bytes_per_round"]) / m["bytes_per_round"] <= 0.01, (p, m)
    out, back = summary["links"]["us-east-1->ap-southeast-2"], summary["links"]["ap-southeast-2->us-east-1"]
    assert out["usd_per_gb"] == 0.5 and back["usd_per_gb"] == 0.098          # override; AWS list price from Sydney
    assert out["egress_usd"] == pytest.approx(out["egress_bytes"] / GB * 0.5, abs=1e-9)  # summary rounds to 1e-9 USD
    assert out["egress_bytes"] >= out["bytes"] > 0                             # probes counted too
    assert summary["egress_usd"] == pytest.approx(out["egress_usd"] + back["egress_usd"])


def test_the_plan_of_the_default_config_agrees_with_its_run(tmp_path):
    """Issue 37 item 2 on the real stack: `geofed plan configs/local-wan.yaml` (co-located step probe,
    the bandwidth policy run to its steady decision) against the default run, shortened to 12
    rounds. Before, the plan predicted 24% utilisation at H 150 where the run had 96% at H 55-146,
    and had no prediction of the run's policy at all: here ModuleNotFoundError (no bench.plan_shipped)."""
    from geofed.bench.plan_shipped import measure_policy_run, predict_shipped, shipped_config, shipped_row

    cfg = shipped_config("local-wan.yaml", ["run.rounds=12", "run.checkpoint_every=0"])
    predicted = predict_shipped(cfg)
    runner = Runner(cfg, tmp_path, show_progress=False)
    try:
        runner.run()
    finally:
        runner.shutdown()
    row = shipped_row("local-wan.yaml", predicted, measure_policy_run(tmp_path))
    assert row["pred_H_in_policy_range"] and row["pred_codec_used"], row
    assert row["utilization_ok"], row          # within 15% of the run's (relative)
