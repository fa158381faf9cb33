"""`geofed run` with no argument: the embedded default trains as well as central training."""

from __future__ import annotations

import json

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import load_config
from geofed.regions.tasks import make_task
from geofed.bench.central import train_centrally

pytestmark = pytest.mark.usefixtures("ray_session")


def test_default_run_matches_central_training_within_two_points(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--no-report", "--quiet"]) == 0
    out = capsys.readouterr().out
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1 and run_dirs[0].name.startswith("local-wan-")
    assert f"run directory: runs/{run_dirs[0].name}" in out
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    cfg = load_config()
    assert summary["rounds"] == cfg.run.rounds
    # The same number of examples: every region's inner steps (H is the policy's, round by round).
    steps = len(cfg.regions.names) * sum(h["H"] for h in summary["H_history"])
    task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed)
    central = train_centrally(task, steps=steps, lr=cfg.sync.inner.lr, seed=cfg.run.seed).value
    assert summary["eval"]["value"] >= central - 0.02, (summary["eval"], central)
    # Every link of the 4-region full mesh carried updates through the emulated WAN.
    assert len(summary["links"]) == 12 and all(v["bytes"] > 0 for v in summary["links"].values())
    # The set-up probes measured every link (the report sets each against its configured rate).
    assert all(v["bandwidth_mbps"] and v["configured_bandwidth_mbps"] for v in summary["links"].values())
    assert cfg.sync.overlap and cfg.sync.policy.kind == "bandwidth"
