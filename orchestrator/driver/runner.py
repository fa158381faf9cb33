"""`geofed run`: the driver. Sets up Ray, TLS, region actors and (optionally) the WAN emulator,
then paces rounds: plan -> every region runs its round -> log -> checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from collections.abc import Collection
from typing import Any

import ray
from geofed.regions import checkpoint
from geofed.regions.export import average_states
from geofed.regions.worker import rss_mb

from .cluster import RegionActors
from ..config import RunConfig
from .emulation import configured_link
from .evaluation import RunEvaluation, consensus_from_sketches, fetched_bytes
from .export import params_by_region, write_model
from .faults import FaultHandling
from .pacing import PacedRounds
from .setup import SetUp
from .privacy import DpAccounting
from .progress import RunProgress
from .recovery import Interrupted, RunFailed, StopSignals, signal_name
from .rundir import Clock, read_jsonl, release_run_dir, write_json
from ..config.strict import ConfigError
from .summary import build_summary, evaluate_average


log = logging.getLogger(__name__)


def prepare_task(cfg: RunConfig, *, source: str) -> RunConfig:
    """Resolve the task's data path against the driver's working directory (actors may run
    elsewhere) and build the task once here, so a bad path fails before Ray starts."""
    from geofed.regions.tasks import make_task

    task = cfg.task
    if isinstance(getattr(task, "path", None), str) and not Path(task.path).is_absolute():
        task = dataclasses.replace(task, path=str(Path(task.path).resolve()))
        cfg = dataclasses.replace(cfg, task=task)
    try:
        make_task(task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed)
    except ValueError as exc:
        msg = str(exc)
        key, sep, rest = msg.partition(": ")
        if sep and not key.startswith("task.") and " " not in key:
            msg = f"task.{key}: {rest}"
        raise ConfigError("", msg, source=str(source)) from None
    return cfg


class Runner(SetUp, FaultHandling, PacedRounds, DpAccounting):
    """The driver of one run: sets up TLS, Ray, the region actors, the emulator and the links, then
    paces rounds (plan, run, log, evaluate, checkpoint) and survives region faults (FaultHandling).
    Call run(), then shutdown() whatever happened.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, *, show_progress: bool = True, resume: bool = False,
                 verbose: bool = False, hostile: dict | None = None):
        self.cfg, self.run_dir, self.resume, self.verbose = cfg, Path(run_dir), resume, verbose
        # region -> regions.adversary.Adversary: `geofed bench attack` turns a member hostile; no config can
        self.hostile = dict(hostile or {})
        self.regions = list(cfg.regions.names)
        self.show_progress = show_progress
        self.ray = None
        self.actors: RegionActors | None = None
        self.emulator = None
        self.addresses: dict[str, str] = {}
        self.alive: list[str] = []
        self.dead: dict[str, str] = {}
        self._probes: dict[str, Any] = {}  # dead region -> node_info ref: answers once Ray restarted it
        self._stalled: dict[str, dict] = {}  # stalled region (in dead; its probe is its pending call)
        self.next_round = 0
        self._last_checkpoint = -1
        self._bytes_sent = 0  # updates pushed by every region so far (bytes_to_target)
        self.evaluation = RunEvaluation(cfg)
        self.clock = Clock()  # from launch until set-up is done, then from round 0
        self.setup_s: float | None = None
        self.startup_s: float | None = None
        self.setup_phases: dict[str, float] = {}
        self.faults = {"region_restarts": 0, "region_failures": 0, "peers_left_out": 0, "late_dropped": 0,
                       "resyncs": 0}
        self.progress: RunProgress | None = None
        self.stop = StopSignals()
        self.outcome = "FAILED"  # for the trackers: FINISHED once the summary is written, KILLED when stopped
        s = cfg.sync
        # Quorum rounds leave the slowest out on purpose; its update comes late, not never. With
        # overlap the exchange in flight is applied first (FaultHandling._flush_for_resync).
        self._resync_on = (s.resync_after_miss and s.algorithm in ("diloco", "allreduce") and s.topology == "full"
                           and s.pacing.mode != "quorum")
        self._init_pacing()

    def _event(self, event: str, **fields) -> None:
        self.events_log.write({"t": round(self.clock.now(), 4), "round": self.next_round, "event": event, **fields})

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Set up and run rounds until run.rounds, run.max_steps or run.target ends the run; returns the
        summary (also in summary.json). A stop signal checkpoints and raises Interrupted between rounds.
        """
        with self.stop:
            self.stop._notify = self._on_signal
            if self.show_progress:
                print(f"geofed: setting up {len(self.regions)} regions (Ray, region actors, TLS, link probes); "
                      f"run directory {self.run_dir}", file=sys.stderr, flush=True)
            self.setup()
            self.progress = RunProgress(self.cfg.run.rounds, enabled=self.show_progress, start=self.next_round,
                                        max_steps=self.cfg.run.max_steps, start_steps=self.coordinator.steps_done)
            try:
                for r in range(self.next_round, self.cfg.run.rounds):
                    if self.stop.requested:
                        self._stop_cleanly()
                    self._round(r)
                    if self.coordinator.done or self.evaluation.hit is not None or self.dp_stopped:
                        break  # run.max_steps spent, run.target reached, privacy.dp.target_epsilon reached
                if self.stop.requested:
                    self._stop_cleanly()
                return self._finish()
            finally:
                self.progress.stop()

    def _on_signal(self, name: str) -> None:
        # Runs in the signal handler: no Ray calls, no locks; the loop acts on it between rounds.
        print(f"geofed: {name}: stopping after the round in flight (again to stop at once)", file=sys.stderr)

    def _round(self, r: int) -> None:
        cfg = self.cfg
        self._revive_dead(r)
        evaluate = self.evaluation.due(r)
        if self.emulator is not None:
            self.emulator.set_round(r)
        t_start = self.clock.now()
        participants, absent = self._participants(r)
        muted = self._muted_for(r)  # members whose updates never arrive (issue 36, N2)
        plans = self._dp_plans(r, self.coordinator.plan(r, alive=participants, evaluate=evaluate, muted=muted,
                                                         optional=self.withhold.on_probation))
        if self.coordinator.at_eval_mark:
            self.evaluation.force(r)
        if plans is None:  # privacy.dp: the round would go past target_epsilon (on_target: stop)
            return
        results = self._run_round(r, plans)
        self._flush_for_resync(r, results)
        self._watch_withholding(r, results, participants)
        t_end = self.clock.now()
        self.coordinator.observe(results)
        self._bytes_sent += sum(m["bytes_sent"] for m in results.values())
        self.evaluation.note_round(r, results, steps=self.coordinator.steps_done)
        extra = {**self.evaluation.of_round(r, results, self.alive, self._fetch_params, t_end=t_end),
                 **self._dp_spend(results)}
        self._log_round(r, results, t_start, t_end, extra={**extra, "participants": participants,
                                                           "absent": sorted(absent), "in_flight": sorted(self.busy),
                                                           **({"muted": sorted(muted)} if muted else {})})
        if extra.get("eval_avg") and self.evaluation.check(extra):
            self._event("target_reached", **self.evaluation.hit)
        self.next_round = r + 1
        self._resync(r, results)
        if cfg.run.checkpoint_every and (r + 1) % cfg.run.checkpoint_every == 0:
            self._checkpoint(r)
        codecs = sorted({c.key for c in self.coordinator.last_codecs.values()}) or ["-"]
        self.progress.update(round_=r, loss=self.coordinator.loss, H=self.coordinator.last_H, mb_sent=self._bytes_sent / 1e6,
                             note=f"down: {','.join(sorted(self.dead))}" if self.dead else "", codec=",".join(codecs),
                             utilization=sum(m["utilization"] for m in results.values()) / max(1, len(results)),
                             elapsed_s=t_end, steps_done=self.coordinator.steps_done)

    def _run_round(self, r: int, plans) -> dict[str, dict[str, Any]]:
        refs = self._dispatch(plans)
        timeout = self.cfg.sync.deadline.max_s * 3 + 600
        if self.pacing.mode == "quorum":
            results = self._gather_quorum(refs, r, timeout=timeout)
        else:
            results = self._gather(refs, f"round {r}", timeout=timeout,
                                   on_result=lambda region, m, waiting: self._notice_done(r, region, m, waiting))
            self._current = set(results)
        now = round(self.clock.now(), 4)
        for region, m in results.items():
            m["t_start"], m["t_end"] = round(now - m["wall_s"], 4), now
            self.faults["peers_left_out"] += len(m.get("peers_missing", []))
            if m.get("refusals"):
                self._event("refused", region=region, by_reason=m["refusals"])
            if m.get("rolled_back"):  # a non-finite round undone (regions/rollback.py)
                self.faults["rollbacks"] = self.faults.get("rollbacks", 0) + 1
                self._event("rolled_back", region=region, **m["rolled_back"])
        return results

    def _notice_done(self, r: int, region: str, m: dict[str, Any], waiting: Collection[str]) -> None:
        """`region` reported round r: the regions still in it whose receive may wait for its update
        learn that it is done (regions/worker.py, senders_done): a member that withholds costs them a
        short grace, not a deadline (issue 36, N2). Only pushes it says were delivered or never made
        count: one still in flight (a slow link) is not cut."""
        done = m.get("pushes_done") or {}
        if done.get("round") != r:
            return  # an overlapped round reports an earlier exchange
        for peer in sorted(set(done.get("peers") or ()) & set(waiting)):
            self.actors.handles[peer].senders_done.remote(r, [region])  # not waited for: the notice races the round

    def _fetch_params(self) -> dict[str, Any]:
        return self._call(self.alive, "get_params", timeout=600)

    def _log_round(self, r: int, results, t_start: float, t_end: float, extra: dict | None = None) -> None:
        for region in self.regions:
            if region in results:
                self.metrics_log.write(results[region])
        links = {}
        for m in results.values():
            for link, est in m.get("links", {}).items():
                entry = dict(est)
                if self.emulator is not None:
                    entry.update(configured_link(self.emulator, *link.split("->", 1)))
                links[link] = entry
        losses = [m["train_loss"] for m in results.values()]
        record = {
            "round": r, "t_start": t_start, "t_end": t_end, "H": self.coordinator.last_H,
            "codecs": {k: v.key for k, v in self.coordinator.last_codecs.items()},
            "reason": self.coordinator.last_reason, "policy": self.coordinator.last_record.get("policy", {}),
            "links": links, "alive": list(self.alive), "regions_reported": sorted(results),
            "mean_train_loss": sum(losses) / len(losses) if losses else None,
            "utilization": sum(m["utilization"] for m in results.values()) / max(1, len(results)),
            "bytes_sent": sum(m["bytes_sent"] for m in results.values()), "driver_rss_mb": rss_mb(),
            **(extra or {})}
        self.rounds_log.write(record)
        self.trackers.log_round(record)

    # -- checkpoints, resume, stop, end ------------------------------------------------------
    def _checkpoint(self, r: int) -> None:
        """Regions first, then the driver's: a driver checkpoint of round r means every region
        alive then has one too (a crash between the two resumes from the previous pair). A region
        whose quorum round is in flight keeps its last one (a resume catches it up from a peer)."""
        busy = self.busy
        self._call([reg for reg in self.alive if reg not in busy], "save_checkpoint", timeout=300)
        state = {"round": r, "clock": self.clock.now(), "coordinator": self.coordinator.state_dict(),
                 "faults": dict(self.faults), "alive": list(self.alive), "withhold": self.withhold.state_dict(),
                 **self._dp_state()}
        d = self.run_dir / "checkpoints" / "driver"
        checkpoint.save_atomic(checkpoint.checkpoint_path(d, r), state)
        checkpoint.prune(d, self.cfg.run.keep_checkpoints)
        self._last_checkpoint = r

    def _restore(self, r: int, state: dict, skipped: list[str], lost: list[int]) -> None:
        """Each region's own checkpoint of round r, or a peer's model when its own is missing or corrupt."""
        for why in skipped:
            self._event("checkpoint_skipped", who="driver", why=why)
        got = self._call(self.regions, "restore_checkpoint", r, timeout=300)
        exact = [reg for reg, g in got.items() if g["round"] == r]
        for reg, g in got.items():
            for why in g["skipped"]:
                self._event("checkpoint_skipped", who=reg, why=why)
        behind = [reg for reg, g in got.items() if g["round"] != r]
        if behind and not exact:
            raise RunFailed(f"{self.run_dir}: no region has a usable checkpoint of round {r}")
        for reg in behind:
            # Its checkpoint of round r is missing or corrupt: the model of a region that has it.
            donor, _ = ray.get(self.actors.handles[reg].catch_up.remote(exact), timeout=300)
            self._event("region_state_from_peer", region=reg, own_round=got[reg]["round"], donor=donor)
        self.coordinator.load_state_dict(state["coordinator"])
        self.faults.update(state["faults"])
        self.withhold.load_state_dict(state.get("withhold") or {})  # muted members stay muted
        self._dp_restore(state)
        self.clock = Clock(offset=state["clock"])
        self.coordinator.clock = self.clock
        self.next_round = r + 1
        self._last_checkpoint = r
        # The progress counts bytes over the whole run, as the summary does.
        self._bytes_sent = sum(rec.get("bytes_sent") or 0 for rec in read_jsonl(self.run_dir / "rounds.jsonl"))
        self._event("resumed", from_checkpoint=r, lost_rounds=lost)

    def _stop_cleanly(self) -> None:
        last = self.next_round - 1
        if last >= 0 and self._last_checkpoint != last:
            self._checkpoint(last)
        self._event("stopped", signal=signal_name(self.stop.signum), last_round=last)
        # What a scheduler's SIGTERM leaves: the run so far, marked; no final evaluation (it could
        # outlast the grace period), the last one stands.
        self._write_summary(self.evaluation.last, None, None,
                            interrupted={"signal": signal_name(self.stop.signum), "last_round": last})
        self.outcome = "KILLED"
        raise Interrupted(self.stop.signum, last)

    def _finish(self) -> dict[str, Any]:
        self._drain_inflight(timeout=self.cfg.sync.deadline.max_s * 3 + 600)
        self._catch_up_behind()
        self._call(self.alive, "finish_pending", timeout=self.cfg.sync.deadline.max_s * 2 + 120)
        self._checkpoint(self.next_round - 1)
        per_region = self._call(self.alive, "evaluate", timeout=600)
        if self.cfg.sync.algorithm == "gossip":
            states = self._call(self.alive, "result_state", timeout=600)
            params = params_by_region(self.cfg, states)
            self.evaluation.fetch_bytes += fetched_bytes(params)
            avg_eval, consensus = evaluate_average(self.cfg, params)
        else:  # every region holds the synchronised model now: one evaluation, one model fetched (the export)
            sketches = self._call(self.alive, "sketch", timeout=600)
            muted = self.withhold.muted(self.next_round - 1)  # a muted member trained alone: not the run's model
            first = next((reg for reg in self.alive if reg not in muted), self.alive[0] if self.alive else None)
            avg_eval = per_region.get(first) if first else None
            consensus = consensus_from_sketches([sketches[r] for r in self.alive if r in sketches])
            states = self._call([first] if first else [], "result_state", timeout=600)
        summary = self._write_summary(avg_eval, per_region, consensus)
        self.outcome = "FINISHED"
        if states:
            write_model(self.run_dir / "model.safetensors", self.cfg, average_states(list(states.values())),
                        round_=self.next_round - 1, regions=list(states), eval_=avg_eval)
        return summary

    def _write_summary(self, avg_eval, per_region, consensus, *, interrupted: dict | None = None) -> dict[str, Any]:
        idle = [reg for reg in self.alive if reg not in self.busy]  # a stop does not wait for a round in flight
        stats = self._call(idle, "transport_stats", timeout=60)
        tail = self._call(idle, "take_refusals", timeout=60)  # refused since each one's last round
        summary = build_summary(self.cfg, self.run_dir, eval_avg=avg_eval, eval_per_region=per_region,
                                consensus=consensus, transport_stats=stats, faults=self.faults,
                                placement=self.actors.info, emulator=self.emulator, wall_s=self.clock.now(),
                                refusals_since_last_round=tail)
        summary.update(self.evaluation.summary_fields())
        summary["setup_s"] = None if self.setup_s is None else round(self.setup_s, 3)
        summary["startup"] = {"process_to_round0_s": self.startup_s, "phases_s": self.setup_phases,
                              "phases_cpu_s": getattr(self, "setup_phases_cpu", None)}
        summary["interrupted"] = interrupted
        summary["pacing"] = {"mode": self.pacing.mode, **self.pacing_stats}
        summary["privacy"] = self._dp_summary()
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def shutdown(self) -> None:
        """Close the logs, the region actors (then kill them, or leave pooled ones for the next run), the emulator and a Ray this driver
        started; safe after a failed or partial setup.
        """
        for logf in ("metrics_log", "rounds_log", "events_log"):
            if hasattr(self, logf):
                getattr(self, logf).close()
        if hasattr(self, "trackers"):
            self.trackers.close(self.outcome)
        if self.actors is not None:
            # Warm-pool actors (ray.warm_pool_s) wait for the next run; the others are killed.
            self.actors.end(self.cfg.ray.warm_pool_s)
        if self.emulator is not None:
            self.emulator.stop()
        if self.ray is not None:
            self.ray.shutdown()
        release_run_dir(self.run_dir)
