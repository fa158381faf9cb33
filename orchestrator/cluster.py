"""Ray: start or join a cluster, place one region actor per region, fail fast when a region has no node."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from geofed.regions.actor import region_actor_class

from .config import RunConfig

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """A region actor cannot be placed (no node carries its label) or never came up."""


@dataclass
class RayHandle:
    started_here: bool
    address: str | None

    def shutdown(self) -> None:
        if self.started_here and ray.is_initialized():
            ray.shutdown()


def init_ray(cfg: RunConfig) -> RayHandle:
    """Reuse an already initialised Ray (tests share one), else start a local one or join `ray.address`."""
    if ray.is_initialized():
        return RayHandle(started_here=False, address=None)
    address = cfg.ray.address
    # Region workers must not each grab every core: torch threads are set per worker.
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.regions.torch_threads))
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                              "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cfg.regions.torch_threads)}}}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, **kwargs)
    return RayHandle(started_here=True, address=address)


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
    handles: dict[str, Any]
    info: dict[str, dict] = field(default_factory=dict)

    def kill(self) -> None:
        for h in self.handles.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass


def create_region_actors(cfg: RunConfig, run_dir: str, *, pin: bool) -> RegionActors:
    """One actor per region; with `pin`, each only on nodes labelled with its region."""
    rc = cfg.regions
    if pin:
        _check_labels(cfg)
    handles = {}
    for region in rc.names:
        selector = {rc.label_key: rc.label_of(region)} if pin else None
        cls = region_actor_class(num_cpus=rc.num_cpus, max_restarts=rc.max_restarts, label_selector=selector)
        handles[region] = cls.options(name=None).remote(cfg, region, run_dir)
    actors = RegionActors(handles)
    try:
        actors.info = wait_ready(actors.handles, rc.placement_timeout_s, cfg)
    except BaseException:
        actors.kill()
        raise
    return actors


def wait_ready(handles: dict[str, Any], timeout_s: float, cfg: RunConfig) -> dict[str, dict]:
    refs = {h.node_info.remote(): r for r, h in handles.items()}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        missing = sorted(refs[p] for p in pending)
        seen = node_labels(cfg.regions.label_key)
        raise PlacementError(
            f"region actors not placed within {timeout_s:.0f}s (regions.placement_timeout_s): {', '.join(missing)}; "
            f"nodes by {cfg.regions.label_key}: {_fmt_seen(seen)}")
    return {refs[ref]: ray.get(ref) for ref in ready}


def _check_labels(cfg: RunConfig) -> None:
    rc = cfg.regions
    seen = node_labels(rc.label_key)
    missing = [r for r in rc.names if rc.label_of(r) not in seen]
    if missing:
        raise PlacementError(
            f"no Ray node carries {rc.label_key}=<region> for: {', '.join(missing)}; "
            f"labels seen: {_fmt_seen(seen)} (start nodes with `ray start --labels {rc.label_key}=<region>`, "
            f"see `geofed launch plan`)")


def _fmt_seen(seen: dict[str, list[str]]) -> str:
    if not seen:
        return "none"
    return ", ".join(f"{k} ({', '.join(v)})" for k, v in sorted(seen.items()))


def wait_alive(handle: Any, timeout_s: float) -> dict | None:
    """node_info of a (possibly restarting) actor, or None if it does not answer in time."""
    try:
        return ray.get(handle.node_info.remote(), timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        return None


def elapsed(t0: float) -> float:
    return time.monotonic() - t0
