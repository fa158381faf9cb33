"""Helpers for the end-to-end tests: `geofed run` as its own process, its process tree read
from /proc, and cleanup of exactly the processes it started (never by name: other runs share
this machine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GEOFED = [sys.executable, "-c", "from geofed.orchestrator.cli import entry; entry()"]


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after its closing one.
    return [text[: text.index(" ")]] + text[text.rindex(")") + 2:].split()


def proc_identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time in clock ticks), or None once the process is gone or a zombie: a pid
    reused by a new process never matches the old identity."""
    st = _stat(pid)
    if st is None or st[1] == "Z":
        return None
    return pid, int(st[20])


def descendants(root: int) -> dict[tuple[int, int], str]:
    """Identity -> command line of every live process below `root` (Ray's gcs, raylet, agents,
    workers and the region actors)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(int(st[2]), []).append(int(entry))
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            ident = proc_identity(child)
            if ident is not None:
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        out[ident] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                todo.append(child)
    return out


def alive(identities: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return {i for i in identities if proc_identity(i[0]) == i}


def wait_gone(identities: set[tuple[int, int]], timeout_s: float) -> set[tuple[int, int]]:
    """Waits until none of `identities` lives; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := alive(identities)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_exactly(identities: set[tuple[int, int]]) -> None:
    """SIGKILL each process that is still the one recorded (same pid and start time)."""
    for pid, _start in alive(identities):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_geofed(args: list[str], *, cwd: Path, log: Path) -> subprocess.Popen:
    """`geofed ARGS` in its own session (so a terminal-like Ctrl-C can go to its group)."""
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
    out = open(log, "wb")  # not a `with`: closed by the child's exit; the test reads the file
    return subprocess.Popen(GEOFED + args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def rounds_logged(run_dir: Path) -> int:
    path = run_dir / "rounds.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}"))


def wait_rounds(proc: subprocess.Popen, run_dir: Path, n: int, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while rounds_logged(run_dir) < n:
        if proc.poll() is not None:
            raise AssertionError(f"geofed exited {proc.returncode} before round {n}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {n} rounds within {timeout_s}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def kill_driver_and_resume(start, resume, *, run_dir: Path, after_rounds: int, tmp_path: Path) -> None:
    """kill -9 of the driver `start(log)` starts once it logged `after_rounds` rounds; its Ray
    processes (GCS, raylet, region actors) must die with it; then `resume(log)` must finish (exit 0)."""
    log = tmp_path / "first.log"
    proc = start(log)
    tree: dict = {}
    try:
        wait_rounds(proc, run_dir, after_rounds, timeout_s=300, log=log)
        tree = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        core = {i for i, cmd in tree.items() if "gcs_server" in cmd or "raylet" in cmd or "RegionActor" in cmd}
        assert not wait_gone(core, timeout_s=30), f"outlived the killed driver: {alive(core)}"
        log2 = tmp_path / "resume.log"
        resumed = resume(log2)
        assert resumed.wait(400) == 0, log2.read_text()[-4000:]
    finally:
        proc.kill()
        kill_exactly(set(tree))


def train_reference(cfg, run_dir: Path) -> dict:
    """The undisturbed run a crash test compares with: trained in this process on the session's
    Ray (geofed's Runner), its summary returned and its actors ended."""
    from geofed.orchestrator.driver.run import Runner

    runner = Runner(cfg, run_dir, show_progress=False)
    try:
        return runner.run()
    finally:
        runner.shutdown()
