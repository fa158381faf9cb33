"""Everything a run does before round 0: TLS material, Ray, the region actors and their servers,
the emulator, the connections, the logs and a resume's checkpoint, the link probes; each phase
timed for the setup_done event.

`set_up` returns what the round loop needs (`Ready`); what it starts or opens goes into the
`Opened` it is given as it goes, so that a set-up that fails half way is ended as a whole one is.
The loop restores a resume's checkpoint into its own parts, then `probe_links` ends set-up.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from geofed.p2p.tls import RENEW_WITHIN_DAYS, make_pki, renew_expiring
from geofed.regions.warm import process_age_s

from ..config import RunConfig
from .cluster import RayHandle, RegionActors, create_region_actors, init_ray
from .coordinator import Coordinator
from .emulation import start_emulation
from .handles import RegionHandles
from .journal import Journal
from .recovery import StopSignals, marked_processes, record_processes
from .reattach import Decision, Live, actor_names, decide, detached, find_live, joined_regions, region_pids, settle
from .resume import DriverCheckpoint, emulation_for_resume, load_driver_checkpoint, reap_previous_driver, train_fn_name
from .rundir import JsonlLog, ensure_private_dir, lock_run_dir
from .shards import connect_shards
from .trackers import Trackers


@dataclass
class Opened:
    """What set-up started or opened, filled as it goes; `close` ends all of it (safe after a
    failed or partial set-up)."""

    ray: RayHandle | None = None
    actors: RegionActors | None = None
    emulator: Any = None
    logs: list[JsonlLog] = field(default_factory=list)
    trackers: Trackers | None = None

    def close(self, *, warm_pool_s: float, outcome: str) -> None:
        for log in self.logs:
            log.close()
        if self.trackers is not None:
            self.trackers.close(outcome)
        if self.actors is not None:
            # Warm-pool actors (ray.warm_pool_s) wait for the next run; the others are killed.
            self.actors.end(warm_pool_s)
        if self.emulator is not None:
            self.emulator.stop()
        if self.ray is not None:
            self.ray.shutdown()


class PhaseTimer:
    """Seconds each set-up phase took, wall and this process's CPU (where start-up time goes).
    Its own monotonic clock, not the run's: a resume sets the run's clock to the checkpoint's time
    mid-set-up, and the phase across that (logs_restore) read minus the run's age."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._last = (time.monotonic(), time.process_time())

    def mark(self, name: str) -> None:
        now, cpu = time.monotonic(), time.process_time()
        self.wall[name] = round(now - self._last[0], 3)
        self.cpu[name] = round(cpu - self._last[1], 3)
        self._last = (now, cpu)


@dataclass(frozen=True, kw_only=True)
class Ready:
    """What set-up hands the round loop: the regions, the coordinator, the logs, and a resume's
    driver checkpoint to restore (None on a fresh run)."""

    regions: RegionHandles
    coordinator: Coordinator
    metrics_log: JsonlLog
    rounds_log: JsonlLog
    trackers: Trackers
    restored: tuple[int, dict, list[str], list[int]] | None
    timer: PhaseTimer
    # A resume's regions that outlived their killed driver (driver/reattach.py): region -> Live,
    # and why each other one was not found alive
    live: dict[str, Live] = field(default_factory=dict)
    gone: dict[str, str] = field(default_factory=dict)
    decision: Decision | None = None


def set_up(cfg: RunConfig, run_dir: Path, opened: Opened, journal: Journal, *, resume: bool, verbose: bool,
           stop: StopSignals, hostile: dict | None, train_fn: Callable[[Any], None] | None = None) -> Ready:
    """TLS, Ray, the region actors and their servers, the emulator, the connections and the logs.
    `train_fn`: the user's training loop each region actor runs (None: the task's built-in stepper)."""
    ensure_private_dir(run_dir)  # 0700, also for a Runner started without new_run_dir
    lock_run_dir(run_dir)  # held until shutdown(); new_run_dir or --resume may hold it already
    timer = PhaseTimer()
    names = list(cfg.regions.names)
    renewed = make_tls(run_dir, names, resume=resume)
    timer.mark("tls")
    named = actor_names(run_dir, names) if detached(cfg, hostile=hostile, train_fn=train_fn) else {}
    # The regions a resume may re-attach to are never the leftovers it ends (only the dead driver's own processes are)
    reaped = reap_previous_driver(run_dir, keep=region_pids(run_dir) if named else set()) if resume else []
    with marked_processes(run_dir) as token:  # what a later --resume may end proves it is ours
        opened.ray = init_ray(cfg, verbose=verbose)
    timer.mark("ray")
    stop.reclaim()
    # A resume rewrites the logs (dropping rounds after its checkpoint) before they are opened.
    restored = load_driver_checkpoint(run_dir) if resume else None
    if named and restored is not None:  # regions that joined under new names outlived the driver too
        named.update(actor_names(run_dir, joined_regions(restored.state)))
    live, gone, decision = ({}, {}, None) if not named or restored is None else reattach(cfg, named, restored)
    opened.actors = create_region_actors(cfg, str(run_dir), pin=bool(cfg.ray.address), hostile=hostile,
                                         train_fn=train_fn, named=named, live=live)
    timer.mark("actors")
    if opened.ray.started_here:
        record_processes(run_dir, token, bind=not cfg.ray.address)
    regions = RegionHandles(cfg, opened.actors, journal, run_dir)
    regions.start(timeout=120)  # a re-attached region's server runs already: its address is the same
    opened.emulator = start_emulation(emulation_for_resume(cfg, restored), names)
    regions.connect(lambda src, dst: route(opened.emulator, regions.addresses, src, dst))
    connect_shards(cfg, opened.actors.handles, list(regions.alive))  # regions.shard_exchange (driver/shards.py)
    timer.mark("servers_connected")
    coordinator = Coordinator(cfg, model_numel=opened.actors.info[names[0]]["params"], clock=journal.clock)
    metrics_log, rounds_log = JsonlLog(run_dir / "metrics.jsonl"), JsonlLog(run_dir / "rounds.jsonl")
    opened.logs += [metrics_log, rounds_log]
    journal.open(run_dir / "events.jsonl")
    opened.trackers = Trackers(cfg, run_dir)
    # train_fn: the loop API's function by name (a resume checks it: orchestrator/driver/resume.py)
    looping = {"train_fn": train_fn_name(train_fn)} if train_fn is not None else {}
    journal.event("started", driver_pid=os.getpid(), resume=resume, **looping,
                  regions={r: {"pid": i.get("pid"), "grpc_address": i.get("grpc_address"), "node_ip": i.get("node_ip"),
                               "start": i.get("start")}
                           for r, i in opened.actors.info.items()})
    if reaped:
        journal.event("reaped_previous_driver", processes=reaped)
    if renewed:
        journal.event("tls_renewed", certificates=renewed)
    return Ready(regions=regions, coordinator=coordinator, metrics_log=metrics_log, rounds_log=rounds_log,
                 trackers=opened.trackers, restored=restored, timer=timer, live=live, gone=gone,
                 decision=decision)


def reattach(cfg: RunConfig, named: dict[str, str], restored: DriverCheckpoint,
             ) -> tuple[dict[str, Live], dict[str, str], Decision]:
    """A resume's regions that outlived their killed driver: those whose state goes on (driver/reattach.py),
    why each other one gets a new actor, and the decision. Waits for a round the dead driver started."""
    live, gone = find_live(named, job=ray.get_runtime_context().get_job_id(),
                           timeout_s=cfg.sync.deadline.max_s * 2 + 120, orphan_timeout_s=cfg.run.orphan_timeout_s)
    in_run = restored.state.get("alive") or list(named)
    # A quorum round's report may arrive rounds late: its round is never taken from the reports.
    quorum = cfg.sync.pacing.mode == "quorum"
    decision = decide(restored.round, [g for g in named if g in in_run],
                      {g: int(lv.info.get("completed_round", -1)) for g, lv in live.items()},
                      {} if quorum else {g: getattr(lv.report, "round", None) for g, lv in live.items()})
    live, gone = settle(named, live, gone, decision)
    return live, gone, decision


def probe_links(cfg: RunConfig, ready: Ready, journal: Journal) -> tuple[float | None, float | None]:
    """Set-up's last phase: every region warms and measures its connections, all at once
    (network.probe_s), so round 0 is planned from measured links and pays no handshake. Then
    setup_done; a fresh run's clock restarts at round 0. Returns set-up's wall seconds (None on a
    resume: its clock goes on from the checkpoint's) and this process's age at round 0."""
    ready.timer.mark("logs_restore")
    per_probe = cfg.network.probe_s + 30.0
    regions = ready.regions
    if links_kept(ready):
        journal.event("links_probed", links=ready.coordinator.links_record(), probes={},
                      skipped="every region was re-attached: the links' estimates are the driver checkpoint's")
    else:
        probes = regions.probe(regions.alive, timeout=2 * per_probe + 60.0)
        ready.coordinator.observe_probe(probes)
        journal.event("links_probed", links=ready.coordinator.links_record(),
                      probes={r: m["transfers"] for r, m in probes.items() if m["transfers"]})
    ready.timer.mark("probes")
    setup_s = journal.clock.now() if ready.restored is None else None
    startup_s = process_age_s()  # from `geofed run` (this process) to round 0
    # CPU seconds beside wall seconds: on a shared host wall time says how busy the others were,
    # CPU time what set-up itself costs (this driver's; each actor's is in `started`'s start.cpu_s).
    journal.event("setup_done", setup_s=setup_s, process_to_round0_s=startup_s, phases_s=ready.timer.wall,
                  phases_cpu_s=ready.timer.cpu, process_cpu_s=round(time.process_time(), 3))
    if ready.restored is None:
        # Wall time counts training; set-up (Ray, actors, TLS, warming the links) is setup_s.
        journal.clock.restart()
    return setup_s, startup_s


def links_kept(ready: Ready) -> bool:
    """Whether a resume may skip set-up's link probes: every region in the run was re-attached (its
    process, its server and its link estimators lived on, driver/reattach.py) and the driver
    checkpoint's coordinator state, restored by now, holds a measurement of every link between
    them. The run then plans from what the undisturbed run knew at that round (a bandwidth still
    unknown stays so, as it would have), and the probes' 2.9 s of a 9-10 s re-attached resume on the
    2-core host are saved (docs/reliability.md, "Where churn's throughput goes"). A link never
    measured (a region in a new actor, a joiner's) is probed, with every other, as before."""
    alive = ready.regions.alive
    if ready.restored is None or not alive or any(region not in ready.live for region in alive):
        return False
    view = ready.coordinator.link_view
    estimates = [view.estimate(f"{src}->{dst}") for src in alive for dst in alive if src != dst]
    return all(e.bandwidth_bps or e.rtt_s for e in estimates)


def make_tls(run_dir: Path, names: list[str], *, resume: bool) -> list[str]:
    """The run's CA and each region's certificate in RUN_DIR/tls; a resumed run keeps its own,
    renewing those about to expire (30-day certificates). Returns the renewed ones."""
    tls = run_dir / "tls"
    if resume and all((tls / f"{n}.pem").is_file() and (tls / f"{n}.key").is_file() for n in ["ca", *names]):
        renewed = renew_expiring(tls, names)
        if renewed:
            print(f"geofed: renewed TLS certificates expiring within {RENEW_WITHIN_DAYS} days from the run's CA: "
                  f"{', '.join(renewed)}", file=sys.stderr)
        return renewed
    make_pki(tls, names)
    return []


def route(emulator: Any, addresses: dict[str, str], src: str, dst: str) -> str:
    """Where `src` dials `dst`: its server, or the emulator's link in front of it."""
    if emulator is None:
        return addresses[dst]
    return emulator.route(src, dst, addresses[dst])
