"""Split a graph's nodes into regions, and cut out each region's subgraph.

Three partitioners, all deterministic given the seed (every region worker recomputes the
same partition on its own, so nothing about the split has to travel):

- ``louvain``: Louvain communities (networkx), packed largest-first into the region with the
  fewest nodes. Regions get whole communities: few cut edges, skewed labels (non-IID by
  structure), as in FedSage+ and most DFGL papers.
- ``label-dirichlet``: for each class, region shares drawn from Dirichlet(alpha); small alpha
  means each region sees few classes (non-IID by label).
- ``random``: a random balanced split (IID baseline; cuts most edges).

A region owns its nodes, their features and labels, and the edges between them. Edges to
other regions are dropped unless ``halo`` is on, in which case the region also receives the
features (never the labels) of its 1-hop out-of-region neighbours once, before training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .data import GraphData

PARTITIONS = ("louvain", "label-dirichlet", "random")
EDGE_ID_BYTES = 8  # halo edges travel as int64 (src, dst) pairs


def partition_nodes(data: GraphData, n_regions: int, method: str, *, alpha: float = 0.5,
                    seed: int = 0) -> np.ndarray:
    """Region id (0..n_regions-1) of every node. Every region gets at least one node."""
    if not 1 <= n_regions <= data.num_nodes:
        raise ValueError(f"n_regions: must be in [1, {data.num_nodes}] for this graph, got {n_regions}")
    if method == "louvain":
        assign = _louvain(data, n_regions, seed)
    elif method == "label-dirichlet":
        if alpha <= 0:
            raise ValueError(f"alpha: must be > 0, got {alpha}")
        assign = _label_dirichlet(data, n_regions, alpha, seed)
    elif method == "random":
        assign = _random(data.num_nodes, n_regions, np.random.default_rng(seed))
    else:
        raise ValueError(f"partition: unknown partitioner {method!r} (known: {', '.join(PARTITIONS)})")
    _fill_empty(assign, n_regions, np.random.default_rng(seed + 1))
    return assign


def _random(n: int, n_regions: int, rng: np.random.Generator) -> np.ndarray:
    assign = np.empty(n, dtype=np.int64)
    assign[rng.permutation(n)] = np.arange(n) % n_regions
    return assign


def _louvain(data: GraphData, n_regions: int, seed: int) -> np.ndarray:
    # Imported here: every run imports the graph tasks (the task registry) and networkx costs
    # ~0.2 s of CPU in the driver and in each region actor before round 0, louvain or not.
    import networkx as nx

    g = nx.Graph()
    g.add_nodes_from(range(data.num_nodes))
    g.add_edges_from(zip(data.edge_index[0].tolist(), data.edge_index[1].tolist()))
    communities = nx.community.louvain_communities(g, seed=seed)
    # Largest community first into the emptiest region: balanced sizes, whole communities.
    # Ties broken by smallest node id so the order never depends on set iteration.
    communities = sorted((sorted(c) for c in communities), key=lambda c: (-len(c), c[0]))
    sizes = np.zeros(n_regions, dtype=np.int64)
    assign = np.empty(data.num_nodes, dtype=np.int64)
    for members in communities:
        r = int(np.argmin(sizes))
        assign[members] = r
        sizes[r] += len(members)
    return assign


def _label_dirichlet(data: GraphData, n_regions: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    assign = np.empty(data.num_nodes, dtype=np.int64)
    for c in range(-1, data.num_classes):
        members = np.flatnonzero(data.y == c)
        if members.size == 0:
            continue
        if c == -1:  # unlabelled nodes carry no label skew to impose
            assign[members] = rng.integers(0, n_regions, members.size)
            continue
        members = rng.permutation(members)
        shares = rng.dirichlet(np.full(n_regions, alpha))
        cuts = (np.cumsum(shares)[:-1] * members.size).round().astype(np.int64)
        for r, part in enumerate(np.split(members, cuts)):
            assign[part] = r
    return assign


def _fill_empty(assign: np.ndarray, n_regions: int, rng: np.random.Generator) -> None:
    """Give an empty region one node from the largest region (tiny graphs, extreme alpha)."""
    for r in range(n_regions):
        if not (assign == r).any():
            counts = np.bincount(assign, minlength=n_regions)
            donor = np.flatnonzero(assign == int(np.argmax(counts)))
            assign[rng.choice(donor)] = r


@dataclass(frozen=True, kw_only=True, eq=False)
class Subgraph:
    """One region's share: owned nodes first, then halo nodes; edges in local ids."""

    region: int
    nodes: np.ndarray  # global ids: owned nodes, then halo nodes
    num_owned: int
    edge_index: np.ndarray  # 2 x E local ids
    cross_edges_dropped: int  # directed edges from an owned node to another region's node, not kept
    halo_bytes: int  # one-time bytes to fetch the halo (features + cross edges); 0 without halo

    @property
    def owned(self) -> np.ndarray:
        return self.nodes[: self.num_owned]


def extract_subgraph(data: GraphData, assign: np.ndarray, region: int, *, halo: bool) -> Subgraph:
    """Region `region`'s subgraph under `assign`: its nodes and the edges among them, plus with `halo`
    the 1-hop neighbours owned elsewhere and the edges to them (their bytes counted); without it the
    cross edges are dropped and counted.
    """
    owned = np.flatnonzero(assign == region)
    src, dst = data.edge_index
    inside = (assign[src] == region) & (assign[dst] == region)
    touching = (assign[src] == region) ^ (assign[dst] == region)
    cross_out = int(((assign[src] == region) & (assign[dst] != region)).sum())
    if halo:
        # Undirected edges with one end owned, kept in both directions (they are stored so).
        halo_nodes = np.setdiff1d(np.unique(np.concatenate([src[touching], dst[touching]])), owned)
        nodes = np.concatenate([owned, halo_nodes])
        keep = inside | touching
        halo_bytes = int(halo_nodes.size * data.num_features * data.x.dtype.itemsize
                         + cross_out * 2 * EDGE_ID_BYTES)
        dropped = 0
    else:
        nodes, keep, halo_bytes, dropped = owned, inside, 0, cross_out
    local = np.full(data.num_nodes, -1, dtype=np.int64)
    local[nodes] = np.arange(nodes.size)
    edge_index = np.stack([local[src[keep]], local[dst[keep]]])
    assert (edge_index >= 0).all()
    return Subgraph(region=region, nodes=nodes, num_owned=int(owned.size), edge_index=edge_index,
                    cross_edges_dropped=dropped, halo_bytes=halo_bytes)


def train_flags(data: GraphData, sub: Subgraph) -> np.ndarray:
    """Bool over `sub.nodes`: owned nodes in the train split (halo labels stay with their owner)."""
    flags = data.train_mask[sub.nodes].copy()
    flags[sub.num_owned:] = False
    return flags


def partition_stats(data: GraphData, assign: np.ndarray, n_regions: int, *, halo: bool) -> dict[str, Any]:
    """Per-region nodes, edges, labels; totals of cut edges and halo bytes (for Task.describe)."""
    regions = []
    for r in range(n_regions):
        sub = extract_subgraph(data, assign, r, halo=halo)
        owned = sub.owned
        train = owned[data.train_mask[owned]]
        regions.append({
            "region": r,
            "nodes": int(sub.num_owned),
            "halo_nodes": int(len(sub.nodes) - sub.num_owned),
            "edges": int(sub.edge_index.shape[1]),
            "train_nodes": int(train.size),
            "train_labels": np.bincount(data.y[train], minlength=data.num_classes).tolist(),
            "labels": np.bincount(data.y[owned][data.y[owned] >= 0], minlength=data.num_classes).tolist(),
            "cross_edges_dropped": sub.cross_edges_dropped,
            "halo_bytes": sub.halo_bytes,
        })
    src, dst = data.edge_index
    return {
        "nodes": data.num_nodes,
        "edges": data.num_edges,
        "cut_edges": int((assign[src] != assign[dst]).sum()),
        "cross_edges_dropped": sum(r["cross_edges_dropped"] for r in regions),
        "halo_bytes": sum(r["halo_bytes"] for r in regions),
        "regions": regions,
    }
