"""Graph loader and the sparse tensors a GNN consumes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from geofed.regions.graph.data import (
    feature_tensor, full_view, gcn_adjacency, load_graph_npz, mean_adjacency,
)

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "datasets" / "planetoid"


def _dataset(name: str) -> Path:
    path = (DATA / f"{name}.npz").resolve()
    if not path.is_file():
        pytest.skip(f"dataset missing: {path}")
    return path


def _tiny(tmp_path: Path, **override) -> Path:
    # A 4-node path graph 0-1-2-3 in the documented format.
    arrays = dict(
        x=np.eye(4, 3, dtype=np.uint8) + 1,
        y=np.array([0, 1, 1, -1], dtype=np.int64),
        edge_index=np.array([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]], dtype=np.int64),
        train_mask=np.array([1, 1, 0, 0], dtype=bool),
        val_mask=np.zeros(4, dtype=bool),
        test_mask=np.array([0, 0, 1, 0], dtype=bool),
    )
    arrays.update(override)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    path = tmp_path / "g.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("name,nodes,features,classes,edges,train", [
    ("cora", 2708, 1433, 7, 10556, 140),
    ("citeseer", 3327, 3703, 6, 9104, 120),
])
def test_planetoid_files_load(name, nodes, features, classes, edges, train):
    g = load_graph_npz(_dataset(name))
    assert (g.num_nodes, g.num_features, g.num_classes, g.num_edges) == (nodes, features, classes, edges)
    assert int(g.train_mask.sum()) == train and int(g.test_mask.sum()) == 1000
    assert not (g.train_mask & g.test_mask).any()


def test_tiny_file_roundtrip(tmp_path):
    g = load_graph_npz(_tiny(tmp_path))
    assert g.num_nodes == 4 and g.num_classes == 2 and g.num_edges == 6


@pytest.mark.parametrize("override,needle", [
    ({"train_mask": None}, "missing arrays"),
    ({"edge_index": np.array([[0, 9], [9, 0]])}, "edge_index: node ids"),
    ({"test_mask": np.ones(4, dtype=np.uint8)}, "test_mask: expected bool"),
    ({"y": np.array([0, 1, 1])}, "y: expected integer shape (4,)"),
    ({"test_mask": np.array([0, 0, 0, 1], dtype=bool)}, "test_mask: selects unlabelled"),
    ({"x": np.array(["a", "b", "c", "d"])}, "x: expected a 2-D numeric"),
])
def test_loader_names_the_bad_array(tmp_path, override, needle):
    with pytest.raises(ValueError) as exc:
        load_graph_npz(_tiny(tmp_path, **override))
    assert needle in str(exc.value) and "g.npz" in str(exc.value)


def test_loader_refuses_pickled_objects(tmp_path):
    path = _tiny(tmp_path, x=np.array([{"a": 1}] * 4, dtype=object))
    with pytest.raises(ValueError, match="not a plain-array"):
        load_graph_npz(path)


def test_loader_refuses_non_npz_and_truncated_files(tmp_path):
    text = tmp_path / "notes.npz"
    text.write_text("hello")
    with pytest.raises(ValueError, match="notes.npz: not a plain-array"):
        load_graph_npz(text)
    good = _tiny(tmp_path).read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="cut.npz: cannot read graph file"):
        load_graph_npz(cut)
    with pytest.raises(ValueError, match="cannot read graph file"):
        load_graph_npz(tmp_path / "absent.npz")


def test_features_are_row_normalised_and_sparse():
    x = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [0, 3, 1, 0]], dtype=np.uint8)
    t = feature_tensor(x)
    assert t.is_sparse and t._nnz() == 4
    dense = t.to_dense()
    assert torch.allclose(dense.sum(1), torch.tensor([1.0, 0.0, 1.0]))
    assert torch.allclose(dense[2], torch.tensor([0.0, 0.75, 0.25, 0.0]))


def test_gcn_adjacency_matches_dense_formula():
    ei = np.array([[0, 1, 1, 2], [1, 0, 2, 1]])
    a = np.zeros((3, 3))
    a[ei[1], ei[0]] = 1
    a += np.eye(3)
    d = np.diag(1 / np.sqrt(a.sum(1)))
    assert np.allclose(gcn_adjacency(ei, 3).to_dense().numpy(), d @ a @ d)


def test_mean_adjacency_rows_average_neighbours():
    ei = np.array([[0, 1, 1, 2], [1, 0, 2, 1]])
    m = mean_adjacency(ei, 4).to_dense()
    assert torch.allclose(m.sum(1), torch.tensor([1.0, 1.0, 1.0, 0.0]))  # node 3 is isolated
    assert torch.allclose(m[1], torch.tensor([0.5, 0.0, 0.5, 0.0]))


def test_full_view_of_cora_is_symmetric():
    g = load_graph_npz(_dataset("cora"))
    v = full_view(g, adjacency="gcn")
    dense = v.adj.to_dense()
    assert torch.allclose(dense, dense.T)
    assert v.train_mask.sum() == 140 and v.x.shape == (2708, 1433)
