"""Processes a killed driver left behind, and ending only those (docs/reliability.md, "Resume").

A SIGKILLed driver cannot stop the local Ray it started: gcs and raylet notice within seconds and
take the region actors with them, but Ray's agents linger for a minute or more. The driver lists
what it started in RUN_DIR/driver.json; `geofed run --resume` ends what is still there.

driver.json is a file, and a run directory can be handed to you: it may list any pid. So a
listed process is signalled only when the process itself proves it is this run's Ray:

- the same start time as listed (a pid the system has reused never matches), and
- its own /proc entries show it was started for this run directory by the driver that wrote
  driver.json, one of two ways:
  - environment: before ray.init the driver puts GEOFED_RUN_DIR (the run directory's real path)
    and GEOFED_RUN_TOKEN (random, per driver, in driver.json) in its environment; every Ray
    process and worker inherits them. /proc/PID/environ shows the environment a process
    started with, until the process overwrites that memory: Ray's `ray::` processes do (they
    set their title with setproctitle, which zeroes it), so for them:
  - session: a `ray::` process running as this user whose standard output or error (or any
    open file) lies in the Ray session directory the driver recorded, where the driver also
    wrote `geofed-run.json` (0600, owned by this user) naming this run directory and the token.

and its command line is Ray's: a `ray::` process, or one naming that session directory.
/proc/PID/environ and /proc/PID/fd are readable only by the process's owner (and root), no
other program carries geofed's marks, and only this user (or root) can own the session file: a
forged driver.json can name any pid but reach no process that is not a geofed run's Ray for this
very run directory.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .rundir import read_json_file, write_json

log = logging.getLogger(__name__)

DRIVER_FILE = "driver.json"
SESSION_FILE = "geofed-run.json"
RUN_DIR_ENV, RUN_TOKEN_ENV = "GEOFED_RUN_DIR", "GEOFED_RUN_TOKEN"
_MAX_FDS = 4096  # open files looked at per process


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


def record_processes(run_dir: Path, token: str, *, bind: bool = True) -> None:
    """Write the driver's own process tree (the local Ray it started, under `token`) to
    RUN_DIR/driver.json, and bind Ray's session directory to this run (SESSION_FILE) unless not
    `bind` (a cluster the driver joined: its session is not this run's, and its processes no leftovers)."""
    me = _identity(os.getpid())
    session = _ray_session_dir() if bind else None
    if session is not None:
        bind_session(session, run_dir, token)
    data = {"pid": os.getpid(), "start": me[1] if me else None, "token": token, "session_dir": session,
            "processes": [list(p) for p in process_tree(os.getpid())]}
    write_json(Path(run_dir) / DRIVER_FILE, data)


def bind_session(session_dir: str, run_dir: Path, token: str) -> None:
    """SESSION_FILE in Ray's session directory: this run directory and the token, 0600, created
    by this process (never through a link, never over an existing file)."""
    path = os.path.join(session_dir, SESSION_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:  # e.g. made by someone else first: then leftovers are proved by environment only
        log.warning("cannot bind Ray's session %s to this run: %s", session_dir, exc.strerror)
        return
    with open(fd, "w") as f:
        json.dump({"run_dir": str(Path(run_dir).resolve()), "token": token}, f)


def _ray_session_dir() -> str | None:
    import ray

    if not ray.is_initialized():  # get_runtime_context() would start a Ray of its own
        return None
    ctx = ray.get_runtime_context()
    return os.path.join(ctx.get_temp_dir(), ctx.get_session_name())


def _read_proc(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:  # gone, or another user's
        return None


def _session_bound(session_dir: str, run_dir: Path, token: str) -> bool:
    """SESSION_FILE in `session_dir` is a regular file of this user, nobody else may write, and
    names this run directory and `token`."""
    path = os.path.join(session_dir, SESSION_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022 or st.st_size > 4096:
            return False
        try:
            bound = json.loads(f.read())
        except ValueError:
            return False
    return (isinstance(bound, dict) and bound.get("token") == token
            and bound.get("run_dir") == str(Path(run_dir).resolve()))


def _holds_file_in(pid: int, directory: str) -> bool:
    prefix = directory.rstrip("/") + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")[:_MAX_FDS]
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
        except OSError:
            continue
    return False


def belongs_to_run(pid: int, run_dir: Path, token: str, session_dir: str | None) -> bool:
    """Whether process `pid` proves it was started for `run_dir` by the driver that recorded
    `token` and `session_dir` (module docstring); False when /proc cannot say."""
    if not isinstance(token, str) or len(token) < 16:
        return False
    env, cmdline = _read_proc(pid, "environ"), _read_proc(pid, "cmdline")
    if env is None or cmdline is None:
        return False
    session = session_dir if isinstance(session_dir, str) and os.path.isabs(session_dir) and len(session_dir) > 1 else None
    ray_process = cmdline.startswith(b"ray::") or (session is not None and session.encode() in cmdline)
    if not ray_process:
        return False
    values = set(env.split(b"\0"))
    if (f"{RUN_DIR_ENV}={Path(run_dir).resolve()}".encode() in values
            and f"{RUN_TOKEN_ENV}={token}".encode() in values):
        return True
    # Its environment was overwritten (setproctitle): the session it writes to must be this run's.
    try:
        mine = os.stat(f"/proc/{pid}").st_uid == os.geteuid()
    except OSError:
        return False
    return (mine and cmdline.startswith(b"ray::") and session is not None
            and _session_bound(session, run_dir, token) and _holds_file_in(pid, session))


def reap_previous(run_dir: Path, *, grace_s: float = 5.0, keep: set[int] | frozenset[int] = frozenset()) -> list[dict]:
    """End what a previous driver of this run directory started and left running, if that driver
    is gone: only processes that prove they are that driver's (belongs_to_run), never one in `keep`
    (region actors that outlive their driver, run.orphan_timeout_s: a resume re-attaches to them).
    Returns what was ended ({pid, name}); [] when nothing was left."""
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
    live = [(pid, start, name) for pid, start, name in listed
            if pid not in keep and (ident := _identity(pid)) is not None and ident[1] == start]
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
