"""`geofed watch` on a live run: a real `geofed run` in a subprocess, watched from its files.

The same run is issue 19's trap 3 (output), for real: `geofed run` with its output in files (no
terminal, as under nohup or CI) prints one line per round, the summary shows set-up and training
time apart, and Ray's start-up messages (its token-auth warning, "Started a local Ray instance")
stay out. A process of its own: Ray is started by the command, as a user's run starts it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

from rich.console import Console

from geofed.orchestrator.cli import main
from geofed.orchestrator.watch import watch


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=160, force_terminal=False), buf


def test_watch_follows_a_live_run_and_exits_when_it_ends(tmp_path):
    run_dir = tmp_path / "run"
    geofed = os.path.join(os.path.dirname(sys.executable), "geofed")  # the console script of this venv
    cmd = [geofed, "run", "--out", str(run_dir), "--no-report",
           "--set", "run.rounds=8", "--set", "regions.names=[us-east-1, eu-west-1]", "--set", "regions.num_cpus=0.5",
           "--set", "ray.num_cpus=2", "--set", "network.emulation.mode=none", "--set", "sync.policy={kind: fixed, H: 150}",
           "--set", "sync.overlap=false", "--set", "task.hidden=64"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # its own local Ray, as a user's terminal would start
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out_path, "w") as out_file, open(err_path, "w") as err_file:  # files, not a terminal
        proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "rounds.jsonl").exists() or not (run_dir / "rounds.jsonl").read_text().strip():
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no round within 120 s"
            time.sleep(0.2)
        # One snapshot mid-run: the state and the rounds so far, out of the config's 8.
        console, buf = _console()
        assert watch(run_dir, once=True, console=console) == 0
        snap = buf.getvalue()
        done = json.loads((run_dir / "rounds.jsonl").read_text().splitlines()[0])["round"] + 1
        assert " / 8" in snap and "train loss" in snap and "us-east-1->eu-west-1" in snap, snap
        assert "running" in snap or "finished" in snap, snap
        assert done >= 1
        # Live: returns by itself once the run's summary.json appears, showing the final state.
        console, buf = _console()
        t0 = time.monotonic()
        assert watch(run_dir, interval=0.2, console=console) == 0
        assert (run_dir / "summary.json").exists() and time.monotonic() - t0 < 120
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    final = buf.getvalue()
    assert "finished" in final and "8 / 8" in final and "eval accuracy" in final, final
    stdout, stderr = out_path.read_text(), err_path.read_text()
    rounds = [ln for ln in stderr.splitlines() if ln.startswith("round ")]
    # Rounds are named 0-based as in the run directory, counts said as counts (docs/RUNDIR.md, "Rounds").
    assert [ln.split()[1:3] for ln in rounds] == [[str(i), f"({i + 1}/8"] for i in range(8)], stderr
    for ln in rounds:
        for field in (" loss ", " H ", " codec ", " sent ", " MB util ", " elapsed ", " eta "):
            assert field in ln, (field, ln)
    assert "Token authentication" not in stderr and "Started a local Ray" not in stderr, stderr
    assert "set-up time (start to first round)" in stdout and "training time (round 0 to end)" in stdout, stdout


def test_watch_refuses_a_missing_run_dir(tmp_path, capsys):
    assert main(["watch", str(tmp_path / "nope"), "--once"]) == 2
    assert "no such run directory" in capsys.readouterr().err
