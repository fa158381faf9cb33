"""sync.pacing.fill_gaps (regions/gapfill.py): the filler steps a real torch model on its own thread
until stopped, within its caps; the worker's public calls stop it first, its own threads don't."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from geofed.regions.emulation import Slowdown
from geofed.regions.gapfill import GapFiller, pausing


@pausing
class _Stepper:
    """The part of a RegionWorker the filler drives: a model, its optimiser, a data stream."""

    def __init__(self, *, fail_after: int | None = None, slowdown: float = 1.0, nan_after: int | None = None):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.slowdown = Slowdown(slowdown)
        self.steps = 0
        self.fail_after = fail_after
        self.nan_after = nan_after
        self.filler = GapFiller(self)

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


def test_a_public_call_stops_the_fill_before_it_runs_but_a_worker_thread_does_not():
    s = _Stepper()
    s.filler.start(lr_scale=1.0, max_steps=10_000, max_s=30.0)
    _wait_for(lambda: s.steps >= 2)
    seen = {}

    def from_overlap_thread():
        seen["running"] = s.filler.running
        s.read()  # an overlapped exchange calling into the worker: the fill goes on
        seen["after"] = s.filler.running

    t = threading.Thread(target=from_overlap_thread, name="geofed-overlap_0")
    t.start()
    t.join()
    assert seen == {"running": True, "after": True}
    n = s.read()  # a call from Ray's thread: stopped first, so nothing steps after it
    assert not s.filler.running
    time.sleep(0.05)
    assert s.steps == n


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
