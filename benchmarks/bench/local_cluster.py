"""A launch plan brought up on this one machine: the head and one worker node per other region,
each from the plan's own `ray start` options and environment (labels, token auth, Ray
settings), with the differences one host forces: its own loopback address (127.0.0.<10+i>), free
ports in place of the plan's fixed ones, its own --temp-dir, a small CPU and memory share.

It is how the multi-node integration test checks that a plan's commands make a working cluster,
and a way to try a plan before renting machines. It stops only the processes it started: each
`ray start` runs in a new session, whose process group holds that node's Ray daemons, and the
worker processes a raylet forks into sessions of their own are found by this cluster's unique
temp dir in their command line. Never `ray stop`: that kills every Ray on the host.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from geofed.orchestrator.launch.plan import LaunchPlan, NodePlan, ray_start_argv

_FIRST_HOST = 10          # 127.0.0.10 is the head; .1 is avoided (Ray swaps it for the host's address)
_WORKER_PORTS = 24        # Ray worker processes per node (each holds one port)
_TERM_GRACE_S = 5.0


class LocalClusterError(RuntimeError):
    """A node did not start (its `ray start` output is in the message)."""


@dataclass
class LocalNode:
    """One node of a LocalCluster: its plan, loopback address, Ray temp dir, log file and process group."""

    plan: NodePlan
    ip: str
    temp_dir: Path
    log: Path
    pgid: int | None = None


class LocalCluster:
    """A launch plan's nodes brought up as Ray processes on this machine (see the module docstring);
    stops exactly what it started.
    """

    def __init__(self, plan: LaunchPlan, *, regions: list[str] | None = None, num_cpus: int = 1,
                 object_store_mb: int = 100, start_timeout_s: float = 90.0, grpc_ports: int = 8):
        """`regions`: the regions that get a worker node (default: every region but the head's).
        `grpc_ports`: size of `grpc_port_range`, free ports for geofed's servers (network.port_range)."""
        wanted = [r for r in plan.regions if r != plan.head_region] if regions is None else list(regions)
        unknown = [r for r in wanted if r not in plan.regions]
        if unknown:
            raise ValueError(f"regions: {unknown} are not in the plan ({', '.join(plan.regions)})")
        self.plan = plan
        self.num_cpus, self.object_store_mb, self.start_timeout_s = num_cpus, object_store_mb, start_timeout_s
        # Short on purpose: Ray's unix socket paths live under it and must stay below ~107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="gfc", dir="/tmp"))
        self.token_path = self.root / "token"
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(24))
        kinds = [plan.node("head")] + [plan.node(f"worker-{r}") for r in wanted]
        self.nodes = [LocalNode(plan=k, ip=f"127.0.0.{_FIRST_HOST + i}", temp_dir=self.root / f"n{i}",
                                log=self.root / f"n{i}.log") for i, k in enumerate(kinds)]
        self.head_address: str | None = None
        self.grpc_ports = grpc_ports
        self.grpc_port_range: tuple[int, int] | None = None
        self._options: dict[str, dict] = {}

    # -- environment ---------------------------------------------------------------------------
    def env(self, node: NodePlan | None = None) -> dict[str, str]:
        """The environment of a node (or, with None, of a driver): the plan's, with this cluster's token."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(node.env if node is not None else self.plan.driver["env"])
        env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        return env

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> str:
        """Start the head, then every worker node at once; the head's HOST:PORT."""
        try:
            self._assign_ports()
            head = self.nodes[0]
            self.head_address = f"{head.ip}:{self._options[head.plan.name]['--port']}"
            self._run([self._launch(head)])
            self._run([self._launch(n) for n in self.nodes[1:]])
        except BaseException:
            self.stop()
            raise
        return self.head_address

    def _launch(self, node: LocalNode) -> tuple[LocalNode, subprocess.Popen]:
        node.temp_dir.mkdir(parents=True)
        argv = ray_start_argv(node.plan, ray=str(Path(sys.executable).parent / "ray"), node_ip=node.ip,
                              head_address=None if node.plan.head else self.head_address,
                              extra=self._options[node.plan.name])
        argv = self._command(node, argv)
        with open(node.log, "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, env=self.env(node.plan), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        node.pgid = proc.pid  # new session: its process group id is its pid
        return node, proc

    def _command(self, node: LocalNode, argv: list[str]) -> list[str]:
        """How a node's `ray start` runs (a subclass runs it in the node's network namespace).

        A venv that shares another's packages (a worktree's) may have no `ray` script: then
        Ray's CLI module, with this interpreter."""
        if not os.access(argv[0], os.X_OK):
            argv = [sys.executable, "-m", "ray.scripts.scripts", *argv[1:]]
        return argv

    def _assign_ports(self) -> None:
        """Every port at once, so that no two nodes (nor geofed's range) get the same one: Ray
        binds some of them on every interface, where distinct loopback addresses do not help."""
        singles = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-grpc-port",
                   "--dashboard-agent-listen-port", "--runtime-env-agent-port", "--metrics-export-port"]
        head_only = ["--port", "--ray-client-server-port", "--dashboard-port"]
        ports = iter(free_ports("0.0.0.0", len(singles) * len(self.nodes) + len(head_only)))
        block = free_port_range("0.0.0.0", _WORKER_PORTS * len(self.nodes) + self.grpc_ports)
        for i, node in enumerate(self.nodes):
            lo = block + i * _WORKER_PORTS
            options = {k: next(ports) for k in singles + (head_only if node.plan.head else [])}
            options.update({"--min-worker-port": lo, "--max-worker-port": lo + _WORKER_PORTS - 1,
                            "--temp-dir": str(node.temp_dir), "--num-cpus": self.num_cpus,
                            "--object-store-memory": self.object_store_mb << 20})
            if node.plan.head:
                options["--include-dashboard"] = "false"
            self._options[node.plan.name] = options
        first = block + _WORKER_PORTS * len(self.nodes)
        self.grpc_port_range = (first, first + self.grpc_ports - 1)

    def _run(self, started: list[tuple[LocalNode, subprocess.Popen]]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for node, proc in started:
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                tail = node.log.read_text(errors="replace")[-2000:]
                why = f"exit {rc}" if rc is not None else f"no answer within {self.start_timeout_s:.0f}s"
                raise LocalClusterError(f"node {node.plan.name} ({node.ip}): `ray start` failed ({why}):\n{tail}")

    def stop(self) -> None:
        """Stop what this cluster started (its process groups, then its stray worker processes),
        SIGTERM then SIGKILL after a grace period, and remove its temp dir."""
        groups = [n.pgid for n in self.nodes if n.pgid is not None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in groups:
                _signal_group(pgid, sig)
            for pid in self._stray_pids():
                _signal_pid(pid, sig)
            deadline = time.monotonic() + _TERM_GRACE_S
            while time.monotonic() < deadline and (self._alive_groups(groups) or self._stray_pids()):
                time.sleep(0.2)
            if not (self._alive_groups(groups) or self._stray_pids()):
                break
        for n in self.nodes:
            n.pgid = None
        shutil.rmtree(self.root, ignore_errors=True)

    def alive_pids(self) -> list[int]:
        """Processes of this cluster still running (empty after stop())."""
        pids = set(self._stray_pids())
        for n in self.nodes:
            if n.pgid is not None:
                pids |= set(_group_members(n.pgid))
        return sorted(pids)

    def _stray_pids(self) -> list[int]:
        marker = str(self.root).encode()
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours to read
        return out

    @staticmethod
    def _alive_groups(groups: list[int]) -> list[int]:
        return [g for g in groups if _group_members(g)]

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after "pid (comm)": state ppid pgrp ...; a zombie is already dead
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def free_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports free on `host` now (held open together so that they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_range(host: str, n: int, *, attempts: int = 200) -> int:
    """First port of `n` consecutive ports free on `host`, below Linux's ephemeral range
    (32768+) so that outgoing connections do not take them meanwhile."""
    rng = random.Random()
    for _ in range(attempts):
        lo = rng.randrange(20000, 32000 - n)
        socks = []
        try:
            for port in range(lo, lo + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return lo
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise LocalClusterError(f"no {n} consecutive free ports on {host} after {attempts} tries")
