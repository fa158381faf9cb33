"""Gap filling (sync.pacing.fill_gaps): a region that has returned a time-budget round keeps taking
inner steps until the driver's next call arrives; those steps belong to the next round.

Why: between two rounds a region waits on the driver (gather, planning, logging, dispatch: 20-30 ms
of a 0.3 s round in `geofed bench hetero`) and, in a round that waits for a slow region, on that
region. With overlap the model a region holds between rounds is already its own unsynced progress
(the outer step lands a round later), so steps taken in the gap are ordinary local steps: they
enter the next round's pseudo-gradient like the round's own. Without overlap the region holds the
synchronised model, which the driver may read (final model, evaluation) before any next round;
the coordinator plans fills only with overlap.

Thread discipline: the filler is the only other thread that touches the model, the optimiser and
the data stream, and every public call of a RegionWorker stops it first and waits for its step in
progress (`pausing`), so nothing the worker does ever runs next to a fill step.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import time
from typing import Any

import torch


# The worker's own threads (an overlapped exchange, sends, secure aggregation, gRPC handlers, the
# filler itself) call into it while it trains, as they do during a round's steps: they don't stop a
# fill. Calls from Ray (the driver) do.
BACKGROUND = ("geofed-", "gossip-")


class GapFiller:
    """Runs `stepper`'s inner steps on a thread until stopped, at most `max_steps` steps and
    `max_s` seconds per fill; `take()` hands the steps taken to the next round's metrics."""

    def __init__(self, stepper: Any):
        self._stepper = stepper
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._losses: list[float] = []
        self._durations: list[float] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # start and stop may come from two threads (a Ray call, a gRPC handler)

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
            threads = torch.get_num_threads()  # intra-op threads are set per thread: keep the worker's
            thread = threading.Thread(target=self._run, args=(lr_scale, max_steps, max_s, threads),
                                      name="geofed-gapfill", daemon=True)
            thread.start()
            self._thread = thread

    def _run(self, lr_scale: float, max_steps: int, max_s: float, threads: int) -> None:
        torch.set_num_threads(threads)
        stepper, t0 = self._stepper, time.monotonic()
        try:
            while not self._stop.is_set() and len(self._durations) < max_steps and time.monotonic() - t0 < max_s:
                t_step = time.monotonic()
                loss = stepper.forward_backward()
                if not math.isfinite(loss):
                    # Not stepped: the next round starts from finite weights, and a rollback
                    # (security.rollback_on_nonfinite) snapshots them at its start.
                    self._losses.append(loss)
                    self._durations.append(time.monotonic() - t_step)
                    break
                stepper.optimizer_step(lr_scale)
                stepper.slowdown.after_step(time.monotonic() - t_step)
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
        an error raised on the fill thread is raised here, on the worker's."""
        self.stop()
        losses, durations, error = self._losses, self._durations, self._error
        self._losses, self._durations, self._error = [], [], None
        if error is not None:
            raise error
        return losses, durations


def pausing(cls: type) -> type:
    """Make every public method of `cls` (a RegionWorker) stop the gap filler before it runs: Ray
    calls into the actor, and calls between the worker's own methods, never run beside a fill step."""
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name)
        if name.startswith("_") or not inspect.isfunction(attr):  # properties, static and class methods stay
            continue
        setattr(cls, name, _stopping_first(attr))
    return cls


def _stopping_first(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        filler = self.__dict__.get("filler")
        if filler is not None and filler.running and not threading.current_thread().name.startswith(BACKGROUND):
            filler.stop()
        return method(self, *args, **kwargs)
    return wrapper


__all__ = ["GapFiller", "pausing"]
