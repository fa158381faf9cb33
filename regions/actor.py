"""The Ray actor of a region: the plain RegionWorker plus where it runs. Nothing else lives here."""

from __future__ import annotations

from typing import Any

import ray

from .worker import RegionWorker


class RegionActor(RegionWorker):
    def node_info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        node_id = ctx.get_node_id()
        labels: dict[str, str] = {}
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                labels = dict(node.get("Labels") or {})
                break
        return {**self.info(), "node_id": node_id, "node_ip": ray.util.get_node_ip_address(), "labels": labels}


def region_actor_class(*, num_cpus: float, max_restarts: int, label_selector: dict[str, str] | None = None):
    """A remote class with the region's resources; pinned to nodes whose labels match `label_selector`."""
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_restarts": max_restarts, "max_task_retries": 0}
    if label_selector:
        options["label_selector"] = label_selector
    return ray.remote(**options)(RegionActor)
