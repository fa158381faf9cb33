"""The built-in tasks: sharding properties, real data, a model that learns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from geofed.orchestrator.config.strict import build
from geofed.regions.tasks import make_task, task_config_class
from geofed.regions.tasks.sharding import partition_indices

TEXT = Path(__file__).resolve().parents[2].parent / "shared" / "datasets" / "tinyshakespeare" / "input.txt"


def _task(kind: str, **keys):
    return make_task(build(task_config_class(kind), {"kind": kind, **keys}), batch_size=16, seed=0)


@pytest.mark.parametrize("kind", ["iid", "dirichlet"])
def test_partition_covers_every_example_once(kind):
    labels = np.repeat(np.arange(10), 50)
    parts = partition_indices(labels, 4, kind=kind, alpha=0.3, seed=1)
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(len(labels)))
    assert all(len(p) > 0 for p in parts)


def test_dirichlet_skews_labels_and_iid_does_not():
    labels = np.repeat(np.arange(10), 100)

    def skew(kind, alpha):
        parts = partition_indices(labels, 4, kind=kind, alpha=alpha, seed=0)
        hists = np.stack([np.bincount(labels[p], minlength=10) / len(p) for p in parts])
        return float(np.abs(hists - 0.1).sum(1).mean())  # mean total-variation x2 from uniform

    assert skew("iid", 0.5) < 0.2
    assert skew("dirichlet", 0.1) > 0.8


def test_digits_shards_are_disjoint_and_eval_is_held_out():
    task = _task("mlp-digits", partition="dirichlet", alpha=0.5)
    xs = [task.shard(i, 3, 0).x for i in range(3)]
    assert sum(len(x) for x in xs) == len(task.x_train)
    assert len(task.x_test) > 0


def test_digits_layers_sets_the_depth_of_the_mlp():
    # 64-256-256-10: the model issue 14 measured on a shaped cluster (85,002 parameters).
    deep = _task("mlp-digits", hidden=256, layers=2).build_model(0)
    assert sum(p.numel() for p in deep.parameters()) == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    shallow = _task("mlp-digits", hidden=256).build_model(0)
    assert sum(p.numel() for p in shallow.parameters()) == 64 * 256 + 256 + 256 * 10 + 10
    with pytest.raises(ValueError, match="layers: must be in"):
        _task("mlp-digits", layers=0)


def test_digits_activation_tanh_for_dp():
    relu = _task("mlp-digits", layers=2).build_model(0)
    tanh = _task("mlp-digits", layers=2, activation="tanh").build_model(0)
    assert [type(m).__name__ for m in tanh] == ["Linear", "Tanh", "Linear", "Tanh", "Linear"]
    assert sum(isinstance(m, torch.nn.ReLU) for m in relu) == 2
    assert all(torch.equal(a, b) for a, b in zip(relu.parameters(), tanh.parameters()))  # the same init


def test_too_many_regions_for_the_data_is_a_clear_error():
    with pytest.raises(ValueError, match="regions: 5000 regions but only"):
        partition_indices(np.zeros(100, dtype=np.int64), 5000, kind="iid", alpha=1.0, seed=0)


@pytest.mark.skipif(not TEXT.exists(), reason=f"tinyshakespeare not found at {TEXT}")
def test_char_lm_on_tinyshakespeare_learns():
    torch.manual_seed(0)
    task = _task("char-lm", path=str(TEXT), max_chars=50_000, seq_len=32, hidden=64)
    model = task.build_model(0)
    before = task.evaluate(model).value
    shard = task.shard(1, 4, 0)  # contiguous: region 1's own stretch of the text
    assert 0 < shard.num_examples < len(task.train_ids)
    batches = shard.batches(torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(60):
        opt.zero_grad()
        task.loss(model, next(batches)).backward()
        opt.step()
    after = task.evaluate(model)
    assert after.metric == "loss" and not after.higher_is_better
    assert after.value < before - 0.8, (before, after.value)  # from ~ln(vocab) towards letter statistics


def test_char_lm_missing_file_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"^path: cannot read"):
        _task("char-lm", path=str(tmp_path / "nope.txt"))
