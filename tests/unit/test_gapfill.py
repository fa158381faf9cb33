"""sync.pacing.fill_gaps (regions/gapfill.py): the filler steps a real torch model on its own thread
until stopped, within its caps; a call through the actor's boundary (`paused()`) stops it first and
starts the fill a round armed once it returns; the region's own threads don't stop it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from geofed.regions.emulation import Slowdown
from geofed.regions.gapfill import GapFill
from geofed.regions.messages import RoundPlan


class _Stepper:
    """The part of a Region the filler drives: a model, its optimiser, a data stream."""

    def __init__(self, *, fail_after: int | None = None, slowdown: float = 1.0, nan_after: int | None = None):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.slowdown = Slowdown(slowdown)
        self.steps = 0
        self.fail_after = fail_after
        self.nan_after = nan_after
        self.filler = GapFill(self)
        self.carried: list[tuple[list[float], list[float]]] = []

    def forward_backward(self) -> float:
        if self.fail_after is not None and self.steps >= self.fail_after:
            raise FloatingPointError("loss is nan")
        self.opt.zero_grad()
        x = torch.randn(16, 8)
        loss = torch.nn.functional.cross_entropy(self.model(x), (x[:, 0] > 0).long())
        loss.backward()
        if self.nan_after is not None and self.steps >= self.nan_after:
            return float("nan")
        return float(loss.detach())

    def optimizer_step(self, lr_scale: float) -> None:
        self.opt.step()
        self.steps += 1

    def read(self) -> int:
        return self.steps

    def carry_steps(self, losses: list[float], durations: list[float]) -> None:
        self.carried.append((losses, durations))


def _wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_fills_until_taken_and_hands_over_its_steps():
    s = _Stepper()
    before = s.model.weight.detach().clone()
    s.filler.start(lr_scale=1.0, max_steps=10_000, max_s=30.0)
    _wait_for(lambda: s.steps >= 5)
    losses, durations = s.filler.take()
    assert not s.filler.running
    assert len(losses) == len(durations) == s.steps >= 5
    assert all(d > 0 for d in durations) and all(loss == loss for loss in losses)
    assert not torch.equal(before, s.model.weight)  # real steps on the real model
    assert s.filler.take() == ([], [])  # taken once


def test_a_fill_keeps_to_its_step_and_time_caps():
    s = _Stepper()
    s.filler.start(lr_scale=1.0, max_steps=7, max_s=30.0)
    _wait_for(lambda: s.filler._thread is None or not s.filler._thread.is_alive())
    assert len(s.filler.take()[0]) == 7
    s = _Stepper(slowdown=50.0)  # each step sleeps: the time cap ends it first
    t0 = time.monotonic()
    s.filler.start(lr_scale=1.0, max_steps=10_000, max_s=0.2)
    _wait_for(lambda: s.filler._thread is None or not s.filler._thread.is_alive())
    assert time.monotonic() - t0 < 5.0 and 1 <= len(s.filler.take()[0]) < 10_000
    s.filler.start(lr_scale=1.0, max_steps=0, max_s=1.0)  # nothing to fill
    assert not s.filler.running


def test_a_call_through_the_boundary_stops_the_fill_before_it_runs_but_a_region_thread_does_not():
    s = _Stepper()
    s.filler.start(lr_scale=1.0, max_steps=10_000, max_s=30.0)
    _wait_for(lambda: s.steps >= 2)
    seen = {}

    def from_overlap_thread():
        seen["running"] = s.filler.running
        s.read()  # an overlapped exchange calling into the region: the fill goes on
        seen["after"] = s.filler.running

    t = threading.Thread(target=from_overlap_thread, name="geofed-overlap_0")
    t.start()
    t.join()
    assert seen == {"running": True, "after": True}
    with s.filler.paused():  # a call from Ray's thread (regions/actor.py): stopped first
        n = s.read()
        assert not s.filler.running
        time.sleep(0.05)
        assert s.steps == n  # nothing steps beside the call
    assert not s.filler.running  # that call armed no fill: none starts after it


def test_a_round_arms_the_fill_it_plans_and_the_next_round_takes_its_steps():
    s = _Stepper()
    plan = RoundPlan(round=3, H=4, fill=True, budget_s=0.5, lr_scale=0.5)
    with s.filler.paused():
        s.filler.report(plan, {})
        assert not s.filler.running  # armed, not started: the call is still running
    assert s.filler.running
    _wait_for(lambda: not s.filler._thread.is_alive())
    assert s.steps == 4  # at most the round's H
    nxt = RoundPlan(round=4, H=4)
    with s.filler.paused():
        assert s.filler.plan(nxt) is nxt
    assert len(s.carried) == 1 and len(s.carried[0][0]) == len(s.carried[0][1]) == 4
    for unfilled in (RoundPlan(round=5, H=4), RoundPlan(round=5, H=4, fill=True, final=True)):
        with s.filler.paused():
            s.filler.report(unfilled, {})
        assert not s.filler.running
    with pytest.raises(RuntimeError), s.filler.paused():
        s.filler.report(plan, {})
        raise RuntimeError("the round failed after its report")
    assert not s.filler.running  # a call that raises starts no fill


def test_an_error_on_the_fill_thread_is_raised_on_take():
    s = _Stepper(fail_after=3)
    s.filler.start(lr_scale=1.0, max_steps=10_000, max_s=30.0)
    _wait_for(lambda: s.filler._thread is None or not s.filler._thread.is_alive())
    with pytest.raises(FloatingPointError, match="nan"):
        s.filler.take()
    assert s.filler.take() == ([], [])


def test_a_non_finite_loss_ends_the_fill_without_a_step():
    s = _Stepper(nan_after=4)
    s.filler.start(lr_scale=1.0, max_steps=10_000, max_s=30.0)
    _wait_for(lambda: s.filler._thread is None or not s.filler._thread.is_alive())
    before = s.model.weight.detach().clone()
    losses, _ = s.filler.take()
    assert s.steps == 4 and len(losses) == 5 and losses[-1] != losses[-1]  # the nan is reported, not stepped
    assert torch.isfinite(before).all()
