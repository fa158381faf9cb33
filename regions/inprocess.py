"""A run's regions in one process: the runtime's Regions over the in-memory transport.

What the region actors of `geofed run` run, without Ray or sockets: one Region per
region, each with an InMemoryTransport on one hub (the gRPC transport's Mailbox and validator,
the same exchanger, codecs and sync algorithm). A round runs the regions side by side, a thread
each: an exchange blocks until the in-neighbours' messages arrive, so regions cannot take turns.
The caller plans the rounds: the orchestrator's Coordinator in ``geofed bench dfgl
--in-process``, hand-made RoundPlans in tests.

With `train_fn` (the loop API, regions/loop.py) each region's inner steps are taken by the user's
function, one LoopHost (a thread) per region; their functions run one after another up to
`ctx.sync` (a model built from torch's global generator is then each region's own), and each
stretch of a loop's code between two hand-offs (one step: from sync.step's return to its next
call) runs under the generator lock below, with the region's own generator swapped in, so the
regions' loops take turns step by step as the built-in steps do.

One process has one global torch generator, and a task may draw from it while it trains (the
GCN's dropout does). A region in its own process has its own; here every worker method that
touches it (a training step, an evaluation, a checkpoint) runs under one lock with its region's
state swapped in. Each region then draws what it would draw alone, whatever order the threads
run in: a run repeats exactly, and matches the same run over Ray and gRPC while no message is
lost. (Measured on Cora: the lock costs no time; without it a run moved by up to 0.6 points.)
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from geofed.p2p.memory import InMemoryHub, InMemoryTransport

from .loop import LoopHost, LoopTimeouts, RegionContext
from .region import Region
from .messages import RoundPlan, RoundReport


class InProcessRegions:
    """The Regions of one run on one in-memory hub, in this process.

    `cfg` is the run config (duck-typed, as Region's); `run_dir` is where a worker keeps
    checkpoints (none are written unless asked); `task`, when given, is shared by every worker
    (built from cfg.task; graph tasks then load and partition once). ``hub`` lets a test delay
    or cut links (InMemoryHub.set_link).
    """

    def __init__(self, cfg: Any, run_dir: str | Path, *, task=None, hub: InMemoryHub | None = None,
                 train_fn: Callable[[RegionContext], Any] | None = None, timeouts: LoopTimeouts | None = None):
        self.cfg, self.run_dir, self.task = cfg, Path(run_dir), task
        self.train_fn, self.timeouts = train_fn, timeouts or LoopTimeouts()
        self.hosts: dict[str, LoopHost] = {}
        self.hub = hub if hub is not None else InMemoryHub()
        self.regions = list(cfg.regions.names)
        self.workers: dict[str, Region] = {}
        self._rng_lock = threading.RLock()
        self._pool = ThreadPoolExecutor(len(self.regions), thread_name_prefix="geofed-region")
        try:
            for region in self.regions:
                self.restart(region)
        except BaseException:
            self.close()
            raise

    def restart(self, region: str) -> Region:
        """A fresh worker for `region`, as a restarted process would have: nothing of the old one."""
        old, old_host = self.workers.pop(region, None), self.hosts.pop(region, None)
        if old_host is not None:
            old_host.close()
        if old is not None:
            old.close()
        transport = InMemoryTransport(region, self.hub, round_window=self.cfg.security.round_window)
        if self.train_fn is None:
            w = _OwnGeneratorRegion(self.cfg, region, self.run_dir, transport=transport, task=self.task,
                                    rng_lock=self._rng_lock)
        else:
            w = self._start_loop(region, transport)
        w.start()
        w.connect({r: f"inmem:{r}" for r in self.regions})
        self.workers[region] = w
        return w

    def _start_loop(self, region: str, transport: InMemoryTransport) -> Region:
        """The user's function for `region` on its thread, up to its ctx.sync: the Region it built."""
        host: LoopHost

        def build(**injected: Any) -> Region:
            w = _OwnGeneratorRegion(self.cfg, region, self.run_dir, transport=transport, rng_lock=self._rng_lock,
                                    **injected)
            host.stepper.turn_hooks = (w.enter_own, w.leave_own)
            return w

        host = LoopHost(self.train_fn, self.cfg, region, self.run_dir, build=build, timeouts=self.timeouts)
        self.hosts[region] = host
        host.start()
        return host.wait_region()

    def finish(self, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """The run is over (the loop API): every user loop is told to stop (should_stop) and its
        function waited for; what each passed to ctx.report, by region. Raises what one raised."""
        for host in self.hosts.values():
            host.stepper.stop()
        return {region: host.finish(timeout_s) for region, host in self.hosts.items()}

    def run_round(self, plans: dict[str, RoundPlan]) -> dict[str, RoundReport]:
        """Every planned region runs its round, concurrently; their reports by region."""
        # No gap filling: the workers share this process's cores and torch's global generator.
        futures = {region: self._pool.submit(self.workers[region].run_round, dataclasses.replace(plan, fill=False))
                   for region, plan in plans.items()}
        return {region: f.result() for region, f in futures.items()}

    def call(self, fn: Callable[[Region], Any], *, regions=None) -> dict[str, Any]:
        """`fn(region)` for every region (or those named in `regions`), one after the other; by region."""
        return {r: fn(self.workers[r]) for r in (regions or self.workers)}

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()
        for w in self.workers.values():
            w.close()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> InProcessRegions:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _OwnGeneratorRegion(Region):
    """A Region whose use of torch's global generator is its own (see the module's doc)."""

    def __init__(self, *args, rng_lock: threading.RLock, **kwargs):
        self._rng_lock = rng_lock
        with rng_lock:
            super().__init__(*args, **kwargs)
            # What construction left in the generator is this region's (gossip seeds it per region).
            self._own_rng = torch.get_rng_state()

    def as_own(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` with this region's torch generator in, under the process's lock."""
        self.enter_own()
        try:
            return fn(*args, **kwargs)
        finally:
            self.leave_own()

    def enter_own(self, timeout_s: float | None = None) -> None:
        """Take the process's generator lock (waiting at most `timeout_s`) and put this region's
        generator state in: as_own's first half, and where a loop-mode region's user code resumes
        (LoopStepper.turn_hooks: each step of the user's loop runs between enter_own and leave_own)."""
        if not self._rng_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise TimeoutError(f"region {self.region}: another region of this process held torch's generator for "
                               f"{timeout_s:g} s (its training loop did not reach sync.step())")
        torch.set_rng_state(self._own_rng)

    def leave_own(self) -> None:
        """Keep what this region's code left in the generator and release the lock."""
        self._own_rng = torch.get_rng_state()
        self._rng_lock.release()

    def forward_backward(self) -> float:
        return self.as_own(super().forward_backward)

    def forward_backward_step(self, lr_scale: float) -> float:
        return self.as_own(super().forward_backward_step, lr_scale)

    def evaluate_params(self, params, **kwargs) -> dict[str, Any]:
        return self.as_own(super().evaluate_params, params, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.as_own(super().state_dict)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.as_own(super().load_state_dict, state)
