"""model.safetensors at the end of a run, and `geofed export` of any checkpoint: standard formats
that load into the task's model and reproduce the summary's evaluation."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import write_config
from geofed.orchestrator.driver.run import Runner
from geofed.regions.tasks import make_task

pytestmark = pytest.mark.usefixtures("ray_session")


def _cfg(algorithm: str):
    return config_from_mapping({
        "run": {"name": "t", "rounds": 3, "report": False, "checkpoint_every": 1, "keep_checkpoints": 5},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": ["us-east-1", "eu-west-1", "ap-northeast-1"], "num_cpus": 0.5},
        "network": {"emulation": {"mode": "none"}},
        "compression": {"error_feedback": algorithm != "gossip"},
        "sync": {"algorithm": algorithm, "topology": "ring" if algorithm == "gossip" else "full",
                 "policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.01}},
    })


def _evaluate(cfg, state):
    task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed)
    model = task.build_model(cfg.run.seed)
    model.load_state_dict(state)  # strict: every key of the task's model, nothing else
    return task.evaluate(model).value


ALGORITHMS = ["diloco", "gossip"]


def _train(cfg, run_dir):
    run_dir.mkdir()
    write_config(run_dir, cfg)  # what `geofed run` writes first (new_run_dir)
    runner = Runner(cfg, run_dir, show_progress=False)
    try:
        return runner.run()
    finally:
        runner.shutdown()


@pytest.fixture(scope="module")
def finished_runs(ray_session, tmp_path_factory):
    """Both algorithms' runs, trained side by side (their own actors and run directories) the
    first time a test asks; each test then checks and exports its own."""
    root = tmp_path_factory.mktemp("export")
    with ThreadPoolExecutor(max_workers=len(ALGORITHMS)) as pool:
        futures = {a: pool.submit(_train, _cfg(a), root / a) for a in ALGORITHMS}
    return {a: (root / a, f.result()) for a, f in futures.items()}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_model_safetensors_reproduces_the_summary_eval(finished_runs, algorithm, capsys):
    cfg = _cfg(algorithm)
    tmp_path, summary = finished_runs[algorithm]
    state = load_file(str(tmp_path / "model.safetensors"))
    assert _evaluate(cfg, state) == summary["eval"]["value"]
    meta = json.loads((tmp_path / "model.json").read_text())
    assert meta["task"]["kind"] == "mlp-digits" and meta["round"] == 2 and meta["config"]["sync"]["algorithm"] == algorithm
    assert meta["eval"] == summary["eval"] and len(meta["regions_averaged"]) == (3 if algorithm == "gossip" else 1)
    assert oct((tmp_path / "model.safetensors").stat().st_mode & 0o777) == "0o600"

    # The newest checkpoint is the final model: `geofed export` writes the same tensors.
    out = tmp_path / "final.pt"
    assert main(["export", str(tmp_path), "--format", "torch", "--out", str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == state.keys()
    for k in state:
        torch.testing.assert_close(exported[k], state[k], rtol=0, atol=1e-7)
    assert sorted(json.loads(out.with_suffix(".json").read_text())["regions_averaged"]) == sorted(meta["regions_averaged"])

    # An earlier round is another model; a round without a checkpoint is exit 2, naming the ones there are.
    assert main(["export", str(tmp_path), "--round", "0"]) == 0
    first = load_file(str(tmp_path / "export" / "model-round0.safetensors"))
    assert any(not torch.equal(first[k], state[k]) for k in state)
    capsys.readouterr()
    assert main(["export", str(tmp_path), "--round", "7"]) == 2
    assert "rounds with checkpoints: 0, 1, 2" in capsys.readouterr().err
