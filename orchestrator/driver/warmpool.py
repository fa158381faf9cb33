"""The driver side of the warm pool (ray.warm_pool_s; docs/launch.md "Faster start"; the actor side
is regions/warm.py): region actors that outlive their run on a Ray cluster, taken by the next run.

A pooled actor is a detached actor named `<slot>|<id>` in its own namespace; the slot says what
it can serve (the region label it is pinned to, its CPUs and GPUs, max_restarts, the geofed code
it runs). A run claims idle actors of its slots (a claim is atomic on the actor: two drivers never
share one), hands each its config with `adopt`, and creates the rest, named, for the next run.
Idle actors it cannot use are ended, so their CPUs never keep this run's actors waiting; an idle
actor nobody takes ends itself after ray.warm_pool_s.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import ray
from geofed.regions import warm
from geofed.regions.warm import POOL_NAMESPACE

from ..config import RunConfig

log = logging.getLogger(__name__)

# How long a claim may take: an idle actor answers on its pool thread at once.
_CLAIM_TIMEOUT_S = 10.0


def code_fingerprint() -> str:
    """The geofed code a pooled actor runs (version and the regions' sources): an actor started
    before an upgrade or an edit is never handed a run."""
    try:
        version = metadata.version("geofed")
    except metadata.PackageNotFoundError:
        version = "?"
    src = Path(warm.__file__).parent
    stamp = ";".join(f"{p.name}:{p.stat().st_mtime_ns}" for p in sorted(src.rglob("*.py")))
    return hashlib.sha256(f"{version};{stamp}".encode()).hexdigest()[:10]


def slot_of(cfg: RunConfig, region: str, cpus: float, *, pin: bool, code: str) -> str:
    """What a pooled actor can serve: its label (pinned) or any node, its resources, its code."""
    rc = cfg.regions
    where = rc.label_of(region) if pin else "*"
    return f"{where}|cpu{cpus:g}|gpu{rc.num_gpus:g}|r{rc.max_restarts}|{code}"


def new_name(slot: str) -> str:
    """A new pooled actor's name: its slot and a random id."""
    return f"{slot}|{uuid.uuid4().hex[:8]}"


def claim_pooled(cfg: RunConfig, cpus: float, *, pin: bool) -> tuple[dict[str, Any], str]:
    """region -> (name, handle) of an idle pooled actor this run now holds (empty with ray.warm_pool_s 0),
    and the code fingerprint. Idle pooled actors this run does not take are ended."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == POOL_NAMESPACE]
    code = code_fingerprint() if cfg.ray.warm_pool_s > 0 else ""
    if not names:
        return {}, code
    job = ray.get_runtime_context().get_job_id()
    handles = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=POOL_NAMESPACE)
        except ValueError:  # ended since it was listed
            continue
    refs = {h.claim.remote(job): name for name, h in handles.items()}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_CLAIM_TIMEOUT_S)
    claimed = []
    for ref in ready:
        try:
            if ray.get(ref):
                claimed.append(refs[ref])
        except ray.exceptions.RayError:
            continue  # dead or restarting: not taken
    taken: dict[str, Any] = {}
    if cfg.ray.warm_pool_s > 0:
        for region in cfg.regions.names:
            slot = slot_of(cfg, region, cpus, pin=pin, code=code)
            match = next((n for n in claimed if n.rsplit("|", 1)[0] == slot), None)
            if match is not None:
                claimed.remove(match)
                taken[region] = (match, handles[match])
    for name in claimed:  # held by this run but of no use to it: its CPUs go to this run's actors
        end_pooled(name, handles[name])
    if taken or claimed:
        log.info("warm pool: %d actor(s) reused, %d idle one(s) ended", len(taken), len(claimed))
    return taken, code


def end_pooled(name: str, handle: Any) -> None:
    """End a pooled actor for good and forget its assignment."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone is fine
        pass
    try:
        warm.drop_assignment(name)
    except Exception as exc:  # noqa: BLE001 - a stale entry is read only by an actor of that name
        log.debug("warm pool: dropping %s: %s", name, exc)
