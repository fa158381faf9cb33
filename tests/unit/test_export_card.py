"""Issue 37, Why 10 / build 8: an exported model.safetensors loaded, but nothing said how the
inputs were scaled (digits needs x / 16: raw pixels score 98.7% where 99.4% is right), how many
parameters it has, what it scored, or how to build the model to load it into. Now the export
writes model-card.json and MODEL_CARD.md beside the weights, with the task's own preprocessing
(the task config's `preprocessing()`, the value digits.py divides by), the parameter count, the
run's final metric from summary.json and a load snippet that runs as written.

Before the card existed every test here failed: no model-card.json beside the weights
(FileNotFoundError).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from geofed.orchestrator import cli
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.export import write_model
from geofed.orchestrator.driver.rundir import new_run_dir, release_run_dir, write_json
from geofed.regions import checkpoint
from geofed.regions.tasks import make_task
from geofed.regions.tasks.digits_data import load_digits_arrays

CFG = {"run": {"name": "card", "rounds": 2, "report": False},
       "task": {"kind": "mlp-digits", "hidden": 8},
       "regions": {"names": ["us-east-1", "eu-west-1"]},
       "network": {"emulation": {"mode": "none"}}}


def _cfg():
    return config_from_mapping(json.loads(json.dumps(CFG)))


def _trained_digits(cfg):
    """A digits MLP trained a little on the task's own (scaled) data: its accuracy shows whether a
    reader scaled the inputs as the card says."""
    task = make_task(cfg.task, seed=0)
    model = task.build_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    x, y = torch.from_numpy(task.x_train), torch.from_numpy(task.y_train).long()
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return task, model


def test_end_of_run_card_says_x_over_16_and_its_snippet_loads_the_model(tmp_path, monkeypatch):
    cfg = _cfg()
    task, model = _trained_digits(cfg)
    eval_ = {"metric": "accuracy", "value": task.evaluate(model).value, "higher_is_better": True}
    write_model(tmp_path / "model.safetensors", cfg, model.state_dict(), round_=1, regions=["us-east-1"], eval_=eval_)
    card = json.loads((tmp_path / "model-card.json").read_text())
    assert card["task"] == "mlp-digits" and card["weights"] == "model.safetensors"
    assert card["preprocessing"]["transform"] == "x / 16" and card["preprocessing"]["scale"] == 16.0
    assert card["parameters"] == sum(p.numel() for p in model.parameters()) == 64 * 8 + 8 + 8 * 10 + 10
    assert card["metric"]["value"] == eval_["value"] and card["round"] == 1 and card["rounds_trained"] == 2
    md = (tmp_path / "MODEL_CARD.md").read_text()
    assert "x / 16" in md and "accuracy" in md and card["load"] in md
    # The snippet runs as written, in the folder of the weights, and gives back the model.
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(card["load"], scope)  # the card's own snippet is what is under test
    loaded = scope["model"]
    data, labels = load_digits_arrays()
    x = torch.from_numpy((data / card["preprocessing"]["scale"]).astype(np.float32))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
        raw = (loaded(torch.from_numpy(data.astype(np.float32))).argmax(1).numpy() == labels).mean()
        scaled = (loaded(x).argmax(1).numpy() == labels).mean()
    assert scaled > raw  # the scale the card states is the one the model was trained under


def test_geofed_export_card_takes_the_final_metric_from_summary_json(tmp_path, capsys):
    cfg = _cfg()
    run_dir = new_run_dir(cfg, str(tmp_path / "run"))
    task, model = _trained_digits(cfg)
    for r in (0, 1):
        for region in cfg.regions.names:
            checkpoint.save_atomic(checkpoint.checkpoint_path(run_dir / "checkpoints" / region, r),
                                   {"model": model.state_dict()})
        checkpoint.save_atomic(checkpoint.checkpoint_path(run_dir / "checkpoints" / "driver", r),
                               {"round": r, "alive": list(cfg.regions.names)})
    write_json(run_dir / "summary.json", {"rounds": 2, "interrupted": None,
                                          "eval": {"metric": "accuracy", "value": 0.937, "higher_is_better": True}})
    release_run_dir(run_dir)
    assert cli.main(["export", str(run_dir), "--round", "0"]) == 0
    out = run_dir / "export"
    card = json.loads((out / "model-card.json").read_text())
    assert card["weights"] == "model-round0.safetensors" and card["round"] == 0
    assert card["metric"] == {"metric": "accuracy", "value": 0.937, "higher_is_better": True, "of_round": 1,
                              "source": "summary.json"}
    assert "round 1" in (out / "MODEL_CARD.md").read_text()  # says the metric is the final round's, not this file's
    assert oct(os.stat(out / "model-card.json").st_mode & 0o777) == "0o600"
