"""The Ray actor of a region: a plain Region (regions/region.py) plus where it runs. Nothing else lives here.

With `train_fn` (the loop API, regions/loop.py) the actor runs the user's function on a thread of
its own (a LoopHost) and holds the Region its ctx.sync builds; `finish_loop` at the end of the run
releases the loop and returns what it passed to ctx.report."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from .leave_notice import LeaveNotice
from .loop import LoopHost, LoopTimeouts, RegionContext
from .region import Region
from .warm import WarmSlot, load_assignment, process_age_s
from .shards import ShardPeers
from .workers import WorkerGroup
from .messages import RoundPlan, RoundReport

# Per-node override of the address peers dial (a node behind NAT, a public IP): set in the
# environment of that node's `ray start`, which Ray's worker processes inherit.
ADVERTISED_HOST_ENV = "GEOFED_ADVERTISED_HOST"
_WILDCARD = ("0.0.0.0", "::", "")


def advertised_host(cfg: Any) -> str | None:
    """Where peers dial this region's gRPC server, decided on the node the actor landed on:
    $GEOFED_ADVERTISED_HOST, else network.advertised_host, else (server on every interface) the
    node's Ray address, which `ray start --node-ip-address` made reachable from the other nodes."""
    env = os.environ.get(ADVERTISED_HOST_ENV, "").strip()
    if env:
        return env
    net = cfg.network
    if net.advertised_host:
        return net.advertised_host
    if net.bind_host in _WILDCARD:
        return ray.util.get_node_ip_address()
    return None


# The liveness probe runs on a thread of its own: a region busy with a long call still answers it,
# a stopped or hung process does not (orchestrator/driver/faults.py tells the two apart by it).
HEALTH_GROUP = "health"
# A warm pool's claim from the next run is answered at once too, whatever the actor is doing.
POOL_GROUP = "pool"
# The driver's "senders done" notices reach a region while its round is waiting on its peers.
NOTICE_GROUP = "notice"
# A region's worker 1..N-1 (regions.workers) answers while its `follow` holds the main thread.
FOLLOWER_GROUP = "follower"


class RegionActor:
    """The Ray actor of a region: a Region (`self.region`) that advertises its node's address, and
    answers heartbeats on a thread of their own. A pooled one (ray.warm_pool_s, regions/warm.py)
    outlives its run and is handed the next run's config by `adopt`.

    Each call from the driver that reaches the region runs inside the gap filler's `paused()`
    (regions/gapfill.py): a fill between rounds stops before the call and, after a round that
    armed one, starts when it returns. Heartbeats, claims and senders_done notices leave a fill
    running: they touch no training state.
    """

    def __init__(self, cfg: Any, region: str, run_dir: str, *, tls=None, pool: dict[str, Any] | None = None,
                 plugin=None, train_fn: Callable[[RegionContext], Any] | None = None,
                 build_region: Callable[..., Region] = Region, notice: LeaveNotice | None = None):
        # `tls`: this region's TlsMaterial, sent by the driver with the actor's creation (small,
        # once); the node never needs the driver's RUN_DIR/tls. `pool`: {"name", "job"} of a pooled
        # actor and the Ray job of the run that creates it.
        t0, age = time.monotonic(), process_age_s(ndigits=3)  # where an actor's start goes (the setup_done event)
        self._pool: WarmSlot | None = None
        if pool is not None:
            # A restart re-runs __init__ with the creation arguments, those of the run that created
            # the actor: the run that holds it now is in its saved assignment.
            held = load_assignment(pool["name"]) or {"cfg": cfg, "region": region, "run_dir": run_dir, "tls": tls,
                                                     "job": pool["job"],
                                                     # a run's own detached actor: run.orphan_timeout_s
                                                     **({"idle_s": pool["idle_s"]} if "idle_s" in pool else {})}
            self._pool = WarmSlot(pool["name"], held)
            cfg, region, run_dir, tls = held["cfg"], held["region"], held["run_dir"], held["tls"]
        # train_fn: the user's function (the loop API), built like `plugin`: the region built around its model
        self.region: Region | None
        self._loop: LoopHost | None
        # build_region: Region, or (regions.per_process > 1, regions/host.py) one that shares its process
        self.region, self._loop = _build(cfg, region, run_dir, tls, plugin=plugin, train_fn=train_fn,  # plugin: a bench's, no config key
                                         build_region=build_region)
        # A SIGTERM (a spot notice) asks the run to let this region leave (regions/leave_notice.py);
        # `notice`: the process's, shared by the regions a host process holds (it closes it itself)
        self._own_notice = notice is None
        self._notice = notice if notice is not None else LeaveNotice(getattr(cfg.regions, "leave_grace_s", 30.0))
        if self._own_notice and _in_actor():  # a RegionActor built as a plain class (tests) leaves its process's handler alone
            self._notice.install()
        # cpu_s: this process's CPU from its start (Ray's worker, the imports, the build): what a
        # region's start costs whatever else the host is doing, where process_s and init_s are wall time.
        self._start: dict[str, Any] = {"process_s": age, "init_s": round(time.monotonic() - t0, 3),
                                       "cpu_s": round(time.process_time(), 3)}
        # What a resumed driver re-attaching to this actor needs (orchestrator/driver/reattach.py): the
        # address its server serves on, and the report of its last round, which a killed driver may never have read.
        self._address: str | None = None
        self._last_report: RoundReport | None = None

    def _paused(self, call: Callable[[Region], Any]) -> Any:
        """`call(region)` with the gap filler paused around it (regions/gapfill.py)."""
        region = self.region
        if region is None:  # a pooled actor between runs
            raise RuntimeError("this pooled region actor holds no region: adopt() it first")
        with region.gap_fill.paused():
            return call(region)

    # -- the pool ---------------------------------------------------------------------------
    @ray.method(concurrency_group=POOL_GROUP)
    def claim(self, job: str, idle_s: float | None = None) -> bool:
        """A pooled actor taken by the run of Ray job `job`; False when another run holds it."""
        return self._pool is not None and self._pool.claim(job, idle_s)

    def adopt(self, cfg: Any, region: str, run_dir: str, *, tls=None,
              train_fn: Callable[[RegionContext], Any] | None = None) -> dict[str, Any]:
        """A claimed pooled actor becomes `region` of a new run: the old region is closed and a
        fresh one built in this process (no state of the last run survives); returns node_info."""
        if self._pool is None:
            raise RuntimeError("adopt: this region actor is not pooled")
        t0, cpu0 = time.monotonic(), time.process_time()
        self.close()
        self.region = None
        self._pool.assign(cfg=cfg, region=region, run_dir=run_dir, tls=tls)  # first: a restart from here on builds this run's region
        self.region, self._loop = _build(cfg, region, run_dir, tls, train_fn=train_fn)
        # The new region has no server yet: start() must start it, not hand out the last run's
        # (closed) address, and a re-attach must not see the last run's report.
        self._address, self._last_report = None, None
        # close() above closed the notice: without this a spot notice would end the adopted region at once
        self._notice.reopen(getattr(cfg.regions, "leave_grace_s", 30.0))
        self._start = {"process_s": None, "init_s": round(time.monotonic() - t0, 3),
                       "cpu_s": round(time.process_time() - cpu0, 3), "reused": True}
        return self.node_info()

    def release(self, idle_s: float) -> None:
        """The run is over: close the region; the actor waits `idle_s` for the next run, then ends."""
        self.close()
        if self._pool is not None:
            self._pool.release(idle_s)

    # -- off the main thread: no pause ------------------------------------------------------
    @ray.method(concurrency_group=NOTICE_GROUP)
    def senders_done(self, round_: int, senders: list[str]) -> None:
        """Region.senders_done, on a thread of its own: the round it cuts short is running."""
        region = self.region
        if region is not None:  # a pooled actor between runs has none
            region.senders_done(round_, senders)

    @ray.method(concurrency_group=HEALTH_GROUP)
    def heartbeat(self) -> dict[str, Any]:
        """Answers at once, whatever the region's main call is doing (reads two plain values)."""
        region = self.region
        return {"pid": os.getpid(), "completed_round": region.completed_round if region is not None else -1,
                **self._notice.record()}

    # -- the region's calls, each with the gap filler paused --------------------------------
    def start(self) -> str:
        """The region's server starts; a re-attached region's runs already: the address it serves on."""
        if self._address is None:
            self._address = self._paused(lambda r: r.start())
        return self._address

    def connect(self, peers: dict[str, str]) -> None:
        return self._paused(lambda r: r.connect(peers))

    def probe(self) -> dict[str, Any]:
        return self._paused(lambda r: r.probe())

    def run_round(self, plan: RoundPlan) -> RoundReport:
        report = self._paused(lambda r: r.run_round(plan))
        if self._notice.leaving:  # a SIGTERM came: the driver retires the region after this round
            report = dataclasses.replace(report, extra={**report.extra, **self._notice.record()})
        self._last_report = report
        return report

    def attach(self) -> dict[str, Any]:
        """A resumed driver takes this region over (run.orphan_timeout_s): node_info, its server's
        address and its last round's report. On the main thread: a round its dead driver started ends first."""
        return {**self.node_info(), "grpc_address": self._address, "last_report": self._last_report}

    def catch_up(self, peers: list[str], **kwargs: Any) -> tuple[str, int]:
        return self._paused(lambda r: r.catch_up(peers, **kwargs))

    def finish_pending(self) -> dict[str, Any]:
        return self._paused(lambda r: r.finish_pending())

    def flush_exchange(self) -> dict[str, Any]:
        return self._paused(lambda r: r.flush_exchange())

    def get_params(self) -> list[Any]:
        return self._paused(lambda r: r.get_params())

    def evaluate(self) -> dict[str, Any]:
        return self._paused(lambda r: r.evaluate())

    def result_state(self) -> dict[str, Any]:
        return self._paused(lambda r: r.result_state())

    def sketch(self) -> Any:
        return self._paused(lambda r: r.sketch())

    def save_checkpoint(self) -> str:
        return self._paused(lambda r: r.save_checkpoint())

    def restore_checkpoint(self, at_most: int | None = None) -> dict[str, Any]:
        return self._paused(lambda r: r.restore_checkpoint(at_most))

    def take_refusals(self) -> dict[str, int]:
        return self._paused(lambda r: r.take_refusals())

    def transport_stats(self) -> dict[str, Any]:
        return self._paused(lambda r: r.transport_stats())

    def info(self) -> dict[str, Any]:
        return self._paused(lambda r: r.info())

    # -- regions.workers > 1: this actor is worker 0 of the region's group (regions/workers.py) --
    def open_group(self) -> str:
        """The group's rendezvous on this node (HOST:PORT), for the driver to hand the other workers."""
        return self._paused(lambda r: _group_of(r).open(ray.util.get_node_ip_address()))

    def join_group(self, address: str, rebuilt: bool = False) -> None:
        """Join the group at `address`; `rebuilt` (after a worker died): the whole state goes to the others first."""
        return self._paused(lambda r: _group_of(r).join(address, r.device, rebuilt=rebuilt,
                                                        node_ip=ray.util.get_node_ip_address()))

    def shard_addresses(self) -> list[str | None]:
        """regions.shard_exchange: each worker's gRPC address by rank, as gathered when the group formed
        (worker 0's own is None: its peers dial the region's address, connect)."""
        return self._paused(lambda r: list(_group_of(r).shard_addresses))

    def connect_shards(self, peers: ShardPeers) -> None:
        """regions.shard_exchange: each follower dials worker k of every region (ShardPeers, from the driver)."""
        def lead(r: Region) -> None:
            if peers.region != r.region:
                raise ValueError(f"region {r.region}: shard peers sent for region {peers.region}")
            _group_of(r).lead_peers(peers)
        return self._paused(lead)

    def finish_loop(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The run is over (the loop API): the user's loop sees should_stop, its function is waited
        for (LoopHost.finish); what it passed to ctx.report ({} without a loop). Raises what it raised."""
        return {} if self._loop is None else self._loop.finish(timeout_s)

    def close(self) -> None:
        """Close the region (a pooled actor keeps running without one until adopted or ended)."""
        if self._own_notice:
            self._notice.close()  # a SIGTERM from now on is an orderly shutdown's
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self.region is not None:
            with self.region.gap_fill.paused():
                self.region.close()

    def node_info(self) -> dict[str, Any]:
        """info() plus the Ray node the actor runs on (id, IP, labels), for the placement check."""
        return {**self.info(), **_node_facts(), "start": self._start}


def _in_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _build(cfg: Any, region: str, run_dir: str, tls, *, plugin=None,
           train_fn: Callable[[RegionContext], Any] | None = None,
           build_region: Callable[..., Region] = Region) -> tuple[Region, LoopHost | None]:
    """The region (and, with `train_fn`, the LoopHost running it: its ctx.sync builds the region)."""
    host_address = advertised_host(cfg)
    if train_fn is None:
        group = None if cfg.regions.workers == 1 else WorkerGroup(region, 0, cfg.regions.workers,
                                                                   timeout_s=cfg.regions.group_timeout_s,
                                                                   sharded=cfg.regions.shard_exchange)
        return build_region(cfg, region, run_dir, tls=tls, advertised_host=host_address, plugin=plugin,
                            workers=group), None

    def build(**injected: Any) -> Region:
        return Region(cfg, region, run_dir, tls=tls, advertised_host=host_address, plugin=plugin, **injected)

    # The function must reach ctx.sync within the actor's start (regions.start_timeout_s, the driver's wait).
    host = LoopHost(train_fn, cfg, region, run_dir, build=build, timeouts=LoopTimeouts(start_s=cfg.regions.start_timeout_s))
    host.start()
    try:
        return host.wait_region(), host
    except BaseException:
        host.close()
        raise


class RegionWorkerActor:
    """Worker `rank` (1..N-1) of a region of N (regions.workers, regions/workers.py): a Region that
    only trains, in step with worker 0 (its transport is an in-memory one nobody reaches: the
    exchange is worker 0's). With regions.shard_exchange it exchanges its shard too (regions/shards.py),
    over a gRPC server of its own with the region's TLS material (`tls`): peers accept it as the region.
    `follow` holds the actor's main thread for the whole run."""

    def __init__(self, cfg: Any, region: str, run_dir: str, rank: int, tls=None):
        from geofed.p2p.memory import InMemoryHub, InMemoryTransport

        sharded = bool(cfg.regions.shard_exchange)
        group = WorkerGroup(region, rank, cfg.regions.workers, timeout_s=cfg.regions.group_timeout_s, sharded=sharded)
        if sharded:
            self.region = Region(cfg, region, run_dir, tls=tls, advertised_host=advertised_host(cfg), workers=group)
        else:
            self.region = Region(cfg, region, run_dir, transport=InMemoryTransport(region, InMemoryHub()), workers=group)
        self.group = group
        self._address: str | None = None  # its gRPC server's, once started (sharded)

    @ray.method(concurrency_group=FOLLOWER_GROUP)
    def node_info(self) -> dict[str, Any]:
        """What the placement check reads: the node it runs on and its labels (as RegionActor.node_info),
        and its pid; on a thread of its own, so that it answers while `follow` holds the main one."""
        return {"region": self.region.region, "rank": self.group.rank, "pid": os.getpid(), **_node_facts()}

    def join_group(self, address: str) -> None:
        if self.group.sharded and self._address is None:  # its server serves its shard's peers (a survivor's stays)
            self._address = self.region.start()
        self.group.join(address, self.region.device, serves=self._address, node_ip=ray.util.get_node_ip_address())

    def follow(self) -> int:
        """Worker 0's commands until it closes the region; the steps taken."""
        return self.group.follow(self.region)

    @ray.method(concurrency_group=FOLLOWER_GROUP)
    def get_params(self) -> list[Any]:
        """Its parameters, on a thread of their own (`follow` holds the main one): between worker 0's
        rounds equal to worker 0's (a test compares them)."""
        return self.region.get_params()


def _node_facts() -> dict[str, Any]:
    """The Ray node this actor runs on: its id, IP and labels."""
    node_id = ray.get_runtime_context().get_node_id()
    labels = next((dict(n.get("Labels") or {}) for n in ray.nodes() if n.get("NodeID") == node_id), {})
    return {"node_id": node_id, "node_ip": ray.util.get_node_ip_address(), "labels": labels}


def _group_of(region: Region) -> WorkerGroup:
    if region.workers is None:
        raise RuntimeError(f"region {region.region}: regions.workers is 1, it has no process group")
    return region.workers


GRPC_LOG_ENV = "GRPC_VERBOSITY"


def grpc_log_env(*, verbose: bool = False) -> dict[str, str]:
    """The environment a region process starts with for gRPC's C-core logging: the user's own
    GRPC_VERBOSITY when the driver has one, else ERROR with --verbose and NONE without. Its lines
    bypass Python logging and reached the console in Ray's actor prefix: one "Failed to add port
    to server ... Address already in use" per busy port of network.port_range, which geofed skips
    as it should. It must be set before the process imports grpc: hence Ray's runtime_env."""
    mine = os.environ.get(GRPC_LOG_ENV)
    return {GRPC_LOG_ENV: mine if mine else "ERROR" if verbose else "NONE"}


# glibc's malloc, as a region process starts (measured in docs/bench-memory.md, "The allocator's share"):
# tensors from 4 MiB up get mappings of their own, returned to the OS when freed (the default threshold
# climbs to 32 MiB after the first such free, and model-sized buffers then fragment the heap), and two
# arenas instead of 8 x cores, one per thread that allocates (training, overlap, gRPC's decodes).
# At 30M parameters: 87.8 -> 79.5 B/param, the same CPU per step.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4194304", "MALLOC_ARENA_MAX": "2"}


def malloc_env() -> dict[str, str]:
    """MALLOC_ENV, less what the driver's own environment sets (the user's choice wins). glibc reads
    these when the process starts, so they travel in Ray's runtime_env; other libcs ignore them."""
    return {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}


def region_actor_class(*, num_cpus: float, max_restarts: int, label_selector: dict[str, str] | None = None,
                       num_gpus: float = 0.0):
    """A remote class with the region's resources; pinned to nodes whose labels match `label_selector`."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts,
                               "max_task_retries": 0,
                               # merged by Ray with the job's env_vars (OMP_NUM_THREADS)
                               "runtime_env": {"env_vars": {**grpc_log_env(), **malloc_env()}},
                               # the default group keeps max_concurrency 1: region calls stay serial
                               "concurrency_groups": {HEALTH_GROUP: 1, POOL_GROUP: 1, NOTICE_GROUP: 1}}
    if label_selector:
        options["label_selector"] = label_selector
    return ray.remote(**options)(RegionActor)

