"""Graph data: the ``.npz`` node-classification format and the sparse tensors a GNN needs.

The format (documented in docs/graph.md and docs/data.md) is one ``.npz``
holding ``x`` (N x F features), ``y`` (N class ids, -1 = unlabelled), ``edge_index`` (2 x E
directed edges, both directions present) and the boolean split masks. It is read with
``allow_pickle=False`` so a file can never run code.

A graph file is bounded before anything is decompressed (a 2 MB ``.npz`` can inflate to 2 GiB):
a regular file (no FIFO, no device) of at most ``max_bytes`` on disk, a zip directory of at most
``MAX_ZIP_DIRECTORY`` bytes, members stored or deflated (what ``np.savez``/``np.savez_compressed``
write; bzip2/lzma inflate without a bound in zipfile), the six arrays' uncompressed sizes summing
to at most ``max_bytes``, and each array's header (shape x dtype) no bigger than its member, so
what numpy allocates is what was checked. zipfile never inflates past a member's declared size.
"""

from __future__ import annotations

import math
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from numpy.lib import format as npy_format

from geofed.regions.inputfiles import InputFileError, open_regular

REQUIRED_KEYS = ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask")
MAX_NODES = 50_000_000
# A class id sizes the model's output layer and every node's logits, a feature column its first
# layer, in every process: one label 49,999,999 in a 1 KB file was a 3 GB output layer. Cora has
# 7 classes and 1,433 columns, CiteSeer 6 and 3,703; 100,000 of each is far past any benchmark.
MAX_CLASSES = 100_000
MAX_FEATURES = 100_000
MAX_GRAPH_BYTES = 1 << 30  # default cap (task.max_mb); Cora is 4 MB uncompressed, CiteSeer 15 MB
MAX_ZIP_DIRECTORY = 1 << 20  # ~20k members' entries; the format has six
_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)


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


def load_graph_npz(path: str | Path, *, max_bytes: int = MAX_GRAPH_BYTES) -> GraphData:
    """Read and validate a graph ``.npz`` of at most `max_bytes` (on disk and uncompressed);
    ValueError names the file and the offending key."""
    path = Path(path)
    try:
        with open_regular(path, max_bytes=max_bytes) as f:
            arrays = _read_arrays(f, max_bytes, str(path))
    except InputFileError as exc:
        if exc.strerror is not None:
            raise ValueError(f"{path}: cannot read graph file: {exc.strerror}") from None
        raise ValueError(f"{path}: {exc.reason}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: cannot read graph file: {exc}") from None
    except ValueError as exc:
        if str(exc).startswith(str(path)):
            raise
        # np.load refuses object arrays when allow_pickle=False; say so plainly.
        raise ValueError(f"{path}: not a plain-array .npz graph file: {exc}") from None
    _validate(arrays, str(path), max_bytes)
    return GraphData(
        x=arrays["x"], y=arrays["y"].astype(np.int64), edge_index=arrays["edge_index"].astype(np.int64),
        train_mask=arrays["train_mask"], val_mask=arrays["val_mask"], test_mask=arrays["test_mask"],
        source=str(path),
    )


def _read_arrays(f: BinaryIO, max_bytes: int, src: str) -> dict[str, np.ndarray]:
    if f.read(4) != b"PK\x03\x04":
        raise ValueError(f"{src}: not a plain-array .npz graph file (not a zip archive)")
    directory = _zip_directory_size(f)
    if directory is not None and directory > MAX_ZIP_DIRECTORY:
        raise ValueError(f"{src}: its zip directory is {directory} bytes (at most {MAX_ZIP_DIRECTORY}); "
                         "a graph file holds six arrays")
    f.seek(0)
    with zipfile.ZipFile(f) as z:
        members = {info.filename.removesuffix(".npy"): info for info in z.infolist()}
        missing = [k for k in REQUIRED_KEYS if k not in members]
        if missing:
            raise ValueError(f"{src}: missing arrays {missing} (need {list(REQUIRED_KEYS)})")
        infos = [members[k] for k in REQUIRED_KEYS]
        for info in infos:
            _check_member(info, max_bytes, src)
        total = sum(info.file_size for info in infos)
        if total > max_bytes:
            raise ValueError(f"{src}: its arrays hold {total} bytes uncompressed; the limit is {max_bytes}")
        return {k: _read_member(z, info, src) for k, info in zip(REQUIRED_KEYS, infos)}


def _check_member(info: zipfile.ZipInfo, max_bytes: int, src: str) -> None:
    name = info.filename
    if info.flag_bits & 0x1:
        raise ValueError(f"{src}: {name}: encrypted; a graph file is a plain np.savez archive")
    if info.compress_type not in _ZIP_METHODS:
        raise ValueError(f"{src}: {name}: zip compression method {info.compress_type}; graph files are stored "
                         "or deflated (np.savez, np.savez_compressed)")
    if info.file_size > max_bytes:
        raise ValueError(f"{src}: {name}: {info.file_size} bytes uncompressed; the limit is {max_bytes}")


def _read_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, src: str) -> np.ndarray:
    """One array, its header checked against its member's size before numpy allocates it."""
    with z.open(info) as m:
        version = npy_format.read_magic(m)
        if version == (1, 0):
            shape, _, dtype = npy_format.read_array_header_1_0(m)
        else:
            shape, _, dtype = npy_format.read_array_header_2_0(m)
    if dtype.hasobject:
        raise ValueError(f"{src}: not a plain-array .npz graph file: {info.filename} holds Python objects "
                         "(refused: allow_pickle=False)")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > info.file_size:
        raise ValueError(f"{src}: {info.filename}: its header declares {nbytes} bytes of data, the member holds "
                         f"{info.file_size}")
    with z.open(info) as m:
        return npy_format.read_array(m, allow_pickle=False)


def _zip_directory_size(f: BinaryIO) -> int | None:
    """The central directory size a zip's end record declares (zipfile reads that many bytes and
    makes an object per entry in them), or None when there is no end record (ZipFile says so)."""
    size = f.seek(0, 2)
    tail_len = min(size, 22 + 0xFFFF)  # the end record, and a comment of at most 64 KiB
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return None
    directory = struct.unpack("<I", tail[at + 12:at + 16])[0]
    end_at = size - tail_len + at
    if at >= 20 and end_at >= 20 + 56 and tail[at - 20:at - 16] == b"PK\x06\x07":
        f.seek(end_at - 20 - 56)  # zip64: the end record sits just before its locator
        record = f.read(56)
        if record[:4] == b"PK\x06\x06":
            directory = max(directory, struct.unpack("<Q", record[40:48])[0])
    return directory


def _validate(a: dict[str, np.ndarray], src: str, max_bytes: int) -> None:
    x, y, ei = a["x"], a["y"], a["edge_index"]
    if x.ndim != 2 or not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)
                           or x.dtype == np.bool_):
        raise ValueError(f"{src}: x: expected a 2-D numeric array (real numbers), got {x.dtype} {x.shape}")
    n = x.shape[0]
    if not 1 <= n <= MAX_NODES:
        raise ValueError(f"{src}: x: node count {n} out of range [1, {MAX_NODES}]")
    if (problem := feature_columns_problem(x.shape[1]) or finite_problem(x)) is not None:
        raise ValueError(f"{src}: x: {problem}")
    if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{src}: y: expected integer shape ({n},), got {y.dtype} {y.shape}")
    if y.min() < -1 or y.max() < 0:
        raise ValueError(f"{src}: y: class ids must be >= 0 (or -1 for unlabelled), with at least one label")
    if (problem := class_count_problem(y, n)) is not None:
        raise ValueError(f"{src}: y: {problem}")
    classes = int(y.max()) + 1
    if n * classes * 4 > max_bytes:  # the logits of a full-batch forward pass, in every process
        raise ValueError(f"{src}: y: {classes} classes x {n} nodes of float32 outputs is {n * classes * 4} bytes; "
                         f"the limit is {max_bytes}")
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


def class_count_problem(y: np.ndarray, n: int) -> str | None:
    """Why the labels `y` of `n` nodes ask for too many classes (ids 0..C-1 make C outputs), or None."""
    top = int(y.max()) if y.size else -1
    bound = min(MAX_CLASSES, n)
    if top + 1 <= bound:
        return None
    return (f"class id {top} makes {top + 1} classes; at most {bound} (the smaller of {MAX_CLASSES} and the node "
            f"count {n}): number the classes 0..C-1")


def feature_columns_problem(columns: int) -> str | None:
    """Why `columns` feature columns are too many (each is a row of the first layer), or None."""
    return None if columns <= MAX_FEATURES else f"{columns} feature columns; at most {MAX_FEATURES}"


def finite_problem(x: np.ndarray) -> str | None:
    """Where a float array holds NaN or an infinity (training on one makes every loss NaN), or None."""
    if not np.issubdtype(x.dtype, np.floating):
        return None
    bad = ~np.isfinite(x)
    if not bad.any():
        return None
    at = tuple(int(i) for i in np.unravel_index(int(bad.argmax()), bad.shape))  # the first, without a list of all
    where = f"row {at[0]}, column {at[1]}" if len(at) == 2 else f"index {at}"
    return f"not finite ({float(x[at])!r} at {where})"


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
    """The propagation matrix of `kind`: 'gcn' (normalised, with self-loops) or 'mean' (GraphSAGE)."""
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
    """The whole graph as one view: a single region's shard, and what evaluation runs on."""
    nodes = np.arange(data.num_nodes)
    return build_view(data, nodes, data.edge_index, adjacency=adjacency)


def load_task_graph(path: str, *, max_mb: int = MAX_GRAPH_BYTES >> 20) -> GraphData:
    """Load the task's graph, within `max_mb` MiB; errors name task.path and where it was resolved."""
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ValueError(
            f"task.path: no graph file at {str(resolved)!r} (resolved from the working directory "
            f"{str(Path.cwd())!r}); point task.path at a .npz in the documented graph format, or use task.dataset "
            "(docs/data.md)")
    try:
        return load_graph_npz(resolved, max_bytes=max_mb << 20)
    except ValueError as exc:
        raise ValueError(f"task.path: {exc} (task.max_mb: {max_mb})" if "limit is" in str(exc)
                         else f"task.path: {exc}") from None
