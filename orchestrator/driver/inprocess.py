"""`Trainer(..., in_process=True)`: a run's regions as threads of this process (regions/inprocess.py:
InProcessRegions over the in-memory transport), planned round by round by the driver's
Coordinator, as Runner plans them over Ray.

What it leaves out, and why it is for tests and quick tries rather than runs: no Ray, no sockets,
no TLS and no WAN emulation (the in-memory hub delivers at once, so the policy sees no real links);
no checkpoints, hence no resume; no fault handling (a region that fails fails the run). What it
writes is what the run directory's readers need (docs/RUNDIR.md): metrics.jsonl, rounds.jsonl and
summary.json (with `reports`), so `geofed report` and `geofed watch` read it as any run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.sketch import consensus_from_sketches

from ..config import RunConfig
from .coordinator import Coordinator
from .evaluation import RunEvaluation
from .loops import LoopEnds, one_initial_model
from .progress import RunProgress
from .resume import train_fn_name
from .run import round_record
from .rundir import Clock, JsonlLog, release_run_dir, write_json
from .summary import build_summary, evaluate_average

__all__ = ["run_in_process"]

logger = logging.getLogger(__name__)


def run_in_process(cfg: RunConfig, run_dir: Path, train_fn: Callable[[Any], None] | None, *,
                   show_progress: bool) -> dict[str, Any]:
    """The run to its end in this process; returns the summary (also in RUN_DIR/summary.json).
    `train_fn`: the user's loop (None: the task's built-in stepper). Releases the run directory's
    lock (new_run_dir took it) whatever happens."""
    from geofed.regions.inprocess import InProcessRegions
    from geofed.regions.loop import LoopTimeouts

    clock = Clock()
    logs = JsonlLog(run_dir / "metrics.jsonl"), JsonlLog(run_dir / "rounds.jsonl")
    # The function reaches ctx.sync within regions.start_timeout_s, as a region actor must start within it.
    timeouts = LoopTimeouts(start_s=cfg.regions.start_timeout_s)
    try:
        with InProcessRegions(cfg, run_dir, train_fn=train_fn, timeouts=timeouts) as group:
            clock.restart()  # as Runner's: wall time counts training, not building the regions
            evaluation, loops = RunEvaluation(cfg), LoopEnds()
            if train_fn is not None:  # a fresh run (in_process has no resume): one initial model
                one_initial_model(list(group.regions), lambda names: group.call(lambda w: w.sketch(), regions=names),
                                  lambda donors: group.call(lambda w: w.catch_up(donors[w.region]), regions=list(donors)),
                                  logger.warning)
            _rounds(cfg, group, clock, evaluation, loops, logs, show_progress=show_progress)
            return _finish(cfg, run_dir, group, clock, evaluation, loops, looping=train_fn is not None)
    finally:
        for log in logs:
            log.close()
        release_run_dir(run_dir)


def _rounds(cfg: RunConfig, group: Any, clock: Clock, evaluation: RunEvaluation, loops: LoopEnds,
            logs: tuple[JsonlLog, JsonlLog], *, show_progress: bool) -> None:
    """Round after round until run.rounds, run.max_steps or run.target ends the run, or every
    region's training loop has ended (a region whose loop ended is planned no more: driver/loops.py)."""
    metrics_log, rounds_log = logs
    names = list(group.regions)
    params = group.call(lambda w: w.info(), regions=names[:1])[names[0]]["params"]
    coordinator = Coordinator(cfg, model_numel=params, clock=clock)
    progress = RunProgress(cfg.run.rounds, enabled=show_progress, max_steps=cfg.run.max_steps)
    sent = 0
    try:
        for r in range(cfg.run.rounds):
            t_start = clock.now()
            alive = loops.looping(names)
            plans = coordinator.plan(r, alive=alive, evaluate=evaluation.due(r))
            if coordinator.at_eval_mark:
                evaluation.force(r)
            results = group.run_round(plans)
            loops.note(r, results, names)
            t_end = clock.now()
            coordinator.observe(results)
            evaluation.note_round(r, results, steps=coordinator.steps_done)
            extra = evaluation.of_round(r, results, alive, lambda names=alive: group.call(lambda w: w.get_params(), regions=names),
                                        t_end=t_end)
            for region in alive:
                metrics_log.write(results[region].to_record())
            record = round_record(r, results, coordinator, t_start=t_start, t_end=t_end, alive=alive,
                                  extra={**extra, "participants": alive, "absent": []})
            rounds_log.write(record)
            if extra.get("eval_avg"):
                evaluation.check(extra)
            sent += record["bytes_sent"]
            progress.update(round_=r, loss=coordinator.loss, H=coordinator.last_H, mb_sent=sent / 1e6,
                            codec=",".join(sorted({c.key for c in coordinator.last_codecs.values()}) or ["-"]),
                            utilization=record["utilization"], elapsed_s=t_end, steps_done=coordinator.steps_done)
            if coordinator.done or evaluation.hit is not None or loops.all_ended:
                break
    finally:
        progress.stop()


def _finish(cfg: RunConfig, run_dir: Path, group: Any, clock: Clock, evaluation: RunEvaluation, loops: LoopEnds, *,
            looping: bool) -> dict[str, Any]:
    """As Runner._finish: the exchange still in flight applied, each region's evaluation, the
    consensus distance; then the user's loops told the run is over and their reports taken."""
    names = list(group.regions)
    group.call(lambda w: w.finish_pending())
    per_region = group.call(lambda w: w.evaluate())
    if algorithm_traits(cfg.sync.algorithm).mixes_models:  # a task's run: Trainer refuses gossip with a loop
        avg_eval, consensus = evaluate_average(cfg, group.call(lambda w: w.get_params()))
    else:  # every region holds the synchronised model
        avg_eval = per_region.get(loops.freshest_first(names)[0])  # a loop that ended early holds an older model
        consensus = consensus_from_sketches(list(group.call(lambda w: w.sketch()).values()))
    reports = group.finish() if looping else {}
    wall_s = clock.now()
    summary = build_summary(cfg, run_dir, eval_avg=avg_eval, eval_per_region=per_region,
                            consensus=consensus, transport_stats=group.call(lambda w: w.transport_stats()),
                            faults={}, placement=group.call(lambda w: w.info()), emulator=None, wall_s=wall_s)
    summary.update(evaluation.summary_fields())
    summary.update(setup_s=None, startup=None, interrupted=None, pacing={"mode": cfg.sync.pacing.mode},
                   privacy=None, in_process=True, reports=reports)
    if looping:  # the model is the training function's; the config's task was not trained
        summary["config"]["task"] = f"train_fn {train_fn_name(group.train_fn)}"
        summary.update(loops.summary_fields())
    write_json(run_dir / "summary.json", summary)
    return summary
