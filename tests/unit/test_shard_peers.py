"""What the driver hands a region's worker 0 for its followers (orchestrator/driver/shards.py,
regions/shards.py ShardPeers): worker k of every alive region, by rank; a broken set-up said by
region and rank. And the Layout the shards follow: every element in exactly one shard."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from geofed.orchestrator.driver.shards import shard_peers
from geofed.regions.shards import ShardPeers
from geofed.regions.sync.fragments import Layout


def test_each_region_gets_worker_k_of_every_alive_region():
    addresses = {"a": [None, "10.0.0.2:1", "10.0.0.3:1"], "b": [None, "10.0.1.2:1", "10.0.1.3:1"]}
    peers = shard_peers(["a", "b"], addresses, 3)
    assert set(peers) == {"a", "b"} and peers["a"].region == "a"
    assert peers["a"].for_rank(1) == {"a": "10.0.0.2:1", "b": "10.0.1.2:1"}
    assert peers["b"].for_rank(2) == {"a": "10.0.0.3:1", "b": "10.0.1.3:1"}
    with pytest.raises(ValueError, match="no shard peers for worker 0"):
        peers["a"].for_rank(0)  # rank 0's peers are the regions' own addresses
    with pytest.raises(dataclasses.FrozenInstanceError):
        peers["a"].region = "b"  # type: ignore[misc]
    assert isinstance(peers["a"], ShardPeers)


def test_a_worker_without_an_address_is_named():
    with pytest.raises(RuntimeError, match="region b: worker 1 serves no shard"):
        shard_peers(["a", "b"], {"a": [None, "x:1"], "b": [None, None]}, 2)
    with pytest.raises(RuntimeError, match="region a: 1 shard addresses for 2 workers"):
        shard_peers(["a"], {"a": [None]}, 2)


def test_the_shards_cover_every_element_once_in_halves():
    """The Layout over N parts that worker k's shard is: views of the live tensors, nothing twice."""
    params = [torch.zeros(64, 16), torch.zeros(16), torch.zeros(10, 16), torch.zeros(10)]
    layout = Layout([tuple(p.shape) for p in params], 2)
    for k in range(2):
        for v in layout.views(params, k):
            v.add_(1)
    assert all(bool((p == 1).all()) for p in params)
    sizes = [sum(v.numel() for v in layout.views(params, k)) for k in range(2)]
    assert sum(sizes) == sum(p.numel() for p in params) and abs(sizes[0] - sizes[1]) <= 16
