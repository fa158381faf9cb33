"""The original Planetoid files (``ind.NAME.{x,y,tx,ty,allx,ally,graph,test.index}``) to the graph .npz.

The files are Python 2 pickles of numpy arrays, scipy CSR matrices and a defaultdict of lists.
Unpickling runs whatever callable a pickle names, so they are read with an unpickler that admits
only the handful of classes those files hold (under their old module paths, e.g.
``scipy.sparse.csr.csr_matrix``); a pickle that names anything else is refused before any of it
runs. The conversion is Kipf & Welling's (and PyG's): test rows reordered to their index, the
standard split (train = the first len(y) nodes, val = the next 500, test = test.index), and for
CiteSeer the ids missing from the test index (isolated nodes) given zero features and label -1.

What a pickle can make the unpickler allocate is bounded too (the SHA-256 pin is the first line;
a file past it, from a mirror folder or a changed cache, may still be hostile): an array's
shape x itemsize, and the sum over one file, at most ``MAX_ARRAY_BYTES``; no object dtypes (an
object array's state may claim 10^9 items it does not hold). The conversion then checks each
part's type and shape before making it dense, the test index's ids, and the adjacency's size
(memo references let a small pickle repeat one long list under every node).
"""

from __future__ import annotations

import collections
import io
import math
import pickle
from pathlib import Path

import numpy as np

from geofed.regions.inputfiles import InputFileError, read_regular

MAX_RAW_BYTES = 256 << 20  # a Planetoid file is at most a few MB; refuse anything far larger
# CiteSeer's largest part made dense is 2,312 x 3,703 float32 (34 MB)
MAX_ARRAY_BYTES = 256 << 20
MAX_NODES = 50_000_000
MAX_ADJACENCY = 1 << 22  # entries of the adjacency lists; Cora has 10,556, PubMed 88,648
VAL_SIZE = 500


class UnsafePickleError(ValueError):
    """A pickle named a class or function outside the few the Planetoid files need."""


class _Budget:
    """What one file's arrays may allocate, in all; every array the unpickler makes is charged."""

    def __init__(self, source: str, limit: int = MAX_ARRAY_BYTES):
        self.source, self.left = source, limit

    def charge(self, shape, dtype) -> None:
        dt = self.dtype(dtype)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if not all(isinstance(d, int) and d >= 0 for d in dims):
            raise UnsafePickleError(f"{self.source}: refused: an array shape {shape!r}")
        nbytes = math.prod(dims) * dt.itemsize
        if nbytes > MAX_ARRAY_BYTES:
            raise UnsafePickleError(f"{self.source}: refused: an array of {nbytes} bytes ({dims} of {dt}); "
                                    f"a Planetoid array is at most {MAX_ARRAY_BYTES}")
        if nbytes > self.left:
            raise UnsafePickleError(f"{self.source}: refused: its arrays would exceed {MAX_ARRAY_BYTES} bytes in all")
        self.left -= nbytes

    def dtype(self, *args) -> np.dtype:
        try:
            dt = np.dtype(*args)
        except (TypeError, ValueError) as exc:
            raise UnsafePickleError(f"{self.source}: refused: dtype {args!r}: {exc}") from None
        if dt.hasobject:
            raise UnsafePickleError(f"{self.source}: refused: dtype {dt} holds Python objects; a Planetoid "
                                    "array holds numbers")
        if dt.itemsize > MAX_ARRAY_BYTES:
            raise UnsafePickleError(f"{self.source}: refused: dtype {dt} of {dt.itemsize}-byte items")
        return dt


def _allowed(budget: _Budget) -> dict[tuple[str, str], object]:
    import scipy.sparse

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct

    class BoundedNdarray(np.ndarray):
        """Stands for numpy.ndarray: calling it (``ndarray(shape, dtype)``) is charged first, and
        it is the only array type the reconstructor below builds (as a plain ndarray)."""

        def __new__(cls, shape, dtype=float, *args, **kwargs):
            budget.charge(shape, dtype)
            return np.ndarray.__new__(np.ndarray, shape, budget.dtype(dtype), *args, **kwargs)

    def reconstruct(subtype, shape, dtype):
        if subtype is not BoundedNdarray:
            raise UnsafePickleError(f"{budget.source}: refused: _reconstruct of {subtype!r}, not numpy.ndarray")
        budget.charge(shape, dtype)
        return _reconstruct(np.ndarray, shape, budget.dtype(dtype))

    class RestoredCsr(scipy.sparse.csr_matrix):
        """Stands for csr_matrix: the files restore it from its state (NEWOBJ, then BUILD), which
        allocates nothing; calling it (``csr_matrix((M, N))`` allocates M + 1 row pointers) is
        refused. The conversion rebuilds a plain csr_matrix from the state, checked."""

        def __init__(self, *args, **kwargs):
            raise UnsafePickleError(f"{budget.source}: refused: a call of csr_matrix; a Planetoid file restores "
                                    "its matrices from their state")

    def list_factory(*args):
        # the adjacency's defaultdict names list as its factory; list(an array) would make a
        # Python object of every element (30x its bytes), so only list() itself is allowed
        if args:
            raise UnsafePickleError(f"{budget.source}: refused: list() of an object; a Planetoid file "
                                    "names list only as a defaultdict's factory")
        return []

    allowed: dict[tuple[str, str], object] = {
        ("numpy", "dtype"): budget.dtype,
        ("numpy", "ndarray"): BoundedNdarray,
        ("collections", "defaultdict"): collections.defaultdict,
        ("__builtin__", "list"): list_factory,
        ("builtins", "list"): list_factory,
    }
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = reconstruct
    for mod in ("scipy.sparse.csr", "scipy.sparse._csr", "scipy.sparse"):
        allowed[(mod, "csr_matrix")] = RestoredCsr
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only numpy arrays/dtypes, scipy CSR matrices, lists and defaultdicts, and arrays
    of at most MAX_ARRAY_BYTES in all."""

    def __init__(self, file, *, source: str):
        super().__init__(file, encoding="latin1")  # Python 2 str in numpy pickles
        self._source = source
        self._allowed = _allowed(_Budget(source))

    def find_class(self, module: str, name: str):
        """The admitted class for (module, name); anything else is refused, never imported."""
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"{self._source}: refused: the pickle names {module}.{name}, which is not one of "
                                    "the numpy/scipy classes a Planetoid file holds (nothing of it was run)") from None


def load_pickle(path: Path):
    """One Planetoid pickle, through the restricted unpickler."""
    try:
        data = read_regular(path, max_bytes=MAX_RAW_BYTES)
    except InputFileError as exc:
        raise ValueError(f"{path}: {exc.reason}; a Planetoid file is at most {MAX_RAW_BYTES} bytes"
                         if exc.size is not None else f"{path}: {exc.reason}") from None
    try:
        return RestrictedUnpickler(io.BytesIO(data), source=str(path)).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ValueError(f"{path}: not a readable Planetoid pickle: {exc}") from None


def _matrix(obj, path: Path) -> np.ndarray:
    """A part as a dense 2-D (or 1-D) numeric array, its size checked before it is made dense."""
    import scipy.sparse

    if isinstance(obj, np.ndarray):
        if obj.ndim not in (1, 2) or not (np.issubdtype(obj.dtype, np.number) or obj.dtype == np.bool_):
            raise ValueError(f"{path}: expected a 1-D or 2-D numeric array, got {obj.dtype} {obj.shape}")
        return obj
    if not isinstance(obj, scipy.sparse.csr_matrix):
        raise ValueError(f"{path}: expected a numpy array or a scipy CSR matrix, got {type(obj).__name__}")
    state = vars(obj)
    shape, data = state.get("_shape"), state.get("data")
    if not (isinstance(shape, tuple) and len(shape) == 2 and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(data, np.ndarray)):
        raise ValueError(f"{path}: not a valid CSR matrix (shape {shape!r})")
    nbytes = shape[0] * shape[1] * data.dtype.itemsize
    if nbytes > MAX_ARRAY_BYTES:
        raise ValueError(f"{path}: a {shape[0]} x {shape[1]} matrix of {data.dtype} is {nbytes} bytes made dense; "
                         f"at most {MAX_ARRAY_BYTES}")
    try:  # a plain csr_matrix from the pickled state; the full check keeps toarray's writes in bounds
        m = scipy.sparse.csr_matrix((data, state.get("indices"), state.get("indptr")), shape=shape)
        m.check_format(full_check=True)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: not a valid CSR matrix: {exc}") from None
    return m.toarray()


def _test_index(path: Path) -> np.ndarray:
    try:
        text = read_regular(path, max_bytes=MAX_RAW_BYTES).decode("ascii")
        ids = np.array([int(line) for line in text.split()], dtype=np.int64)
    except InputFileError as exc:
        raise ValueError(f"{path}: {exc.reason}") from None
    except (UnicodeDecodeError, ValueError, OverflowError):
        raise ValueError(f"{path}: not a list of node ids, one a line") from None
    if not ids.size or ids.min() < 0 or ids.max() > MAX_NODES:
        raise ValueError(f"{path}: node ids must be in [0, {MAX_NODES}], at least one")
    return ids


def convert_planetoid(raw: Path, name: str) -> dict[str, np.ndarray]:
    """The graph arrays (x, y, edge_index, train/val/test masks) of dataset `name` from its raw files in `raw`."""
    path = {p: raw / f"ind.{name}.{p}" for p in ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")}
    parts = {p: load_pickle(path[p]) for p in ("x", "y", "tx", "ty", "allx", "ally", "graph")}
    test_index = _test_index(path["test.index"])
    tx, ty, allx, ally = (_matrix(parts[p], path[p]) for p in ("tx", "ty", "allx", "ally"))
    if tx.ndim != 2 or allx.ndim != 2 or ty.ndim != 2 or ally.ndim != 2 or tx.shape[1] != allx.shape[1] \
            or ty.shape[1] != ally.shape[1] or tx.shape[0] != ty.shape[0] != len(test_index) \
            or allx.shape[0] != ally.shape[0]:
        raise ValueError(f"{raw}: ind.{name}.*: the parts' shapes disagree (allx {allx.shape}, ally {ally.shape}, "
                         f"tx {tx.shape}, ty {ty.shape}, test.index {len(test_index)} ids)")
    test_sorted = np.sort(test_index)
    lo, hi = int(test_sorted[0]), int(test_sorted[-1])
    if hi - lo + 1 > len(test_index):
        # CiteSeer: some ids in [lo, hi] are isolated nodes absent from the test set; they get
        # zero features and no label (y = -1), in no split.
        nbytes = (hi - lo + 1) * tx.shape[1] * tx.dtype.itemsize
        if nbytes > MAX_ARRAY_BYTES:
            raise ValueError(f"{path['test.index']}: ids {lo}..{hi} make a {nbytes}-byte feature block; "
                             f"at most {MAX_ARRAY_BYTES}")
        full_tx = np.zeros((hi - lo + 1, tx.shape[1]), dtype=tx.dtype)
        full_tx[test_sorted - lo] = tx
        full_ty = np.zeros((hi - lo + 1, ty.shape[1]), dtype=ty.dtype)
        full_ty[test_sorted - lo] = ty
        tx, ty = full_tx, full_ty
    x = np.vstack([allx, tx])
    onehot = np.vstack([ally, ty])
    n = x.shape[0]
    if hi >= n:
        raise ValueError(f"{path['test.index']}: node id {hi} is past the {n} nodes of the features")
    # the test rows are stored in sorted order; put each at its node id
    x[test_index] = x[test_sorted]
    onehot[test_index] = onehot[test_sorted]
    y = np.where(onehot.any(axis=1), onehot.argmax(axis=1), -1).astype(np.int64)
    n_train = _matrix(parts["y"], path["y"]).shape[0]
    masks = {k: np.zeros(n, dtype=bool) for k in ("train_mask", "val_mask", "test_mask")}
    masks["train_mask"][:n_train] = True
    masks["val_mask"][n_train:n_train + VAL_SIZE] = True
    masks["test_mask"][test_index] = True
    return {"x": (x != 0).astype(np.uint8), "y": y, "edge_index": edges_from_adjacency(parts["graph"], n, path["graph"]),
            **masks}


def edges_from_adjacency(graph: dict, n: int, source: Path | str = "graph") -> np.ndarray:
    """Both directions of every edge in an adjacency dict, without self loops or duplicates, sorted;
    at most MAX_ADJACENCY entries (memo references can repeat one list under every node)."""
    if not isinstance(graph, dict) or not all(isinstance(vs, list) for vs in graph.values()):
        raise ValueError(f"{source}: expected a dict of adjacency lists, got {type(graph).__name__}")
    total = sum(len(vs) for vs in graph.values())
    if total > MAX_ADJACENCY:
        raise ValueError(f"{source}: {total} adjacency entries; at most {MAX_ADJACENCY}")
    try:
        pairs = [(int(u), int(v)) for u, vs in graph.items() for v in vs]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{source}: the adjacency holds something other than node ids") from None
    try:
        return edge_index_from_pairs(np.array(pairs, dtype=np.int64).reshape(-1, 2), n)
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"{source}: {exc}") from None


def edge_index_from_pairs(pairs: np.ndarray, n: int) -> np.ndarray:
    """A 2 x E int64 edge_index from an E' x 2 array of node pairs: symmetric, no self loops, no
    duplicates, sorted by (source, target); ids must be in [0, n)."""
    if pairs.size and (pairs.min() < 0 or pairs.max() >= n):
        raise ValueError(f"edge ids must be in [0, {n}), got [{pairs.min()}, {pairs.max()}]")
    both = np.concatenate([pairs, pairs[:, ::-1]]) if pairs.size else np.zeros((0, 2), dtype=np.int64)
    both = both[both[:, 0] != both[:, 1]]
    both = np.unique(both, axis=0)  # sorts rows lexicographically
    return np.ascontiguousarray(both.T.astype(np.int64))
