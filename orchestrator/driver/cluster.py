"""Ray: start or join a cluster, place one region actor per region, fail fast when a region has no node.

Only the control plane travels through Ray: coordinator calls, small metrics, and once per actor
its TLS material. Updates (pseudo-gradients, gossip, rejoin state) go region to region over
geofed's own mutual-TLS gRPC (regions/region.py -> p2p/grpc_transport.py), never through Ray's
object store.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from geofed.p2p.tls import TlsMaterial, load_tls
from geofed.regions.actor import FOLLOWER_GROUP, RegionWorkerActor, grpc_log_env, region_actor_class
from geofed.regions.warm import POOL_NAMESPACE, drop_assignment

from ..config import RunConfig
from .failures import OOM, death_cause
from .hosts import actor_of, create_hosts, pack
from .reattach import RUN_NAMESPACE, release_name
from .warmpool import claim_pooled, end_pooled, new_name, slot_of

log = logging.getLogger(__name__)

# How often the label check looks again while nodes may still be joining.
_LABEL_POLL_S = 1.0
# regions.num_cpus when the config leaves it unset (a local run shrinks it to fit its CPUs).
DEFAULT_REGION_CPUS = 0.5


class PlacementError(RuntimeError):
    """The region actors cannot be placed: the cluster is unreachable, a region has no node
    carrying its label, or an actor never came up."""


@dataclass
class RayHandle:
    """The Ray session a run uses; shutdown() ends it only if this driver started it (tests share one)."""

    started_here: bool
    address: str | None

    def shutdown(self) -> None:
        if self.started_here and ray.is_initialized():
            ray.shutdown()


def init_ray(cfg: RunConfig, *, verbose: bool = False) -> RayHandle:
    """Reuse an already initialised Ray (tests share one), else start a local one or join `ray.address`.
    Ray's own start-up messages (its token-auth warning, "Started a local Ray instance") reach the
    terminal only when `verbose` (--verbose); its errors always do."""
    address = cfg.ray.address
    if verbose:  # region processes then keep gRPC's C-core errors (regions/actor.py: grpc_log_env)
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if ray.is_initialized():
        _check_same_cluster(address)
        return RayHandle(started_here=False, address=None)
    level = logging.INFO if verbose else logging.ERROR
    logging.getLogger("ray").setLevel(level)
    # Region workers must not each grab every core: torch threads are set per worker.
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.regions.torch_threads))
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": level,
                              "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cfg.regions.torch_threads)}}}
    if address:
        _wait_reachable(address, cfg.ray.init_timeout_s)
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as exc:
            raise PlacementError(f"cannot join the Ray cluster at {address}: {exc} (token auth: the driver needs "
                                 f"RAY_AUTH_MODE=token and the cluster's token, see docs/launch.md)") from None
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, **kwargs)
    return RayHandle(started_here=True, address=address)


def _check_same_cluster(address: str | None) -> None:
    """A process that already holds a Ray session (a notebook, a test session) keeps it; a
    `ray.address` naming another cluster would otherwise be ignored without a word and the run
    would train on the wrong machines."""
    if not address or address == "auto" or "://" in address:
        return
    current = ray.get_runtime_context().gcs_address or ""
    if _host_port(address) != _host_port(current):
        raise PlacementError(
            f"ray.address: {address} names another cluster than the Ray session this process already "
            f"holds ({current}); call ray.shutdown() first, or leave ray.address unset to use that session")


def _host_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    try:
        host = socket.gethostbyname(host.strip("[]"))
    except OSError:
        pass
    return host, port


def _wait_reachable(address: str, timeout_s: float) -> None:
    """A TCP connect to HOST:PORT within ray.init_timeout_s, so a wrong address fails in bounded
    time with its name instead of inside Ray's own retries. `auto` and ray:// are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise PlacementError(f"ray.address: expected auto, HOST:PORT or ray://HOST:PORT, got {address!r}")
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as exc:
            last = exc
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    raise PlacementError(f"no Ray head answers at {address} within {timeout_s:.0f}s (ray.init_timeout_s): {last}")


def node_labels(label_key: str) -> dict[str, list[str]]:
    """label value -> node IPs of alive nodes carrying `label_key`."""
    seen: dict[str, list[str]] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        value = (node.get("Labels") or {}).get(label_key)
        if value is not None:
            seen.setdefault(value, []).append(node.get("NodeManagerAddress", "?"))
    return seen


@dataclass
class RegionActors:
    """The region actors by region, and what each reported when it started (node_info); `pooled`:
    region -> name of a warm-pool actor (ray.warm_pool_s), released at the end instead of killed."""

    handles: dict[str, Any]
    info: dict[str, dict] = field(default_factory=dict)
    pooled: dict[str, str] = field(default_factory=dict)
    # regions.workers > 1: each region's workers 1..N-1 (regions/workers.py), and their `follow`
    # calls, which return when worker 0 closes the region (or fail when its group does)
    workers: dict[str, list[Any]] = field(default_factory=dict)
    following: dict[str, list[Any]] = field(default_factory=dict)
    # run.orphan_timeout_s: region -> name of its detached actor (driver/reattach.py), killed at the end like any
    named: dict[str, str] = field(default_factory=dict)

    def kill(self) -> None:
        for handles in self.workers.values():
            for h in handles:
                try:
                    ray.kill(h, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead is fine
                    pass
        killed: set[Any] = set()
        for region, h in self.handles.items():
            if region in self.pooled or region in self.named:
                end_pooled(self.pooled.get(region) or self.named[region], h)
                continue
            actor = actor_of(h)  # regions.per_process > 1: the host of several, killed once
            if actor in killed:
                continue
            killed.add(actor)
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass

    def end(self, idle_s: float) -> None:
        """The run is over: pooled actors close their worker and wait `idle_s` for the next run;
        the others (and a pooled one that does not answer) close and are killed."""
        refs = {(h.release.remote(idle_s) if r in self.pooled else h.close.remote()): r for r, h in self.handles.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=10)
        for ref in ready:
            try:
                ray.get(ref)
                if refs[ref] in self.pooled:
                    del self.handles[refs[ref]]  # waits for the next run
            except Exception as exc:  # noqa: BLE001 - dead actors cannot close; they are killed next
                log.debug("closing region %s: %s", refs[ref], exc)
        self.kill()


def region_tls(cfg: RunConfig, run_dir: str | Path) -> dict[str, TlsMaterial | None]:
    """Each region's certificate and key, read on the driver from RUN_DIR/tls (security.tls)."""
    if not cfg.security.tls:
        return {r: None for r in cfg.regions.names}
    return {r: load_tls(Path(run_dir) / "tls", r) for r in cfg.regions.names}


def create_region_actors(cfg: RunConfig, run_dir: str, *, pin: bool, hostile: dict | None = None,
                         train_fn: Callable[[Any], None] | None = None, named: dict[str, str] | None = None,
                         live: dict[str, Any] | None = None) -> RegionActors:
    """One actor per region; with `pin`, each only on nodes labelled with its region.

    `named` (run.orphan_timeout_s, driver/reattach.py): region -> the name of its detached actor,
    which outlives this driver; `live`: region -> a live one a resume re-attaches to (reattach.Live),
    taken as it is instead of a new actor.

    Each actor gets its region's TLS material in its creation arguments: the driver's RUN_DIR
    need not be on a shared filesystem, and a restarted actor gets the same material again. So
    does `train_fn`, the loop API's function (orchestrator/trainer.py): a restarted actor runs it
    again and its Region restores as a task's does.
    """
    rc = cfg.regions
    hostile = hostile or {}  # region -> the Region actor's plugin: geofed bench attack only (benchmarks/bench/adversary.py)
    if (hostile or train_fn is not None) and cfg.ray.warm_pool_s > 0:
        raise ValueError("hostile regions and a training function need ray.warm_pool_s 0: a pooled actor would "
                         "outlive its run")
    loop = {"train_fn": train_fn} if train_fn is not None else {}
    if pin:
        wait_for_labels(cfg)
    cpus = region_cpus(cfg, pin=pin)
    tls = region_tls(cfg, run_dir)
    # Absolute: an actor's working directory is not the driver's, and on another node each region
    # writes its checkpoints under this same path on its own disk.
    run_dir = str(Path(run_dir).resolve())
    if rc.per_process > 1:  # regions/host.py: no pool, no detached actors, no workers (the config refused them)
        if train_fn is not None or hostile:
            raise ValueError("regions.per_process > 1: a training function (the loop API) and hostile regions run "
                             "one region a process")
        actors = RegionActors(create_hosts(cfg, run_dir, tls=tls, cpus=cpus, pin=pin))
        try:
            actors.info = wait_ready(actors.handles, rc.start_timeout_s, cfg)
            if pin:
                check_placement(cfg, actors.info)
        except BaseException:
            actors.kill()
            raise
        return actors
    reused, code = claim_pooled(cfg, cpus, pin=pin)  # warm actors of an earlier run (ray.warm_pool_s)
    job = ray.get_runtime_context().get_job_id()
    handles, pooled, adopting = {}, {}, {}
    named, live = named or {}, live or {}
    for region in rc.names:
        if region in live:
            handles[region] = live[region].handle
            continue
        if region in reused:
            pooled[region], handles[region] = reused[region]
            adopting[region] = handles[region].adopt.remote(cfg, region, run_dir, tls=tls[region])  # -> node_info
            continue
        handles[region], pool_name = _new_region_actor(
            cfg, region, run_dir, tls=tls[region], cpus=cpus, pin=pin, job=job, code=code,
            named=named.get(region), extra={**loop, **({"plugin": hostile[region]} if region in hostile else {})})
        if pool_name is not None:
            pooled[region] = pool_name
    actors = RegionActors(handles, pooled=pooled, named=dict(named))
    try:
        if rc.workers > 1:
            if train_fn is not None or hostile:
                raise ValueError("regions.workers > 1: a training function (the loop API) and hostile regions run "
                                 "one worker a region")
            actors.workers = create_workers(cfg, run_dir, cpus=cpus, pin=pin)
        waiting = {r: h for r, h in actors.handles.items() if r not in live}
        # a resume's live joiners under new names are membership.py's to take back, placed by their own label
        actors.info = {**{r: dict(live[r].info) for r in rc.names if r in live},
                       **wait_ready(waiting, rc.start_timeout_s, cfg, started=adopting, looping=bool(loop))}
        if pin:
            check_placement(cfg, actors.info)
        if rc.workers > 1:
            form_groups(cfg, actors, pin=pin)
    except BaseException:
        actors.kill()
        raise
    return actors


def _new_region_actor(cfg: RunConfig, region: str, run_dir: str, *, tls: Any, cpus: float, pin: bool, job: str,
                      code: str, named: str | None, extra: dict[str, Any], pool: bool = True) -> tuple[Any, str | None]:
    """A new actor for `region`: detached under `named` (it outlives this driver), a warm-pool
    actor (ray.warm_pool_s; not when `pool` is False: a joiner's), or a plain one given `extra` (the
    loop's function, a bench's plugin). Returns its handle and its pool name (None unless it is a
    warm-pool actor)."""
    rc = cfg.regions
    selector = {rc.label_key: rc.label_of(region)} if pin else None
    cls = region_actor_class(num_cpus=cpus, num_gpus=rc.num_gpus, max_restarts=rc.max_restarts,
                             label_selector=selector)
    if named is not None:
        drop_assignment(named)  # a killed predecessor's: a new actor must not read its dead driver's job
        return cls.options(name=named, namespace=RUN_NAMESPACE, lifetime="detached").remote(
            cfg, region, run_dir, tls=tls, pool={"name": named, "job": job, "idle_s": cfg.run.orphan_timeout_s}), None
    if pool and cfg.ray.warm_pool_s > 0:
        name = new_name(slot_of(cfg, region, cpus, pin=pin, code=code))
        return cls.options(name=name, namespace=POOL_NAMESPACE, lifetime="detached").remote(
            cfg, region, run_dir, tls=tls, pool={"name": name, "job": job}), name
    return cls.options(name=None).remote(cfg, region, run_dir, tls=tls, **extra), None


def create_workers(cfg: RunConfig, run_dir: str, *, cpus: float, pin: bool) -> dict[str, list[Any]]:
    """Workers 1..N-1 of each region (regions.workers), placed as its actor is."""
    return {region: [new_worker(cfg, run_dir, region, rank, cpus=cpus, pin=pin) for rank in range(1, cfg.regions.workers)]
            for region in cfg.regions.names}


def new_worker(cfg: RunConfig, run_dir: str, region: str, rank: int, *, cpus: float, pin: bool) -> Any:
    """Worker `rank` of `region`: its label, its CPUs and GPUs, as the region's actor. No Ray restarts:
    a worker restarted alone would not find its group again; a region rebuilt after a worker died
    gets a new one (driver/regroup.py)."""
    rc = cfg.regions
    options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": rc.num_gpus, "max_restarts": 0, "max_task_retries": 0,
                               "runtime_env": {"env_vars": grpc_log_env()},
                               "concurrency_groups": {FOLLOWER_GROUP: 1}}
    if pin:
        options["label_selector"] = {rc.label_key: rc.label_of(region)}
    # regions.shard_exchange: it serves its shard with the region's certificate (peers take it as the region)
    tls = load_tls(Path(run_dir) / "tls", region) if rc.shard_exchange and cfg.security.tls else None
    return ray.remote(**options)(RegionWorkerActor).remote(cfg, region, run_dir, rank, tls)


def form_groups(cfg: RunConfig, actors: RegionActors, *, pin: bool) -> None:
    """Each region's workers form their process group: worker 0 opens it on its node, the driver
    hands its address to the others (inside the region: never a WAN link, never a fixed port),
    all join at once within regions.group_timeout_s; then workers 1..N-1 follow worker 0.
    PlacementError naming the region and the worker that did not start or join."""
    rc = cfg.regions
    refs = {h.node_info.remote(): (region, rank) for region, hs in actors.workers.items()
            for rank, h in enumerate(hs, start=1)}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=rc.start_timeout_s)
    if pending:
        missing = ", ".join(f"{r} worker {k}" for r, k in sorted(refs[p] for p in pending))
        raise PlacementError(f"region workers not started within {rc.start_timeout_s:.0f}s "
                             f"(regions.start_timeout_s): {missing}")
    for ref in ready:
        region, rank = refs[ref]
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise PlacementError(f"region {region}: worker {rank} failed to start: {_cause_line(exc)}") from None
        if pin and info.get("labels", {}).get(rc.label_key) != rc.label_of(region):
            raise PlacementError(f"region {region}: worker {rank} landed on a node labelled "
                                 f"{info.get('labels', {}).get(rc.label_key)!r} ({rc.label_key})")
    addresses = dict(zip(rc.names, ray.get([actors.handles[r].open_group.remote() for r in rc.names],
                                           timeout=rc.start_timeout_s)))
    joins = {actors.handles[r].join_group.remote(addresses[r]): (r, 0) for r in rc.names}
    joins.update({h.join_group.remote(addresses[r]): (r, rank) for r, hs in actors.workers.items()
                  for rank, h in enumerate(hs, start=1)})
    # Each join gives up at the group's deadline itself (and says why); the wait here only bounds a hung actor.
    ready, pending = ray.wait(list(joins), num_returns=len(joins), timeout=rc.group_timeout_s + 30)
    errors = [f"region {joins[p][0]}: worker {joins[p][1]} did not answer within regions.group_timeout_s "
              f"{rc.group_timeout_s:g}s + 30s" for p in pending]
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            errors.append(_cause_line(exc))
    if errors:
        raise PlacementError("the region's workers formed no process group: " + "; ".join(sorted(set(errors))))
    actors.following = {r: [h.follow.remote() for h in hs] for r, hs in actors.workers.items()}


def _cause_line(exc: BaseException) -> str:
    """A Ray error's cause in one line (a RayTaskError carries the remote exception)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip()
    return text.splitlines()[0] if text else type(cause).__name__


def region_cpus(cfg: RunConfig, *, pin: bool) -> float:
    """The CPUs each region actor asks Ray for, checked against the cluster before any actor is
    created: PlacementError with the arithmetic and the key to change, instead of actors that
    wait for CPUs until regions.start_timeout_s. Unset on a local run, it shrinks to fit."""
    rc = cfg.regions
    # regions.workers: every worker of a region asks the same; regions.per_process: each process does
    n = len(rc.names) * rc.workers if rc.per_process == 1 else len(pack(list(rc.names), rc.per_process))
    total = float(ray.cluster_resources().get("CPU", 0.0))
    cpus = rc.num_cpus if rc.num_cpus is not None else DEFAULT_REGION_CPUS
    if rc.num_cpus is None and not pin and total > 0:
        cpus = min(cpus, math.floor(total / n * 1e4) / 1e4)  # Ray counts CPUs in 1e-4 units
    if pin:
        check_label_cpus(cfg, cpus)
    elif n * cpus > total + 1e-9:
        hint = (f"set regions.num_cpus to at most {math.floor(total / n * 1e4) / 1e4:g}"
                + (" (or leave it unset: a local run then fits the regions to its CPUs)" if rc.num_cpus is not None else "")
                + ", or give Ray more CPUs (ray.num_cpus)")
        actors = (f"{n} processes of regions.per_process {rc.per_process} regions" if rc.per_process > 1
                  else f"{n} regions" if rc.workers == 1 else f"{len(rc.names)} regions x regions.workers {rc.workers}")
        raise PlacementError(f"{actors} x regions.num_cpus {cpus:g} = {n * cpus:g} CPUs requested, "
                             f"but the Ray cluster has {total:g}: {hint}")
    return cpus


def check_label_cpus(cfg: RunConfig, cpus: float) -> None:
    """Pinned regions: the nodes carrying each label must hold that label's regions' CPUs."""
    rc = cfg.regions
    have: dict[str, float] = {}
    for node in ray.nodes():
        value = (node.get("Labels") or {}).get(rc.label_key)
        if node.get("Alive") and value is not None:
            have[value] = have.get(value, 0.0) + float((node.get("Resources") or {}).get("CPU", 0.0))
    wanted: dict[str, list[str]] = {}
    for r in rc.names:
        wanted.setdefault(rc.label_of(r), []).append(r)
    # the actors each label's nodes host: regions x workers, or (regions.per_process) the processes
    # of its regions (hosts.create_hosts refuses a process whose regions' labels differ)
    hosts: dict[str, int] = {}
    for group in pack(list(rc.names), rc.per_process):
        hosts[rc.label_of(group[0])] = hosts.get(rc.label_of(group[0]), 0) + 1
    actors = {label: len(regs) * rc.workers if rc.per_process == 1 else hosts[label] for label, regs in wanted.items()}
    short = [(label, regs, have.get(label, 0.0)) for label, regs in sorted(wanted.items())
             if actors[label] * cpus > have.get(label, 0.0) + 1e-9]
    if short:
        each = "" if rc.workers == 1 else f" x regions.workers {rc.workers}"  # workers > 1: per_process is 1
        detail = "; ".join(f"{rc.label_key}={label}: "
                           + (f"{len(regs)} region(s){each}" if rc.per_process == 1
                              else f"{actors[label]} process(es) of regions.per_process {rc.per_process}")
                           + f" x regions.num_cpus {cpus:g} = {actors[label] * cpus:g} CPUs requested, "
                           f"its nodes have {got:g}"
                           for label, regs, got in short)
        raise PlacementError(f"{detail}: lower regions.num_cpus or give those nodes more CPUs")


def wait_ready(handles: dict[str, Any], timeout_s: float, cfg: RunConfig, *,
               started: dict[str, Any] | None = None, looping: bool = False) -> dict[str, dict]:
    """node_info of every actor once all answer (`started`: region -> a call already made that
    returns it, a warm actor's adopt); PlacementError naming the regions that did not start within
    `timeout_s`, or the actor that failed to. `looping`: each actor runs the loop API's function,
    and has started once that function called ctx.sync (the likelier culprit: said first).
    """
    started = started or {}
    refs = {(started[r] if r in started else h.node_info.remote()): r for r, h in handles.items()}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        missing = sorted(refs[p] for p in pending)
        seen = node_labels(cfg.regions.label_key)
        if looping:
            raise PlacementError(
                f"region actors not started within {timeout_s:.0f}s (regions.start_timeout_s): {', '.join(missing)}; "
                f"the training function must call ctx.sync(model, optimizer) within that time in every region "
                f"(a function that loads its data first may need a larger regions.start_timeout_s)")
        raise PlacementError(
            f"region actors not started within {timeout_s:.0f}s (regions.start_timeout_s): {', '.join(missing)}; "
            f"nodes by {cfg.regions.label_key}: {_fmt_seen(seen)} (a labelled node may lack the free CPUs "
            f"regions.num_cpus asks for, or the actor failed to start: see the node's Ray logs)")
    info = {}
    for ref in ready:
        try:
            info[refs[ref]] = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as exc:
            # e.g. no free port in network.port_range, a data path missing on that node, a model too big
            raise start_failure(refs[ref], exc) from None
        except ray.exceptions.RayTaskError as exc:  # a warm actor's adopt
            raise PlacementError(f"region {refs[ref]}: its warm-pool actor failed to take the run: {exc.cause!r}") from None
    return info


def start_failure(region: str, exc: BaseException) -> PlacementError:
    """The error for a region actor that died while starting: one line naming the region and, when
    Ray's memory monitor killed it (OutOfMemoryError is no RayActorError), saying so and what to do,
    instead of Ray's multi-line OutOfMemoryError reaching the user raw."""
    death = death_cause(exc)
    if death.cause == OOM:
        return PlacementError(
            f"region {region}: its actor ran out of memory while starting (Ray's memory monitor killed it: "
            f"{death.detail}); a region holds about 64-72 bytes per parameter (delayed DiLoCo, int8; "
            f"docs/bench-memory.md): use a node with more memory, a smaller model, or fewer regions a node")
    return PlacementError(f"region {region}: its actor failed to start: {exc}")


def wait_for_labels(cfg: RunConfig) -> None:
    """Until every region has an alive node with its label, at most regions.placement_timeout_s
    (nodes may still be joining); then PlacementError naming the missing regions and the labels seen."""
    rc = cfg.regions
    deadline = time.monotonic() + rc.placement_timeout_s
    while True:
        seen = node_labels(rc.label_key)
        missing = [r for r in rc.names if rc.label_of(r) not in seen]
        if not missing:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(min(_LABEL_POLL_S, max(0.0, deadline - time.monotonic())))
    wanted = ", ".join(f"{r} ({rc.label_key}={rc.label_of(r)})" for r in missing)
    raise PlacementError(
        f"no alive Ray node carries the label of region(s) {wanted} after {rc.placement_timeout_s:.0f}s "
        f"(regions.placement_timeout_s); labels seen: {rc.label_key}: {_fmt_seen(seen)}; "
        f"start a node per region with its label (see `geofed launch plan`)")


def check_placement(cfg: RunConfig, info: dict[str, dict]) -> None:
    """Each pinned actor reports the labels of the node it runs on: they must name its region."""
    rc = cfg.regions
    wrong = {r: i.get("labels", {}).get(rc.label_key) for r, i in info.items()
             if i.get("labels", {}).get(rc.label_key) != rc.label_of(r)}
    if wrong:
        detail = ", ".join(f"{r} on a node labelled {v!r}" for r, v in sorted(wrong.items()))
        raise PlacementError(f"region actors landed on the wrong nodes ({rc.label_key}): {detail}")


def create_region_actor(cfg: RunConfig, run_dir: str, region: str, *, pin: bool,
                        train_fn: Callable[[Any], None] | None = None, named: str | None = None) -> tuple[Any, dict]:
    """One region's actor for a region joining a live run (driver/membership.py), waited for: its
    handle and node_info once it started, within regions.start_timeout_s. PlacementError as
    create_region_actors says it. `start_region_actor` makes the same actor without waiting."""
    starting = start_region_actor(cfg, run_dir, region, pin=pin, train_fn=train_fn, named=named)
    try:
        info = wait_ready({region: starting.handle}, cfg.regions.start_timeout_s, cfg, started={region: starting.ref},
                          looping=train_fn is not None)
        if pin:
            check_placement(cfg, info)
    except BaseException:
        starting.end()
        raise
    return starting.handle, info[region]


@dataclass
class StartingActor:
    """A region actor made without waiting for it (a joiner's, driver/membership.py): `poll()` asks,
    without blocking, whether it has started (its node_info) and `end()` ends it, named or not. The
    round loop goes on meanwhile, as it does while Ray restarts a region (faults.Faults.revive)."""

    cfg: RunConfig
    region: str
    handle: Any
    pin: bool
    named: str | None
    ref: Any  # its node_info call, made with the actor: it answers once the actor has started

    def poll(self) -> dict | None:
        """Its node_info once it answered, else None; PlacementError (the actor ended) when it died
        while starting or landed on a node without its label."""
        if not ray.wait([self.ref], timeout=0)[0]:
            return None
        try:
            info = ray.get(self.ref)
            if self.pin:
                check_placement(self.cfg, {self.region: info})
        except ray.exceptions.RayError as exc:  # OutOfMemoryError is no RayActorError: start_failure says which
            self.end()
            raise start_failure(self.region, exc) from None
        except PlacementError:
            self.end()
            raise
        return info

    def end(self) -> None:
        if self.named is not None:
            end_pooled(self.named, self.handle)
        else:
            ray.kill(self.handle, no_restart=True)


def start_region_actor(cfg: RunConfig, run_dir: str, region: str, *, pin: bool,
                       train_fn: Callable[[Any], None] | None = None, named: str | None = None) -> StartingActor:
    """One region's actor for a region joining a live run, not waited for: placed as set-up places
    it (only on nodes with its label when `pin`), its certificate from RUN_DIR/tls, never pooled;
    with `named` (run.orphan_timeout_s, driver/reattach.py) detached under that name as set-up's
    are, so that it outlives this driver too, once a predecessor that still holds the name has ended."""
    tls = load_tls(Path(run_dir) / "tls", region) if cfg.security.tls else None
    loop = {"train_fn": train_fn} if train_fn is not None else {}
    if named is not None:
        release_name(named)
    handle, _ = _new_region_actor(cfg, region, str(Path(run_dir).resolve()), tls=tls, cpus=region_cpus(cfg, pin=pin),
                                  pin=pin, job=ray.get_runtime_context().get_job_id(), code="", named=named,
                                  extra=loop, pool=False)
    return StartingActor(cfg=cfg, region=region, handle=handle, pin=pin, named=named, ref=handle.node_info.remote())


def _fmt_seen(seen: dict[str, list[str]]) -> str:
    if not seen:
        return "none"
    return ", ".join(f"{k} ({', '.join(v)})" for k, v in sorted(seen.items()))

