"""The loop API's region side (issue 38): the user's own training loop takes a region's inner steps.

geofed's round is unchanged (RoundPlan -> Region.run_round -> the sync algorithm -> exchange ->
outer step -> RoundReport); only who takes the inner steps changes. The algorithm asks its
region's stepper for H steps (`InnerStepper.inner_steps`, regions/sync/protocol.py); here the
stepper is a `LoopStepper`, which lets the user's loop thread take them and waits until its
`sync.step()` has been called that many times::

    def train_region(ctx: RegionContext) -> None:       # runs in every region, on a thread of its own
        model, opt = build()                             # the user's own code
        sync = ctx.sync(model, opt, state={"loader": loader})
        for batch in loader:
            loss = step(model, batch); loss.backward(); opt.step(); opt.zero_grad()
            sync.step(loss=loss.item())                  # the round's last step blocks: exchange + outer step
            if sync.should_stop:
                break
        ctx.report(final_loss=loss.item())

The hand-off is strict: the user's thread runs only while a round's `inner_steps` waits for it,
and the round's thread only while the user's thread is parked in `sync.step()` (or not yet
released from `ctx.sync`), so the model, the optimizer and torch's global generator are never
used by both at once. With `sync.overlap` the exchange thread runs beside the user's steps, as it
runs beside the built-in stepper's.

Who does what:

- `LoopHost` runs the user's function on its thread in the region's process (the actor, or one
  host per region in `InProcessRegions`), waits for `ctx.sync` to hand it the Region built around
  the user's model and optimizer (`Region(..., model=, optimizer=, stepper=, evaluate=,
  user_state=, examples=)`), and at the end of the run (`finish`) tells the loop to stop and
  returns what it passed to `ctx.report`.
- `ctx.sync(...)` builds that Region and blocks until the first round's inner steps, so a
  resume's restore (Region.load_state_dict, which loads the objects registered with `state=`)
  happens before the loop takes its first batch.
- `Sync.step()` counts one inner step. The round's last step (H of them; or a time budget spent,
  `sync.pacing` time-budget, at most `max_steps`; or a non-finite loss) blocks until the next
  round's steps start or the run ends (`finish`); then `should_stop` is True and `step()`
  returns at once.

Deadlines (`LoopTimeouts`): the user's function must reach `ctx.sync` within `start_s`; within
a round, `sync.step()` must come within `step_s` of the last one (else the round fails with a
TimeoutError); a parked loop waits at most `park_s` for the next round; `finish` waits
`finish_s` for the function to return. A function that raises fails the round it is in with its
own exception and traceback (or `wait_region` / `finish`, outside a round).

A loop that returns early (its data ran out) ends the round with the steps taken; every later
round a region that is still asked takes no steps (`steps: 0`, `train_loss: null`). The rounds
report `loop_ended: true`; the driver then leaves the region out of later rounds, as a region that
left, and ends the run once every region's loop has ended (orchestrator/driver/loops.py).

What loop mode cannot do. Skipped: gap filling (sync.pacing.fill_gaps, on by default in time-budget
rounds with overlap) steps between rounds with the built-in stepper while the user's loop is
parked; a loop-mode Region never arms it and logs that once (`gap_fill_skipped`). DP needs
`ctx.sync(..., examples=N)` (its accountant's sample rate). Refused by Region, naming the key,
where the config asks for it: record-level DP (its clipped per-example gradients are geofed's forward/backward), the
per-step algorithm (allreduce steps one batch at a time itself) and gossip's gradient tracking
(it acts between a step's backward and its optimizer step). Update scoring (security.
score_updates) needs the task's loss on the region's data and is skipped, with a log line.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .algorithm_traits import algorithm_traits
from .device import resolve_device
from .emulation import Slowdown
from .hooks import RoundHook
from .pacing import budget_over

if TYPE_CHECKING:
    from torch import nn

    from .messages import RoundPlan

log = logging.getLogger(__name__)
# regions/region.py's Region, which imports this module: named, not imported (no cycle in the room).
Region = Any


@dataclass(frozen=True, kw_only=True)
class LoopTimeouts:
    """How long each wait of the hand-off lasts before it fails (module docstring)."""

    start_s: float = 600.0     # the user's function reaches ctx.sync (it may load data, build a model)
    step_s: float = 600.0      # between two sync.step() calls of one round (one inner step)
    park_s: float = 86400.0    # a parked loop waits for the next round (rounds apart: outages, absences)
    finish_s: float = 60.0     # the function returns once told the run is over


class LoopStepper(RoundHook):
    """The InnerStepper of loop mode (regions/sync/protocol.py): `inner_steps` releases the user's
    loop for the round's steps and returns the same metrics as Region.inner_steps. Also a round
    hook (its `plan`): what `Sync.round`, `.H` and `.lr_scale` say is the plan of the round."""

    def __init__(self, region: str, *, slowdown: float = 1.0, timeouts: LoopTimeouts = LoopTimeouts()):
        self.region = region
        self.timeouts = timeouts
        self.slowdown = Slowdown(slowdown)
        self._cv = threading.Condition()
        self._turn = "round"   # "loop": the user's thread may step; "round": it is parked (or not started)
        self._left = 0         # steps the loop may still take in this round
        self._budget_s: float | None = None
        self._t0 = self._t_last = 0.0
        self._losses: list[float | None] = []  # None: a step whose loss the loop did not pass
        self._durations: list[float] = []
        self._stopped = False  # the run is over (finish), or a round gave up on the loop
        self._ended = False    # the user's function returned
        self._error: BaseException | None = None  # what the user's function raised
        self._plan: tuple[int, int, float] = (-1, 0, 1.0)  # round, H, lr_scale of the round being run
        self._step_time_s = 0.0  # the last round's mean step: what a round without steps reports
        # (enter(timeout_s), leave()): run on the loop's thread around each stretch of the user's code
        # between two hand-offs (from ctx.sync's or a step's return to the next step). InProcessRegions
        # swaps the region's own torch generator in there under the process's lock (regions/inprocess.py):
        # per step, not per round, so the regions of one process take turns step by step, as their
        # built-in steps do, instead of one region's whole round after another's.
        self.turn_hooks: tuple[Callable[[float], None], Callable[[], None]] | None = None
        self._in_turn = False  # the loop's thread is between enter and leave (only that thread uses it)
        self.last_loss: float | None = None  # the last round's mean loss (the metric without `evaluate`)

    # -- the round's side ------------------------------------------------------------------
    def plan(self, plan: RoundPlan) -> RoundPlan:
        """Hook point: note the round the loop is about to step in."""
        with self._cv:
            self._plan = (plan.round, plan.H, plan.lr_scale)
        return plan

    def inner_steps(self, H: int, lr_scale: float, *, before_step: Callable[[int], None] | None = None,
                    budget_s: float | None = None, max_steps: int | None = None) -> dict[str, Any]:
        """Let the user's loop take H steps (with `budget_s`: until the budget is spent, at least one,
        at most `max_steps`) and wait for them; the round's step metrics. Raises the user's exception
        when the loop raised, FloatingPointError (with `.metrics`) for a non-finite loss."""
        if before_step is not None:
            raise ValueError("the loop API cannot run a step hook between the user's backward and optimizer step "
                             "(sync.gossip.tracking)")
        return self._hand_over(H, budget_s, max_steps)

    def _hand_over(self, H: int, budget_s: float | None, max_steps: int | None) -> dict[str, Any]:
        with self._cv:
            self._raise_error()
            if self._ended or self._stopped:
                return self._metrics(0.0)
            self._left = H if budget_s is None else max(1, max_steps or H)
            self._budget_s = budget_s
            self._losses, self._durations = [], []
            self._t0 = self._t_last = time.monotonic()
            self._turn = "loop"
            self._cv.notify_all()
            while self._turn == "loop":
                wait_s = self._t_last + self.timeouts.step_s - time.monotonic()
                if wait_s <= 0:
                    self._stopped, self._turn = True, "round"
                    self._cv.notify_all()
                    raise TimeoutError(f"region {self.region}: the training loop took no step for "
                                       f"{self.timeouts.step_s:g} s (sync.step() was not called)")
                self._cv.wait(wait_s)
            self._raise_error()
            return self._metrics(self._t_last - self._t0)

    def _metrics(self, compute_s: float) -> dict[str, Any]:
        """Region.inner_steps' metrics of the steps just taken (called holding the lock)."""
        durations, losses = self._durations, [x for x in self._losses if x is not None]
        self._durations, self._losses = [], []
        steps = len(durations)
        loss = sum(losses) / len(losses) if losses else None
        if steps:
            self._step_time_s = compute_s / steps
            steady = durations[1:] if len(durations) >= 3 else durations
            steady_s = sum(steady) / len(steady)
        else:
            steady_s = self._step_time_s
        metrics: dict[str, Any] = {"train_loss": loss, "compute_s": compute_s, "step_time_s": self._step_time_s,
                                   "steps": steps, "step_time_steady_s": steady_s}
        if self._ended:
            metrics["loop_ended"] = True
        if loss is not None and not math.isfinite(loss):
            exc = FloatingPointError(f"region {self.region}: train loss is {loss}")
            exc.metrics = metrics  # type: ignore[attr-defined]  # what a rollback reports (regions/rollback.py)
            raise exc
        if loss is not None:
            self.last_loss = loss
        return metrics

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # -- the user's side (Sync) --------------------------------------------------------------
    def step(self, loss: float | None) -> None:
        """One inner step taken by the loop; the round's last one parks the loop until the next round."""
        self.leave_turn()
        try:
            self._step(loss)
        finally:
            self._enter_turn()

    def _enter_turn(self) -> None:
        if self.turn_hooks is not None and not self._in_turn:
            self.turn_hooks[0](self.timeouts.step_s)
            self._in_turn = True

    def leave_turn(self) -> None:
        """On the loop's thread: the user's code stops here (a step's hand-off, the function's end)."""
        if self._in_turn and self.turn_hooks is not None:
            self._in_turn = False
            self.turn_hooks[1]()

    def _step(self, loss: float | None) -> None:
        self.slowdown.after_step(time.monotonic() - self._t_last)  # an emulated slower device
        with self._cv:
            if self._stopped:
                return
            if self._turn != "loop":
                raise RuntimeError("sync.step() called outside a round's steps: call it from the thread that "
                                   "called ctx.sync, once per optimizer step")
            now = time.monotonic()
            self._durations.append(now - self._t_last)
            self._t_last = now
            self._losses.append(None if loss is None else float(loss))
            self._left -= 1
            bad = loss is not None and not math.isfinite(loss)  # the round fails at once, not H steps later
            over = self._budget_s is not None and budget_over(now - self._t0, self._durations, self._budget_s)
            if self._left <= 0 or bad or over:
                self._turn = "round"
                self._cv.notify_all()
                self._park()

    def wait_first(self) -> None:
        """Park the loop until the first round's steps (ctx.sync: a restore comes before them)."""
        with self._cv:
            self._park()
        self._enter_turn()

    def _park(self) -> None:
        """Wait (holding the lock) for the next round's steps or the run's end."""
        if not self._cv.wait_for(lambda: self._turn == "loop" or self._stopped, self.timeouts.park_s):
            raise TimeoutError(f"region {self.region}: no round started for {self.timeouts.park_s:g} s")

    def ended(self, error: BaseException | None) -> None:
        """The user's function returned (or raised `error`): a round waiting on it stops waiting."""
        with self._cv:
            self._ended = True
            self._error = error
            self._turn = "round"
            self._cv.notify_all()

    def stop(self) -> None:
        """The run is over: the parked loop's step() returns, should_stop is True."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def round_plan(self) -> tuple[int, int, float]:
        """(round, H, lr_scale) of the round the loop steps in."""
        return self._plan


class Sync:
    """What `ctx.sync` returns to the user's loop: `step()` after every optimizer step."""

    def __init__(self, stepper: LoopStepper):
        self._stepper = stepper

    def step(self, loss: float | None = None) -> None:
        """Count one inner step (`loss`: its training loss, for the round's report). The round's last
        step blocks while the region exchanges and steps its outer optimizer, until the next round
        starts or the run ends."""
        self._stepper.step(loss)

    @property
    def should_stop(self) -> bool:
        """The run is over (after the final round's outer step): leave the loop."""
        return self._stepper.stopped

    @property
    def round(self) -> int:
        """The round the loop is in."""
        return self._stepper.round_plan[0]

    @property
    def H(self) -> int:
        """This round's planned inner steps."""
        return self._stepper.round_plan[1]

    @property
    def lr_scale(self) -> float:
        """The plan's lr multiplier (warm-up, schedule); the built-in stepper applies it to
        sync.inner.lr, the user's loop may apply it to its own."""
        return self._stepper.round_plan[2]


@dataclass(frozen=True, kw_only=True)
class RegionContext:
    """What the user's function knows of its region, and its two calls (`sync`, `report`)."""

    region: str
    region_index: int
    num_regions: int
    seed: int
    run_dir: Path
    config: Any  # the RunConfig (duck-typed: regions do not import orchestrator)
    device: torch.device  # where the model belongs (regions.device resolved on this node)
    host: LoopHost = field(repr=False, compare=False)

    def sync(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, state: dict[str, Any] | None = None,
             evaluate: Callable[[nn.Module], Any] | None = None, examples: int | None = None) -> Sync:
        """Join the run with `model` and `optimizer` (the user's; geofed syncs the model's parameters
        that require grad). `state`: objects with state_dict/load_state_dict that checkpoints keep
        and a resume restores (a data loader's position, a scheduler). `evaluate(model)`: the metric
        of evaluation rounds (a float, lower is better; or {"metric", "value", "higher_is_better"};
        or an EvalResult), on a scratch copy of the synchronised model; without it, train_loss.
        `examples`: the region's training examples, for the driver's records. Blocks until the
        first round's steps (a resume's restore comes first)."""
        return self.host.sync(model, optimizer, state=state, evaluate=evaluate, examples=examples)

    def report(self, **values: Any) -> None:
        """The region's final report (plain values: numbers, strings, dicts of them); later calls add
        to it. The run's summary holds it under reports[region]."""
        self.host.add_report(values)


class LoopHost:
    """Runs the user's function `train_fn(ctx)` for one region on a thread of its own and hands
    back the Region that its `ctx.sync` builds. `build(**injected)` builds that Region (the
    actor's Region, InProcessRegions' own-generator one) from model=, optimizer=, stepper=,
    evaluate=, user_state=, examples=. `start()` then `wait_region()`, at the end `finish()`."""

    def __init__(self, train_fn: Callable[[RegionContext], Any], cfg: Any, region: str, run_dir: str | Path, *,
                 build: Callable[..., Region], timeouts: LoopTimeouts = LoopTimeouts()):
        self.train_fn, self.cfg, self.build, self.timeouts = train_fn, cfg, build, timeouts
        regions = list(cfg.regions.names)
        spec = cfg.regions.device
        if algorithm_traits(cfg.sync.algorithm).cpu_only and spec == "auto":
            spec = "cpu"  # as Region chooses it
        self.ctx = RegionContext(region=region, region_index=regions.index(region), num_regions=len(regions),
                                 seed=cfg.run.seed, run_dir=Path(run_dir), config=cfg,
                                 device=resolve_device(spec, region=region), host=self)
        self.stepper = LoopStepper(region, slowdown=cfg.regions.emulation.slowdown.get(region, 1.0),
                                   timeouts=timeouts)
        self._cv = threading.Condition()
        self._region: Region | None = None
        self._done = False
        self._error: BaseException | None = None
        self._report: dict[str, Any] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the user's function on its thread."""
        threads = self.cfg.regions.torch_threads  # intra-op threads are set per thread: the region's own
        self._thread = threading.Thread(target=self._run, args=(threads,), daemon=True,
                                        name=f"geofed-loop-{self.ctx.region}")
        self._thread.start()

    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)
        error: BaseException | None = None
        try:
            self.train_fn(self.ctx)
        except BaseException as exc:  # noqa: BLE001 - handed to the round (or wait_region, finish) that waits
            error = exc
        finally:
            self.stepper.leave_turn()
        with self._cv:
            self._done, self._error = True, error
            self._cv.notify_all()
        self.stepper.ended(error)

    def sync(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, state: dict[str, Any] | None,
             evaluate: Callable[[nn.Module], Any] | None, examples: int | None) -> Sync:
        """ctx.sync on the user's thread: build the Region, hand it over, park until the first round."""
        with self._cv:
            if self._region is not None:
                raise RuntimeError(f"region {self.ctx.region}: ctx.sync() was called twice")
        region = self.build(model=model, optimizer=optimizer, stepper=self.stepper, evaluate=evaluate,
                            user_state=state, examples=examples)
        with self._cv:
            self._region = region
            self._cv.notify_all()
        self.stepper.wait_first()
        return Sync(self.stepper)

    def wait_region(self) -> Region:
        """The Region once ctx.sync built it; the function's own exception if it raised first,
        RuntimeError if it returned without ctx.sync, TimeoutError after timeouts.start_s."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._region is not None or self._done, self.timeouts.start_s):
                raise TimeoutError(f"region {self.ctx.region}: the training function did not call ctx.sync() "
                                   f"within {self.timeouts.start_s:g} s")
            if self._region is not None:
                return self._region
            if self._error is not None:
                raise self._error
            raise RuntimeError(f"region {self.ctx.region}: the training function returned without calling ctx.sync()")

    def add_report(self, values: dict[str, Any]) -> None:
        """ctx.report: plain values only (they travel to the driver and into summary.json)."""
        for key, value in values.items():
            try:
                json.dumps(value, allow_nan=True)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"ctx.report({key}=...): {exc}; report plain values (numbers, strings, lists and "
                                "dicts of them), e.g. float(tensor)") from None
        with self._cv:
            self._report.update(values)

    @property
    def report(self) -> dict[str, Any]:
        """What the function passed to ctx.report so far."""
        with self._cv:
            return dict(self._report)

    def finish(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The run is over: release the parked loop (should_stop), wait for the function to return
        (at most `timeout_s`, default timeouts.finish_s) and return its report. Raises what the
        function raised, or TimeoutError if it does not return."""
        self.stepper.stop()
        timeout_s = self.timeouts.finish_s if timeout_s is None else timeout_s
        with self._cv:
            if not self._cv.wait_for(lambda: self._done, timeout_s):
                raise TimeoutError(f"region {self.ctx.region}: the training function did not return within "
                                   f"{timeout_s:g} s after the run ended (sync.should_stop)")
            if self._error is not None:
                raise self._error
            return dict(self._report)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop without asking for its report (a region closed or restarted): release it
        and give it `timeout_s` to return; its thread is a daemon if it does not."""
        self.stepper.stop()
        thread = self._thread
        with self._cv:
            parked = self._region is not None  # a function short of ctx.sync never sees the stop: no wait for it
        if parked and thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


def eval_result(value: Any) -> dict[str, Any]:
    """The user's evaluate() result as a round's `eval` dict: a float is a loss (lower is better)."""
    if isinstance(value, dict):
        missing = {"metric", "value"} - set(value)
        if missing:
            raise ValueError(f"evaluate() returned a dict without {sorted(missing)}")
        return {"metric": str(value["metric"]), "value": float(value["value"]),
                "higher_is_better": bool(value.get("higher_is_better", True))}
    if hasattr(value, "metric") and hasattr(value, "value"):  # the tasks' EvalResult
        return {"metric": value.metric, "value": float(value.value),
                "higher_is_better": bool(getattr(value, "higher_is_better", True))}
    return {"metric": "eval", "value": float(value), "higher_is_better": False}


def gap_fill_skipped(cfg: Any, region: str) -> None:
    """Log, where the config would fill gaps (sync.pacing.fill_gaps), that loop mode does not."""
    p = cfg.sync.pacing
    if p.mode == "time-budget" and p.fill_gaps and cfg.sync.overlap:
        log.info("region %s: sync.pacing.fill_gaps is skipped with the loop API: the gaps between rounds would be "
                 "filled with geofed's own inner steps while the user's loop is parked", region)


def refuse_in_loop_mode(cfg: Any, *, examples: int | None) -> None:
    """ValueError naming the key of what the loop API cannot do (module docstring), or what it
    needs of ctx.sync: DP's accountant samples at batch_size / the smallest region's examples."""
    if cfg.privacy.dp.mode == "record":
        raise ValueError("privacy.dp.mode: record-level DP clips per-example gradients in geofed's own inner steps; "
                         "the loop API takes its steps in the user's loop (use mode: update)")
    if cfg.privacy.dp.mode != "off" and not examples:
        raise ValueError("privacy.dp: its accountant needs each region's training examples: pass "
                         "ctx.sync(..., examples=N)")
    if algorithm_traits(cfg.sync.algorithm).per_step:
        raise ValueError(f"sync.algorithm: {cfg.sync.algorithm} takes one batch at a time itself; the loop API "
                         "needs an algorithm that asks for H inner steps (diloco, gossip)")
    if algorithm_traits(cfg.sync.algorithm).mixes_models and cfg.sync.gossip.tracking:
        raise ValueError("sync.gossip.tracking: gradient tracking acts between a step's backward and its optimizer "
                         "step, inside the user's loop; set it false with the loop API")


__all__ = ["LoopHost", "LoopStepper", "LoopTimeouts", "RegionContext", "Sync", "eval_result", "gap_fill_skipped",
           "refuse_in_loop_mode"]
