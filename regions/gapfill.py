"""Gap filling (sync.pacing.fill_gaps): a region that has returned a time-budget round keeps taking
inner steps until the driver's next call arrives; those steps belong to the next round.

Why: between two rounds a region waits on the driver (gather, planning, logging, dispatch: 20-30 ms
of a 0.3 s round in `geofed bench hetero`) and, in a round that waits for a slow region, on that
region. With overlap the model a region holds between rounds is already its own unsynced progress
(the outer step lands a round later), so steps taken in the gap are ordinary local steps: they
enter the next round's pseudo-gradient like the round's own. Without overlap the region holds the
synchronised model, which the driver may read (final model, evaluation) before any next round;
the coordinator plans fills only with overlap.

`GapFill` is one of the region's round hooks (regions/hooks.py): a round's `report` arms the fill
(plan.fill, not the final round), its `plan` hands the steps filled since to the round
(Region.carry_steps), and in between the fill runs on a thread of its own.

Thread discipline: the filler is the only other thread that touches the model, the optimiser and
the data stream. It runs only between calls from outside the region: the Ray actor runs every such
call inside `paused()` (regions/actor.py), which stops a fill first (waiting for its step in
progress) and starts the fill a round armed once the call returns. The region's own threads (an
overlapped exchange, sends, secure aggregation, gRPC handlers) never stop it, as they never stop
a round's own steps.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from .hooks import RoundHook

if TYPE_CHECKING:
    from .messages import RoundPlan


class GapFill(RoundHook):
    """Runs `region`'s inner steps on a thread until stopped, at most `max_steps` steps and
    `max_s` seconds per fill; `take()` hands the steps taken to the next round."""

    def __init__(self, region: Any):
        self._region = region
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._losses: list[float] = []
        self._durations: list[float] = []
        self._error: BaseException | None = None
        self._armed: dict[str, Any] | None = None  # the fill the last round asked for, started once its call returns
        self._lock = threading.Lock()  # start and stop may come from two threads (a Ray call, a gRPC handler)

    # -- hook points ----------------------------------------------------------------------
    def plan(self, plan: RoundPlan) -> RoundPlan:
        """The steps filled since the last round are this round's first (Region.carry_steps)."""
        losses, durations = self.take()
        if losses:
            self._region.carry_steps(losses, durations)
        return plan

    def report(self, plan: RoundPlan, metrics: dict[str, Any]) -> None:
        """Arm a fill for the gap after this round, if planned: at most a nominal round's steps (a
        long gap, a peer back from an absence fetching the model, must not turn into several rounds
        of unsynchronised drift)."""
        self._armed = None
        if plan.fill and not plan.final:
            self._armed = {"lr_scale": plan.lr_scale, "max_steps": max(1, plan.H),
                           "max_s": max(1.0, 4 * (plan.budget_s or 0.0))}

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Around one call from outside the region: a fill in progress stops before it runs, and a
        fill the call armed (a round's report) starts once it has returned. A call that raises
        starts none."""
        self.stop()
        self._armed = None
        yield
        armed, self._armed = self._armed, None
        if armed is not None:
            self.start(**armed)

    # -- the fill thread ------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, *, lr_scale: float, max_steps: int, max_s: float) -> None:
        """Start filling (after a round has returned its metrics); a no-op for max_steps < 1."""
        self.stop()
        if max_steps < 1 or max_s <= 0:
            return
        with self._lock:
            self._stop.clear()
            threads = torch.get_num_threads()  # intra-op threads are set per thread: keep the region's
            thread = threading.Thread(target=self._run, args=(lr_scale, max_steps, max_s, threads),
                                      name="geofed-gapfill", daemon=True)
            thread.start()
            self._thread = thread

    def _run(self, lr_scale: float, max_steps: int, max_s: float, threads: int) -> None:
        torch.set_num_threads(threads)
        region, t0 = self._region, time.monotonic()
        try:
            while not self._stop.is_set() and len(self._durations) < max_steps and time.monotonic() - t0 < max_s:
                t_step = time.monotonic()
                loss = region.forward_backward()
                if not math.isfinite(loss):
                    # Not stepped: the next round starts from finite weights, and a rollback
                    # (security.rollback_on_nonfinite) snapshots them at its start.
                    self._losses.append(loss)
                    self._durations.append(time.monotonic() - t_step)
                    break
                region.optimizer_step(lr_scale)
                region.slowdown.after_step(time.monotonic() - t_step)
                self._losses.append(loss)
                self._durations.append(time.monotonic() - t_step)
        except BaseException as exc:  # noqa: BLE001 - handed to the next round, which raises it
            self._error = exc

    def stop(self) -> None:
        """Stop filling and wait for the step in progress (at most one step)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._stop.set()
                thread.join()

    def take(self) -> tuple[list[float], list[float]]:
        """The losses and step durations of the fills since the last take (stops a running fill);
        an error raised on the fill thread is raised here, on the caller's."""
        self.stop()
        losses, durations, error = self._losses, self._durations, self._error
        self._losses, self._durations, self._error = [], [], None
        if error is not None:
            raise error
        return losses, durations


__all__ = ["GapFill"]
