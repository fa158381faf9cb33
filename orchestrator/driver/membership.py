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
probed, planned from the next round. The driver does not wait for that actor while it starts (a
new process that imports torch): the rounds go on without the joiner (`region_joining`), and the
first poll after its actor answers brings it in, as faults.py brings back a restarted region;
only then is the join answered (`region_joined`). One that has not started within
regions.start_timeout_s is refused and ended. A driver killed meanwhile leaves its request taken
and unanswered: the resume takes it again (requeue_unanswered). summary.json's `left` and
`joined` say who, when and why.

A region may also join under a NEW name (`geofed join RUN_DIR --region NEW [--label VALUE]`): the
name is checked as regions.names' entries are, the run's CA (RUN_DIR/tls) issues its certificate,
its actor is placed on a node labelled VALUE (regions.label_key) when given, else as the run
places its regions; once that actor answers, the emulator adds its links (driver/emulation.py)
and it is appended to the run's regions: the coordinator plans over them from the next round,
and each plan names them (RoundPlan.members), so every region's topology and mixing weights
follow; a region not in yet is in no plan, so nobody waits for it or mixes it. The driver checkpoint
records the joined names (`grown`), and a resumed run rebuilds them. Runs that cannot grow are
refused with the reason (`growth_refusal`).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geofed.regions.algorithm_traits import algorithm_traits

from .rundir import read_jsonl

if TYPE_CHECKING:  # the commands' side (request_from_args) runs without Ray
    from ..config import RunConfig
    from .handles import RegionHandles
    from .journal import Journal

__all__ = ["CONTROL_DIR", "ACTIONS", "EXIT", "Request", "Joining", "Membership", "request_from_args", "parse_request",
           "requeue_unanswered", "run_is_live", "take_requests", "withdraw_request", "write_request",
           "AwaitingNode", "grown_config", "growth_refusal", "label_refusal"]

CONTROL_DIR = "control"
ACTIONS = ("leave", "join")
MAX_REQUEST_BYTES = 4096  # a request is a few dozen bytes; anything larger is not one of ours
_ID_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")
# A Ray node label's value (Kubernetes' rule, which Ray follows): at most 63 characters, letters,
# digits, '-', '_' and '.', starting and ending with a letter or digit.
_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True, kw_only=True)
class Request:
    """One control request: `id` (the file's stem, echoed in the answer), `action`, `region`, and a
    join's node `label` (None: placed as the run places its regions)."""

    id: str
    action: str
    region: str
    label: str | None = None


@dataclass(frozen=True, kw_only=True)
class Joining:
    """A join whose actor is starting while the rounds go on: who asked (`request`, before round
    `asked_round`), a new name's node `label`, the actor's `handle` and `started` (a
    cluster.StartingActor: poll() its node_info without blocking, end() it), since when and until
    when it may start (monotonic seconds; regions.start_timeout_s)."""

    request: str | None
    label: str | None
    new: bool
    asked_round: int
    handle: Any
    started: Any
    since: float
    deadline: float
    names: tuple[str, ...] = ()  # a new name's: the run's regions its actor was built with (its index is the last)


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
    unknown = sorted(set(data) - {"action", "region", "requested_at", "label"})
    if unknown:
        raise ValueError(f"unknown keys: {', '.join(unknown)}")
    action, region = data.get("action"), data.get("region")
    if action not in ACTIONS:
        raise ValueError(f"action: expected one of {', '.join(ACTIONS)}, got {action!r}")
    if not isinstance(region, str) or not region:
        raise ValueError(f"region: expected a region name, got {region!r}")
    label = data.get("label")
    if label is not None and (action != "join" or label_refusal(label) is not None):
        raise ValueError(f"label: {label_refusal(label) if action == 'join' else 'only a join takes one'}")
    return Request(id=request_id, action=action, region=region, label=label)


def label_refusal(label: Any) -> str | None:
    """Why `label` cannot be a Ray node label's value, or None."""
    if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
        return (f"{label!r} is not a node label value (at most 63 letters, digits, '-', '_' or '.', starting and "
                "ending with a letter or digit)")
    return None


class AwaitingNode:
    """A joiner's start while no alive Ray node carries its label yet (`geofed join --label`): each
    poll() looks again without waiting and, once a node carries it, makes the actor (`make()`: a
    cluster.StartingActor) and answers for that from then on; past `deadline` (monotonic seconds,
    regions.placement_timeout_s) it raises ValueError naming the labels seen. The rounds go on
    meanwhile, as they do while an actor starts; `handle` is None until the actor is made."""

    def __init__(self, label_key: str, value: str, *, timeout_s: float, seen: Callable[[str], Mapping[str, Any]],
                 make: Callable[[], Any]):
        self.label_key, self.value, self.timeout_s, self.seen, self.make = label_key, value, timeout_s, seen, make
        self.deadline = time.monotonic() + timeout_s
        self.started: Any = None

    @property
    def handle(self) -> Any:
        return None if self.started is None else self.started.handle

    def poll(self) -> dict | None:
        if self.started is None:
            labels = self.seen(self.label_key)
            if self.value not in labels:
                if time.monotonic() >= self.deadline:
                    raise ValueError(f"no alive Ray node carries {self.label_key}={self.value} after "
                                     f"{self.timeout_s:g}s (regions.placement_timeout_s); values seen: "
                                     f"{', '.join(sorted(labels)) or 'none'}")
                return None
            self.started = self.make()
        return self.started.poll()

    def end(self) -> None:
        if self.started is not None:
            self.started.end()


def grown_config(cfg: RunConfig, grown: Mapping[str, str | None]) -> RunConfig:
    """The run's config with the regions that joined under new names (region -> its node label or
    None) appended to regions.names, their labels in regions.labels: what a joiner's actor is built
    from. ValueError as the config's own checks word it (a bad or reserved name, too many regions)."""
    if not grown:
        return cfg
    rc = cfg.regions
    labels = {**rc.labels, **{r: label for r, label in grown.items() if label is not None}}
    return dataclasses.replace(cfg, regions=dataclasses.replace(rc, names=(*rc.names, *grown), labels=labels))


def growth_refusal(cfg: RunConfig, grown: Mapping[str, str | None], region: str, label: str | None) -> str | None:
    """Why the run (its config `cfg`, the regions already joined under new names `grown`) cannot take
    `region` under a new name, or None. The run's algorithm and set-up decide it: each refusal
    names the key that fixes the group at start."""
    from geofed.p2p.grpc_transport import server_peer_capacity

    if label is not None and (why := label_refusal(label)) is not None:
        return f"label: {why}"
    try:
        grown_config(cfg, {**grown, region: label})
    except ValueError as exc:
        return f"region name {region!r}: {str(exc).removeprefix('names: ')}"
    if cfg.regions.workers > 1:
        return "regions.workers > 1: a join places one actor a region, not a group of workers"
    if cfg.security.secure_aggregation:
        return ("security.secure_aggregation: the masks are agreed within the starting regions, a fixed group that "
                "cannot grow")
    if algorithm_traits(cfg.sync.algorithm).mixes_models:
        return (f"sync.algorithm {cfg.sync.algorithm}: each region keeps a public copy of every in-neighbour's model "
                "from round 0 (CHOCO), which a new neighbour does not have")
    if cfg.privacy.dp.mode != "off":
        return "privacy.dp: the privacy budget is planned over the starting regions' data"
    if cfg.network.emulation.mode == "kernel":
        return "network.emulation.mode kernel: its network namespaces and links are made at start"
    peers = len(cfg.regions.names) + len(grown)  # each region's peers once it joined
    capacity = server_peer_capacity(max(1, len(cfg.regions.names) - 1))
    if peers > capacity:
        return (f"the regions' gRPC servers were sized at start for {capacity} peers each; {region} would make "
                f"{peers}")
    return None


def write_request(run_dir: Path, action: str, region: str, label: str | None = None) -> str:
    """Write one request into RUN_DIR/control atomically; returns its id (the answer carries it)."""
    control = Path(run_dir) / CONTROL_DIR
    control.mkdir(mode=0o700, exist_ok=True)
    ns = time.time_ns()  # ids sort in the order they were written: the driver takes them in that order
    request_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(ns // 10**9))}-{ns % 10**9:09d}-{secrets.token_hex(3)}"
    tmp = control / f".{request_id}.tmp"
    body = json.dumps({"action": action, "region": region, "requested_at": time.time(),
                       **({"label": label} if label is not None else {})}).encode()
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
    answered = {e.get("request") for e in read_jsonl(Path(run_dir) / "events.jsonl") if e.get("event") in _ANSWERS}
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
    flight before it goes; `spawn(region)` places a new actor for a joiner of the run's config (its
    handle and its start: a cluster.StartingActor that `poll` asks without blocking, or node_info
    when it started already), `spawn(region, cfg, label)` one of a region joined under a new name,
    built from `cfg` (the run's config with those regions: `config()`) and placed on a node with
    `label` when one is given; `rejoin(region, r, info)` brings it in
    as a restarted region is (faults.py); `probe(regions, joiner)` measures their links before
    they carry updates (or says why they need not be). A joiner under a new name also needs `grow(region, label)` (the coordinator's and the
    emulator's side) and, to rebuild it on a resume, `start(region)` (its server's address) and
    `connect()` (every region to every other). Without `spawn` joins are refused."""

    def __init__(self, run_dir: Path, regions: RegionHandles, journal: Journal, *,
                 busy: Callable[[], Collection[str]], drain: Callable[[str], None],
                 spawn: Callable[..., tuple[Any, dict]] | None = None,
                 rejoin: Callable[[str, int, dict], Any] | None = None,
                 probe: Callable[[list[str], str], None] | None = None,
                 grow: Callable[[str, str | None], None] | None = None,
                 start: Callable[[str], str] | None = None, connect: Callable[[], None] | None = None):
        self.run_dir, self.regions, self.journal = Path(run_dir), regions, journal
        self.busy, self.drain = busy, drain
        self.spawn, self.rejoin, self.probe = spawn, rejoin, probe
        self.grow, self.start, self.connect = grow, start, connect
        self.grown: dict[str, str | None] = {}  # joined under a new name, in join order: region -> node label
        self.left: dict[str, dict[str, Any]] = {}  # region -> {round, why, request} of its last leave
        self.joined: dict[str, dict[str, Any]] = {}  # region -> {round, request} of its last join
        self.out: set[str] = set()  # left and not back
        self.waiting: list[Request] = []  # leaves held until the region's round in flight returns
        self.kept: set[str] = set()  # the last region, which a SIGTERM cannot retire (said once)
        self.joining: dict[str, Joining] = {}  # region -> its join whose actor is starting

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
                self.join(req.region, r, request=req.id, label=req.label)
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
        self._arrivals(r)
        return gone

    def note_reports(self, results: Mapping[str, Any]) -> None:
        """A round's reports: a region whose report says it is leaving (it got a SIGTERM, a spot
        notice: regions/leave_notice.py) leaves before the next round, its update of this one delivered."""
        for region, m in results.items():
            if m.extra.get("leaving"):
                self.regions.leaving.setdefault(region, dict(m.extra))

    def config(self) -> RunConfig:
        """The run's config with the regions joined under new names: what a joiner's actor is built from."""
        return grown_config(self.regions.cfg, self.grown)

    def _refusal(self, req: Request) -> str | None:
        regions = self.regions
        if req.action == "join" and (self.spawn is None or self.rejoin is None):
            return "this run cannot place new region actors (joins need the Ray driver)"
        if req.action == "join" and req.region in self.joining:
            asked = self.joining[req.region]
            return (f"region {req.region} is joining already (request {asked.request}, before round {asked.asked_round}): "
                    "its actor is starting")
        if req.action == "join" and req.region not in regions.names:
            if self.grow is None:
                return "this run cannot add regions under new names"
            return growth_refusal(regions.cfg, {**self.grown, **self._joining_new()}, req.region, req.label)
        if req.region not in regions.names:
            return f"unknown region {req.region!r}: the run's regions are {', '.join(regions.names)}"
        if req.action == "join":
            if req.region in regions.alive:
                return f"region {req.region} is in the run"
            placed = self.config().regions.label_of(req.region)
            if req.label is not None and req.label != placed:
                return (f"label: region {req.region} is placed by its own label ({placed}); --label places a region "
                        "that joins under a new name")
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

    def join(self, region: str, r: int, *, request: str | None = None, label: str | None = None) -> None:
        """`region` (one that left, or failed and was given up, or a new name) asks to come back before
        round r: its new actor is made (a new name's certificate first) and not waited for. The
        rounds go on without it while it starts (a new process that imports torch: seconds); the
        first poll after it answers brings it in (`_come_in`). An actor that started at once (an
        in-process spawn's) comes in now."""
        regions = self.regions
        new = region not in regions.names
        if region in regions.dead:
            regions.retire(region)  # failed and not back: its old actor goes for good, a new one takes its place
        label = label if new else self.grown.get(region)
        try:
            handle, started = self._place(region, label, new=new)
        except Exception as exc:  # noqa: BLE001 - a placement error: the run goes on without it
            self._refuse(request or "-", region, f"its actor could not be placed: {exc}")
            return
        if handle is not None:  # None: no node carries its label yet (AwaitingNode), no actor to end
            regions.actors.handles[region] = handle  # the run's end ends it with the others, started or not
        now = time.monotonic()
        built = (*regions.cfg.regions.names, *self.grown, *self._joining_new(), region) if new else ()
        joining = Joining(request=request, label=label, new=new, asked_round=r, handle=handle, started=started,
                          since=now, deadline=now + regions.cfg.regions.start_timeout_s, names=built)
        if isinstance(started, dict):
            self._come_in(region, r, joining, started)
            return
        self.joining[region] = joining
        self.journal.event("region_joining", region=region, request=request, asked_round=r, new=new,
                           start_timeout_s=regions.cfg.regions.start_timeout_s, **({"label": label} if new else {}))
        self.journal.note(f"region {region} is joining: its actor is starting; the rounds go on without it until it "
                          "answers")

    def _arrivals(self, r: int) -> None:
        """Joiners whose actor answered since the last round come in before round r (the probe a
        restarted region gets, faults.Faults.revive: never blocking); one that failed to start, or
        did not within regions.start_timeout_s, is refused and its actor ended."""
        for region, joining in list(self.joining.items()):
            try:
                info = joining.started.poll()
            except Exception as exc:  # noqa: BLE001 - it died starting (cluster.start_failure says why)
                self._give_up(region, joining, f"its actor could not be placed: {exc}")
                continue
            if info is not None and joining.new and joining.names != (*self.regions.names, region):
                self._out_of_turn(region, joining)
            elif info is not None:
                del self.joining[region]
                if joining.handle is None:  # its node came up after the join was asked (AwaitingNode)
                    joining = dataclasses.replace(joining, handle=joining.started.handle)
                    self.regions.actors.handles[region] = joining.handle
                self._come_in(region, r, joining, info)
            elif time.monotonic() > joining.deadline:
                joining.started.end()
                self._give_up(region, joining, f"its actor could not be placed: it did not start within "
                                               f"{self.regions.cfg.regions.start_timeout_s:g}s (regions.start_timeout_s)")

    def _out_of_turn(self, region: str, joining: Joining) -> None:
        """A new name's actor answered, but it was built with another index than it would come in at:
        a new name asked before it is still starting (it waits for that one: names only grow at the end,
        in the order asked), or one asked before it gave up (its actor is built again, with the run's
        names as they are). Each region's index fixes its data shard and its place in the topology, and
        a region refuses members that do not extend its own list (Region.set_members)."""
        ahead = list(self.joining)[:list(self.joining).index(region)]
        if any(self.joining[other].new for other in ahead):
            return
        joining.started.end()
        built = (*self.regions.names, region)
        try:
            handle, started = self._place(region, joining.label, new=True, before=dict(self.grown))
        except Exception as exc:  # noqa: BLE001 - a placement error: refused as a first placement's would be
            self._give_up(region, joining, f"its actor could not be placed again: {exc}")
            return
        if handle is not None:
            self.regions.actors.handles[region] = handle
        now = time.monotonic()
        self.joining[region] = dataclasses.replace(
            joining, handle=handle, started=started, names=built, deadline=now + self.regions.cfg.regions.start_timeout_s)
        self.journal.note(f"region {region}: its actor was built as region {len(joining.names)} of the run, which "
                          f"has {len(built)} with it (a new name asked before it did not join): built again")

    def _give_up(self, region: str, joining: Joining, why: str) -> None:
        del self.joining[region]
        handle = joining.started.handle if joining.handle is None else joining.handle
        if handle is not None and self.regions.actors.handles.get(region) is handle:
            del self.regions.actors.handles[region]
        self._refuse(joining.request or "-", region, why)

    def end_joins(self, last: int) -> None:
        """The run is over (after round `last`): joins still starting are refused and their actors ended."""
        for region, joining in list(self.joining.items()):
            joining.started.end()
            self._give_up(region, joining, f"the run ended after round {last} before its actor started")

    def _come_in(self, region: str, r: int, joining: Joining, info: dict) -> None:
        """A joiner whose actor has started comes in before round r: a new name is added to the run
        (its links, the topology over it), then the rejoin path (its server, everyone reconnects, the
        current model and outer state from a peer: region_rejoined, after: join), its links probed;
        planned from round r."""
        regions = self.regions
        if joining.new:
            self._add(region, joining.label)
        regions.actors.info[region] = info
        regions.dead[region] = "joining"  # the rejoin path brings a dead region back
        self.rejoin(region, r, info)
        if region not in regions.alive:
            self._refuse(joining.request or "-", region,
                         "its new actor did not come up in time: it rejoins once it answers")
            return
        if self.probe is not None:
            self.probe(list(regions.alive), region)
        self.out.discard(region)
        grown = {"new": True, "label": self.grown[region]} if joining.new else {}
        self.joined[region] = {"round": r, "request": joining.request, **grown}
        self.journal.count("regions_joined")
        waited = {} if r == joining.asked_round else {"asked_round": joining.asked_round,
                                                       "start_s": round(time.monotonic() - joining.since, 2)}
        self.journal.event("region_joined", region=region, request=joining.request, first_round=r,
                           pid=info.get("pid"), alive=list(regions.alive), **waited, **grown)
        self.journal.note(f"region {region} joined the run before round {r}"
                          + (" under a new name" if joining.new else ""), style="green")

    def _place(self, region: str, label: str | None, *, new: bool, issue: bool = False,
               before: Mapping[str, str | None] | None = None) -> tuple[Any, Any]:
        """A joiner's new actor and its start (a dict: started; else a cluster.StartingActor); a new
        name first gets its certificate from the run's CA (RUN_DIR/tls), as set-up's make_tls issues
        each region's (a rebuilt one a fresh one: no expiry to track). A new name is built after the
        names `before` it (default: those that joined, then those still starting)."""
        if before is None:
            before = {**self.grown, **self._joining_new()}
        cfg = grown_config(self.regions.cfg, {**before, region: label}) if new else self.config()
        if (new or issue) and cfg.security.tls:
            from geofed.p2p.tls import issue_region

            issue_region(self.run_dir / "tls", region)
        assert self.spawn is not None
        if region in self.regions.cfg.regions.names:
            return self.spawn(region)
        return self.spawn(region, cfg, label)

    def _joining_new(self) -> dict[str, str | None]:
        """New names whose actor is starting: counted as the run's for a later joiner's name, index and
        the servers' size."""
        return {region: j.label for region, j in self.joining.items() if j.new}

    def _started(self, region: str, started: Any) -> dict:
        """A resume's rebuilt joiner, waited for (set-up: no round runs yet) within regions.start_timeout_s."""
        if isinstance(started, dict):
            return started
        timeout = self.regions.cfg.regions.start_timeout_s
        deadline = time.monotonic() + timeout
        while (info := started.poll()) is None:
            if time.monotonic() > deadline:
                started.end()
                raise TimeoutError(f"region {region}: its actor did not start within {timeout:g}s (regions.start_timeout_s)")
            time.sleep(0.2)
        return info

    def _add(self, region: str, label: str | None) -> None:
        """`region`, placed, is one of the run's regions from now on: after regions.names' and the
        earlier joiners' (topology order), in the coordinator's plans and the emulator's links."""
        self.grown[region] = label
        self.regions.names.append(region)
        assert self.grow is not None
        self.grow(region, label)

    def summary_fields(self) -> dict[str, Any]:
        """summary.json's `left` (region -> {round: the last it ran, why, request}) and `joined`
        (region -> {round: the first it ran again, request})."""
        return {"left": dict(self.left), "joined": dict(self.joined)}

    def state_dict(self) -> dict[str, Any]:
        return {"left": dict(self.left), "joined": dict(self.joined), "out": sorted(self.out),
                "grown": [[region, label] for region, label in self.grown.items()]}

    def load_state_dict(self, state: dict[str, Any], *, live: Mapping[str, Any] | None = None) -> None:
        """A resumed run: the regions out stay out (their new actors are retired at once); the regions
        that joined under new names are the run's again, in their order, and those not out get a
        new actor each (its own checkpoint then restores it as any region's does), or take their
        actor that outlived the killed driver (`live`: region -> reattach.Live, driver/reattach.py)."""
        self.left.update(state.get("left") or {})
        self.joined.update(state.get("joined") or {})
        out = state.get("out", list(state.get("left") or {}))
        grown = [(region, label) for region, label in state.get("grown") or [] if region not in self.regions.names]
        for region, label in grown:
            self._add(region, label)
        for region in out:
            if region in self.regions.names and region not in self.out:
                self.regions.retire(region)
                self.out.add(region)
        rebuilt = [region for region, _ in grown if region not in self.out]
        for region in rebuilt:
            self._rebuild(region, (live or {}).get(region))
        if rebuilt and self.connect is not None:
            self.connect()

    def _rebuild(self, region: str, live: Any = None) -> None:
        """A resumed run's joiner under a new name: a new actor and server, or its `live` one as it is
        (its server runs already), in the run (not yet connected)."""
        regions = self.regions
        try:
            if live is not None:
                handle, info = live.handle, dict(live.info)
            else:
                handle, started = self._place(region, self.grown[region], new=False, issue=True)
                info = self._started(region, started)
                handle = started.handle if handle is None else handle  # made once its node came up
            regions.actors.handles[region] = handle
            assert self.start is not None
            address = self.start(region)
        except Exception as exc:  # noqa: BLE001 - the run resumes without it; a join brings it back
            regions.retire(region)
            self.out.add(region)
            self.left[region] = {"round": None, "why": "not rebuilt on resume", "request": None}
            self.journal.event("region_left", region=region, request=None, why="not rebuilt on resume",
                               error=str(exc)[:500], alive=list(regions.alive))
            return
        regions.actors.info[region] = info
        regions.dead[region] = "joining"
        regions.rejoin(region, address, info)


# -- the CLI's side: `geofed leave` -----------------------------------------------------------
EXIT = {"done": 0, "refused": 1, "bad_input": 2, "not_running": 3, "timed_out": 4}
_DONE = {"leave": "region_left", "join": "region_joined"}
# The events that answer a request; `region_joining` (its actor is starting) is progress, not an answer.
_ANSWERS = (*_DONE.values(), "control_refused")


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
    `geofed join RUN_DIR --region NAME [--label VALUE] [--wait S]` (bring it back, or a new region
    NAME placed on a node labelled VALUE, before the next round): write the request and wait (at most S seconds; 0: not at all) for the driver's answer in events.jsonl,
    printed as one JSON line. Exit codes: EXIT (0 done, 1 refused by the driver, 2 not a run
    directory or an unknown region, 3 no driver runs the run, 4 no answer within S)."""
    from .rundir import run_dir_config

    def _say(message: str) -> None:
        print(f"geofed {action}: {message}", file=sys.stderr)

    run_dir = Path(args.run_dir)
    label = getattr(args, "label", None)  # a join's only
    if label is not None and (why := label_refusal(label)) is not None:
        _say(f"--label: {why}")
        return EXIT["bad_input"]
    # A Runner started from Python writes no config.yaml: then the driver alone checks the name.
    known = (run_dir / "config.yaml").exists() or not ((run_dir / "run.lock").exists() or (run_dir / "events.jsonl").exists())
    cfg = run_dir_config(run_dir) if known else None  # ConfigError (exit 2): not a run directory
    names = list(cfg.regions.names) if cfg is not None else [args.region]
    if args.region not in names and action == "leave":
        _say(f"unknown region {args.region!r}: {run_dir}'s regions are {', '.join(names)}")
        return EXIT["bad_input"]
    if args.region not in names:  # a join under a new name: checked as regions.names' entries are
        try:
            grown_config(cfg, {args.region: label})
        except ValueError as exc:
            _say(f"--region: {args.region!r} cannot name a region: {str(exc).removeprefix('names: ')}")
            return EXIT["bad_input"]
    if not run_is_live(run_dir):
        _say(f"no driver runs {run_dir} (the run has ended, or its driver is gone: geofed run --resume {run_dir} "
             "takes requests again)")
        return EXIT["not_running"]
    tail = _EventTail(run_dir / "events.jsonl")
    request_id = write_request(run_dir, action, args.region, label)
    if args.wait <= 0:
        print(json.dumps({"request": request_id, "region": args.region, "action": action}))
        return EXIT["done"]
    deadline = time.monotonic() + args.wait
    joining: dict[str, Any] | None = None  # the driver's region_joining: taken, its actor starting
    while True:
        live = run_is_live(run_dir)  # before reading: a driver that answers and ends is read after its end
        for record in tail.new():
            if record.get("request") != request_id:
                continue
            if record.get("event") in (_DONE[action], "control_refused"):
                print(json.dumps(record))
                return EXIT["done"] if record["event"] == _DONE[action] else EXIT["refused"]
            if record.get("event") == "region_joining" and joining is None:
                joining = record
                _say(f"the driver took the request before round {record.get('asked_round')}: region {args.region}'s actor is "
                     f"starting while the run goes on (the driver gives it {record.get('start_timeout_s')}s, "
                     f"regions.start_timeout_s); it joins between rounds once it answers; waiting "
                     f"{max(0.0, deadline - time.monotonic()):.0f}s more")
        if not live or time.monotonic() > deadline:
            if joining is not None:
                _say(("the run ended" if not live else f"no answer within {args.wait:g}s") +
                     f" while region {args.region}'s actor was starting (request {request_id}; events.jsonl: "
                     "region_joined or control_refused)" + (": geofed run --resume takes the request again" if not live else ""))
                return EXIT["not_running"] if not live else EXIT["timed_out"]
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
