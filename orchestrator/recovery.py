"""What the driver does about faults, kept apart from the round loop (docs/reliability.md).

- ``StopSignals``: the first SIGINT/SIGTERM asks for a clean stop at the next round boundary
  (the round in flight finishes, a checkpoint is written, exit 130/143); a second one stops at
  once (KeyboardInterrupt; the previous checkpoint stands, so at most one round is lost).
- ``plan_resync``: after a round in which some regions missed an in-neighbour's update, which
  region pulls the model from which (DiLoCo/all-reduce over a full topology keep one model).
- ``Interrupted``: raised by the runner after a clean stop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from .rundir import read_json_file, write_json

log = logging.getLogger(__name__)

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class RunFailed(RuntimeError):
    """The run cannot go on (fail-fast region loss, diverged training, no usable checkpoint...)."""


def signal_name(signum: int | None) -> str | None:
    return None if signum is None else signal.Signals(signum).name


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class Interrupted(Exception):
    """The run stopped cleanly on a signal after `round` (the last completed round, -1: none)."""

    def __init__(self, signum: int, round_: int):
        self.signum, self.round = signum, round_
        super().__init__(f"stopped by {signal.Signals(signum).name} after round {round_}")

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 130)


class StopSignals:
    """Turn SIGINT/SIGTERM into a request the round loop polls. Only the main thread can own
    signal handlers: elsewhere (a Runner inside a test thread) this is inert."""

    def __init__(self, notify=None):
        self.signum: int | None = None
        self._notify = notify
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for s in EXIT_CODES:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def reclaim(self) -> None:
        """Take the signals back after ray.init(), whose core worker installs its own SIGTERM
        handler (it logs and kills the driver, skipping the clean stop)."""
        for s in self._old:
            signal.signal(s, self._handle)

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        self.signum = signum
        if self._notify is not None:
            self._notify(signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        return self.signum is not None


@dataclass(frozen=True, kw_only=True)
class Resync:
    region: str
    donors: tuple[str, ...]  # any of them will do; the joiner's rendezvous order spreads the load


def plan_resync(results: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> list[Resync]:
    """Who pulls the model from whom after a round.

    With DiLoCo or all-reduce over a full topology every region that received every update holds
    the same model; a region that missed one folded the missing weight into its own update and
    drifted. The donors are the regions that missed nothing; when every region missed something
    (an outage of every link, a region that died mid-round) the one that missed fewest, first in
    `order`, is the donor and the others take its model: one model again, at the cost of one
    round of the others' local progress.

    A region fetches only from donors whose update reached it this round when there are such:
    that proves the donor -> region direction works, while the link that made it miss an update
    may still be down (a FetchState over it would stall until its timeout).
    """
    missing = {r: len(m.get("peers_missing") or ()) for r, m in results.items()}
    if not any(missing.values()):
        return []
    complete = [r for r in order if missing.get(r) == 0]
    if complete:
        donors = tuple(complete)
    else:
        fewest = min(missing.values())
        donors = (next(r for r in order if missing.get(r) == fewest),)
    jobs = []
    for r in order:
        if r in missing and missing[r] and r not in donors:
            heard = {t.get("peer") for t in results[r].get("transfers") or () if t.get("direction") == "recv"}
            jobs.append(Resync(region=r, donors=tuple(d for d in donors if d in heard) or donors))
    return jobs


# -- processes a killed driver left behind -------------------------------------------------------
# A SIGKILLed driver cannot stop the local Ray it started: gcs and raylet notice within seconds and
# take the region actors with them, but Ray's agents linger for a minute or more. The driver lists
# what it started in RUN_DIR/driver.json; `geofed run --resume` ends what is still there.
#
# driver.json is a file, and a run directory can be handed to you: it may list any pid. So a
# listed process is signalled only when the process itself proves it is this run's: the same
# start time (a reused pid never matches), an environment holding this run directory's path and
# the token of the driver that wrote driver.json (set before that driver started Ray, inherited by
# every Ray process and worker), and a command line of that Ray session (a `ray::` worker, or one
# naming the session directory). /proc/PID/environ is readable only by the process's owner (and
# root), and no other program puts geofed's marks in its environment.

DRIVER_FILE = "driver.json"
RUN_DIR_ENV, RUN_TOKEN_ENV = "GEOFED_RUN_DIR", "GEOFED_RUN_TOKEN"


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after its closing one.
    return [text[: text.index(" ")], text[text.index("(") + 1: text.rindex(")")]] + text[text.rindex(")") + 2:].split()


def _identity(pid: int) -> tuple[int, int, str] | None:
    st = _stat(pid)
    if st is None or st[2] == "Z":
        return None
    return pid, int(st[21]), st[1]  # pid, start time (clock ticks since boot), name


def process_tree(root: int) -> list[tuple[int, int, str]]:
    """(pid, start time, name) of every live process below `root`, from /proc ([] without it)."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(int(st[3]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if (ident := _identity(child)) is not None:
                out.append(ident)
                todo.append(child)
    return out


@contextmanager
def marked_processes(run_dir: Path) -> Iterator[str]:
    """Inside, processes this driver starts (Ray's, and the workers they start later) carry this
    run directory and a fresh token in their environment; yields the token for driver.json."""
    token = secrets.token_hex(16)
    marks = {RUN_DIR_ENV: str(Path(run_dir).resolve()), RUN_TOKEN_ENV: token}
    saved = {k: os.environ.get(k) for k in marks}
    os.environ.update(marks)
    try:
        yield token
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def record_processes(run_dir: Path, token: str) -> None:
    """Write the driver's own process tree (the local Ray it started, under `token`) to RUN_DIR/driver.json."""
    me = _identity(os.getpid())
    data = {"pid": os.getpid(), "start": me[1] if me else None, "token": token, "session_dir": _ray_session_dir(),
            "processes": [list(p) for p in process_tree(os.getpid())]}
    write_json(Path(run_dir) / DRIVER_FILE, data)


def _ray_session_dir() -> str | None:
    import ray

    if not ray.is_initialized():  # get_runtime_context() would start a Ray of its own
        return None
    ctx = ray.get_runtime_context()
    return os.path.join(ctx.get_temp_dir(), ctx.get_session_name())


def belongs_to_run(pid: int, run_dir: Path, token: str, session_dir: str | None) -> bool:
    """Whether process `pid` proves it was started for `run_dir` by the driver that recorded
    `token` and `session_dir` (see above); False when /proc cannot say."""
    if not isinstance(token, str) or len(token) < 16:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = set(f.read().split(b"\0"))
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ")
    except OSError:  # gone, or another user's
        return False
    marked = (f"{RUN_DIR_ENV}={Path(run_dir).resolve()}".encode() in env
              and f"{RUN_TOKEN_ENV}={token}".encode() in env)
    ray_process = cmdline.startswith(b"ray::") or (
        isinstance(session_dir, str) and len(session_dir) > 1 and session_dir.encode() in cmdline)
    return marked and ray_process


def reap_previous(run_dir: Path, *, grace_s: float = 5.0) -> list[dict]:
    """End what a previous driver of this run directory started and left running, if that driver
    is gone: only processes that prove they are that driver's (belongs_to_run). Returns what was
    ended ({pid, name}); [] when nothing was left."""
    data = read_json_file(Path(run_dir) / DRIVER_FILE)  # None when missing; a FIFO or 1 GB file is refused
    if not isinstance(data, dict):
        return []
    try:
        driver_pid, listed = int(data.get("pid", -1)), [(int(p), int(s), str(n)) for p, s, n in data.get("processes", [])]
    except (ValueError, TypeError):  # a malformed list: nothing provably ours
        return []
    driver = _identity(driver_pid)
    if driver is not None and driver[1] == data.get("start"):
        raise RuntimeError(f"the driver of {run_dir} (pid {data['pid']}) is still running")
    live = [(pid, start, name) for pid, start, name in listed if (ident := _identity(pid)) is not None and ident[1] == start]
    left = [p for p in live if belongs_to_run(p[0], run_dir, data.get("token"), data.get("session_dir"))]
    if len(left) < len(live):
        others = sorted(p[0] for p in set(live) - set(left))
        log.warning("%s: %d live processes listed in %s do not prove they belong to this run; left alone: %s",
                    run_dir, len(others), DRIVER_FILE, others)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid, start, _ in left:
            ident = _identity(pid)
            if ident is not None and ident[1] == start:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any((i := _identity(p)) is not None and i[1] == s for p, s, _ in left):
            time.sleep(0.1)
    return [{"pid": pid, "name": name} for pid, _, name in left]


def schedule_after(schedule: Sequence[Any], *, next_round: int, elapsed_s: float) -> tuple:
    """The WAN emulator schedule a resumed run plays (it starts a fresh emulator, whose clock
    and rounds would otherwise replay the whole schedule): events already past keep their link
    changes, applied at once, and lose their outages, which are over; later `at_s` events move
    earlier by the time already run."""
    out = []
    for ev in schedule:
        past = ((ev.at_round is not None and ev.at_round < next_round)
                or (ev.at_s is not None and ev.at_s < elapsed_s))
        if not past:
            out.append(ev if ev.at_s is None else dataclasses.replace(ev, at_s=ev.at_s - elapsed_s))
        elif ev.set is not None:
            when = {"at_s": 0.0} if ev.at_s is not None else {}
            out.append(dataclasses.replace(ev, outage_s=None, end_outage=False, **when))
    return tuple(out)
