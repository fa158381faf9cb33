"""The Ray actor of a region: the plain RegionWorker plus where it runs. Nothing else lives here."""

from __future__ import annotations

import os
from typing import Any

import ray

from .worker import RegionWorker

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


class RegionActor(RegionWorker):
    """The Ray actor of a region: a RegionWorker that advertises its node's address and answers
    heartbeats on a thread of their own.
    """

    def __init__(self, cfg: Any, region: str, run_dir: str, *, tls=None):
        # `tls`: this region's TlsMaterial, sent by the driver with the actor's creation (small,
        # once); the node never needs the driver's RUN_DIR/tls.
        super().__init__(cfg, region, run_dir, tls=tls, advertised_host=advertised_host(cfg))

    @ray.method(concurrency_group=HEALTH_GROUP)
    def heartbeat(self) -> dict[str, Any]:
        """Answers at once, whatever the region's main call is doing (reads two plain values)."""
        return {"pid": os.getpid(), "completed_round": self.completed_round}

    def node_info(self) -> dict[str, Any]:
        """info() plus the Ray node the actor runs on (id, IP, labels), for the placement check."""
        ctx = ray.get_runtime_context()
        node_id = ctx.get_node_id()
        labels: dict[str, str] = {}
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                labels = dict(node.get("Labels") or {})
                break
        return {**self.info(), "node_id": node_id, "node_ip": ray.util.get_node_ip_address(), "labels": labels}


def region_actor_class(*, num_cpus: float, max_restarts: int, label_selector: dict[str, str] | None = None,
                       num_gpus: float = 0.0):
    """A remote class with the region's resources; pinned to nodes whose labels match `label_selector`."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts,
                               "max_task_retries": 0,
                               # the default group keeps max_concurrency 1: region calls stay serial
                               "concurrency_groups": {HEALTH_GROUP: 1}}
    if label_selector:
        options["label_selector"] = label_selector
    return ray.remote(**options)(RegionActor)
