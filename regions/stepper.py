"""The local-training half of RegionWorker (regions/worker.py): the data stream, the inner
optimizer and its steps, a time-budget round's stopping rule and the set-up warm-up.

A mixin, not a class of its own: it works on the worker's attributes (cfg, model, params, task,
shard, generator, batches, batches_drawn, inner, precision, slowdown, device, dp_plan,
dp_generator), which RegionWorker.__init__ sets.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from .device import to_device
from .pacing import budget_over
from .privacy.dp import dp_step


class LocalSteps:
    """Inner steps on the region's shard (used by the sync algorithms through SyncContext.stepper)."""

    def _warm_compute(self, passes: int = 3) -> float:
        """Forward and backward passes on one batch of the shard, before round 0 and outside the
        training clock, changing nothing the run sees (data stream, random state, weights and
        optimiser are as before); returns the median pass time after the first, stretched by the
        emulated slowdown. A region's first steps (allocation, lazy init) take several of its later
        ones, and time-budget rounds start with a calibration round that waits for the slowest
        region. The pass time reads 5-20x below a real step (no data, no optimiser step, a hot
        cache), alike for every region: the coordinator uses only the ratios between regions, to
        give a slow region fewer calibration steps."""
        saved = self.generator.get_state()
        batch = to_device(next(self._batch_stream()), self.device)
        self.generator.set_state(saved)
        times = []
        with torch.random.fork_rng(devices=[]):
            for _ in range(passes + 1):
                t0 = time.monotonic()
                with self.precision.autocast():
                    loss = self.task.loss(self.model, batch)
                loss.backward()
                times.append(time.monotonic() - t0)
        self.inner.zero_grad(set_to_none=False)
        return statistics.median(times[1:]) * max(1.0, self.slowdown.factor)

    def inner_steps(self, H: int, lr_scale: float, *, before_step=None, budget_s: float | None = None,
                    max_steps: int | None = None) -> dict[str, Any]:
        """H local optimizer steps, or with `budget_s` as many as fit in that many seconds (at least
        one, at most `max_steps`); returns loss and timing (compute only, no network; an emulated
        slowdown's sleep counts as compute: it stands for a slower device). `before_step(k)`, when
        given, runs between the k-th backward and step (e.g. gradient tracking adds its drift
        correction to the gradients there)."""
        filled_losses, filled = self.filler.take() if getattr(self, "filler", None) is not None else ([], [])
        losses, durations = [], []
        t0 = time.monotonic()
        limit = H if budget_s is None else max(1, (max_steps or H) - len(filled))
        for k in range(limit):
            t_step = time.monotonic()
            losses.append(self.forward_backward())
            if before_step is not None:
                before_step(k)
            self.optimizer_step(lr_scale)
            self.slowdown.after_step(time.monotonic() - t_step)
            durations.append(time.monotonic() - t_step)
            if budget_s is not None and budget_over(time.monotonic() - t0, durations, budget_s):
                break
        # Steps taken between rounds (sync.pacing.fill_gaps) are this round's first.
        compute_s = time.monotonic() - t0 + sum(filled)
        losses, durations = filled_losses + losses, filled + durations
        loss = sum(losses) / len(losses)
        steps = len(losses)
        # A round's first step reads several of the rest (a new round's data, allocation); a time
        # budget sized on a 10-step round's mean made the next rounds 2-3x too long.
        steady = durations[1:] if len(durations) >= 3 else durations
        metrics = {"train_loss": loss, "compute_s": compute_s, "step_time_s": compute_s / steps, "steps": steps,
                   "step_time_steady_s": sum(steady) / len(steady)}
        if filled:
            metrics["fill_steps"], metrics["fill_s"] = len(filled), round(sum(filled), 6)
        if not math.isfinite(loss):
            exc = FloatingPointError(f"region {self.region}: train loss is {loss}")
            exc.metrics = metrics  # what the round's rollback reports (regions/rollback.py)
            raise exc
        return metrics

    def forward_backward(self) -> float:
        """One batch of the shard: gradients zeroed, then forward and backward; returns the loss."""
        self.inner.zero_grad(set_to_none=False)
        batch = to_device(next(self.batches), self.device)
        self.batches_drawn += 1
        if self.dp_plan is not None:  # record-level DP: clipped per-example gradients plus noise
            return dp_step(self.model, self.task.loss, batch, clip=self.dp_plan.dp_clip,
                           noise_multiplier=self.dp_plan.dp_noise, expected_batch=self.cfg.sync.inner.batch_size,
                           generator=self.dp_generator)
        with self.precision.autocast():
            loss = self.task.loss(self.model, batch)
        self.precision.backward(loss, self.inner)
        return float(loss.detach())

    def optimizer_step(self, lr_scale: float) -> None:
        """One inner optimizer step at sync.inner.lr x `lr_scale` (the plan's schedule)."""
        for group in self.inner.param_groups:
            group["lr"] = self.cfg.sync.inner.lr * lr_scale
        self.precision.step(self.inner)

    def _seek_data(self, start: torch.Tensor, drawn: int) -> None:
        """Replay the data stream to where the checkpoint was: the batches after a restore are the
        ones the region would have drawn had it not stopped (a shard's iterator holds its epoch's
        permutation, which the generator state alone does not give back)."""
        self.generator.set_state(start)
        self.batches = self._batch_stream()
        for _ in range(drawn):
            next(self.batches)
        self.batches_drawn = drawn

    def _batch_stream(self):
        """The shard's batches; with record-level DP Poisson-sampled at batch_size / shard size
        (expected batch_size) where the shard can, as the accountant assumes (docs/privacy.md)."""
        if self.cfg.privacy.dp.mode == "record":
            rate = min(1.0, self.cfg.sync.inner.batch_size / self.shard.num_examples)
            stream = self.shard.poisson_batches(self.generator, rate)
            if stream is not None:
                return stream
        return self.shard.batches(self.generator)

    def _make_inner_optimizer(self) -> torch.optim.Optimizer:
        inner = self.cfg.sync.inner
        if inner.kind == "adamw":
            return torch.optim.AdamW(self.params, lr=inner.lr, weight_decay=inner.weight_decay)
        return torch.optim.SGD(self.params, lr=inner.lr, momentum=inner.momentum, weight_decay=inner.weight_decay)

