"""Who is in a live run: requests to leave it or join it again, taken between rounds, and the
spot notices of regions that got a SIGTERM (docs/reliability.md, "Membership: leave and join";
issue 41).

The control channel is the run directory itself, so it needs no port and works with the driver on
any node that sees RUN_DIR: `geofed leave` and `geofed join` write one request as
RUN_DIR/control/<id>.json (a temporary file renamed into place, so the driver never reads half of
one); the driver, between rounds, takes each request by renaming it to <id>.json.taken (a request
is taken once, whoever else looks) and answers in events.jsonl with the request's id:
`region_left`, `region_joined`, or `control_refused` with the reason. A malformed request is
refused the same way and the run goes on.

A region that leaves has delivered its update of the last round it ran (requests are taken only
between rounds; with overlap its exchange in flight is finished first), then it is retired for
good: its actor closed and killed with no restart, out of `alive`, so the coordinator plans the
next round without it and topology and mixing weights follow the regions that remain (a region's
plan names who is in the round: its weight goes to them). A SIGTERM to a region's process
(regions/leave_notice.py) reaches the driver in the region's report or heartbeat and is a leave
request of its own. A region that left joins again under its name in a new actor, through the
path of a restarted region (faults.py: the current model and outer state from a peer), its links
probed, planned from the next round. summary.json's `left` and `joined` say who, when and why.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .rundir import read_jsonl

if TYPE_CHECKING:  # the commands' side (request_from_args) runs without Ray
    from .handles import RegionHandles
    from .journal import Journal

__all__ = ["CONTROL_DIR", "ACTIONS", "EXIT", "Request", "Membership", "request_from_args", "parse_request",
           "requeue_unanswered", "run_is_live", "take_requests", "withdraw_request", "write_request"]

CONTROL_DIR = "control"
ACTIONS = ("leave", "join")
MAX_REQUEST_BYTES = 4096  # a request is a few dozen bytes; anything larger is not one of ours
_ID_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")


@dataclass(frozen=True, kw_only=True)
class Request:
    """One control request: `id` (the file's stem, echoed in the answer), `action`, `region`."""

    id: str
    action: str
    region: str


def parse_request(request_id: str, raw: bytes) -> Request:
    """A request file's content -> Request; ValueError with the reason for anything else."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise ValueError(f"larger than {MAX_REQUEST_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"action", "region", "requested_at"})
    if unknown:
        raise ValueError(f"unknown keys: {', '.join(unknown)}")
    action, region = data.get("action"), data.get("region")
    if action not in ACTIONS:
        raise ValueError(f"action: expected one of {', '.join(ACTIONS)}, got {action!r}")
    if not isinstance(region, str) or not region:
        raise ValueError(f"region: expected a region name, got {region!r}")
    return Request(id=request_id, action=action, region=region)


def write_request(run_dir: Path, action: str, region: str) -> str:
    """Write one request into RUN_DIR/control atomically; returns its id (the answer carries it)."""
    control = Path(run_dir) / CONTROL_DIR
    control.mkdir(mode=0o700, exist_ok=True)
    ns = time.time_ns()  # ids sort in the order they were written: the driver takes them in that order
    request_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(ns // 10**9))}-{ns % 10**9:09d}-{secrets.token_hex(3)}"
    tmp = control / f".{request_id}.tmp"
    body = json.dumps({"action": action, "region": region, "requested_at": time.time()}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, control / f"{request_id}.json")  # the driver lists *.json only: never half a request
    return request_id


def withdraw_request(run_dir: Path, request_id: str) -> bool:
    """Remove a request the driver has not taken yet; False when it was taken (it may still act)."""
    try:
        (Path(run_dir) / CONTROL_DIR / f"{request_id}.json").unlink()
        return True
    except FileNotFoundError:
        return False


def requeue_unanswered(run_dir: Path) -> list[str]:
    """A resumed driver's first look: requests its killed predecessor took (.taken) but never answered
    in events.jsonl go back to waiting, so that a join or leave sent just before a driver kill is
    not lost. Returns their ids."""
    control = Path(run_dir) / CONTROL_DIR
    if not control.is_dir():
        return []
    answered = {e.get("request") for e in read_jsonl(Path(run_dir) / "events.jsonl")}
    back = []
    for taken in sorted(control.glob("*.json.taken")):
        request_id = taken.name[: -len(".json.taken")]
        if request_id not in answered:
            try:
                os.rename(taken, control / f"{request_id}.json")
                back.append(request_id)
            except FileNotFoundError:
                continue
    return back


def take_requests(run_dir: Path) -> list[tuple[str, Request | ValueError]]:
    """Every request waiting in RUN_DIR/control, oldest first (ids start with their UTC time), each
    taken by renaming it to .taken: (id, the Request or the ValueError saying why it is malformed)."""
    control = Path(run_dir) / CONTROL_DIR
    if not control.is_dir():
        return []
    out: list[tuple[str, Request | ValueError]] = []
    for path in sorted(control.glob("*.json")):
        request_id = path.stem
        taken = path.with_name(path.name + ".taken")
        try:
            os.rename(path, taken)
        except FileNotFoundError:
            continue  # withdrawn meanwhile
        if not set(request_id) <= _ID_CHARS:
            out.append((request_id[:80], ValueError("file name: not a request id (write requests with geofed leave)")))
            continue
        try:
            with open(taken, "rb") as f:
                raw = f.read(MAX_REQUEST_BYTES + 1)
            out.append((request_id, parse_request(request_id, raw)))
        except OSError as exc:
            out.append((request_id, ValueError(f"unreadable: {exc.strerror}")))
        except ValueError as exc:
            out.append((request_id, exc))
    return out


class Membership:
    """The driver's side of who is in the run. The round loop calls `poll(r)` before each round and
    `note_reports(results)` after it. `busy()` names regions with a round in flight (a quorum round's
    straggler), whose leave waits for that round; `drain(region)` finishes a leaver's exchange in
    flight before it goes; `spawn(region)` places a new actor for a joiner (its handle and
    node_info) and `rejoin(region, r, info)` brings it in as a restarted region is (faults.py);
    `probe(regions)` measures their links before they carry updates. Without `spawn` joins are refused."""

    def __init__(self, run_dir: Path, regions: RegionHandles, journal: Journal, *,
                 busy: Callable[[], Collection[str]], drain: Callable[[str], None],
                 spawn: Callable[[str], tuple[Any, dict]] | None = None,
                 rejoin: Callable[[str, int, dict], Any] | None = None,
                 probe: Callable[[list[str]], None] | None = None):
        self.run_dir, self.regions, self.journal = Path(run_dir), regions, journal
        self.busy, self.drain = busy, drain
        self.spawn, self.rejoin, self.probe = spawn, rejoin, probe
        self.left: dict[str, dict[str, Any]] = {}  # region -> {round, why, request} of its last leave
        self.joined: dict[str, dict[str, Any]] = {}  # region -> {round, request} of its last join
        self.out: set[str] = set()  # left and not back
        self.waiting: list[Request] = []  # leaves held until the region's round in flight returns
        self.kept: set[str] = set()  # the last region, which a SIGTERM cannot retire (said once)

    def poll(self, r: int) -> list[str]:
        """Take the requests in RUN_DIR/control and act on them, in the order written, before round
        r; then the spot notices. Returns the regions that left."""
        for request_id, got in take_requests(self.run_dir):
            if isinstance(got, ValueError):
                self._refuse(request_id, None, f"malformed request: {got}")
            else:
                self.waiting.append(got)
        gone, held = [], []
        for req in self.waiting:
            why = self._refusal(req)
            if why is not None:
                self._refuse(req.id, req.region, why)
            elif req.action == "join":
                self.join(req.region, r, request=req.id)
            elif req.region in self.busy():
                held.append(req)  # its quorum round is in flight: it leaves once that returns
            else:
                self.leave(req.region, r, why="request", request=req.id)
                gone.append(req.region)
        self.waiting = held
        for region in sorted(self.regions.leaving):  # spot notices: a SIGTERM to the region's process
            if region in self.out or region in self.busy():
                continue
            if not [reg for reg in self.regions.alive if reg != region]:
                if region not in self.kept:
                    self.kept.add(region)
                    self.journal.note(f"region {region} got a SIGTERM but is the last region in the run: it stays "
                                      "until its process ends")
                continue
            self.leave(region, r, why="sigterm")
            gone.append(region)
        return gone

    def note_reports(self, results: Mapping[str, Any]) -> None:
        """A round's reports: a region whose report says it is leaving (it got a SIGTERM, a spot
        notice: regions/leave_notice.py) leaves before the next round, its update of this one delivered."""
        for region, m in results.items():
            if m.extra.get("leaving"):
                self.regions.leaving.setdefault(region, dict(m.extra))

    def _refusal(self, req: Request) -> str | None:
        regions = self.regions
        if req.region not in regions.names:
            new = " (joining under a new name is not supported yet)" if req.action == "join" else ""
            return f"unknown region {req.region!r}: the run's regions are {', '.join(regions.names)}{new}"
        if req.action == "join":
            if req.region in regions.alive:
                return f"region {req.region} is in the run"
            if self.spawn is None or self.rejoin is None:
                return "this run cannot place new region actors (joins need the Ray driver)"
            return None
        if req.region in self.out:
            return f"region {req.region} has already left the run"
        if [reg for reg in regions.alive if reg != req.region] == []:
            return f"region {req.region} is the last region in the run: stop the run instead (Ctrl-C or SIGTERM to the driver)"
        return None

    def _refuse(self, request_id: str, region: str | None, why: str) -> None:
        self.journal.event("control_refused", request=request_id, region=region, why=why)
        self.journal.note(f"control request {request_id} refused: {why}")

    def leave(self, region: str, r: int, *, why: str, request: str | None = None) -> None:
        """Retire `region` before round r: its exchange in flight finished (when it is alive), its
        actor closed and killed for good, out of the run."""
        regions = self.regions
        was_alive = region in regions.alive
        if was_alive:
            try:
                self.drain(region)
            except Exception as exc:  # noqa: BLE001 - it goes anyway; its peers' deadlines cover the rest
                self.journal.note(f"region {region}: its exchange in flight did not finish before it left: {exc}")
        notice = regions.leaving.get(region) or {}
        regions.retire(region)
        self.left[region] = {"round": r - 1, "why": why, "request": request}
        self.out.add(region)
        self.journal.count("regions_left")
        self.journal.event("region_left", region=region, request=request, why=why, last_round=r - 1,
                           was_alive=was_alive, alive=list(regions.alive),
                           **({"grace_left_s": notice["grace_left_s"]} if "grace_left_s" in notice else {}))
        self.journal.note(f"region {region} left the run after round {r - 1} ({why}); "
                          f"{len(regions.alive)} regions go on: {', '.join(regions.alive)}", style="green")

    def join(self, region: str, r: int, *, request: str | None = None) -> None:
        """`region` (one that left, or failed and was given up) comes back before round r: a new
        actor, the current model and outer state from a peer (the rejoin path: region_rejoined,
        after: join), its links probed; planned from round r."""
        regions = self.regions
        if region in regions.dead:
            regions.retire(region)  # failed and not back: its old actor goes for good, a new one takes its place
        try:
            handle, info = self.spawn(region)
        except Exception as exc:  # noqa: BLE001 - a placement error: the run goes on without it
            self._refuse(request or "-", region, f"its actor could not be placed: {exc}")
            return
        regions.actors.handles[region] = handle
        regions.actors.info[region] = info
        regions.dead[region] = "joining"  # the rejoin path brings a dead region back
        self.rejoin(region, r, info)
        if region not in regions.alive:
            self._refuse(request or "-", region, "its new actor did not come up in time: it rejoins once it answers")
            return
        if self.probe is not None:
            self.probe(list(regions.alive))
        self.out.discard(region)
        self.joined[region] = {"round": r, "request": request}
        self.journal.count("regions_joined")
        self.journal.event("region_joined", region=region, request=request, first_round=r,
                           pid=info.get("pid"), alive=list(regions.alive))
        self.journal.note(f"region {region} joined the run before round {r}", style="green")

    def summary_fields(self) -> dict[str, Any]:
        """summary.json's `left` (region -> {round: the last it ran, why, request}) and `joined`
        (region -> {round: the first it ran again, request})."""
        return {"left": dict(self.left), "joined": dict(self.joined)}

    def state_dict(self) -> dict[str, Any]:
        return {"left": dict(self.left), "joined": dict(self.joined), "out": sorted(self.out)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run: the regions out stay out (their new actors are retired at once)."""
        self.left.update(state.get("left") or {})
        self.joined.update(state.get("joined") or {})
        out = state.get("out", list(state.get("left") or {}))
        for region in out:
            if region in self.regions.names and region not in self.out:
                self.regions.retire(region)
                self.out.add(region)


# -- the CLI's side: `geofed leave` -----------------------------------------------------------
EXIT = {"done": 0, "refused": 1, "bad_input": 2, "not_running": 3, "timed_out": 4}
_DONE = {"leave": "region_left", "join": "region_joined"}


def run_is_live(run_dir: Path) -> bool:
    """A driver holds RUN_DIR/run.lock (rundir.lock_run_dir) for as long as it runs the run."""
    try:
        fd = os.open(Path(run_dir) / "run.lock", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EACCES)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class _EventTail:
    """events.jsonl's lines written after it was opened, as they come (a torn last line waits)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.is_file() else 0
        self.partial = b""

    def new(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(1 << 20)
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


def request_from_args(args: Any, action: str) -> int:
    """`geofed leave RUN_DIR NAME [--wait S]` (retire region NAME after the round in flight) and
    `geofed join RUN_DIR --region NAME [--wait S]` (bring it back before the next round): write the
    request and wait (at most S seconds; 0: not at all) for the driver's answer in events.jsonl,
    printed as one JSON line. Exit codes: EXIT (0 done, 1 refused by the driver, 2 not a run
    directory or an unknown region, 3 no driver runs the run, 4 no answer within S)."""
    from .rundir import run_dir_config

    def _say(message: str) -> None:
        print(f"geofed {action}: {message}", file=sys.stderr)

    run_dir = Path(args.run_dir)
    # A Runner started from Python writes no config.yaml: then the driver alone checks the name.
    known = (run_dir / "config.yaml").exists() or not ((run_dir / "run.lock").exists() or (run_dir / "events.jsonl").exists())
    names = list(run_dir_config(run_dir).regions.names) if known else [args.region]  # ConfigError (exit 2): not a run directory
    if args.region not in names:
        _say(f"unknown region {args.region!r}: {run_dir}'s regions are {', '.join(names)}")
        return EXIT["bad_input"]
    if not run_is_live(run_dir):
        _say(f"no driver runs {run_dir} (the run has ended, or its driver is gone: geofed run --resume {run_dir} "
             "takes requests again)")
        return EXIT["not_running"]
    tail = _EventTail(run_dir / "events.jsonl")
    request_id = write_request(run_dir, action, args.region)
    if args.wait <= 0:
        print(json.dumps({"request": request_id, "region": args.region, "action": action}))
        return EXIT["done"]
    deadline = time.monotonic() + args.wait
    while True:
        live = run_is_live(run_dir)  # before reading: a driver that answers and ends is read after its end
        for record in tail.new():
            if record.get("request") == request_id and record.get("event") in (_DONE[action], "control_refused"):
                print(json.dumps(record))
                return EXIT["done"] if record["event"] == _DONE[action] else EXIT["refused"]
        if not live or time.monotonic() > deadline:
            if withdraw_request(run_dir, request_id):
                _say("the run ended before its driver took the request (withdrawn)" if not live else
                     f"the driver did not take the request within {args.wait:g}s (withdrawn): it takes requests "
                     "between rounds; a longer --wait waits for a long round")
                return EXIT["not_running"] if not live else EXIT["timed_out"]
            if not live:
                _say("the run ended after its driver took the request, without an answer")
                return EXIT["not_running"]
            _say(f"the driver took request {request_id} but did not answer within {args.wait:g}s: it acts "
                 f"between rounds (events.jsonl: {_DONE[action]})")
            return EXIT["timed_out"]
        time.sleep(0.2)
