"""A real multi-node Ray cluster on this machine over shaped links: one network namespace per region.

`ShapedCluster` brings up a `p2p.wan.hub.RegionNet` (a namespace per region, one tbf-shaped
egress each, a user-space router that delays every packet by the pair's latency and counts
every flow) and, in it, the launch plan of a run config (`geofed launch plan`): the Ray head in
the head region's namespace, a worker node in each other region's, each from the plan's own
`ray start` options (labels, token auth, Ray's timers sized by the RTT), with its namespace
address as `--node-ip-address`. Each namespace has its own ports, so the plan's fixed ports are
used as on real machines. `run()` runs `geofed run CONFIG --address HEAD` in the head's
namespace, where a driver sits in a real cluster, and snapshots the router's flow counters as
the run goes (start-up, each round, the end) so that bytes can be put to phases and to who
sent them (geofed's gRPC ports or Ray's).

It stops only what it started: each `ray start` runs in a session of its own (LocalCluster),
Ray's worker processes are found by this cluster's temp dir in their command line, and then any
process still in one of its namespaces (`ip netns pids`) is killed before the namespaces go.
Never `ray stop`. `ray start --temp-dir` writes its `ray_current_cluster` file under that dir,
not /tmp/ray, so a plain `ray.init()` elsewhere on the machine does not join this cluster.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .hub import RegionLinks, RegionNet
from geofed.p2p.wan.kernel import run_tool

from geofed.orchestrator.launch.plan import LaunchPlan
from .local_cluster import LocalCluster, LocalNode, _signal_pid

POLL_S = 0.02          # how often run() looks for new lines in the run directory
_KILL_GRACE_S = 5.0


class NetnsCluster(LocalCluster):
    """A LocalCluster whose nodes run in the namespaces of a RegionNet, at its addresses."""

    def __init__(self, plan: LaunchPlan, net: RegionNet, *, num_cpus: int = 1, object_store_mb: int = 100,
                 start_timeout_s: float = 120.0):
        super().__init__(plan, num_cpus=num_cpus, object_store_mb=object_store_mb, start_timeout_s=start_timeout_s)
        self.net = net
        for node in self.nodes:
            node.ip = net.address(node.plan.region)

    def _command(self, node: LocalNode, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.net.namespace(node.plan.region), *super()._command(node, argv)]

    def _assign_ports(self) -> None:
        """The plan's own fixed ports: every node has a namespace, hence a port space, of its own."""
        for node in self.nodes:
            options: dict[str, Any] = {"--temp-dir": str(node.temp_dir), "--num-cpus": self.num_cpus,
                                       "--object-store-memory": self.object_store_mb << 20}
            if node.plan.head:
                options["--include-dashboard"] = "false"
                options["--port"] = node.plan.options["--port"]
            self._options[node.plan.name] = options
        lo, hi = self.plan.ports["between_nodes"]["geofed_grpc"]
        self.grpc_port_range = (int(lo), int(hi))

    def namespace_pids(self) -> list[int]:
        out: set[int] = set()
        for ns in self.net.names.values():
            try:
                out |= {int(p) for p in run_tool("ip", "netns", "pids", ns).split()}
            except RuntimeError:
                continue  # the namespace is gone already
        out.discard(os.getpid())
        return sorted(out)

    def alive_pids(self) -> list[int]:
        return sorted(set(super().alive_pids()) | set(self.namespace_pids()))

    def stop(self) -> None:
        """LocalCluster's stop, then whatever still runs in our namespaces (a driver, a worker)."""
        super().stop()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.namespace_pids()
            for pid in pids:
                _signal_pid(pid, sig)
            deadline = time.monotonic() + _KILL_GRACE_S
            while pids and time.monotonic() < deadline:
                time.sleep(0.1)
                pids = self.namespace_pids()
            if not pids:
                return


@dataclass
class Snapshot:
    """The router's flow counters at one moment of a driver run (a phase boundary: launch, a round, the end)."""

    label: str          # "launch", "started", "round 3", "end"
    t: float            # time.monotonic()
    flows: dict         # router FlowCounters.snapshot()


@dataclass
class DriverRun:
    """One `geofed run` on the cluster: its exit, its run directory and the traffic by phase."""

    run_dir: Path
    returncode: int
    output: str
    snapshots: list[Snapshot] = field(default_factory=list)
    nic_before: dict[str, dict[str, int]] = field(default_factory=dict)
    nic_after: dict[str, dict[str, int]] = field(default_factory=dict)
    startup_s: float | None = None      # launch -> round 0's start (the driver's setup_done, else started, event)

    @property
    def round0(self) -> str:
        """The snapshot taken as round 0 started: "setup_done" where the driver writes that event
        (after its link probes), else "started"."""
        return "setup_done" if any(s.label == "setup_done" for s in self.snapshots) else "started"

    def snapshot(self, label: str) -> Snapshot:
        for s in self.snapshots:
            if s.label == label:
                return s
        raise KeyError(f"no snapshot {label!r} (have {', '.join(s.label for s in self.snapshots)})")

    def check(self) -> None:
        if self.returncode != 0:
            raise RuntimeError(f"geofed run failed (exit {self.returncode}) in {self.run_dir}:\n{self.output[-4000:]}")


class ShapedCluster:
    """RegionNet + NetnsCluster for the regions of `plan`; a context manager that removes both."""

    def __init__(self, plan: LaunchPlan, links: RegionLinks, *, prefix: str = "gfc", num_cpus: int = 1,
                 object_store_mb: int = 100, start_timeout_s: float = 120.0):
        self.plan = plan
        self.net = RegionNet(plan.regions, links, prefix=prefix)
        self.cluster: NetnsCluster | None = None
        self._kw = {"num_cpus": num_cpus, "object_store_mb": object_store_mb, "start_timeout_s": start_timeout_s}
        self.started_s: float | None = None

    def start(self) -> ShapedCluster:
        t0 = time.monotonic()
        atexit.register(self.stop)   # an interrupted owner still stops its Ray nodes
        try:
            self.net.up()
            self.cluster = self._ray_nodes()
            self.cluster.start()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _ray_nodes(self) -> NetnsCluster:
        """The Ray nodes, once the namespaces are up (not started yet): one a region."""
        return NetnsCluster(self.plan, self.net, **self._kw)

    def stop(self) -> None:
        """Every process this cluster started, then its namespaces. Idempotent."""
        try:
            if self.cluster is not None:
                self.cluster.stop()
        finally:
            self.net.down()
            atexit.unregister(self.stop)

    def __enter__(self) -> ShapedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def head_address(self) -> str:
        assert self.cluster is not None and self.cluster.head_address, "start() first"
        return self.cluster.head_address

    @property
    def grpc_port_range(self) -> tuple[int, int]:
        assert self.cluster is not None and self.cluster.grpc_port_range
        return self.cluster.grpc_port_range

    def exec_argv(self, region: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.net.namespace(region), *argv]

    def nic_counters(self) -> dict[str, dict[str, Any]]:
        """Each region's TUN counters (the kernel's) and its tbf's (sent, dropped, overlimits)."""
        return {r: {**self.net.nic(r), "qdisc": self.net.qdisc(r)} for r in self.net.regions}

    def run(self, config: str | Path, out: Path, overrides: Sequence[str] = (), *, timeout_s: float = 600,
            geofed: str | None = None) -> DriverRun:
        """`geofed run CONFIG --address HEAD --out OUT` in the head region's namespace (the
        driver of a real cluster sits on the head node); snapshots of every flow at launch, at
        the driver's `started` event, at each new line of rounds.jsonl and at the end."""
        assert self.cluster is not None and self.net.router is not None, "start() first"
        geofed = geofed or str(Path(sys.executable).parent / "geofed")
        argv = [geofed, "run", str(config), "--address", self.head_address, "--out", str(out), "--no-report",
                "--quiet", *(x for o in overrides for x in ("--set", o))]
        env = {**self.cluster.env(), "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
        out.parent.mkdir(parents=True, exist_ok=True)
        log_path = out.parent / f"{out.name}.driver.log"
        run = DriverRun(run_dir=out, returncode=-1, output="", nic_before=self.nic_counters())
        watch = _Watcher(self, out, run)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self.exec_argv(self.plan.head_region, argv), env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=out.parent)
            watch.start()
            try:
                run.returncode = proc.wait(timeout=timeout_s)
            except BaseException:
                _stop_driver(proc)
                raise
            finally:
                watch.stop()
        run.snapshots.append(Snapshot("end", time.monotonic(), self.net.router.counters.snapshot()))
        run.nic_after = self.nic_counters()
        run.output = log_path.read_text(errors="replace")
        return run


def _stop_driver(proc: subprocess.Popen) -> None:
    """SIGINT first (the driver checkpoints and closes its actors), then the whole group."""
    for sig, wait_s in ((signal.SIGINT, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class _Watcher:
    """Polls the run directory; takes a flow snapshot when the driver starts and after each round."""

    def __init__(self, cluster: ShapedCluster, run_dir: Path, run: DriverRun):
        self.cluster, self.run_dir, self.run = cluster, run_dir, run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="cluster-watch", daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> None:
        self._take("launch")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll_once()   # lines written between the last poll and the driver's exit

    def _take(self, label: str) -> None:
        router = self.cluster.net.router
        assert router is not None
        self.run.snapshots.append(Snapshot(label, time.monotonic(), router.counters.snapshot()))

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll_once()

    def _poll_once(self) -> None:
        have = {s.label for s in self.run.snapshots}
        events = _events(self.run_dir / "events.jsonl")
        for name in ("started", "setup_done"):   # setup_done: drivers that probe the links after start
            if name not in have and name in events:
                self._take(name)
                self.run.startup_s = time.monotonic() - self.t0
        for r in range(_count_lines(self.run_dir / "rounds.jsonl")):
            if f"round {r}" not in have:
                self._take(f"round {r}")


def _count_lines(path: Path) -> int:
    try:
        data = path.read_bytes()
    except OSError:
        return 0
    return data.count(b"\n")


def _events(path: Path) -> set[str]:
    """Names of the events in events.jsonl so far (a torn last line is left for the next poll)."""
    out: set[str] = set()
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            out.add(json.loads(line).get("event"))
        except ValueError:
            break
    return out


class NodeNetnsCluster(NetnsCluster):
    """A NetnsCluster with `nodes_per_region` nodes a region, each in a namespace of its own (a RegionNet
    keyed by node name): the head and a worker node of the head region, and copies of each other
    region's worker node (`worker-<region>-<i>`), all with the region's label. For a region of several
    workers (regions.workers) on several nodes: each node's egress is shaped on its own."""

    def __init__(self, plan: LaunchPlan, net: RegionNet, *, nodes_per_region: int = 2, num_cpus: int = 1,
                 object_store_mb: int = 100, start_timeout_s: float = 120.0):
        LocalCluster.__init__(self, plan, regions=list(plan.regions), num_cpus=num_cpus,
                              object_store_mb=object_store_mb, start_timeout_s=start_timeout_s)
        extra = [dataclasses.replace(plan.node(f"worker-{r}"), name=f"worker-{r}-{i}")
                 for r in plan.regions for i in range(1, nodes_per_region if r != plan.head_region else nodes_per_region - 1)]
        first = len(self.nodes)
        self.nodes += [LocalNode(plan=k, ip="", temp_dir=self.root / f"n{first + i}", log=self.root / f"n{first + i}.log")
                       for i, k in enumerate(extra)]
        self.net = net
        for node in self.nodes:
            node.ip = net.address(node.plan.name)

    def _command(self, node: LocalNode, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.net.namespace(node.plan.name), *LocalCluster._command(self, node, argv)]


def node_names(plan: LaunchPlan, nodes_per_region: int) -> dict[str, str]:
    """Node name -> its region, as NodeNetnsCluster names them."""
    out = {"head": plan.head_region}
    for r in plan.regions:
        out[f"worker-{r}"] = r
        for i in range(1, nodes_per_region if r != plan.head_region else nodes_per_region - 1):
            out[f"worker-{r}-{i}"] = r
    return out


class ShapedNodesCluster(ShapedCluster):
    """ShapedCluster with `nodes_per_region` nodes a region (NodeNetnsCluster): every node's egress its own
    tbf at `egress_mbps`, `latency_ms` one way between nodes of different regions, none inside a region."""

    def __init__(self, plan: LaunchPlan, *, egress_mbps: float, latency_ms: float, nodes_per_region: int = 2,
                 prefix: str = "gfn", num_cpus: int = 1, object_store_mb: int = 100, start_timeout_s: float = 120.0,
                 lan_unshaped: bool = False):
        """`lan_unshaped`: the nodes of a region are joined by a veth of their own (a /32 route to each
        other's address through it), as on a region's LAN: what a node sends inside its region takes
        it, unshaped and past the router, and its TUN device (the tbf, the router's delay) carries
        only what it sends to other regions. False: every flow goes through the router, and the tbf
        shapes everything the node sends (RegionNet's own)."""
        self.plan = plan
        self.egress_mbps, self.lan_unshaped = egress_mbps, lan_unshaped
        self.region_of = node_names(plan, nodes_per_region)
        names = list(self.region_of)
        links = RegionLinks(egress_mbps={n: egress_mbps for n in names},
                            latency_ms={(a, b): (latency_ms if self.region_of[a] != self.region_of[b] else 0.0)
                                        for a in names for b in names if a != b})
        self.net = RegionNet(names, links, prefix=prefix)
        self.nodes_per_region = nodes_per_region
        self.cluster: NetnsCluster | None = None
        self._kw = {"num_cpus": num_cpus, "object_store_mb": object_store_mb, "start_timeout_s": start_timeout_s}
        self.started_s: float | None = None

    def _ray_nodes(self) -> NetnsCluster:
        """`nodes_per_region` Ray nodes a region, their LANs joined first where `lan_unshaped`."""
        if self.lan_unshaped:
            self._connect_lans()
        return NodeNetnsCluster(self.plan, self.net, nodes_per_region=self.nodes_per_region, **self._kw)

    def _connect_lans(self) -> None:
        """A veth between every two nodes of a region, and in each a /32 route to the other's address
        through it (source: the node's own address, so replies come back the same way). Nothing else
        is added: the veths go with the namespaces (RegionNet.down)."""
        nodes = list(self.region_of)
        pairs = [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:] if self.region_of[a] == self.region_of[b]]
        for k, (a, b) in enumerate(pairs):
            ends = [(a, f"lan{k}a", b), (b, f"lan{k}b", a)]
            run_tool("ip", "link", "add", ends[0][1], "netns", self.net.namespace(a), "type", "veth",
                     "peer", "name", ends[1][1], "netns", self.net.namespace(b))
            for node, dev, other in ends:
                ns = self.net.namespace(node)
                run_tool("ip", "-n", ns, "link", "set", dev, "up")
                run_tool("ip", "-n", ns, "route", "add", f"{self.net.address(other)}/32", "dev", dev,
                         "src", self.net.address(node))

    def exec_argv(self, region: str, argv: Sequence[str]) -> list[str]:
        """In the namespace of `region`'s node, or (a region) of its head or first worker node."""
        node = region if region in self.region_of else ("head" if region == self.plan.head_region else f"worker-{region}")
        return ["ip", "netns", "exec", self.net.namespace(node), *argv]

    def wan_bytes_by_node(self, run: DriverRun, start: str = "launch", end: str = "end") -> dict[str, int]:
        """TCP payload each node pushed to geofed's servers (network.port_range) on nodes of other regions,
        between two snapshots: the WAN bytes of the regions' exchanges, by the node that sent them."""
        assert self.cluster is not None and self.cluster.grpc_port_range
        lo, hi = self.cluster.grpc_port_range
        node_of = {self.net.address(n): n for n in self.region_of}
        a, b = run.snapshot(start).flows, run.snapshot(end).flows
        out = {n: 0 for n in self.region_of}
        for key, (_, _, payload) in b.items():
            src, dst = node_of.get(key[0]), node_of.get(key[1])
            if src is None or dst is None or self.region_of[src] == self.region_of[dst] or not lo <= key[4] <= hi:
                continue
            out[src] += payload - a.get(key, (0, 0, 0))[2]
        return out
