"""regions.shard_exchange: the driver hands each region's workers their shard's peers (regions/shards.py).

Worker k of a region (k >= 1) serves its shard on a gRPC server of its own; worker 0 gathered its
workers' addresses when their group formed. Each time the regions connect (set-up, and after a region
restarted or was rebuilt: faults.reconnect), the driver asks each alive region's worker 0 for them
(`shard_addresses`), and sends each one a ShardPeers: worker k of every alive region, by rank, which
worker 0 passes to its followers between rounds. Rank 0's peers are the regions' own addresses,
connected as before (handles.RegionHandles.connect).
"""

from __future__ import annotations

from typing import Any

import ray
from geofed.regions.shards import ShardPeers

from ..config import RunConfig


def sharded(cfg: RunConfig) -> bool:
    """Whether the run's regions exchange in shards (regions.shard_exchange with regions.workers > 1)."""
    return cfg.regions.workers > 1 and cfg.regions.shard_exchange


def shard_peers(alive: list[str], addresses: dict[str, list[str | None]], workers: int) -> dict[str, ShardPeers]:
    """Each region's ShardPeers: worker k of every alive region, k = 1..workers-1. A worker without an
    address (its group gathered none) is a broken set-up, said by region and rank."""
    meshes: dict[int, dict[str, str]] = {k: {} for k in range(1, workers)}
    for region in alive:
        got = addresses[region]
        if len(got) != workers:
            raise RuntimeError(f"region {region}: {len(got)} shard addresses for {workers} workers")
        for k in range(1, workers):
            address = got[k]
            if not address:
                raise RuntimeError(f"region {region}: worker {k} serves no shard (no gRPC address)")
            meshes[k][region] = address
    return {region: ShardPeers(region=region, addresses={k: dict(m) for k, m in meshes.items()}) for region in alive}


def connect_shards(cfg: RunConfig, handles: dict[str, Any], alive: list[str], *, timeout_s: float = 60.0) -> None:
    """Every alive region's followers dial worker k of every other alive region (module docstring)."""
    if not sharded(cfg) or not alive:
        return
    got = ray.get([handles[r].shard_addresses.remote() for r in alive], timeout=timeout_s)
    peers = shard_peers(alive, dict(zip(alive, got)), cfg.regions.workers)
    ray.get([handles[r].connect_shards.remote(peers[r]) for r in alive], timeout=timeout_s)
