"""Issue 15, finding 5: `--resume` signalled every pid listed in the run directory's driver.json
whose start time matched. A run directory is a file anyone can hand you (as root, that reached
any process). Now a listed process is ended only when its own environment and command line prove
it is this run's Ray: this run directory and the recording driver's token in /proc/PID/environ
(or, for a `ray::` process whose environment Ray's setproctitle zeroed, its output in the Ray
session the driver bound to this run), a `ray::` worker or the recorded Ray session in
/proc/PID/cmdline.

Real processes throughout: the stand-ins for Ray's leftovers are real processes given the
environment and command line a Ray worker of the run has (the full path, with Ray, is
tests/e2e/test_driver_crash.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from geofed.orchestrator.driver.recovery import reap_previous

TOKEN = "5f0c2b7d9e1a4c3b8d6f0a2e4c6b8d0f"
SESSION = "/tmp/ray/session_2026-01-01_00-00-00_000000_1"


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _spawn(argv0: str, *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`sleep 300` whose command line starts with argv0 (bash's exec -a), with extra environment."""
    proc = subprocess.Popen(["bash", "-c", f'exec -a "{argv0}" sleep 300'], env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until bash has exec'd: the identity and cmdline are sleep's
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            if f.read().startswith(argv0.encode()):
                return proc
        time.sleep(0.01)
    raise AssertionError("the stand-in process did not start")


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _driver_json(run_dir: Path, procs, *, token: str = TOKEN) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "driver.json").write_text(json.dumps({
        "pid": _dead_pid(), "start": 1, "token": token, "session_dir": SESSION,
        "processes": [[p.pid, _start_time(p.pid), "sleep"] for p in procs]}))


def _marks(run_dir: Path, token: str = TOKEN) -> dict[str, str]:
    return {"GEOFED_RUN_DIR": str(run_dir.resolve()), "GEOFED_RUN_TOKEN": token}


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:  # exactly the processes this test started
        if p.poll() is None:
            p.kill()
        p.wait()


def test_an_unrelated_process_named_in_driver_json_is_left_alone(tmp_path, procs):
    bystander = _spawn("sleep")  # e.g. someone's shell, sshd: listed with its true start time
    procs.append(bystander)
    _driver_json(tmp_path / "run", [bystander])
    assert reap_previous(tmp_path / "run", grace_s=1.0) == []
    time.sleep(0.3)
    assert bystander.poll() is None, "an unrelated process was signalled"


@pytest.mark.parametrize("case", ["no marks", "another run directory", "another driver's token", "not a ray process"])
def test_a_process_that_does_not_prove_it_is_this_runs_is_left_alone(tmp_path, procs, case):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env, argv0 = _marks(run_dir), "ray::RegionActor"
    if case == "no marks":
        env = {}
    elif case == "another run directory":
        (tmp_path / "other").mkdir()
        env = _marks(tmp_path / "other")
    elif case == "another driver's token":
        env = _marks(run_dir, token="0" * 32)
    else:
        argv0 = "sleep"  # carries the marks (a child of the driver) but is no process of Ray's
    proc = _spawn(argv0, env=env)
    procs.append(proc)
    _driver_json(run_dir, [proc])
    assert reap_previous(run_dir, grace_s=1.0) == []
    time.sleep(0.3)
    assert proc.poll() is None


def test_a_leftover_of_this_runs_ray_is_ended_and_only_it(tmp_path, procs):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    worker = _spawn("ray::RegionActor", env=_marks(run_dir))  # a worker of the dead driver's Ray
    agent = _spawn(f"/venv/bin/python -u /venv/ray/dashboard/agent.py --session-dir={SESSION}", env=_marks(run_dir))
    bystander = _spawn("sleep")
    procs.extend([worker, agent, bystander])
    _driver_json(run_dir, [worker, agent, bystander])
    reaped = reap_previous(run_dir, grace_s=5.0)
    assert sorted(p["pid"] for p in reaped) == sorted([worker.pid, agent.pid])
    assert worker.wait(10) == -signal.SIGTERM and agent.wait(10) == -signal.SIGTERM
    assert bystander.poll() is None


# A Ray agent whose environment, as /proc shows it, no longer holds the run's marks: Ray's
# setproctitle zeroes all or part of it (how much varies: the test gives none, to be sure which
# proof is at work). Its output goes to the session's logs, as Ray's agents' does.
AGENT = ("import os, sys, time, ray._raylet; ray._raylet.setproctitle('ray::DashboardAgent'); "
         "print('up', flush=True); time.sleep(300)")


def _agent(run_dir: Path, session: Path) -> subprocess.Popen:
    (session / "logs").mkdir(parents=True, exist_ok=True)
    out = open(session / "logs" / "dashboard_agent.out", "wb")  # not a `with`: the child holds it
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEOFED_")}
    proc = subprocess.Popen([sys.executable, "-c", AGENT], env=env, stdout=out)
    deadline = time.monotonic() + 30
    while (session / "logs" / "dashboard_agent.out").read_bytes() != b"up\n":
        assert time.monotonic() < deadline and proc.poll() is None, "the stand-in agent did not start"
        time.sleep(0.05)
    out.close()
    return proc


def _bind(session: Path, run_dir: Path, token: str = TOKEN) -> Path:
    path = session / "geofed-run.json"  # what the driver writes into Ray's session at start
    path.write_text(json.dumps({"run_dir": str(run_dir.resolve()), "token": token}))
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize("case", ["bound", "unbound", "bound to another run", "bound by another user"])
def test_a_ray_process_whose_environment_was_overwritten_is_proved_by_its_session(tmp_path, procs, case):
    run_dir, session = tmp_path / "run", tmp_path / "ray" / "session_x"
    run_dir.mkdir()
    agent = _agent(run_dir, session)
    procs.append(agent)
    with open(f"/proc/{agent.pid}/environ", "rb") as f:
        assert b"GEOFED_RUN_TOKEN" not in f.read()  # only the session can prove it
    if case == "bound":
        _bind(session, run_dir)
    elif case == "bound to another run":
        (tmp_path / "other").mkdir()
        _bind(session, tmp_path / "other")
    elif case == "bound by another user":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file away")
        os.chown(_bind(session, run_dir), 65534, 65534)
    (run_dir / "driver.json").write_text(json.dumps({
        "pid": _dead_pid(), "start": 1, "token": TOKEN, "session_dir": str(session),
        "processes": [[agent.pid, _start_time(agent.pid), "ray::DashboardA"]]}))
    reaped = reap_previous(run_dir, grace_s=5.0)
    if case == "bound":
        assert [p["pid"] for p in reaped] == [agent.pid] and agent.wait(10) == -signal.SIGTERM
    else:
        assert reaped == [] and agent.poll() is None


def test_a_malformed_driver_json_ends_nothing(tmp_path, procs):
    bystander = _spawn("sleep")
    procs.append(bystander)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for text in ["[1, 2]", '{"pid": "x", "processes": 3}', '{"processes": [[%d, "9" , 1, 2]]}' % bystander.pid,
                 '{"processes": [["1%s", 1, "x"]]}' % ("0" * 5000)]:
        (run_dir / "driver.json").write_text(text)
        assert reap_previous(run_dir, grace_s=0.5) == []
    assert bystander.poll() is None
