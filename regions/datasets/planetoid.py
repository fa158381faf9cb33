"""The original Planetoid files (``ind.NAME.{x,y,tx,ty,allx,ally,graph,test.index}``) to the graph .npz.

The files are Python 2 pickles of numpy arrays, scipy CSR matrices and a defaultdict of lists.
Unpickling runs whatever callable a pickle names, so they are read with an unpickler that admits
only the handful of classes those files hold (under their old module paths, e.g.
``scipy.sparse.csr.csr_matrix``); a pickle that names anything else is refused before any of it
runs. The conversion is Kipf & Welling's (and PyG's): test rows reordered to their index, the
standard split (train = the first len(y) nodes, val = the next 500, test = test.index), and for
CiteSeer the ids missing from the test index (isolated nodes) given zero features and label -1.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path

import numpy as np

MAX_RAW_BYTES = 256 << 20  # a Planetoid file is at most a few MB; refuse anything far larger
VAL_SIZE = 500


class UnsafePickleError(ValueError):
    """A pickle named a class or function outside the few the Planetoid files need."""


def _allowed() -> dict[tuple[str, str], object]:
    import scipy.sparse

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    allowed: dict[tuple[str, str], object] = {
        ("numpy", "dtype"): np.dtype,
        ("numpy", "ndarray"): np.ndarray,
        ("collections", "defaultdict"): collections.defaultdict,
        ("__builtin__", "list"): list,
        ("builtins", "list"): list,
    }
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = _reconstruct
    for mod in ("scipy.sparse.csr", "scipy.sparse._csr", "scipy.sparse"):
        allowed[(mod, "csr_matrix")] = scipy.sparse.csr_matrix
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only numpy arrays/dtypes, scipy CSR matrices, lists and defaultdicts."""

    def __init__(self, file, *, source: str):
        super().__init__(file, encoding="latin1")  # Python 2 str in numpy pickles
        self._source = source
        self._allowed = _allowed()

    def find_class(self, module: str, name: str):
        """The admitted class for (module, name); anything else is refused, never imported."""
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"{self._source}: refused: the pickle names {module}.{name}, which is not one of "
                                    "the numpy/scipy classes a Planetoid file holds (nothing of it was run)") from None


def load_pickle(path: Path):
    """One Planetoid pickle, through the restricted unpickler."""
    data = Path(path).read_bytes()
    if len(data) > MAX_RAW_BYTES:
        raise ValueError(f"{path}: {len(data)} bytes; a Planetoid file is at most {MAX_RAW_BYTES}")
    try:
        return RestrictedUnpickler(io.BytesIO(data), source=str(path)).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ValueError(f"{path}: not a readable Planetoid pickle: {exc}") from None


def _dense(m) -> np.ndarray:
    return m.toarray() if hasattr(m, "toarray") else np.asarray(m)


def convert_planetoid(raw: Path, name: str) -> dict[str, np.ndarray]:
    """The graph arrays (x, y, edge_index, train/val/test masks) of dataset `name` from its raw files in `raw`."""
    parts = {p: load_pickle(raw / f"ind.{name}.{p}") for p in ("x", "y", "tx", "ty", "allx", "ally", "graph")}
    test_index = np.array([int(line) for line in (raw / f"ind.{name}.test.index").read_text().split()], dtype=np.int64)
    tx, ty = _dense(parts["tx"]), np.asarray(parts["ty"])
    allx, ally = _dense(parts["allx"]), np.asarray(parts["ally"])
    test_sorted = np.sort(test_index)
    lo, hi = int(test_sorted[0]), int(test_sorted[-1])
    if hi - lo + 1 > len(test_index):
        # CiteSeer: some ids in [lo, hi] are isolated nodes absent from the test set; they get
        # zero features and no label (y = -1), in no split.
        full_tx = np.zeros((hi - lo + 1, tx.shape[1]), dtype=tx.dtype)
        full_tx[test_sorted - lo] = tx
        full_ty = np.zeros((hi - lo + 1, ty.shape[1]), dtype=ty.dtype)
        full_ty[test_sorted - lo] = ty
        tx, ty = full_tx, full_ty
    x = np.vstack([allx, tx])
    onehot = np.vstack([ally, ty])
    # the test rows are stored in sorted order; put each at its node id
    x[test_index] = x[test_sorted]
    onehot[test_index] = onehot[test_sorted]
    n = x.shape[0]
    y = np.where(onehot.any(axis=1), onehot.argmax(axis=1), -1).astype(np.int64)
    n_train = np.asarray(parts["y"]).shape[0]
    masks = {k: np.zeros(n, dtype=bool) for k in ("train_mask", "val_mask", "test_mask")}
    masks["train_mask"][:n_train] = True
    masks["val_mask"][n_train:n_train + VAL_SIZE] = True
    masks["test_mask"][test_index] = True
    return {"x": (x != 0).astype(np.uint8), "y": y, "edge_index": edges_from_adjacency(parts["graph"], n), **masks}


def edges_from_adjacency(graph: dict, n: int) -> np.ndarray:
    """Both directions of every edge in an adjacency dict, without self loops or duplicates, sorted."""
    pairs = [(int(u), int(v)) for u, vs in graph.items() for v in vs]
    return edge_index_from_pairs(np.array(pairs, dtype=np.int64).reshape(-1, 2), n)


def edge_index_from_pairs(pairs: np.ndarray, n: int) -> np.ndarray:
    """A 2 x E int64 edge_index from an E' x 2 array of node pairs: symmetric, no self loops, no
    duplicates, sorted by (source, target); ids must be in [0, n)."""
    if pairs.size and (pairs.min() < 0 or pairs.max() >= n):
        raise ValueError(f"edge ids must be in [0, {n}), got [{pairs.min()}, {pairs.max()}]")
    both = np.concatenate([pairs, pairs[:, ::-1]]) if pairs.size else np.zeros((0, 2), dtype=np.int64)
    both = both[both[:, 0] != both[:, 1]]
    both = np.unique(both, axis=0)  # sorts rows lexicographically
    return np.ascontiguousarray(both.T.astype(np.int64))
