"""The loop API's examples (docs/own-loop.md) run as the README and the docs give them.

- examples/own_loop/plain.py trains on its own; geofed_loop.py is the same script with geofed and
  changes at most 10 of its lines; `python examples/own_loop/geofed_loop.py --rounds 2` runs over
  Ray, gRPC and the default config's emulated WAN (slow: a minute of set-up on 2 cores; its
  function also runs in-process in the default suite).
- examples/hf_trainer.py trains its tiny GPT-2 through transformers.Trainer and GeofedCallback,
  2 rounds x 2 regions, offline, on a small generated text: after the final outer step of serial
  DiLoCo with a lossless codec the regions' saved models are equal, and the losses are finite.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
OWN_LOOP = ROOT / "examples" / "own_loop"


def _run(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    # The script starts a Ray of its own; it must not join a cluster this session may have started.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["HF_HUB_OFFLINE"] = "1"  # tests never reach the internet
    env["OMP_NUM_THREADS"] = "1"  # as the Ray session gives its actors: a busy 2-core host thrashes with more
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_geofed_version_changes_at_most_ten_lines_of_the_plain_script():
    plain = (OWN_LOOP / "plain.py").read_text().splitlines()
    geofed = (OWN_LOOP / "geofed_loop.py").read_text().splitlines()
    changes = [op for op in difflib.SequenceMatcher(a=plain, b=geofed, autojunk=False).get_opcodes() if op[0] != "equal"]
    marked = sum((i2 - i1) + (j2 - j1) for _, i1, i2, j1, j2 in changes)  # diff's `<` and `>` lines
    changed = sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in changes)
    assert changed <= 10 and marked <= 20, (changed, marked)
    added = "\n".join(line for *_, j1, j2 in changes for line in geofed[j1:j2])
    for needed in ("from geofed.orchestrator import Trainer", "def train(ctx):", "ctx.sync(model, opt, state=",
                   "sync.step(loss=", "if sync.should_stop:", "ctx.report(", "Trainer(train, "):
        assert needed in added, needed


def test_the_plain_script_trains_on_its_own(tmp_path):
    done = _run([str(OWN_LOOP / "plain.py"), "--steps", "200"], tmp_path, timeout_s=300)
    assert done.returncode == 0, done.stderr[-2000:]
    accuracy = float(done.stdout.split("held-out accuracy ")[1].split()[0])
    assert accuracy > 0.85, done.stdout


def test_the_geofed_loop_function_trains_across_regions_in_process(tmp_path):
    from geofed.orchestrator import Trainer
    from geofed.orchestrator.config import load_config

    example = _module(OWN_LOOP / "geofed_loop.py")
    summary = Trainer(example.train, overrides=["run.rounds=2"], out=tmp_path / "run", in_process=True,
                      show_progress=False, report=False).fit()
    reports = summary["reports"]
    assert set(reports) == set(load_config().regions.names), reports  # the default config's four regions
    for report in reports.values():
        assert report["accuracy"] > 0.85 and report["steps"] > 0, reports
    assert summary["rounds"] == 2


@pytest.mark.slow
def test_geofed_loop_script_runs_across_the_default_emulated_regions(tmp_path):
    done = _run([str(OWN_LOOP / "geofed_loop.py"), "--rounds", "2"], tmp_path, timeout_s=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2
    assert len(summary["reports"]) == 4 and all(r["accuracy"] > 0.8 for r in summary["reports"].values()), summary["reports"]
    # Over the emulated WAN: every link of the 4-region full mesh carried updates.
    assert len(summary["links"]) == 12 and all(v["bytes"] > 0 for v in summary["links"].values())
    assert (run_dir / "report" / "report.html").is_file()


def _small_text(path: Path) -> Path:
    rng = random.Random(0)
    words = "to be or not that is the question whether tis nobler in the mind suffer slings arrows".split()
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)), encoding="utf-8")
    return path


def test_hf_trainer_example_two_rounds_two_regions_ends_with_equal_models(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'geofed[hf]')")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install 'geofed[hf]')")
    from safetensors.torch import load_file

    out = tmp_path / "run"
    text = _small_text(tmp_path / "text.txt")
    done = _run([str(ROOT / "examples" / "hf_trainer.py"), "--rounds", "2", "--text", str(text), "--out", str(out),
                 "--in-process", "--set", "sync.policy.H=5", "--set", "compression.codec=identity",
                 "--set", "run.eval_every=1"],  # an evaluation mid-training too: on a copy of the hooked model
                tmp_path, timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and set(summary["reports"]) == {"us-east-1", "eu-west-1"}
    for report in summary["reports"].values():
        assert report["steps"] == 10  # 2 rounds of H=5 optimizer steps: the callback stopped transformers
        assert math.isfinite(report["train_loss"]) and math.isfinite(report["heldout_loss"]), report
    assert math.isfinite(summary["eval"]["value"]) and summary["eval"]["metric"] == "loss"
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    evaluated = [r["eval_round"] for r in rounds if r.get("eval_avg")]
    assert evaluated == [0, 1], rounds  # round 0's evaluation is mid-training, on a copy of the hooked model
    first, second = (load_file(out / "hf" / region / "model.safetensors") for region in ("us-east-1", "eu-west-1"))
    assert first.keys() == second.keys()
    unequal = [k for k in first if not torch.equal(first[k], second[k])]
    assert unequal == [], f"the regions' models differ after the final outer step in {unequal}"
