"""The documented plug-in example (examples/) runs through `geofed run` and learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geofed.orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("ray_session")


def test_example_task_runs_and_learns(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the command as the README gives it (task.path is relative to the config's folder)
    out = tmp_path / "run"
    assert main(["run", "examples/my-task.yaml", "--set", "run.rounds=4", "--out", str(out), "--no-report", "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["task"] == "python:my_task:make_task"
    assert summary["eval"]["metric"] == "accuracy" and summary["eval"]["value"] > 0.9


def test_plugin_that_is_not_a_task_is_a_config_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad_task.py").write_text("from geofed.regions.tasks import task_factory\n\n"
                                          "@task_factory\ndef make_task():\n    return 42\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"task: {{kind: 'python:bad_task:make_task', path: '{tmp_path}'}}\n")
    assert main(["run", str(cfg), "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert "task.kind: 'python:bad_task:make_task' returned int, not a geofed Task" in capsys.readouterr().err
