"""A user's own graph to the graph .npz the gcn-planetoid task reads (``geofed data convert-graph``).

Inputs: an edge list (CSV, one ``source,target`` pair of node ids per line), node features (CSV,
one row per node, or a 2-D ``.npy``) and labels (CSV/text, one class id per line, -1 for none, or a
1-D ``.npy``). Node ids are row numbers of the features, 0-based. A header line and ``#``
comments are allowed in the CSV files. The split is drawn with a seed, Planetoid-style:
``train_per_class`` labelled nodes of each class, then ``val`` and ``test`` nodes from the rest.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

from geofed.regions.inputfiles import InputFileError, open_regular

from .planetoid import edge_index_from_pairs

MAX_INPUT_BYTES = 4 << 30
# A table (CSV or .npy) of more than 2^28 values is over 2 GiB parsed as float64/int64, and makes
# a graph over the 1 GiB the task and this command's own load-back accept.
MAX_TABLE_VALUES = 1 << 28


@dataclass(frozen=True, kw_only=True)
class SplitSizes:
    """How many labelled nodes go to each split."""

    train_per_class: int = 20
    val: int = 500
    test: int = 1000
    seed: int = 0


def _read_table(path: Path, dtype, what: str, *, max_columns: int | None = None) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: no file at {str(path)!r}")
    if path.stat().st_size > MAX_INPUT_BYTES:
        raise ValueError(f"{what}: {path} is larger than {MAX_INPUT_BYTES} bytes")
    if path.suffix == ".npy":
        return _read_npy(path, what, max_columns)
    with open(path, encoding="utf-8") as f:
        first = next((ln for ln in f if ln.strip() and not ln.lstrip().startswith("#")), "")
    skip = 0 if _numeric_row(first) else 1  # a header line
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f if ln.strip() and not ln.lstrip().startswith("#")][skip:]
        columns = lines[0].count(",") + 1 if lines else 0
        _check_shape(path, what, (len(lines), columns), max_columns, MAX_TABLE_VALUES)
        return np.loadtxt(lines, delimiter=",", dtype=dtype, ndmin=2)
    except ValueError as exc:
        if str(exc).startswith(f"{what}: "):
            raise
        raise ValueError(f"{what}: {path}: {exc}") from None


def _check_shape(path: Path, what: str, shape: tuple[int, ...], max_columns: int | None, max_values: int) -> None:
    """Refuse, before the array exists, a table wider than `max_columns` or of more than `max_values` values."""
    if max_columns is not None and len(shape) == 2 and shape[1] > max_columns:
        raise ValueError(f"{what}: {path}: {shape[1]} feature columns; at most {max_columns}")
    values = math.prod(shape)
    if values > max_values:
        raise ValueError(f"{what}: {path}: {' x '.join(map(str, shape))} is {values} values; at most {max_values}")


def _read_npy(path: Path, what: str, max_columns: int | None) -> np.ndarray:
    """A plain .npy whose header (shape x itemsize) is checked against the file's size before
    numpy allocates what the header declares: a 128-byte file may declare 8 TiB."""
    try:
        with open_regular(path, max_bytes=MAX_INPUT_BYTES) as f:
            size = os.fstat(f.fileno()).st_size
            try:
                version = npy_format.read_magic(f)
                read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
                shape, fortran, dtype = read_header(f)
            except ValueError as exc:
                raise ValueError(f"{what}: {path}: not a plain numeric .npy: {exc}") from None
            if dtype.hasobject:
                raise ValueError(f"{what}: {path}: not a plain numeric .npy: it holds Python objects "
                                 "(refused: allow_pickle=False)")
            data = size - f.tell()
            declared = math.prod(shape) * dtype.itemsize
            if declared != data:
                raise ValueError(f"{what}: {path}: its header declares {' x '.join(map(str, shape))} {dtype} "
                                 f"({declared} bytes), the file holds {data} bytes of data")
            _check_shape(path, what, tuple(shape), max_columns, MAX_TABLE_VALUES)
            # read here, from the header just checked (numpy's read_array would parse it again)
            values = np.fromfile(f, dtype=dtype, count=math.prod(shape))
            return values.reshape(shape, order="F" if fortran else "C")
    except InputFileError as exc:
        raise ValueError(f"{what}: {path}: {exc.reason}") from None


def _numeric_row(line: str) -> bool:
    try:
        [float(v) for v in line.strip().split(",")]
        return True
    except ValueError:
        return False


def read_user_graph(edges: Path, features: Path, labels: Path, split: SplitSizes = SplitSizes()) -> dict[str, np.ndarray]:
    """The graph arrays (x, y, edge_index, train/val/test masks) from a user's files."""
    from geofed.regions.graph.data import MAX_FEATURES, class_count_problem, finite_problem

    x = _read_table(features, np.float64, "features", max_columns=MAX_FEATURES)
    if x.ndim != 2:
        raise ValueError(f"features: expected one row per node (2-D), got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating) or x.dtype == np.bool_):
        raise ValueError(f"features: {features}: expected real numbers, got {x.dtype}")
    if (problem := finite_problem(x)) is not None:
        raise ValueError(f"features: {features}: {problem}")
    n = x.shape[0]
    y = _read_table(labels, np.int64, "labels").reshape(-1)
    if not np.issubdtype(y.dtype, np.integer) or y.shape != (n,):
        raise ValueError(f"labels: expected {n} integer class ids (one per feature row), got {y.dtype} {y.shape}")
    if y.min() < -1 or y.max() < 0:
        raise ValueError("labels: class ids must be >= 0, or -1 for an unlabelled node")
    if (problem := class_count_problem(y, n)) is not None:
        raise ValueError(f"labels: {problem}")
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
