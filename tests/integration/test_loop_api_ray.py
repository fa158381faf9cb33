"""The loop API over the real driver (issue 38): Trainer(train_fn) runs the user's loop in Ray
region actors that exchange over mutual-TLS gRPC through the emulated WAN, as `geofed run` runs a
task. Same seeds, same weights as the Task path; a driver killed with SIGKILL resumes with the
user's optimizer and data position, to the weights of an undisturbed run; a function that never
calls ctx.sync fails the start by name; regions whose functions built other initial weights take
the first region's, and a region whose loop ended leaves the run (orchestrator/driver/loops.py).

The user's loop is tests/support/user_loop.py (the Task's model, an equal AdamW, the
shard's batches, the task's loss). Imported here it travels to the actors by value (this test
module's folder is not on the actors' path); run as a script (the kill -9 test) it is __main__'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
import torch
import yaml
from safetensors.torch import load_file

from geofed.orchestrator import Trainer
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.cluster import PlacementError
from geofed.orchestrator.driver.rundir import read_jsonl
from support import user_loop

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600)]

REGIONS = ["us-east-1", "eu-west-1"]
H = 8
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))
from e2e_harness import kill_driver_and_resume

# The actors cannot import this folder's modules by name: their functions travel by value.
ray.cloudpickle.register_pickle_by_value(user_loop)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _mapping(rounds: int) -> dict:
    # The default network: the emulated WAN (proxy, the aws preset's links), mutual TLS.
    return {"run": {"name": "loop", "rounds": rounds, "seed": 5, "report": False, "checkpoint_every": 1},
            "task": {"kind": "mlp-digits", "hidden": 16},
            "regions": {"names": REGIONS, "num_cpus": 0.5},
            "compression": {"codec": "fp16"},
            "sync": {"overlap": False, "policy": {"kind": "fixed", "H": H}, "inner": {"lr": 0.003},
                     "outer": {"momentum": 0.5},
                     # generous: a deadline miss would make the runs differ
                     "deadline": {"initial_s": 30.0, "min_s": 10.0, "max_s": 60.0}},
            "ray": {"num_cpus": 4}}


def _fit(train_fn, mapping: dict, out: Path) -> dict:
    return Trainer(train_fn, config_from_mapping(json.loads(json.dumps(mapping))), out=out,
                   show_progress=False, report=False).fit()


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def _losses(run_dir: Path) -> list[tuple[int, str, float]]:
    return sorted((m["round"], m["region"], m["train_loss"]) for m in read_jsonl(run_dir / "metrics.jsonl"))


def test_the_loop_api_over_ray_trains_the_task_paths_weights(tmp_path):
    """Serial DiLoCo, 5 rounds, 2 regions over Ray actors, gRPC + mTLS and the emulated WAN."""
    mapping = _mapping(rounds=5)
    # The two runs train side by side (their own actors and run directories); generous deadlines
    # keep every update on time, so the comparison is the same as one run after the other.
    with ThreadPoolExecutor(max_workers=1) as pool:
        task_run = pool.submit(_fit, None, mapping, tmp_path / "task")
        loop_summary = _fit(user_loop.train_region, mapping, tmp_path / "loop")
        task_summary = task_run.result()

    want, got = _weights(tmp_path / "task"), _weights(tmp_path / "loop")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert _losses(tmp_path / "loop") == _losses(tmp_path / "task")  # round by round, region by region
    assert loop_summary["eval"] == task_summary["eval"]  # the user's evaluate is the task's here

    # What `geofed run` writes, the loop API writes: the records, the summary with the reports.
    run_dir = tmp_path / "loop"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert sorted((m["round"], m["region"]) for m in metrics) == [(r, g) for r in range(5) for g in sorted(REGIONS)]
    assert all(m["steps"] == H and m["bytes_sent"] > 0 and not m["peers_missing"] for m in metrics)
    assert [r["round"] for r in read_jsonl(run_dir / "rounds.jsonl")] == list(range(5))
    assert json.loads((run_dir / "summary.json").read_text()) == loop_summary
    last = {g: loss for r, g, loss in _losses(run_dir) if r == 4}
    # ctx.report after the loop saw should_stop: each region's own, by region
    assert loop_summary["reports"] == {g: {"batches": 5 * H, "stopped": True, "region": g,
                                           "last_loss": pytest.approx(last[g], abs=0.5)} for g in REGIONS}
    assert task_summary["reports"] == {}
    assert loop_summary["config"]["task"] == "train_fn support.user_loop:train_region"
    assert all(t["tls"] for t in loop_summary["transport"].values())
    assert loop_summary["config"]["emulation"] == "proxy" and loop_summary["links"]
    (started,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "started"]
    assert started["train_fn"] == "support.user_loop:train_region"


def _start_user_script(args: list[str], *, cwd: Path, log: Path) -> subprocess.Popen:
    """The user's script as its own process (its own Ray), in its own session."""
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
    out = open(log, "wb")  # closed by the child's exit; the test reads the file
    return subprocess.Popen([sys.executable, str(HERE.parent / "support" / "user_loop.py"), *args], cwd=cwd, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
def test_a_sigkilled_loop_api_run_resumes_to_the_undisturbed_weights(tmp_path):
    """kill -9 of the driver mid-run, then the same script with resume=RUN_DIR: the user's AdamW
    state and data position come back through ctx.sync(state=...) (the loader) and the Region's
    checkpoint (the optimizer), so the resumed run trains the undisturbed run's weights."""
    rounds = 10
    mapping = _mapping(rounds)
    reference = tmp_path / "reference"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(mapping))
    run_dir = tmp_path / "run"
    # The undisturbed reference (this process, the session's Ray) trains beside the killed script
    # (its own Ray); generous deadlines keep every update of both on time.
    with ThreadPoolExecutor(max_workers=1) as pool:
        undisturbed = pool.submit(_fit, user_loop.train_region, mapping, reference)
        kill_driver_and_resume(lambda log: _start_user_script([str(config), str(run_dir)], cwd=tmp_path, log=log),
                               lambda log: _start_user_script([str(config), str(run_dir), "--resume"], cwd=tmp_path,
                                                              log=log),
                               run_dir=run_dir, after_rounds=4, tmp_path=tmp_path)
        undisturbed.result()

    (event,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "resumed"]
    assert 0 <= event["from_checkpoint"] < rounds - 1
    assert [r["round"] for r in read_jsonl(run_dir / "rounds.jsonl")] == list(range(rounds))
    want, got = _weights(reference), _weights(run_dir)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert _losses(run_dir) == _losses(reference)
    summary = json.loads((run_dir / "summary.json").read_text())
    # The resumed loader went on from the checkpoint's position: every batch drawn once in all.
    assert {g: r["batches"] for g, r in summary["reports"].items()} == {g: rounds * H for g in REGIONS}


def test_a_function_that_never_calls_sync_fails_the_start_naming_it(tmp_path):
    mapping = _mapping(rounds=2)
    # The wait is the test's cost. Short is safe: an actor slower to start than this (a loaded host)
    # fails with the same message, which names ctx.sync whenever a training function runs.
    mapping["regions"]["start_timeout_s"] = 2.0
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"must call ctx.sync\(model, optimizer\) within that time"):
        _fit(_never_syncs, mapping, tmp_path / "run")
    assert time.monotonic() - t0 < 120


@pytest.mark.slow  # ~17 s on 2 cores; the default suite has the actor's side (test_loop_api) and the driver's message (above)
def test_a_function_that_raises_before_sync_fails_with_its_error(tmp_path):
    with pytest.raises(PlacementError, match="the user's own bug"):
        _fit(_raises, _mapping(rounds=2), tmp_path / "run")


def _never_syncs(ctx) -> None:
    time.sleep(3600)  # loads data forever, say


def _raises(ctx) -> None:
    raise KeyError("the user's own bug")


def test_over_ray_one_initial_model_and_a_loop_that_ends_leaves_the_run(tmp_path):
    """Each region's function seeds its model its own way: before round 0 eu-west-1 takes
    us-east-1's initial model over gRPC (events.jsonl says so). us-east-1's loop returns in round 1:
    round 2 runs eu-west-1 alone, and the run's model is eu-west-1's (~8 s after the Ray set-up)."""
    mapping = _mapping(rounds=3)
    summary = _fit(_own_init, mapping, tmp_path / "run")
    events = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "initial_model"]
    assert [(e["donor"], e["regions"]) for e in events] == [("us-east-1", ["eu-west-1"])]
    reports = summary["reports"]
    assert reports["us-east-1"]["start"] == reports["eu-west-1"]["start"]
    assert sorted((m["round"], m["region"]) for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")) == [
        (0, "eu-west-1"), (0, "us-east-1"), (1, "eu-west-1"), (1, "us-east-1"), (2, "eu-west-1")]
    assert summary["loops_ended"] == {"us-east-1": 1} and summary["ended_early"] is None
    assert [r["participants"] for r in read_jsonl(tmp_path / "run" / "rounds.jsonl")][-1] == ["eu-west-1"]
    final = _weights(tmp_path / "run")["weight"].flatten()[:8].tolist()
    assert final == pytest.approx(reports["eu-west-1"]["end"], abs=1e-6)


def _own_init(ctx) -> None:
    torch.manual_seed(1000 + ctx.region_index)  # not ctx.seed: another model in each region
    model = torch.nn.Linear(64, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = ctx.sync(model, opt)
    start = [float(x) for x in model.weight.detach().flatten()[:8]]
    gen = torch.Generator().manual_seed(ctx.region_index)
    steps = 0
    while not sync.should_stop and (ctx.region_index or steps < H + 2):  # us-east-1's data ends in round 1
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync.step(loss=float(loss.detach()))
        steps += 1
    ctx.report(start=start, end=[float(x) for x in model.weight.detach().flatten()[:8]])
