"""Partitioners and per-region subgraphs: coverage, determinism, non-IID-ness, halo accounting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geofed.regions.graph.data import GraphData, load_graph_npz
from geofed.regions.graph.partition import (
    EDGE_ID_BYTES, PARTITIONS, extract_subgraph, partition_nodes, partition_stats, train_flags,
)

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "datasets" / "planetoid"


@pytest.fixture(scope="module")
def cora() -> GraphData:
    path = (DATA / "cora.npz").resolve()
    if not path.is_file():
        pytest.skip(f"dataset missing: {path}")
    return load_graph_npz(path)


def _label_entropy(g: GraphData, assign: np.ndarray, n: int) -> float:
    out = []
    for r in range(n):
        counts = np.bincount(g.y[assign == r], minlength=g.num_classes).astype(float)
        p = counts[counts > 0] / counts.sum()
        out.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(out))


@pytest.mark.parametrize("method", PARTITIONS)
def test_every_node_in_one_region_deterministically(cora, method):
    a = partition_nodes(cora, 4, method, alpha=0.5, seed=3)
    assert a.shape == (cora.num_nodes,) and set(np.unique(a)) == {0, 1, 2, 3}
    assert np.array_equal(a, partition_nodes(cora, 4, method, alpha=0.5, seed=3))


def test_louvain_is_balanced_and_cuts_far_fewer_edges_than_random(cora):
    lv = partition_nodes(cora, 4, "louvain", seed=0)
    rnd = partition_nodes(cora, 4, "random", seed=0)
    cut = {name: int((a[cora.edge_index[0]] != a[cora.edge_index[1]]).sum()) for name, a in [("lv", lv), ("rnd", rnd)]}
    assert cut["lv"] * 4 < cut["rnd"]
    sizes = np.bincount(lv)
    assert sizes.max() - sizes.min() <= 0.1 * sizes.mean()
    # Communities are label-homophilous: louvain regions see fewer classes than random ones.
    assert _label_entropy(cora, lv, 4) < _label_entropy(cora, rnd, 4) - 0.2


def test_label_dirichlet_skew_grows_as_alpha_shrinks(cora):
    ent = {alpha: _label_entropy(cora, partition_nodes(cora, 4, "label-dirichlet", alpha=alpha, seed=1), 4)
           for alpha in (0.1, 100.0)}
    assert ent[0.1] < ent[100.0] - 0.5
    overall = np.bincount(cora.y) / cora.num_nodes
    assert ent[100.0] > 0.97 * float(-(overall * np.log(overall)).sum())  # each region ~ the whole graph


@pytest.mark.parametrize("bad,needle", [
    (dict(n_regions=0, method="random"), "n_regions"),
    (dict(n_regions=3, method="metis"), "partition: unknown partitioner"),
    (dict(n_regions=3, method="label-dirichlet", alpha=0.0), "alpha"),
])
def test_bad_partition_arguments(cora, bad, needle):
    with pytest.raises(ValueError, match=needle):
        partition_nodes(cora, bad.pop("n_regions"), bad.pop("method"), **bad)


def test_subgraph_without_halo_keeps_only_internal_edges(cora):
    a = partition_nodes(cora, 4, "louvain", seed=0)
    sub = extract_subgraph(cora, a, 2, halo=False)
    glob = sub.nodes[sub.edge_index]
    assert (a[glob] == 2).all() and sub.num_owned == len(sub.nodes)
    src, dst = cora.edge_index
    assert sub.cross_edges_dropped == int(((a[src] == 2) & (a[dst] != 2)).sum()) > 0
    assert sub.halo_bytes == 0


def test_halo_is_exactly_the_out_of_region_neighbours(cora):
    a = partition_nodes(cora, 4, "louvain", seed=0)
    sub = extract_subgraph(cora, a, 1, halo=True)
    src, dst = cora.edge_index
    crossing = (a[src] == 1) & (a[dst] != 1)
    expected = np.unique(dst[crossing])
    assert np.array_equal(np.sort(sub.nodes[sub.num_owned:]), expected)
    assert sub.halo_bytes == expected.size * cora.num_features + int(crossing.sum()) * 2 * EDGE_ID_BYTES
    assert sub.cross_edges_dropped == 0
    flags = train_flags(cora, sub)
    assert not flags[sub.num_owned:].any()  # halo labels stay with their owner
    assert flags.sum() == (cora.train_mask & (a == 1)).sum()


def test_stats_add_up(cora):
    a = partition_nodes(cora, 4, "random", seed=0)
    s = partition_stats(cora, a, 4, halo=False)
    assert sum(r["nodes"] for r in s["regions"]) == cora.num_nodes
    assert sum(r["edges"] for r in s["regions"]) + s["cut_edges"] == cora.num_edges
    assert s["cross_edges_dropped"] == s["cut_edges"]
    assert sum(sum(r["train_labels"]) for r in s["regions"]) == 140


@st.composite
def _graphs(draw):
    n = draw(st.integers(2, 30))
    pairs = draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=60))
    und = {(min(u, v), max(u, v)) for u, v in pairs if u != v}
    ei = np.array([[u for u, v in und] + [v for u, v in und], [v for u, v in und] + [u for u, v in und]],
                  dtype=np.int64).reshape(2, -1)
    y = np.array(draw(st.lists(st.integers(-1, 2), min_size=n, max_size=n)), dtype=np.int64)
    y[0] = 0
    mask = y >= 0
    return GraphData(x=np.ones((n, 3), dtype=np.uint8), y=y, edge_index=ei,
                     train_mask=mask, val_mask=np.zeros(n, bool), test_mask=mask)


@settings(max_examples=60, deadline=None)
@given(g=_graphs(), n_regions=st.integers(1, 5), method=st.sampled_from(PARTITIONS),
       halo=st.booleans(), seed=st.integers(0, 3))
def test_partition_invariants_on_random_graphs(g, n_regions, method, halo, seed):
    n_regions = min(n_regions, g.num_nodes)
    a = partition_nodes(g, n_regions, method, alpha=0.3, seed=seed)
    assert set(np.unique(a)) == set(range(n_regions))
    s = partition_stats(g, a, n_regions, halo=halo)
    assert sum(r["nodes"] for r in s["regions"]) == g.num_nodes
    kept_internal = sum(r["edges"] for r in s["regions"]) if not halo else None
    if kept_internal is not None:
        assert kept_internal + s["cut_edges"] == g.num_edges
    else:  # with a halo every cut edge is kept by both of its regions, in both directions
        assert sum(r["edges"] for r in s["regions"]) == g.num_edges + s["cut_edges"]
