"""The loop API's region side (regions/loop.py, issue 38): the user's loop takes the inner steps.

In process (InProcessRegions over the in-memory transport): the loop API trains the weights the
Task path trains for the same seeds; the hand-off never hangs (a loop that raises, returns early
or stops taking steps); the user's objects go through checkpoints; time budgets and max_steps
hold; what loop mode cannot do is refused by name.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.loop import LoopStepper, LoopTimeouts, RegionContext
from geofed.regions.messages import RoundPlan
from geofed.regions.region import Region
from geofed.regions.tasks import make_task
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from support.user_loop import Loader

REGIONS = ["a", "b", "c"]
ROUNDS, H = 5, 4
QUICK = LoopTimeouts(start_s=60.0, step_s=20.0, park_s=120.0, finish_s=20.0)


def _cfg(regions=REGIONS, privacy=None, **sync):
    return config_from_mapping(_mapping(regions, privacy, **sync), source="test_loop_api")


def _mapping(regions=REGIONS, privacy=None, **sync) -> dict:
    m: dict = {"run": {"name": "loop", "seed": 7, "rounds": ROUNDS},
               "task": {"kind": "mlp-digits", "hidden": 16},
               "regions": {"names": regions},
               "network": {"emulation": {"mode": "none"}},
               "compression": {"codec": "fp16"},
               "sync": {"policy": {"kind": "fixed", "H": H}, "inner": {"lr": 0.01}, "outer": {"momentum": 0.5},
                        "deadline": {"initial_s": 30.0, "max_s": 60.0}, **sync}}
    if privacy is not None:
        m["privacy"] = privacy
    return m


def task_loop(limit: int | None = None, *, fail_at: int | None = None, log: list | None = None):
    """The user's function: the Task's own model, an equal AdamW, the shard's batches and its loss."""

    def train_region(ctx: RegionContext) -> None:
        cfg = ctx.config
        task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=ctx.seed, device="cpu")
        model = task.build_model(ctx.seed)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sync.inner.lr,
                                weight_decay=cfg.sync.inner.weight_decay)
        loader = Loader(ctx, task, limit)
        sync = ctx.sync(model, opt, state={"loader": loader}, examples=loader.shard.num_examples)
        for k, batch in enumerate(loader):
            if fail_at is not None and k == fail_at and ctx.region == "b":
                raise KeyError("the user's own bug")
            opt.zero_grad(set_to_none=False)
            loss = task.loss(model, batch)
            loss.backward()
            opt.step()
            if log is not None:
                log.append((ctx.region, sync.round, sync.H))
            sync.step(loss=float(loss.detach()))
            if sync.should_stop:
                break
        ctx.report(batches=loader.drawn, stopped=sync.should_stop)

    return train_region


def _run(group: InProcessRegions, rounds=ROUNDS, regions=REGIONS, start=0, **plan):
    reports = []
    for r in range(start, rounds):
        reports.append(group.run_round({reg: RoundPlan(round=r, H=H, final=r == rounds - 1, **plan)
                                        for reg in regions}))
    return reports


def _weights(group: InProcessRegions) -> dict[str, list[torch.Tensor]]:
    group.call(lambda r: r.finish_pending())
    return {reg: [p.detach().clone() for p in w.params] + [g.detach().clone() for g in w.algorithm.eval_params()]
            for reg, w in group.workers.items()}


def _train(tmp_path: Path, cfg, train_fn=None):
    with InProcessRegions(cfg, tmp_path, train_fn=train_fn, timeouts=QUICK) as group:
        reports = _run(group)
        weights = _weights(group)
        finished = group.finish() if train_fn is not None else {}
    return weights, reports, finished


def test_the_loop_api_trains_the_task_paths_weights(tmp_path):
    """Serial DiLoCo, 5 rounds, 3 regions: bit for bit the weights of the Task path."""
    cfg = _cfg(overlap=False)
    want, task_reports, _ = _train(tmp_path / "task", cfg)
    got, loop_reports, finished = _train(tmp_path / "loop", cfg, task_loop())
    for reg in REGIONS:
        assert all(torch.equal(a, b) for a, b in zip(got[reg], want[reg], strict=True)), reg
    for a, b in zip(task_reports, loop_reports, strict=True):
        for reg in REGIONS:
            assert b[reg].steps.steps == a[reg].steps.steps == H
            assert b[reg].steps.train_loss == pytest.approx(a[reg].steps.train_loss, rel=1e-6)
    # Every loop saw should_stop after the run and returned; its report is what it passed.
    assert finished == {reg: {"batches": ROUNDS * H, "stopped": True} for reg in REGIONS}


@pytest.mark.parametrize("overlap", [True, "eager"])
def test_the_loop_api_with_overlap_matches_within_tolerance(tmp_path, overlap):
    """sync.overlap true (delayed) and eager: the exchange thread runs beside the user's steps. The
    same steps in the same order: equal to float rounding, rtol 1e-5 (measured: bit-identical here,
    5 rounds x 3 regions, both modes)."""
    cfg = _cfg(overlap=overlap)
    want, _, _ = _train(tmp_path / "task", cfg)
    got, _, _ = _train(tmp_path / "loop", cfg, task_loop())
    for reg in REGIONS:
        for a, b in zip(got[reg], want[reg], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_loop_that_raises_fails_the_round_with_its_error(tmp_path):
    # Short deadlines: the other regions' rounds wait for the failed region's update until theirs.
    cfg = _cfg(deadline={"initial_s": 1.0, "min_s": 0.5, "max_s": 2.0})
    with InProcessRegions(cfg, tmp_path, train_fn=task_loop(fail_at=6), timeouts=QUICK) as group:
        _run(group, rounds=1)
        with pytest.raises(KeyError, match="the user's own bug") as info:
            _run(group, rounds=2, start=1)
        # The user's traceback, not only its message: the frame that raised is the user's function.
        frames = [f.name for f in __import__("traceback").extract_tb(info.value.__traceback__)]
        assert "train_region" in frames


def test_a_loop_that_runs_out_of_data_ends_its_rounds_with_the_steps_taken(tmp_path):
    """6 batches for rounds of 4: round 0 takes 4, round 1 takes 2 and says the loop ended, round 2
    takes none and still exchanges; the run ends cleanly."""
    with InProcessRegions(_cfg(), tmp_path, train_fn=task_loop(limit=6), timeouts=QUICK) as group:
        t0 = time.monotonic()
        reports = _run(group, rounds=3)
        assert time.monotonic() - t0 < 15  # no wait ran to a deadline
        finished = group.finish()
    for reg in REGIONS:
        r0, r1, r2 = (reports[r][reg] for r in range(3))
        assert r0.steps.steps == 4 and "loop_ended" not in r0.extra
        assert r1.steps.steps == 2 and r1.extra["loop_ended"] is True and math.isfinite(r1.steps.train_loss)
        assert r2.steps.steps == 0 and r2.steps.train_loss is None and r2.extra["loop_ended"] is True
        assert not r2.exchange.peers_missing  # it still took part in the exchange
        assert finished[reg] == {"batches": 6, "stopped": False}


def test_should_stop_and_the_round_the_loop_sees(tmp_path):
    seen: list = []
    with InProcessRegions(_cfg(), tmp_path, train_fn=task_loop(log=seen), timeouts=QUICK) as group:
        _run(group, rounds=2)
        finished = group.finish()
    for reg in REGIONS:
        assert [(r, h) for g, r, h in seen if g == reg] == [(0, H)] * H + [(1, H)] * H
        assert finished[reg]["stopped"] is True


def test_a_loop_that_stops_stepping_fails_the_round_at_its_deadline(tmp_path):
    release = threading.Event()

    def stuck(ctx):
        model = torch.nn.Linear(2, 1)
        sync = ctx.sync(model, torch.optim.SGD(model.parameters(), lr=0.1))
        sync.step(loss=1.0)
        release.wait(30)  # hangs (a dead data source, a deadlock)

    timeouts = LoopTimeouts(start_s=20.0, step_s=0.5, park_s=30.0, finish_s=5.0)
    with InProcessRegions(_cfg(regions=["a"]), tmp_path, train_fn=stuck, timeouts=timeouts) as group:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="took no step for 0.5 s"):
            group.run_round({"a": RoundPlan(round=0, H=H)})
        assert time.monotonic() - t0 < 5
        release.set()


def test_a_function_that_never_calls_sync_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(RuntimeError, match="without calling ctx.sync"):
        InProcessRegions(_cfg(regions=["a"]), tmp_path, train_fn=lambda ctx: None, timeouts=QUICK)

    def broken(ctx):
        raise ImportError("no such model")

    with pytest.raises(ImportError, match="no such model"):
        InProcessRegions(_cfg(regions=["a"]), tmp_path, train_fn=broken, timeouts=QUICK)


def test_user_state_and_the_optimizer_go_through_a_checkpoint(tmp_path):
    """Region.state_dict -> load_state_dict on a fresh region: the user's loader position, the
    user's optimizer state and the model come back; the built-in data stream is not in it."""
    cfg = _cfg(regions=["a"])
    with InProcessRegions(cfg, tmp_path / "one", train_fn=task_loop(), timeouts=QUICK) as group:
        _run(group, rounds=2, regions=["a"])
        state = group.workers["a"].state_dict()
        model_before = [p.detach().clone() for p in group.workers["a"].params]
        adam_before = group.workers["a"].inner.state_dict()
    assert "data" not in state and state["user"] == {"loader": {"drawn": 2 * H}}
    with InProcessRegions(cfg, tmp_path / "two", train_fn=task_loop(), timeouts=QUICK) as fresh:
        w = fresh.workers["a"]
        assert w.user_state["loader"].drawn == 0
        w.load_state_dict(state)
        assert w.user_state["loader"].drawn == 2 * H
        assert all(torch.equal(a, b) for a, b in zip(w.params, model_before))
        restored = w.inner.state_dict()
        assert restored["state"][0]["step"] == adam_before["state"][0]["step"] == 2 * H
        assert torch.equal(restored["state"][0]["exp_avg"], adam_before["state"][0]["exp_avg"])
        # The restored loader resumes at its position: the next round draws batches 9..12.
        _run(fresh, rounds=3, regions=["a"], start=2)
        assert w.user_state["loader"].drawn == 3 * H
        fresh.finish()


def _stepper_region(tmp_path, stepper: LoopStepper, cfg, evaluate=None):
    """A Region in loop mode around `stepper`, over a one-region in-memory hub."""
    model = torch.nn.Linear(4, 1)
    return Region(cfg, "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()), model=model,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1), stepper=stepper, evaluate=evaluate)


def _user_thread(stepper: LoopStepper, step_s: float, counted: list[int]) -> threading.Thread:
    from geofed.regions.loop import Sync

    def loop():
        sync = Sync(stepper)
        stepper.wait_first()
        while not sync.should_stop:
            time.sleep(step_s)
            counted.append(1)
            sync.step(loss=1.0)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_the_loop_stepper_honours_a_time_budget_and_max_steps():
    stepper = LoopStepper("a", timeouts=QUICK)
    counted: list[int] = []
    thread = _user_thread(stepper, 0.02, counted)
    # A budget of ~10 steps, max_steps far above it: the budget ends the round.
    m = stepper.inner_steps(4, 1.0, budget_s=0.2, max_steps=100)
    # Stopped by the budget (pacing.budget_over: the next step would end past it), whatever this
    # host's load makes a 20 ms step take: not before, and not later than the step that crossed it.
    assert 1 <= m["steps"] < 100, m
    assert m["compute_s"] + m["step_time_s"] > 0.2 * 0.8 and m["compute_s"] < 0.2 + 2 * m["step_time_s"], m
    # max_steps ends it before a long budget.
    m = stepper.inner_steps(4, 1.0, budget_s=30.0, max_steps=3)
    assert m["steps"] == 3 and m["train_loss"] == 1.0
    # Without a budget: H steps.
    assert stepper.inner_steps(4, 1.0)["steps"] == 4
    stepper.stop()
    thread.join(5)
    assert not thread.is_alive()


def test_a_non_finite_loss_raises_in_the_rounds_thread_with_metrics():
    stepper = LoopStepper("a", timeouts=QUICK)

    def loop():
        stepper.wait_first()
        stepper.step(1.0)
        stepper.step(float("nan"))

    threading.Thread(target=loop, daemon=True).start()
    with pytest.raises(FloatingPointError) as info:
        stepper.inner_steps(4, 1.0)
    assert info.value.metrics["steps"] == 2  # ended at the bad step, not H steps later
    stepper.stop()


@pytest.mark.parametrize("sync, privacy, key", [
    ({"algorithm": "allreduce"}, None, "sync.algorithm"),
    ({"algorithm": "gossip", "topology": "ring", "gossip": {"tracking": True, "choco": False}}, None,
     "sync.gossip.tracking"),
    ({}, {"dp": {"mode": "record", "clip": 1.0, "noise_multiplier": 0.5}}, "privacy.dp.mode"),
    ({}, {"dp": {"mode": "update", "clip": 1.0, "noise_multiplier": 0.5}}, r"examples=N"),
])
def test_what_loop_mode_cannot_do_is_refused_by_name(tmp_path, sync, privacy, key):
    cfg = _cfg(regions=["a"], privacy=privacy, **sync)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _stepper_region(tmp_path, LoopStepper("a"), cfg)


def test_loop_mode_has_no_task_and_evaluates_with_the_users_function(tmp_path):
    cfg = _cfg(regions=["a"])
    cases = [(None, "train_loss", False), (lambda m: {"metric": "acc", "value": 0.5, "higher_is_better": True}, "acc", True),
             (lambda m: 0.25, "eval", False)]
    for evaluate, metric, higher in cases:
        w = _stepper_region(tmp_path, LoopStepper("a"), cfg, evaluate=evaluate)
        try:
            assert w.task is None and w.shard is None and w.gauntlet is None
            for got in (w.evaluate(), w.evaluate_synced()):
                assert (got["metric"], got["higher_is_better"]) == (metric, higher)
        finally:
            w.close()


def test_a_resumed_loop_run_trains_the_uninterrupted_runs_weights(tmp_path):
    """Checkpoint every region after round 1, new regions and new user loops restore them (the
    loader's position and the user's optimizer through `state=`), rounds 2-3: the weights of four
    rounds straight, bit for bit (serial DiLoCo)."""
    cfg = _cfg(overlap=False)
    with InProcessRegions(cfg, tmp_path / "straight", train_fn=task_loop(), timeouts=QUICK) as group:
        _run(group, rounds=4)
        want = _weights(group)
        group.finish()
    with InProcessRegions(cfg, tmp_path / "cut", train_fn=task_loop(), timeouts=QUICK) as first:
        for r in range(2):  # the plans of a 4-round run, cut after round 1
            first.run_round({reg: RoundPlan(round=r, H=H) for reg in REGIONS})
        first.call(lambda w: w.save_checkpoint())
    with InProcessRegions(cfg, tmp_path / "cut", train_fn=task_loop(), timeouts=QUICK) as resumed:
        restored = resumed.call(lambda w: w.restore_checkpoint())
        assert {r["round"] for r in restored.values()} == {1}
        _run(resumed, rounds=4, start=2)
        got = _weights(resumed)
        finished = resumed.finish()
    for reg in REGIONS:
        assert all(torch.equal(a, b) for a, b in zip(got[reg], want[reg], strict=True)), reg
        assert finished[reg]["batches"] == 4 * H


def test_gap_filling_is_skipped_in_loop_mode_with_a_log_line(tmp_path, caplog):
    cfg = _cfg(regions=["a"], overlap=True, pacing={"mode": "time-budget", "fill_gaps": True})
    with caplog.at_level("INFO", logger="geofed.regions.loop"):
        w = _stepper_region(tmp_path, LoopStepper("a"), cfg)
    try:
        assert w.gap_fill not in w.hooks
        assert "sync.pacing.fill_gaps is skipped with the loop API" in caplog.text
        # A round planned with a fill arms nothing: no thread steps between rounds.
        w.gap_fill.report(RoundPlan(round=0, H=H, fill=True), {})
        with w.gap_fill.paused():
            pass
        assert not w.gap_fill.running
    finally:
        w.close()


def test_evaluation_rounds_use_the_users_evaluate_on_the_synchronised_model(tmp_path):
    seen: list = []

    def evaluate(model):
        seen.append(model)
        return {"metric": "accuracy", "value": 0.75, "higher_is_better": True}

    def train_region(ctx):
        task = make_task(ctx.config.task, batch_size=32, seed=ctx.seed, device="cpu")
        model = task.build_model(ctx.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sync = ctx.sync(model, opt, evaluate=evaluate)
        for batch in Loader(ctx, task):
            loss = task.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sync.step()  # no loss passed: the round's train_loss is None
            if sync.should_stop:
                break
        seen.append(model)

    for overlap in (False, True):
        seen.clear()
        with InProcessRegions(_cfg(regions=["a", "b"], overlap=overlap), tmp_path / str(overlap),
                              train_fn=train_region, timeouts=QUICK) as group:
            reports = _run(group, rounds=2, regions=["a", "b"], evaluate=True)
            user_models = {id(w.model) for w in group.workers.values()}
            group.finish()
        # With overlap an eval round's model is evaluated when its exchange completes (reported a round later).
        for m in [reports[1]["a"], reports[1]["b"]] + ([] if overlap else [reports[0]["a"]]):
            assert m.evaluation.eval["metric"] == "accuracy" and m.evaluation.eval["value"] == 0.75, overlap
            assert m.steps.train_loss is None and m.steps.steps == H
        evaluated = {id(model) for model in seen[:-2]}
        assert evaluated and not evaluated & user_models  # a scratch copy, never the user's live model


def test_report_takes_plain_values_only(tmp_path):
    def train_region(ctx):
        model = torch.nn.Linear(2, 1)
        ctx.report(loss=0.5, note="ok", per_class={"a": 1})
        ctx.report(weights=model.weight)  # a tensor: refused by name

    with pytest.raises(TypeError, match=r"ctx.report\(weights=...\)"):
        InProcessRegions(_cfg(regions=["a"]), tmp_path, train_fn=train_region, timeouts=QUICK)


def test_the_region_actor_runs_the_users_function(tmp_path):
    """RegionActor(train_fn=...) as a plain class (no Ray): its region is the one ctx.sync built
    (gRPC transport with mutual TLS), its rounds are the loop's steps, finish_loop the report."""
    from geofed.p2p.tls import make_pki
    from geofed.regions.actor import RegionActor

    def train_region(ctx):
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = ctx.sync(model, opt, state={"opt": opt})
        steps = 0
        while not sync.should_stop:
            loss = model(torch.ones(2, 3)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sync.step(loss=loss.item())
            steps += 1
        ctx.report(steps=steps, device=str(ctx.device))

    make_pki(tmp_path / "tls", ["a"])
    actor = RegionActor(_cfg(regions=["a"]), "a", str(tmp_path), train_fn=train_region)
    try:
        actor.start()
        actor.connect({})
        losses = [actor.run_round(RoundPlan(round=r, H=3, final=r == 1)).steps for r in range(2)]
        assert [s.steps for s in losses] == [3, 3] and losses[1].train_loss < losses[0].train_loss
        assert Path(actor.save_checkpoint()).exists()
        assert actor.finish_loop() == {"steps": 6, "device": "cpu"}
    finally:
        actor.close()


def test_a_parked_loop_and_the_end_of_the_run_have_deadlines_too(tmp_path):
    # A loop parked past park_s (no round came: the driver is gone) gets a TimeoutError in its thread.
    stepper = LoopStepper("a", timeouts=LoopTimeouts(park_s=0.2))
    with pytest.raises(TimeoutError, match="no round started for 0.2 s"):
        stepper.wait_first()
    # A function that does not return once told the run is over: finish says so after finish_s.
    release = threading.Event()

    def lingers(ctx):
        model = torch.nn.Linear(2, 1)
        ctx.sync(model, torch.optim.SGD(model.parameters(), lr=0.1))
        release.wait(30)

    timeouts = LoopTimeouts(start_s=20.0, step_s=5.0, park_s=30.0, finish_s=0.3)
    with InProcessRegions(_cfg(regions=["a"]), tmp_path, train_fn=lingers, timeouts=timeouts) as group:
        with pytest.raises(TimeoutError, match="did not return within 0.3 s"):
            group.finish()
        release.set()


def test_restarting_a_loop_region_runs_its_function_afresh(tmp_path):
    """InProcessRegions.restart (a restarted process): the old loop is released and returns, the
    function runs again and its new region restores the checkpoint before its loop's first batch."""
    cfg = _cfg(regions=["a"])
    with InProcessRegions(cfg, tmp_path, train_fn=task_loop(), timeouts=QUICK) as group:
        _run(group, rounds=1, regions=["a"])
        group.call(lambda w: w.save_checkpoint())
        old_host, old = group.hosts["a"], group.workers["a"]
        new = group.restart("a")
        assert new is not old and old_host.report == {"batches": H, "stopped": True}
        assert new.restore_checkpoint()["round"] == 0
        _run(group, rounds=2, regions=["a"], start=1)
        assert group.finish() == {"a": {"batches": 2 * H, "stopped": True}}


def test_in_process_loops_take_turns_step_by_step_not_round_by_round(tmp_path):
    """The generator lock is held per step of a user's loop (from sync.step's return to its next
    call), not for a region's whole round: while one region's loop is out of its step (here the
    emulated slowdown's sleep after it), another region's loop steps. Held per round, every step of
    one region came before any of the other's."""
    order: list[tuple[str, int]] = []

    def train_region(ctx):
        model = torch.nn.Linear(2, 1)
        sync = ctx.sync(model, torch.optim.SGD(model.parameters(), lr=0.1))
        while not sync.should_stop:
            time.sleep(0.02)  # the step's compute
            order.append((ctx.region, sync.round))
            sync.step(loss=1.0)

    cfg = config_from_mapping({**_mapping(regions=["a", "b"], overlap=False),
                               "regions": {"names": ["a", "b"], "emulation": {"slowdown": {"a": 2.0, "b": 2.0}}}},
                              source="test_loop_api")
    with InProcessRegions(cfg, tmp_path, train_fn=train_region, timeouts=QUICK) as group:
        _run(group, rounds=1, regions=["a", "b"])
        group.finish()
    first = [g for g, r in order if r == 0]
    assert sorted(first) == ["a"] * H + ["b"] * H
    assert first != sorted(first) and first != sorted(first, reverse=True), first  # interleaved


def test_a_region_actor_whose_function_fails_before_sync_raises_its_error_at_once(tmp_path):
    """RegionActor(train_fn=...) as a plain class: the function's own exception comes out of the
    actor's creation (the driver's PlacementError then carries it); a function that never reaches
    ctx.sync fails it after regions.start_timeout_s, and neither waits on the stuck thread after."""
    from geofed.regions.actor import RegionActor

    def raises(ctx):
        raise KeyError("the user's own bug")

    with pytest.raises(KeyError, match="the user's own bug"):
        RegionActor(_cfg(regions=["a"]), "a", str(tmp_path), train_fn=raises)
    release = threading.Event()
    mapping = _mapping(regions=["a"])
    mapping["regions"] = {"names": ["a"], "start_timeout_s": 0.5}
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"did not call ctx.sync\(\) within 0.5 s"):
            RegionActor(config_from_mapping(mapping, source="test_loop_api"), "a", str(tmp_path),
                        train_fn=lambda ctx: release.wait(30))
        assert time.monotonic() - t0 < 3  # not the 5 s a join of the stuck thread would add
    finally:
        release.set()
