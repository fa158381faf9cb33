"""Issue 19, trap 3 (output), for real: `geofed run` with its output in files (no terminal, as under
nohup or CI) prints one line per round, the summary shows set-up and training time apart, and
Ray's start-up messages (its token-auth warning, "Started a local Ray instance") stay out.
A process of its own: Ray is started by the command, as a user's run starts it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_run_without_a_terminal(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    cmd = [sys.executable, "-m", "geofed.orchestrator.cli", "run", "--set", "run.rounds=2",
           "--set", "regions.names=[us-east-1, eu-west-1]", "--set", "network.emulation.mode=none",
           "--set", "ray.num_cpus=2", "--out", str(tmp_path / "run"), "--no-report"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    rounds = [ln for ln in done.stderr.splitlines() if ln.startswith("round ")]
    # Rounds are named 0-based as in the run directory, counts said as counts (docs/RUNDIR.md, "Rounds").
    assert [ln.split()[1:3] for ln in rounds] == [["0", "(1/2"], ["1", "(2/2"]], done.stderr
    for ln in rounds:
        for field in (" loss ", " H ", " codec ", " sent ", " MB util ", " elapsed ", " eta "):
            assert field in ln, (field, ln)
    assert "Token authentication" not in done.stderr and "Started a local Ray" not in done.stderr, done.stderr
    assert "set-up time (start to first round)" in done.stdout and "training time (round 0 to end)" in done.stdout
