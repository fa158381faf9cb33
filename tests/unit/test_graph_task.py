"""Task gcn-planetoid: config keys and errors, shards, evaluation on the full graph, describe()."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.config.strict import ConfigError
from geofed.regions.tasks.base import make_task, task_config_class
from geofed.regions.tasks.graph import GcnPlanetoidConfig, GcnPlanetoidTask, GraphShard

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cora_path(cora_npz) -> str:
    return str(cora_npz)


@pytest.fixture(scope="module")
def task(cora_path) -> GcnPlanetoidTask:
    return GcnPlanetoidTask(GcnPlanetoidConfig(path=cora_path))


def test_registered_with_the_config_loader(cora_path):
    assert task_config_class("gcn-planetoid") is GcnPlanetoidConfig
    cfg = config_from_mapping({"task": {"kind": "gcn-planetoid", "path": cora_path, "model": "sage", "halo": True}})
    assert isinstance(cfg.task, GcnPlanetoidConfig) and cfg.task.model == "sage" and cfg.task.halo
    assert isinstance(make_task(cfg.task), GcnPlanetoidTask)


@pytest.mark.parametrize("task_map,needle", [
    ({"hidden": 0}, "task.hidden: must be in [1, 65536]"),
    ({"dropout": 1.0}, "task.dropout"),
    ({"alpha": -1}, "task.alpha: must be > 0"),
    ({"partition": "metis"}, "task.partition: unknown value 'metis'"),
    ({"model": "gat"}, "task.model: unknown value 'gat'"),
    ({"hiden": 16}, "task.hiden"),
])
def test_config_errors_name_the_key(task_map, needle):
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"task": {"kind": "gcn-planetoid", **task_map}})
    assert needle in str(exc.value)


def test_missing_file_names_task_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as exc:
        GcnPlanetoidTask(GcnPlanetoidConfig(path="graphs/mine.npz"))
    msg = str(exc.value)
    assert msg.startswith("task.path:") and "graphs/mine.npz" in msg and str(tmp_path) in msg


def test_the_default_dataset_resolves_through_the_data_cache(cora_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    cfg = GcnPlanetoidConfig()
    assert (cfg.dataset, cfg.path) == ("cora", cora_path)
    assert GcnPlanetoidTask(cfg).data.num_nodes == 2708
    own = GcnPlanetoidConfig(dataset="citeseer", path=cora_path)  # path overrides dataset
    assert own.path == cora_path


def test_a_dataset_not_fetched_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("GEOFED_DATA", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"task": {"kind": "gcn-planetoid", "dataset": "citeseer"}}, source="c.yaml")
    msg = str(exc.value)
    assert msg.startswith("c.yaml: task.dataset: ") and msg.endswith("fetch it with: geofed data fetch citeseer")
    assert "\n" not in msg and str(tmp_path / "empty-cache") in msg


@pytest.mark.parametrize("kind,dataset", [("gcn-planetoid", "pubmed"), ("gcn-planetoid", "tinyshakespeare"),
                                          ("char-lm", "cora"), ("gpt", "citeseer")])
def test_a_dataset_of_another_task_or_unknown_is_refused(kind, dataset):
    with pytest.raises(ConfigError, match=rf"task\.dataset: '{dataset}' is not a {kind} dataset \(known: "):
        config_from_mapping({"task": {"kind": kind, "dataset": dataset}})


def test_shards_cover_the_train_labels_and_weight_by_nodes(task):
    shards = [task.shard(r, 4, seed=0) for r in range(4)]
    assert all(isinstance(s, GraphShard) for s in shards)
    assert sum(s.num_examples for s in shards) == 140
    assert [s.view.loss_scale for s in shards] == pytest.approx([s.num_examples * 4 / 140 for s in shards])
    gen = torch.Generator().manual_seed(0)
    it = shards[0].batches(gen)
    assert next(it) is next(it)  # full batch: the whole subgraph every step
    assert task.shard(0, 4, seed=99).view.num_nodes == shards[0].view.num_nodes  # partition_seed, not run seed


def test_region_loss_scale_reproduces_centralized_gradient(cora_path):
    # The weighting alone (logits from the full graph, so cut edges play no part): the mean of
    # the weighted region losses is the centralized mean over all 140 train nodes.
    t = GcnPlanetoidTask(GcnPlanetoidConfig(path=cora_path, dropout=0.0, weight_decay=0.0, partition="random"))
    m = t.build_model(0)
    full = t.full_view()
    logits = m(full.x, full.adj).detach()
    central = torch.nn.functional.cross_entropy(logits[full.train_mask], full.y[full.train_mask])
    assign = t.assignment(4)
    parts = []
    for r in range(4):
        sel = full.train_mask & torch.from_numpy(assign == r)
        scale = t.shard(r, 4, 0).view.loss_scale
        parts.append(scale * torch.nn.functional.cross_entropy(logits[sel], full.y[sel]))
    assert torch.stack(parts).mean() == pytest.approx(float(central), rel=1e-5)


def test_evaluate_uses_the_whole_graph(task):
    m = task.build_model(0)
    res = task.evaluate(m)
    assert res.metric == "accuracy" and res.higher_is_better and 0 <= res.value <= 1
    full = task.full_view()
    assert full.num_nodes == 2708 and int(full.test_mask.sum()) == 1000


def test_describe_reports_partition(task):
    task.shard(0, 4, seed=0)
    d = task.describe()
    assert d["nodes"] == 2708 and d["classes"] == 7 and d["partition"] == "louvain"
    regions = d["regions"]["regions"]
    assert len(regions) == 4 and sum(r["nodes"] for r in regions) == 2708
    assert d["regions"]["cross_edges_dropped"] > 0 and d["regions"]["halo_bytes"] == 0


def test_halo_shards_carry_features_not_labels(cora_path):
    t = GcnPlanetoidTask(GcnPlanetoidConfig(path=cora_path, halo=True))
    plain = GcnPlanetoidTask(GcnPlanetoidConfig(path=cora_path))
    for r in range(4):
        a, b = t.shard(r, 4, 0), plain.shard(r, 4, 0)
        assert a.view.num_nodes > b.view.num_nodes and a.num_examples == b.num_examples
    assert t.partition_stats(4)["halo_bytes"] > 0


def test_one_region_is_the_whole_graph(task):
    s = task.shard(0, 1, seed=0)
    assert s.view.num_nodes == 2708 and s.num_examples == 140 and s.view.loss_scale == 1.0


def test_config_is_frozen_keyword_only():
    with pytest.raises(TypeError):
        GcnPlanetoidConfig("x.npz")  # type: ignore[misc]
    cfg = GcnPlanetoidConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 3  # type: ignore[misc]
