"""Issue 36, item 6 ("data paths bounded"): a graph file, a user's feature and label files and a
Planetoid pickle can ask for no more memory than the documented caps allow (N6, N12, N15), and
`geofed validate` refuses such a graph on one line (exit 2)."""

from __future__ import annotations

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
