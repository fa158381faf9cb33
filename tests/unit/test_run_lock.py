"""Issue 19, trap 1: two `geofed run` on one run directory interleaved its files (rounds.jsonl
read 0,1,2,0,3,1,...). Now RUN_DIR/run.lock is held for the run's life: a second run, or a
--resume, on it exits 2 at once naming the holder's pid; default names carry a random suffix."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml
from geofed.orchestrator import cli
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import lock_run_dir, new_run_dir, release_run_dir

BASE = {"run": {"name": "lock", "rounds": 1, "report": False},
        "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["us-east-1", "eu-west-1"]},
        "network": {"emulation": {"mode": "none"}},
        # Unreachable: a run the lock failed to stop would end here quickly (exit 1), not train.
        "ray": {"address": "127.0.0.1:9", "init_timeout_s": 1}}

HOLDER = """
import sys, yaml
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import new_run_dir
new_run_dir(config_from_mapping(yaml.safe_load(open(sys.argv[1]))), sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path, monkeypatch):
    """Another process that created tmp/run with new_run_dir and holds its lock until stdin closes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, "run.yaml", "run"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_second_run_on_the_same_out_exits_2_naming_the_pid(holder, tmp_path, capsys):
    t0 = time.monotonic()
    assert cli.main(["run", "run.yaml", "--out", "run", "--quiet"]) == 2
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert f"in use by another geofed run (pid {holder.pid}" in err and err.startswith("geofed: --out: ")
    assert not (tmp_path / "run" / "rounds.jsonl").exists()


def test_resume_takes_the_same_lock(holder, capsys):
    assert cli.main(["run", "--resume", "run", "--quiet"]) == 2
    assert f"pid {holder.pid}" in capsys.readouterr().err


def test_lock_is_free_once_the_holder_ends(holder, tmp_path):
    holder.stdin.close()
    holder.wait(timeout=30)
    lock_run_dir(tmp_path / "run")  # no error: the lock died with its process
    assert (tmp_path / "run" / "run.lock").read_text().strip() == str(__import__("os").getpid())
    release_run_dir(tmp_path / "run")


def test_default_names_started_in_one_second_differ(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config_from_mapping(json.loads(json.dumps(BASE)))
    dirs = [new_run_dir(cfg, None) for _ in range(5)]
    try:
        assert len(set(dirs)) == 5 and all(d.parent.name == "runs" for d in dirs)
    finally:
        for d in dirs:
            release_run_dir(d)
