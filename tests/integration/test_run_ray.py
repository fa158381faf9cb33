"""The spine, for real: region actors on a local Ray exchanging updates over mutual-TLS gRPC."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner

pytestmark = pytest.mark.usefixtures("ray_session")


def _cfg(**sections):
    base = {
        "run": {"name": "t", "rounds": 3, "report": False, "checkpoint_every": 1},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": ["us-east-1", "eu-west-1"], "num_cpus": 0.5},
        "network": {"emulation": {"mode": "none"}},
        "sync": {"policy": {"kind": "fixed", "H": 20}, "inner": {"lr": 0.01}},
    }
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return config_from_mapping(base)


def test_the_runner_and_the_cli_side_by_side(tmp_path, capsys, monkeypatch):
    """Two runs at once, their own actors and run directories: Runner's two regions, three
    rounds, and `geofed run --set` over three emulated regions."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        runner_run = pool.submit(_two_regions_three_rounds_loss_goes_down, tmp_path / "runner")
        _cli_end_to_end_with_set(tmp_path / "cli", capsys, monkeypatch)
        runner_run.result()


def _two_regions_three_rounds_loss_goes_down(tmp_path):
    # A floor of 30 s under the adaptive deadline: the run beside it must not make an update late.
    runner = Runner(_cfg(sync={"deadline": {"initial_s": 30.0, "min_s": 30.0}}), tmp_path, show_progress=False)
    try:
        summary = runner.run()
    finally:
        runner.shutdown()
    rounds = read_jsonl(tmp_path / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[-1]["mean_train_loss"] < rounds[0]["mean_train_loss"] * 0.8
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(metrics) == 6
    # Updates crossed over gRPC: both regions sent and received every round.
    for m in metrics:
        assert m["bytes_sent"] > 0 and m["bytes_received"] > 0 and not m["peers_missing"]
    assert summary["bytes_sent"] == sum(m["bytes_sent"] for m in metrics)
    assert summary["refusals"]["total"] == 0
    # TLS material of the run: per-region keys readable by the owner only.
    keys = list((tmp_path / "tls").glob("*key*"))
    assert keys and all(oct(k.stat().st_mode & 0o777) == "0o600" for k in keys)


REQUIRED = {"rounds", "wall_s", "final_train_loss", "eval", "bytes_sent", "compute_utilization", "links", "H_history"}


def _cli_end_to_end_with_set(tmp_path, capsys, monkeypatch):
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    code = main(["run", "--set", "run.rounds=2", "--set", "regions.names=[us-east-1, eu-west-1, ap-northeast-1]",
                 "--set", "network.emulation.bandwidth_scale=0.2", "--out", str(out), "--no-report", "--quiet"])
    assert code == 0
    assert f"run directory: {out}" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert REQUIRED <= set(summary)
    assert summary["rounds"] == 2 and len(summary["H_history"]) == 2
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) == 2 * 3
    assert summary["bytes_sent"] == sum(m["bytes_sent"] for m in metrics)
    link_bytes = sum(v["bytes"] for v in summary["links"].values())
    assert link_bytes == summary["bytes_sent"]
    assert len(summary["links"]) == 6  # full topology over 3 regions
    for link in summary["links"].values():
        assert link["configured_rtt_ms"] > 0 and link["rtt_ms"] is not None
    assert summary["eval"]["metric"] == "accuracy" and 0 <= summary["eval"]["value"] <= 1
    assert 0 < summary["compute_utilization"] <= 1
    cfg_text = (out / "config.yaml").read_text()
    assert "rounds: 2" in cfg_text


def test_ray_address_of_another_cluster_is_refused_when_a_session_is_up():
    """A process already holding Ray (a notebook, this test session) used to ignore ray.address."""
    import ray

    from geofed.orchestrator.driver.cluster import PlacementError, init_ray

    ours = ray.get_runtime_context().gcs_address
    with pytest.raises(PlacementError, match=r"^ray\.address: 127\.0\.0\.1:9 names another cluster"):
        init_ray(_cfg(ray={"address": "127.0.0.1:9"}))
    assert init_ray(_cfg(ray={"address": ours})).started_here is False  # the same cluster is fine
    assert init_ray(_cfg(ray={"address": "auto"})).started_here is False
