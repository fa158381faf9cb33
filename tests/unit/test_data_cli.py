"""`geofed data` through the real CLI (exit codes, one-line errors) and what a config naming a dataset
does when the dataset has not been fetched: `validate`, `run` and the benches exit 2 at once."""

from __future__ import annotations

import json
import numpy as np
import pytest

from geofed.orchestrator.cli import main
from geofed.regions.graph.data import load_graph_npz

from conftest import DATASETS, ROOT


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("GEOFED_DATA", str(root))
    monkeypatch.delenv("GEOFED_DATA_MIRROR", raising=False)
    return root


@pytest.mark.parametrize("argv", [
    ["validate", "configs/dfgl-cora.yaml"],
    ["run", "configs/dfgl-cora.yaml", "--set", "run.rounds=2", "--quiet", "--no-report"],
    ["bench", "dfgl", "--dataset", "cora", "--seeds", "1"],
    ["bench", "wan", "--quick"],
    ["validate", "configs/dfgl-citeseer.yaml"],
])
def test_a_missing_dataset_is_exit_2_with_the_fetch_command(argv, empty_cache, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)] if argv[0] == "run" else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    name = "tinyshakespeare" if "wan" in argv else "citeseer" if "citeseer" in argv[-1] else "cora"
    assert len(err) == 1 and err[0].endswith(f"fetch it with: geofed data fetch {name}"), err
    assert "task.dataset" in err[0] and not out.exists()


def test_fetch_verify_path_and_list(empty_cache, data_mirror, capsys):
    assert main(["data", "path", "cora"]) == 2
    assert capsys.readouterr().err.strip().endswith("geofed data fetch cora")
    assert main(["data", "fetch", "cora", "--mirror", data_mirror.url, "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == f"cora: {empty_cache / 'cora' / 'cora.npz'}"
    assert main(["data", "path", "cora"]) == 0
    assert capsys.readouterr().out.strip() == str(empty_cache / "cora" / "cora.npz")
    assert main(["data", "verify"]) == 0
    assert capsys.readouterr().out.count(": ok ") == 9  # 8 raw files and the .npz
    main(["data", "list"])
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.split()[:2] == ["cora", "cached"] for ln in lines)
    assert any(ln.split()[:2] == ["citeseer", "-"] for ln in lines)
    # a damaged file is found by verify (exit 1), and a new fetch repairs it
    raw = empty_cache / "cora" / "raw" / "ind.cora.y"
    raw.write_bytes(raw.read_bytes()[:-1])
    assert main(["data", "verify", "cora"]) == 1
    assert "mismatch" in capsys.readouterr().out
    assert main(["data", "fetch", "cora", "--mirror", data_mirror.url, "--quiet"]) == 0
    assert main(["data", "verify", "cora"]) == 0


def test_fetch_from_a_mirror_folder_and_the_env_mirror(empty_cache, monkeypatch, capsys):
    if not DATASETS.is_dir():
        pytest.skip(f"no test mirror at {DATASETS}")
    assert main(["data", "fetch", "tinyshakespeare", "--mirror", str(DATASETS), "--quiet"]) == 0
    monkeypatch.setenv("GEOFED_DATA_MIRROR", str(DATASETS / "planetoid" / "raw"))
    assert main(["data", "fetch", "citeseer", "--quiet"]) == 0
    assert load_graph_npz(empty_cache / "citeseer" / "citeseer.npz").num_nodes == 3327


def test_fetch_errors(empty_cache, tmp_path, capsys):
    assert main(["data", "fetch", "pubmed"]) == 2
    assert "unknown dataset 'pubmed' (known: citeseer, cora, tinyshakespeare)" in capsys.readouterr().err
    assert main(["data", "fetch", "cora", "--mirror", str(tmp_path / "nothing"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in the mirror folder" in err[0]
    assert main(["data", "-h"]) == 0 and "convert-graph" in capsys.readouterr().out
    assert main(["data"]) == 2


def test_convert_graph_from_a_users_csv_files(tmp_path, capsys):
    rng = np.random.default_rng(0)
    n = 60
    edges = tmp_path / "edges.csv"
    pairs = rng.integers(0, n, size=(150, 2))
    edges.write_text("source,target\n" + "".join(f"{a},{b}\n" for a, b in pairs))
    feats = tmp_path / "features.npy"
    np.save(feats, rng.random((n, 8)).astype(np.float32))
    labels = tmp_path / "labels.csv"
    y = rng.integers(0, 3, size=n)
    y[:4] = -1
    labels.write_text("label\n" + "".join(f"{v}\n" for v in y))
    out = tmp_path / "mine.npz"
    assert main(["data", "convert-graph", "--edges", str(edges), "--features", str(feats), "--labels", str(labels),
                 "--out", str(out), "--train-per-class", "5", "--val", "10", "--test", "20"]) == 0
    assert capsys.readouterr().out.strip().endswith("split 15/10/20")
    g = load_graph_npz(out)
    assert g.num_nodes == n and g.x.dtype == np.float32 and g.y.tolist() == y.tolist()
    ei = g.edge_index
    assert (ei[0] != ei[1]).all() and {(a, b) for a, b in ei.T} == {(b, a) for a, b in ei.T}
    assert not (g.train_mask & g.test_mask).any() and (g.y[g.train_mask | g.val_mask | g.test_mask] >= 0).all()
    # then a config points task.path at it
    from geofed.orchestrator.config import config_from_mapping

    cfg = config_from_mapping({"task": {"kind": "gcn-planetoid", "path": str(out)}})
    assert cfg.task.path == str(out)


def test_convert_graph_refuses_edges_outside_the_features(tmp_path, capsys):
    (tmp_path / "e.csv").write_text("0,1\n1,7\n")
    (tmp_path / "f.csv").write_text("1,0\n0,1\n1,1\n")
    (tmp_path / "y.csv").write_text("0\n1\n0\n")
    assert main(["data", "convert-graph", "--edges", str(tmp_path / "e.csv"), "--features", str(tmp_path / "f.csv"),
                 "--labels", str(tmp_path / "y.csv"), "--out", str(tmp_path / "g.npz")]) == 2
    err = capsys.readouterr().err
    assert "edges: edge ids must be in [0, 3), got [0, 7]" in err and not (tmp_path / "g.npz").exists()


def test_no_package_code_or_shipped_config_names_the_projects_shared_folder():
    # a user's clone has no ../shared next to it: configs name datasets, the cache finds them
    hits = [f"{p}:{n}" for folder in ("orchestrator", "regions", "p2p", "compression", "configs")
            for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and p.suffix in (".py", ".yaml", ".proto")
            for n, line in enumerate(p.read_text().splitlines(), 1) if "shared/" in line]
    assert hits == []


def test_fetch_then_a_short_run(empty_cache, data_mirror, monkeypatch, tmp_path, capsys):
    # a user's first steps: fetch over HTTP, then the shipped config's arms (in process: no Ray)
    monkeypatch.chdir(ROOT)
    assert main(["data", "fetch", "cora", "--mirror", data_mirror.url, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["bench", "dfgl", "--dataset", "cora", "--in-process", "--json", "--regions", "2", "--seeds", "1",
                 "--epochs", "30", "--out", str(tmp_path / "bench")]) == 0
    doc = json.loads(capsys.readouterr().out)
    arms = doc["arms"]
    # measured: centralized 0.69, gossip 0.55, geofed 0.47, regions alone 0.13 after 30 epochs
    assert doc["dataset"] == "cora" and arms["centralized"]["acc_mean"] > 0.6
    assert arms["geofed"]["acc_mean"] > arms["local_only"]["acc_mean"] + 0.2
