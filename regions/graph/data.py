"""Graph data: the ``.npz`` node-classification format and the sparse tensors a GNN needs.

The format (documented in docs/graph.md and ../shared/datasets/README.md) is one ``.npz``
holding ``x`` (N x F features), ``y`` (N class ids, -1 = unlabelled), ``edge_index`` (2 x E
directed edges, both directions present) and the boolean split masks. It is read with
``allow_pickle=False`` so a file can never run code.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REQUIRED_KEYS = ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask")
MAX_NODES = 50_000_000


@dataclass(frozen=True, kw_only=True, eq=False)
class GraphData:
    """A whole node-classification graph, as numpy arrays (the loader's output)."""

    x: np.ndarray  # N x F, any real dtype (0/1 bag of words in Planetoid)
    y: np.ndarray  # N int64, -1 for unlabelled nodes
    edge_index: np.ndarray  # 2 x E int64, directed, both directions of each undirected edge
    train_mask: np.ndarray
    val_mask: np.ndarray
    test_mask: np.ndarray
    source: str = "<memory>"

    @property
    def num_nodes(self) -> int:
        return int(self.x.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.x.shape[1])

    @property
    def num_classes(self) -> int:
        return int(self.y.max()) + 1

    @property
    def num_edges(self) -> int:
        """Directed edges (each undirected edge counts twice)."""
        return int(self.edge_index.shape[1])


def load_graph_npz(path: str | Path) -> GraphData:
    """Read and validate a graph ``.npz``; ValueError names the file and the offending key."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in REQUIRED_KEYS if k not in f.files]
            if missing:
                raise ValueError(f"{path}: missing arrays {missing} (need {list(REQUIRED_KEYS)})")
            arrays = {k: f[k] for k in REQUIRED_KEYS}
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: cannot read graph file: {exc}") from None
    except ValueError as exc:
        if str(exc).startswith(str(path)):
            raise
        # np.load refuses object arrays when allow_pickle=False; say so plainly.
        raise ValueError(f"{path}: not a plain-array .npz graph file: {exc}") from None
    _validate(arrays, str(path))
    return GraphData(
        x=arrays["x"], y=arrays["y"].astype(np.int64), edge_index=arrays["edge_index"].astype(np.int64),
        train_mask=arrays["train_mask"], val_mask=arrays["val_mask"], test_mask=arrays["test_mask"],
        source=str(path),
    )


def _validate(a: dict[str, np.ndarray], src: str) -> None:
    x, y, ei = a["x"], a["y"], a["edge_index"]
    if x.ndim != 2 or not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise ValueError(f"{src}: x: expected a 2-D numeric array, got {x.dtype} {x.shape}")
    n = x.shape[0]
    if not 1 <= n <= MAX_NODES:
        raise ValueError(f"{src}: x: node count {n} out of range [1, {MAX_NODES}]")
    if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{src}: y: expected integer shape ({n},), got {y.dtype} {y.shape}")
    if y.min() < -1 or y.max() < 0:
        raise ValueError(f"{src}: y: class ids must be >= 0 (or -1 for unlabelled), with at least one label")
    if ei.ndim != 2 or ei.shape[0] != 2 or not np.issubdtype(ei.dtype, np.integer):
        raise ValueError(f"{src}: edge_index: expected integer shape (2, E), got {ei.dtype} {ei.shape}")
    if ei.size and (ei.min() < 0 or ei.max() >= n):
        raise ValueError(f"{src}: edge_index: node ids must be in [0, {n}), got [{ei.min()}, {ei.max()}]")
    for key in ("train_mask", "val_mask", "test_mask"):
        m = a[key]
        if m.shape != (n,) or m.dtype != np.bool_:
            raise ValueError(f"{src}: {key}: expected bool shape ({n},), got {m.dtype} {m.shape}")
        if (y[m] < 0).any():
            raise ValueError(f"{src}: {key}: selects unlabelled nodes (y == -1)")
    if not a["train_mask"].any() or not a["test_mask"].any():
        raise ValueError(f"{src}: train_mask and test_mask must each select at least one node")


def feature_tensor(x: np.ndarray) -> torch.Tensor:
    """Row-normalised features as a sparse COO float32 tensor (bag-of-words rows are ~1% dense).

    Row normalisation is per node, so a region can do it alone and get the same rows as the
    centralized run (Kipf & Welling's preprocessing).
    """
    xf = x.astype(np.float32, copy=False)
    rows, cols = np.nonzero(xf)
    vals = xf[rows, cols]
    sums = np.zeros(x.shape[0], dtype=np.float32)
    np.add.at(sums, rows, vals)
    vals = vals / np.where(sums[rows] == 0, 1.0, sums[rows])
    idx = torch.from_numpy(np.stack([rows, cols]).astype(np.int64))
    return torch.sparse_coo_tensor(idx, torch.from_numpy(vals), size=x.shape, check_invariants=False).coalesce()


def gcn_adjacency(edge_index: np.ndarray, n: int) -> torch.Tensor:
    """D^-1/2 (A + I) D^-1/2 as sparse COO (Kipf & Welling's propagation matrix)."""
    loops = np.arange(n, dtype=np.int64)
    src = np.concatenate([edge_index[0], loops])
    dst = np.concatenate([edge_index[1], loops])
    deg = np.bincount(dst, minlength=n).astype(np.float32)
    inv_sqrt = 1.0 / np.sqrt(deg)
    vals = inv_sqrt[dst] * inv_sqrt[src]
    idx = torch.from_numpy(np.stack([dst, src]))
    return torch.sparse_coo_tensor(idx, torch.from_numpy(vals.astype(np.float32)), size=(n, n), check_invariants=False).coalesce()


def mean_adjacency(edge_index: np.ndarray, n: int) -> torch.Tensor:
    """Row i averages node i's in-neighbours (GraphSAGE mean aggregator); isolated rows are 0."""
    dst, src = edge_index[1], edge_index[0]
    deg = np.bincount(dst, minlength=n).astype(np.float32)
    vals = 1.0 / deg[dst] if dst.size else np.zeros(0, dtype=np.float32)
    idx = torch.from_numpy(np.stack([dst, src]).astype(np.int64))
    return torch.sparse_coo_tensor(idx, torch.from_numpy(vals.astype(np.float32)), size=(n, n), check_invariants=False).coalesce()


@dataclass(frozen=True, kw_only=True, eq=False)
class GraphView:
    """What one forward pass needs: features, propagation matrix, labels and a loss mask.

    This is the training batch of a full-batch GNN: a region's subgraph (with its halo, if
    any) or the whole graph for evaluation.
    """

    x: torch.Tensor  # sparse n x F
    adj: torch.Tensor  # sparse n x n, model-specific normalisation
    y: torch.Tensor  # n, int64 (-1 unlabelled)
    train_mask: torch.Tensor  # n bool: nodes whose labels this view trains on
    test_mask: torch.Tensor  # n bool
    val_mask: torch.Tensor  # n bool
    loss_scale: float = 1.0  # multiplies the mean cross-entropy (region weighting, see gnn_loss)

    @property
    def num_nodes(self) -> int:
        return int(self.y.shape[0])


def adjacency_for(kind: str, edge_index: np.ndarray, n: int) -> torch.Tensor:
    if kind == "gcn":
        return gcn_adjacency(edge_index, n)
    if kind == "mean":
        return mean_adjacency(edge_index, n)
    raise ValueError(f"adjacency: unknown kind {kind!r} (known: gcn, mean)")


def build_view(data: GraphData, nodes: np.ndarray, edge_index: np.ndarray, *, adjacency: str,
               train_nodes: np.ndarray | None = None) -> GraphView:
    """A view on `nodes` (global ids, in local order) with `edge_index` in local ids.

    Only nodes flagged in `train_nodes` (a bool over `nodes`; default: the global train mask)
    contribute to the loss, so halo nodes can carry features without carrying labels.
    """
    n = len(nodes)
    train = data.train_mask[nodes] if train_nodes is None else train_nodes
    return GraphView(
        x=feature_tensor(data.x[nodes]),
        adj=adjacency_for(adjacency, edge_index, n),
        y=torch.from_numpy(data.y[nodes].copy()),
        train_mask=torch.from_numpy(np.ascontiguousarray(train)),
        test_mask=torch.from_numpy(data.test_mask[nodes].copy()),
        val_mask=torch.from_numpy(data.val_mask[nodes].copy()),
    )


def full_view(data: GraphData, *, adjacency: str) -> GraphView:
    nodes = np.arange(data.num_nodes)
    return build_view(data, nodes, data.edge_index, adjacency=adjacency)
