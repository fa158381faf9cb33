"""`geofed watch` on a live run: a real `geofed run` in a subprocess, watched from its files."""

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
    cmd = [geofed, "run", "--out", str(run_dir), "--quiet", "--no-report",
           "--set", "run.rounds=8", "--set", "regions.names=[us-east-1, eu-west-1]", "--set", "regions.num_cpus=0.5",
           "--set", "ray.num_cpus=2", "--set", "network.emulation.mode=none", "--set", "sync.policy={kind: fixed, H: 150}",
           "--set", "sync.overlap=false", "--set", "task.hidden=64"]
    env = {**os.environ, "RAY_ADDRESS": ""}  # its own local Ray, as a user's terminal would start
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "rounds.jsonl").exists() or not (run_dir / "rounds.jsonl").read_text().strip():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
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


def test_watch_refuses_a_missing_run_dir(tmp_path, capsys):
    assert main(["watch", str(tmp_path / "nope"), "--once"]) == 2
    assert "no such run directory" in capsys.readouterr().err
