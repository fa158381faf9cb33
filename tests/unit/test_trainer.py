"""Trainer (orchestrator/trainer.py, issue 38): its arguments checked before anything starts, what
the driver cannot run with a training function refused by key, a resume that would swap who takes
the inner steps refused, and `in_process=True`: the driver's Coordinator over InProcessRegions,
with the run directory's records and the loops' reports. (Over Ray: tests/integration/test_loop_api_ray.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geofed.orchestrator import Trainer
from geofed.orchestrator.config import ConfigError, config_from_mapping
from geofed.orchestrator.driver.resume import check_resume_mode
from geofed.orchestrator.driver.rundir import read_jsonl
from support import user_loop


def _fn(ctx) -> None:
    pass


def _mapping(**sync) -> dict:
    return {"run": {"name": "t", "rounds": 3, "seed": 5, "report": False},
            "task": {"kind": "mlp-digits", "hidden": 16},
            "regions": {"names": ["us-east-1", "eu-west-1"]},
            "network": {"emulation": {"mode": "none"}},
            "compression": {"codec": "fp16"},
            "sync": {"policy": {"kind": "fixed", "H": 4}, "inner": {"lr": 0.003}, "outer": {"momentum": 0.5},
                     "deadline": {"initial_s": 30.0, "max_s": 60.0}, **sync}}


def _cfg(**sync):
    return config_from_mapping(_mapping(**sync))


@pytest.mark.parametrize("bad", [42, "train.py", [_fn]])
def test_a_train_fn_that_is_not_a_function_is_refused(bad):
    with pytest.raises(TypeError, match="train_fn must be a function taking the region's context"):
        Trainer(bad)


def _no_args() -> None:
    pass


def _two_args(ctx, other) -> None:
    pass


@pytest.mark.parametrize("fn", [_no_args, _two_args, lambda: None])
def test_a_train_fn_with_the_wrong_arguments_is_refused_by_name(fn):
    with pytest.raises(TypeError, match=r"must take exactly one argument, the region's context"):
        Trainer(fn)


@pytest.mark.parametrize("fn", [_fn, lambda ctx, extra=1: None, lambda *a: None, type("Loop", (), {"__call__": lambda self, ctx: None})()])
def test_any_callable_taking_the_context_is_taken(fn):
    Trainer(fn)


def test_other_arguments_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(TypeError, match="overrides must be a sequence"):
        Trainer(_fn, overrides="run.rounds=2")
    with pytest.raises(TypeError, match="config must be a YAML path, a RunConfig or None"):
        Trainer(_fn, config={"run": {"rounds": 2}})
    with pytest.raises(ValueError, match="in_process runs keep no checkpoints"):
        Trainer(_fn, resume=tmp_path, in_process=True)
    with pytest.raises(ConfigError, match="allow_config_change: only with resume=RUN_DIR"):
        Trainer(_fn, allow_config_change=["run.rounds"])


def test_a_stop_says_how_to_continue_the_run():
    assert Trainer(None).resume_hint(Path("runs/r")) == "geofed run --resume runs/r"
    assert Trainer(_fn).resume_hint(Path("runs/r")) == "Trainer(_fn, resume='runs/r').fit() (run your script again)"


def test_a_config_error_names_the_file_and_the_dotted_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  rounds: 2\nsync:\n  policy:\n    kind: fixed\n    HH: 5\n")
    with pytest.raises(ConfigError) as info:
        Trainer(_fn, str(path)).fit()
    assert str(path) in str(info.value) and "sync.policy.HH" in str(info.value)
    with pytest.raises(ConfigError, match=r"sync\.policy\.H"):
        Trainer(_fn, _cfg(), overrides=("sync.policy.H=-3",)).fit()
    assert not list(tmp_path.glob("t-*"))  # no run directory for a run that never started


def test_a_config_for_a_function_needs_no_task(tmp_path):
    """A training function brings its model and data: the config's task may be left out (a task's run needs one)."""
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  rounds: 2\nray:\n  warm_pool_s: 60\n")
    with pytest.raises(ConfigError, match=f"{path}: ray.warm_pool_s: must be 0 with a training function"):
        Trainer(_fn, str(path)).fit()  # past the config's load: refused for what it asks, not for a task
    with pytest.raises(ConfigError, match=f"{path}: task: required key is missing"):
        Trainer(None, str(path)).fit()


@pytest.mark.parametrize(("overrides", "key"), [(("sync.algorithm=gossip", "sync.gossip.choco=false"), "sync.algorithm"),
                                                (("ray.warm_pool_s=60",), "ray.warm_pool_s")])
def test_what_the_driver_cannot_run_with_a_function_is_refused_by_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=rf"<RunConfig>: {key}: "):
        Trainer(_fn, _cfg(), overrides=overrides, out=tmp_path / "run").fit()
    assert not (tmp_path / "run").exists()


def _events(run_dir: Path, **started) -> None:
    run_dir.mkdir(exist_ok=True)
    (run_dir / "events.jsonl").write_text(json.dumps({"event": "started", "resume": False, **started}) + "\n")


def test_a_resume_that_swaps_who_takes_the_steps_is_refused(tmp_path, capsys):
    _events(tmp_path / "loop", train_fn="train:train_region")
    with pytest.raises(ConfigError, match=r"trains with the function train:train_region: run the script"):
        check_resume_mode(tmp_path / "loop", None)  # geofed run --resume of a loop-API run
    check_resume_mode(tmp_path / "loop", "train:train_region")
    check_resume_mode(tmp_path / "loop", "train:renamed")
    assert "resuming with the training function train:renamed" in capsys.readouterr().err
    _events(tmp_path / "task")  # a run from before the loop API: no train_fn recorded
    with pytest.raises(ConfigError, match="trains its task with the built-in stepper"):
        check_resume_mode(tmp_path / "task", "train:train_region")
    check_resume_mode(tmp_path / "task", None)
    check_resume_mode(tmp_path / "never-started", None)  # killed in set-up: nothing to compare


def test_in_process_the_loop_trains_what_the_task_trains_and_reports(tmp_path):
    """The driver's Coordinator over InProcessRegions, 3 rounds: the same losses round by round as
    the Task path, the records of a run, and each loop's ctx.report in the summary."""
    task = Trainer(None, _cfg(), out=tmp_path / "task", in_process=True, show_progress=False, report=False).fit()
    loop = Trainer(user_loop.train_region, _cfg(), overrides=("run.report=true",), out=tmp_path / "loop",
                   in_process=True, show_progress=False).fit()

    def losses(run):
        return [(m["round"], m["region"], m["train_loss"]) for m in read_jsonl(tmp_path / run / "metrics.jsonl")]

    assert losses("loop") == losses("task") and len(losses("loop")) == 6
    assert loop["eval"] == task["eval"] and loop["rounds"] == 3 and loop["in_process"] is True
    assert {g: (r["batches"], r["stopped"]) for g, r in loop["reports"].items()} == {
        "us-east-1": (12, True), "eu-west-1": (12, True)}
    assert task["reports"] == {}
    assert json.loads((tmp_path / "loop" / "summary.json").read_text()) == loop
    assert [r["round"] for r in read_jsonl(tmp_path / "loop" / "rounds.jsonl")] == [0, 1, 2]
    page = (tmp_path / "loop" / "report" / "report.html").read_text()  # the report shows what the loops reported
    assert '<h2 id="reports">Reports</h2>' in page and "<td>batches</td><td>12</td>" in page


def test_in_process_a_function_that_never_calls_sync_fails_at_the_start_deadline(tmp_path):
    import threading

    release = threading.Event()

    def stuck(ctx) -> None:
        release.wait(30)

    mapping = _mapping()
    mapping["regions"]["start_timeout_s"] = 1.0
    try:
        with pytest.raises(TimeoutError, match=r"did not call ctx.sync\(\) within 1 s"):
            Trainer(stuck, config_from_mapping(mapping), out=tmp_path / "run", in_process=True,
                    show_progress=False).fit()
    finally:
        release.set()


def test_trackers_get_the_reports_numbers_at_the_last_round(tmp_path):
    from geofed.orchestrator.driver.trackers import Trackers

    logged = []

    class Fake:
        def log_round(self, round_, metrics):
            logged.append((round_, metrics))

    trackers = Trackers(_cfg(), tmp_path)  # run.trackers empty: nothing to log to
    trackers.log_reports(2, {"a": {"acc": 0.9}})
    assert logged == []
    trackers.items["fake"] = Fake()
    trackers.log_reports(2, {"a": {"acc": 0.9, "batches": 12, "note": "x", "ok": True}, "b": {"acc": 0.8}})
    assert logged == [(2, {"report/a/acc": 0.9, "report/a/batches": 12.0, "report/b/acc": 0.8})]


def test_a_functions_model_card_names_it_and_export_points_to_the_final_model(tmp_path, capsys):
    """The end-of-run model of a loop-API run is the function's model: the card names the function
    (not the config's placeholder task) and `geofed export`, which builds the task's model to name a
    checkpoint's tensors, refuses and says where the final model is."""
    import torch

    from geofed.orchestrator.cli import main
    from geofed.orchestrator.driver.export import write_model

    path = write_model(tmp_path / "model.safetensors", _cfg(), {"w": torch.zeros(3)}, round_=2, regions=["a"],
                       trained_by="train:train_region")
    card = json.loads((tmp_path / "model-card.json").read_text())
    assert card["task"] == "train_fn train:train_region" and card["preprocessing"] is None
    assert "model.load_state_dict(state)" in card["load"] and "make_task" not in card["load"]
    assert "the training function's inputs" in (tmp_path / "MODEL_CARD.md").read_text()
    assert path.exists()
    run_dir = tmp_path / "run"
    _events(run_dir, train_fn="train:train_region")
    (run_dir / "config.yaml").write_text("task:\n  kind: mlp-digits\n")
    assert main(["export", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "trained the model of the function train:train_region" in err and "model.safetensors" in err


def _own_init_loop(limits: dict[int, int] | None = None, seen: dict | None = None):
    """A user's function that builds its model from a seed of its own per region (no ctx.seed), as a
    user who does not seed model construction gets; `limits`: batches by region index."""
    import torch

    from geofed.regions.tasks import make_task

    def train_region(ctx) -> None:
        task = make_task(ctx.config.task, batch_size=ctx.config.sync.inner.batch_size, seed=ctx.seed, device="cpu")
        torch.manual_seed(1000 + ctx.region_index)  # in-process the regions share a generator: made to differ
        model = torch.nn.Linear(64, 10)  # drawn from the generator as it happens to be: one per region
        opt = torch.optim.AdamW(model.parameters(), lr=ctx.config.sync.inner.lr)
        loader = user_loop.Loader(ctx, task, (limits or {}).get(ctx.region_index))
        sync = ctx.sync(model, opt, state={"loader": loader})
        if seen is not None:
            seen[ctx.region, "start"] = [p.detach().clone() for p in model.parameters()]
        for batch in loader:
            x, y = batch[0], batch[1]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sync.step(loss=float(loss.detach()))
            if sync.should_stop:
                break
        if seen is not None:
            seen[ctx.region, "end"] = [p.detach().clone() for p in model.parameters()]
        ctx.report(batches=loader.drawn)

    return train_region


def test_regions_whose_functions_built_other_initial_weights_start_from_the_first_ones(tmp_path):
    """As DDP broadcasts rank 0's model: before round 0 the second region takes the first's initial
    model (its own init differed), so both end on one synchronised model (serial DiLoCo, identity codec:
    fp16 rounds the peer's update and not a region's own)."""
    seen: dict = {}
    summary = Trainer(_own_init_loop(seen=seen), _cfg(overlap=False), overrides=("compression.codec=identity",),
                      out=tmp_path / "run", in_process=True, show_progress=False, report=False).fit()
    a, b = "us-east-1", "eu-west-1"
    assert all(torch_equal(x, y) for x, y in zip(seen[a, "start"], seen[b, "start"], strict=True))
    assert all(torch_equal(x, y) for x, y in zip(seen[a, "end"], seen[b, "end"], strict=True))
    assert summary["reports"] == {a: {"batches": 12}, b: {"batches": 12}}


def test_a_region_that_cannot_take_the_first_ones_model_fails_the_run_by_name():
    import torch

    from geofed.orchestrator.driver.loops import one_initial_model
    from geofed.orchestrator.driver.recovery import RunFailed

    sketches = {"a": torch.ones(8), "b": torch.ones(8), "c": torch.zeros(8)}
    took: list = []
    # Equal sketches: nothing moves.
    assert one_initial_model(["a", "b"], lambda names: {n: sketches[n] for n in names}, took.append, print) == []
    assert took == []
    # A catch-up that leaves "c" as it was: the run fails, naming it and the fix.
    with pytest.raises(RunFailed, match=r"regions c could not take region a's initial model.*ctx\.seed"):
        one_initial_model(["a", "b", "c"], lambda names: {n: sketches[n] for n in names}, took.append, print)
    assert took == [{"c": ["a"]}]


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y)


def test_a_region_whose_loop_ended_leaves_the_run_and_the_run_ends_with_the_last_loop(tmp_path):
    """us-east-1's data ends after 6 batches (round 1 of rounds of 4 steps): from round 2 it is
    planned no more and eu-west-1 goes on alone (no zero update of the ended region mixed in); once
    eu-west-1's 10 batches end too (round 2), the run stops before its 5 planned rounds."""
    mapping = _mapping(overlap=False)
    mapping["run"]["rounds"] = 5
    summary = Trainer(_own_init_loop(limits={0: 6, 1: 10}), config_from_mapping(mapping), out=tmp_path / "run",
                      in_process=True, show_progress=False, report=False).fit()
    rounds = read_jsonl(tmp_path / "run" / "rounds.jsonl")
    assert [r["participants"] for r in rounds] == [["us-east-1", "eu-west-1"]] * 2 + [["eu-west-1"]]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [(m["round"], m["region"], m["steps"]) for m in metrics] == [
        (0, "us-east-1", 4), (0, "eu-west-1", 4), (1, "us-east-1", 2), (1, "eu-west-1", 4), (2, "eu-west-1", 2)]
    assert summary["loops_ended"] == {"us-east-1": 1, "eu-west-1": 2}
    assert summary["ended_early"] == "every region's training loop ended (the last in round 2)"
    assert summary["reports"] == {"us-east-1": {"batches": 6}, "eu-west-1": {"batches": 10}}
