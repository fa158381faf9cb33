"""A user's own graph to the graph .npz the gcn-planetoid task reads (``geofed data convert-graph``).

Inputs: an edge list (CSV, one ``source,target`` pair of node ids per line), node features (CSV,
one row per node, or a 2-D ``.npy``) and labels (CSV/text, one class id per line, -1 for none, or a
1-D ``.npy``). Node ids are row numbers of the features, 0-based. A header line and ``#``
comments are allowed in the CSV files. The split is drawn with a seed, Planetoid-style:
``train_per_class`` labelled nodes of each class, then ``val`` and ``test`` nodes from the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .planetoid import edge_index_from_pairs

MAX_INPUT_BYTES = 4 << 30


@dataclass(frozen=True, kw_only=True)
class SplitSizes:
    """How many labelled nodes go to each split."""

    train_per_class: int = 20
    val: int = 500
    test: int = 1000
    seed: int = 0


def _read_table(path: Path, dtype, what: str) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: no file at {str(path)!r}")
    if path.stat().st_size > MAX_INPUT_BYTES:
        raise ValueError(f"{what}: {path} is larger than {MAX_INPUT_BYTES} bytes")
    if path.suffix == ".npy":
        try:
            return np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"{what}: {path}: not a plain numeric .npy: {exc}") from None
    with open(path, encoding="utf-8") as f:
        first = next((ln for ln in f if ln.strip() and not ln.lstrip().startswith("#")), "")
    skip = 0 if _numeric_row(first) else 1  # a header line
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f if ln.strip() and not ln.lstrip().startswith("#")][skip:]
        return np.loadtxt(lines, delimiter=",", dtype=dtype, ndmin=2)
    except ValueError as exc:
        raise ValueError(f"{what}: {path}: {exc}") from None


def _numeric_row(line: str) -> bool:
    try:
        [float(v) for v in line.strip().split(",")]
        return True
    except ValueError:
        return False


def read_user_graph(edges: Path, features: Path, labels: Path, split: SplitSizes = SplitSizes()) -> dict[str, np.ndarray]:
    """The graph arrays (x, y, edge_index, train/val/test masks) from a user's files."""
    x = _read_table(features, np.float64, "features")
    if x.ndim != 2:
        raise ValueError(f"features: expected one row per node (2-D), got shape {x.shape}")
    n = x.shape[0]
    y = _read_table(labels, np.int64, "labels").reshape(-1)
    if not np.issubdtype(y.dtype, np.integer) or y.shape != (n,):
        raise ValueError(f"labels: expected {n} integer class ids (one per feature row), got {y.dtype} {y.shape}")
    if y.min() < -1 or y.max() < 0:
        raise ValueError("labels: class ids must be >= 0, or -1 for an unlabelled node")
    pairs = _read_table(edges, np.int64, "edges")
    if pairs.size and pairs.shape[1] != 2:
        raise ValueError(f"edges: expected two columns (source,target), got {pairs.shape[1]}")
    try:
        edge_index = edge_index_from_pairs(pairs.reshape(-1, 2), n)
    except ValueError as exc:
        raise ValueError(f"edges: {exc} (node ids are 0-based rows of the features)") from None
    binary = np.isin(x, (0, 1)).all()
    return {"x": x.astype(np.uint8 if binary else np.float32), "y": y.astype(np.int64), "edge_index": edge_index,
            **split_masks(y, split)}


def split_masks(y: np.ndarray, split: SplitSizes) -> dict[str, np.ndarray]:
    """Seeded Planetoid-style masks over the labelled nodes (y >= 0); disjoint, test non-empty."""
    rng = np.random.default_rng(split.seed)
    n = len(y)
    train = np.zeros(n, dtype=bool)
    for c in np.unique(y[y >= 0]):
        members = np.flatnonzero(y == c)
        train[rng.permutation(members)[:split.train_per_class]] = True
    rest = rng.permutation(np.flatnonzero((y >= 0) & ~train))
    val, test = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    val[rest[:split.val]] = True
    test[rest[split.val:split.val + split.test]] = True
    if not train.any() or not test.any():
        raise ValueError(f"labels: {int((y >= 0).sum())} labelled nodes leave no train or test node for the split "
                         f"({split.train_per_class} per class, val {split.val}, test {split.test})")
    return {"train_mask": train, "val_mask": val, "test_mask": test}
