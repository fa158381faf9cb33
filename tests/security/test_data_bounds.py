"""Issue 36, item 6 ("data paths bounded"): a graph file, a user's feature and label files and a
Planetoid pickle can ask for no more memory than the documented caps allow (N6, N12, N15), and
`geofed validate` refuses such a graph on one line (exit 2)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hostile_files import child_peak, npy_header

from geofed.orchestrator.cli import main as geofed_main
from geofed.orchestrator.datacmd import main as data_main
from geofed.regions.graph.data import load_graph_npz

from conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def _graph(n: int = 6, **override) -> dict[str, np.ndarray]:
    arrays = dict(
        x=np.eye(n, 3, dtype=np.uint8), y=np.array([0, 1] * (n // 2), dtype=np.int64),
        edge_index=np.array([[0, 1], [1, 0]], dtype=np.int64), train_mask=np.array([1, 1] + [0] * (n - 2), dtype=bool),
        val_mask=np.zeros(n, dtype=bool), test_mask=np.array([0, 0] + [1] * (n - 2), dtype=bool))
    arrays.update(override)
    return arrays


def _label_bomb(tmp_path, label: int = 49_999_999):
    path = tmp_path / "labels.npz"
    y = _graph()["y"]
    y[0] = label
    np.savez_compressed(path, **_graph(y=y))
    return path


# -- N6: class count and feature columns capped in graph loading --------------------------------

def test_a_huge_class_id_is_refused_when_the_graph_loads(tmp_path):
    """N6: one label 49,999,999 in a ~1 KB file made every process build a 50M-way output layer
    (3.6 GB, 26 s); before the fix the file loaded (num_classes 50,000,000) and nothing was raised."""
    path = _label_bomb(tmp_path)
    assert path.stat().st_size < 2000
    with pytest.raises(ValueError) as exc:
        load_graph_npz(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: y: class id 49999999") and "at most 6" in msg, msg


def test_a_label_bomb_costs_the_task_no_memory(tmp_path):
    """N6, measured in a child process capped at 6 GiB: before the fix building the task and its
    model on this 1 KB file grew the child by 3,091 MB (the output layer and its logits); now it is
    refused before the model exists."""
    _label_bomb(tmp_path)
    out = child_peak("cfg = geofed.regions.tasks.graph.GcnPlanetoidConfig(path='labels.npz')\n"
                     "task = geofed.regions.tasks.make_task(cfg)\n"
                     "task.build_model(0)\n", cwd=tmp_path)
    assert out.get("error", "").startswith("ValueError: task.path: labels.npz: y: class id 49999999"), out
    assert out["grew_mb"] < 100, out


def test_validate_refuses_a_graph_with_a_huge_class_id(tmp_path, capsys):
    """N6: before the fix `geofed validate` printed 'ok' and exited 0 without opening task.path."""
    path = _label_bomb(tmp_path)
    rc = geofed_main(["validate", str(ROOT / "configs" / "dfgl-cora.yaml"), "--set", f"task.path={path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and str(path) in err and "class id 49999999" in err, err


def test_validate_still_passes_a_good_graph(tmp_path, capsys):
    path = tmp_path / "good.npz"
    np.savez_compressed(path, **_graph())
    rc = geofed_main(["validate", str(ROOT / "configs" / "dfgl-cora.yaml"), "--set", f"task.path={path}"])
    assert rc == 0 and ": ok (" in capsys.readouterr().out


@pytest.mark.parametrize("case,needle", [
    ("sparse_ids", "y: class id 9 makes 10 classes; at most 6"),
    ("columns", "x: 200000 feature columns; at most 100000"),
    ("nan", "x: not finite (nan at row 1, column 2)"),
    ("inf", "x: not finite (inf at row 0, column 0)"),
    ("complex", "x: expected a 2-D numeric array (real numbers), got complex64 (6, 3)"),
])
def test_the_loader_caps_classes_and_features_and_refuses_non_finite_values(tmp_path, case, needle):
    """N6/N12: before the fix each of these loaded (a 200,000-column row makes a 200,000 x hidden
    first layer in every region; NaN features train to NaN)."""
    x = np.eye(6, 3, dtype=np.float32)
    override = {
        "sparse_ids": {"y": np.array([0, 1, 0, 9, 1, 0])},
        "columns": {"x": np.zeros((6, 200_000), dtype=np.uint8)},
        "nan": {"x": np.where(np.arange(18).reshape(6, 3) == 5, np.nan, x)},
        "inf": {"x": np.where(np.arange(18).reshape(6, 3) == 0, np.inf, x)},
        "complex": {"x": x.astype(np.complex64)},
    }[case]
    path = tmp_path / "g.npz"
    np.savez_compressed(path, **_graph(**override))
    with pytest.raises(ValueError) as exc:
        load_graph_npz(path)
    assert str(exc.value).startswith(f"{path}: ") and needle in str(exc.value), str(exc.value)


def test_the_logits_of_every_node_must_fit_the_task_cap(tmp_path):
    """The dense output the model makes (nodes x classes float32) is bounded by the same cap as the
    file (task.max_mb): 60,000 nodes x 6,000 classes is 1.4 GB of logits from a 1 MB file."""
    n = 60_000
    y = np.zeros(n, dtype=np.int64)
    y[1] = 5_999
    path = tmp_path / "wide.npz"
    np.savez_compressed(path, **_graph(n, x=np.zeros((n, 1), dtype=np.uint8), y=y))
    with pytest.raises(ValueError, match=r"y: 6000 classes x 60000 nodes of float32 outputs is 1440000000 bytes; "
                                         r"the limit is 1073741824"):
        load_graph_npz(path)
    assert load_graph_npz(path, max_bytes=2 << 30).num_classes == 6000


# -- N12: convert-graph checks .npy headers and refuses NaN/inf ---------------------------------

def _convert(tmp_path, *, features, labels=None, edges=None) -> list[str]:
    edges = edges or tmp_path / "e.csv"
    if not edges.exists():
        edges.write_text("0,1\n1,2\n")
    if labels is None:
        labels = tmp_path / "y.csv"
        labels.write_text("0\n1\n0\n")
    return ["convert-graph", "--edges", str(edges), "--features", str(features), "--labels", str(labels),
            "--out", str(tmp_path / "g.npz"), "--train-per-class", "1", "--val", "0", "--test", "1"]


def test_convert_graph_checks_a_npy_header_against_the_file_size(tmp_path, capsys):
    """N12: a 128-byte .npy whose header declares 2^20 x 2^20 float64 (8 TiB): before the fix
    numpy tried to allocate it (MemoryError out of `geofed data`, a traceback)."""
    bomb = tmp_path / "f.npy"
    bomb.write_bytes(npy_header((1 << 20, 1 << 20)))
    assert bomb.stat().st_size < 200
    rc = data_main(_convert(tmp_path, features=bomb))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert (f"features: {bomb}: its header declares 1048576 x 1048576 float64 (8796093022208 bytes), "
            "the file holds 0 bytes of data") in err, err
    assert not (tmp_path / "g.npz").exists()


@pytest.mark.parametrize("what", ["features", "labels"])
def test_convert_graph_refuses_a_npy_longer_than_its_header_says(tmp_path, capsys, what):
    """N12: the data after the header must be exactly shape x itemsize (trailing bytes mean the
    header lies); before the fix numpy read the prefix and ignored the rest."""
    arr = np.ones((3, 2), dtype=np.float32) if what == "features" else np.array([0, 1, 0])
    path = tmp_path / f"{what}.npy"
    np.save(path, arr)
    path.write_bytes(path.read_bytes() + bytes(16))
    kw = {"features": path} if what == "features" else {"features": tmp_path / "f.csv", "labels": path}
    (tmp_path / "f.csv").write_text("1,0\n0,1\n1,1\n")
    rc = data_main(_convert(tmp_path, **kw))
    err = capsys.readouterr().err
    assert rc == 2 and f"{what}: {path}: its header declares" in err and "the file holds" in err, err


@pytest.mark.parametrize("kind", ["csv", "npy"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_convert_graph_refuses_non_finite_features(tmp_path, capsys, kind, value):
    """N12: before the fix a NaN or inf feature was written into the graph (exit 0), and training on
    it gives NaN losses in every region."""
    if kind == "csv":
        feats = tmp_path / "f.csv"
        feats.write_text(f"1,0\n0,{value}\n1,1\n")
    else:
        feats = tmp_path / "f.npy"
        np.save(feats, np.array([[1, 0], [0, float(value)], [1, 1]], dtype=np.float32))
    rc = data_main(_convert(tmp_path, features=feats))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert f"features: {feats}: not finite ({value} at row 1, column 1)" in err, err
    assert not (tmp_path / "g.npz").exists()


@pytest.mark.parametrize("case", ["columns_npy", "columns_csv", "classes"])
def test_convert_graph_caps_feature_columns_and_classes(tmp_path, capsys, case):
    """N6 in convert-graph: before the fix a 200,000-column feature file or a class id of
    49,999,999 was converted (exit 0) into a graph every region then paid for."""
    feats, labels = tmp_path / "f.csv", None
    feats.write_text("1,0\n0,1\n1,1\n")
    if case == "columns_npy":
        feats = tmp_path / "f.npy"
        np.save(feats, np.zeros((3, 200_000), dtype=np.uint8))
    elif case == "columns_csv":
        feats.write_text("".join(",".join(["0"] * 200_000) + "\n" for _ in range(3)))
    else:
        labels = tmp_path / "y.csv"
        labels.write_text("0\n49999999\n1\n")
    rc = data_main(_convert(tmp_path, features=feats, labels=labels))
    err = capsys.readouterr().err.strip()
    needle = {"columns_npy": f"features: {feats}: 200000 feature columns; at most 100000",
              "columns_csv": f"features: {feats}: 200000 feature columns; at most 100000",
              "classes": "labels: class id 49999999 makes 50000000 classes; at most 3"}[case]
    assert rc == 2 and needle in err, err
    assert not (tmp_path / "g.npz").exists()


# -- N15: the Planetoid unpickler and conversion bound what a pickle can make them allocate -----

def _op(value) -> bytes:
    """The protocol-2 opcodes that push `value` (an int, str or tuple of those)."""
    import pickle

    return pickle.dumps(value, protocol=2)[2:-1]


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


_RECONSTRUCT = _global("numpy.core.multiarray", "_reconstruct")
_NDARRAY = _global("numpy", "ndarray")
_TUPLE3, _TUPLE1, _REDUCE, _STOP = b"\x87", b"\x85", b"R", b"."


@pytest.mark.parametrize("case", ["reconstruct", "ndarray_call", "wide_dtype"])
def test_the_unpickler_refuses_arrays_over_the_bound(tmp_path, case):
    """N15: `_reconstruct(ndarray, (2**40,), 'b')` in a 70-byte pickle asks numpy for 1 TiB (and a
    dtype of 1 MB items for 1 GB); before the fix that allocation was attempted (a MemoryError
    here for the first two, the 1 GB array made without a word)."""
    from geofed.regions.datasets.planetoid import UnsafePickleError, load_pickle

    body = {
        "reconstruct": _RECONSTRUCT + _NDARRAY + _op((1 << 40,)) + _op("b") + _TUPLE3 + _REDUCE,
        "ndarray_call": _NDARRAY + _op(((1 << 40,),)) + _REDUCE,
        "wide_dtype": (_RECONSTRUCT + _NDARRAY + _op((1000,)) + _global("numpy", "dtype") + _op(("V1000000", 0, 1))
                       + _REDUCE + _TUPLE3 + _REDUCE),
    }[case]
    path = tmp_path / "ind.cora.x"
    path.write_bytes(b"\x80\x02" + body + _STOP)
    with pytest.raises(UnsafePickleError) as exc:
        load_pickle(path)
    msg = str(exc.value)
    want = {"reconstruct": 1 << 40, "ndarray_call": 8 << 40, "wide_dtype": 1000 * 1_000_000}[case]
    assert msg.startswith(f"{path}: refused: an array of {want} bytes"), msg


def test_the_unpickler_refuses_object_dtypes(tmp_path):
    """N15: an object dtype lets a pickle's array state say 10^9 items with an empty list (numpy
    then crashes); before the fix dtype('O8') was made without a word."""
    from geofed.regions.datasets.planetoid import UnsafePickleError, load_pickle

    path = tmp_path / "ind.cora.y"
    path.write_bytes(b"\x80\x02" + _global("numpy", "dtype") + _op(("O8", 0, 1)) + _REDUCE + _STOP)
    with pytest.raises(UnsafePickleError, match="refused: dtype object holds Python objects"):
        load_pickle(path)


@pytest.mark.parametrize("case", ["csr_call", "list_of_array"])
def test_the_unpickler_refuses_calls_the_files_never_make(tmp_path, case):
    """N15: `csr_matrix((2**31 - 1, 1))` allocates 2^31 row pointers (16 GB) and `list(an array)` a
    Python object per element (~30x the array); the real files only restore CSR matrices from
    their state and name list as a defaultdict's factory. Before the fix both calls were made."""
    from geofed.regions.datasets.planetoid import UnsafePickleError, load_pickle

    body = {
        "csr_call": _global("scipy.sparse.csr", "csr_matrix") + _op(((2**31 - 1, 1),)) + _REDUCE,
        "list_of_array": (_global("__builtin__", "list") + _RECONSTRUCT + _NDARRAY + _op((1 << 20,)) + _op("b")
                          + _TUPLE3 + _REDUCE + _TUPLE1 + _REDUCE),
    }[case]
    path = tmp_path / "ind.cora.x"
    path.write_bytes(b"\x80\x02" + body + _STOP)
    needle = {"csr_call": "refused: a call of csr_matrix", "list_of_array": "refused: list() of an object"}[case]
    with pytest.raises(UnsafePickleError, match=re.escape(needle)):
        load_pickle(path)


def test_the_allocations_of_one_pickle_are_bounded_in_total(tmp_path):
    """N15: many arrays each under the bound: 40 of 16 MiB from one memoised callable; before the
    fix each was allocated (640 MiB from a 2 KB file)."""
    from geofed.regions.datasets.planetoid import MAX_ARRAY_BYTES, UnsafePickleError, load_pickle

    one = _RECONSTRUCT + _NDARRAY + _op((16 << 20,)) + _op("b") + _TUPLE3 + _REDUCE + b"0"  # POP
    path = tmp_path / "ind.cora.x"
    path.write_bytes(b"\x80\x02" + one * 40 + b"N" + _STOP)
    with pytest.raises(UnsafePickleError, match=rf"refused: its arrays would exceed {MAX_ARRAY_BYTES} bytes"):
        load_pickle(path)


def _raw_copy(tmp_path):
    from conftest import DATASETS

    raw = DATASETS / "planetoid" / "raw"
    if not raw.is_dir():
        pytest.skip(f"no raw Planetoid files at {raw}")
    import shutil

    for f in raw.glob("ind.cora.*"):
        shutil.copy(f, tmp_path / f.name)
    return tmp_path


def _with_shape(data: bytes, shape: tuple[int, int]) -> bytes:
    """A Python 2 CSR pickle with the ints of its `_shape` tuple replaced (BININT opcodes)."""
    import pickletools
    import struct

    ops = list(pickletools.genops(data))
    at = next(i for i, (op, arg, _) in enumerate(ops) if arg == "_shape")
    first = next(i for i in range(at + 1, len(ops)) if ops[i][0].name.startswith("BININT"))
    start, end = ops[first][2], ops[first + 2][2]  # the two ints, up to the TUPLE2
    return data[:start] + b"".join(b"J" + struct.pack("<i", v) for v in shape) + data[end:]


@pytest.mark.parametrize("case", ["csr_shape", "test_index", "list_for_array"])
def test_the_conversion_refuses_shapes_over_the_bound(tmp_path, case):
    """N15 past the unpickler: a CSR matrix whose pickled _shape says 10^6 x 10^6 (4 TB when made
    dense), a test.index naming node 10^9 (a 10^9-row block), a list where an array belongs.
    Before the fix each was a MemoryError or IndexError traceback (or that much memory)."""
    import pickle

    from geofed.regions.datasets.planetoid import convert_planetoid

    raw = _raw_copy(tmp_path)
    if case == "csr_shape":  # the real file, its pickled _shape (1000, 1433) rewritten
        (raw / "ind.cora.tx").write_bytes(_with_shape((raw / "ind.cora.tx").read_bytes(), (10**6, 10**6)))
        needle = "ind.cora.tx: a 1000000 x 1000000 matrix"
    elif case == "test_index":
        (raw / "ind.cora.test.index").write_text("0\n1000000000\n")
        needle = "ind.cora.test.index: node ids must be in [0, 50000000]"
    else:
        (raw / "ind.cora.ty").write_bytes(pickle.dumps([[0, 1]] * 5, protocol=2))
        needle = "ind.cora.ty: expected a numpy array or a scipy CSR matrix, got list"
    with pytest.raises(ValueError) as exc:
        convert_planetoid(raw, "cora")
    assert needle in str(exc.value), str(exc.value)


def test_a_shared_adjacency_list_cannot_multiply_the_edges(tmp_path):
    """N15: 10,000 nodes whose adjacency is one shared 100,000-entry list (a 600 KB pickle, memo
    references) is 10^9 edges; before the fix the conversion built them as Python tuples until
    this child's 6 GiB ran out (MemoryError)."""
    raw = _raw_copy(tmp_path)
    out = child_peak(
        "import collections, pickle, pathlib\n"
        "from geofed.regions.datasets.planetoid import convert_planetoid\n"
        "big = list(range(100_000))\n"
        "g = collections.defaultdict(list, {i: big for i in range(10_000)})\n"
        "pathlib.Path('ind.cora.graph').write_bytes(pickle.dumps(g, protocol=2))\n"
        "convert_planetoid(pathlib.Path('.'), 'cora')\n", cwd=raw)
    assert out.get("error", "").startswith("ValueError: "), out
    assert "ind.cora.graph: 1000000000 adjacency entries; at most" in out["error"], out
    assert out["grew_mb"] < 300, out


def test_convert_graph_bounds_a_npy_table_by_its_values(tmp_path, capsys, monkeypatch):
    """A .npy whose header is honest can still hold more values than a graph under the cap (the
    bound is lowered here so that the file stays small); before, .npy tables were bounded only by
    the 4 GiB file size."""
    from geofed.regions.datasets import owngraph

    monkeypatch.setattr(owngraph, "MAX_TABLE_VALUES", 1000)
    feats = tmp_path / "f.npy"
    np.save(feats, np.zeros((3, 400), dtype=np.uint8))
    rc = data_main(_convert(tmp_path, features=feats))
    err = capsys.readouterr().err
    assert rc == 2 and f"features: {feats}: 3 x 400 is 1200 values; at most 1000" in err, err
