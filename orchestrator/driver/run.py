"""`geofed run`: the driver's round loop, read top to bottom. Set-up (setup.py) places the region
actors and hands the loop what it needs; then each round: faults revive regions -> pacing picks
who runs -> the coordinator plans (the DP budget adds its noise) -> the regions run it (handles.py)
-> faults flush, watch and resync -> the coordinator observes -> log -> checkpoint. Faults, pacing
and the privacy budget are objects of their own, each in its module, that the loop calls by name.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import ray
from geofed.regions import checkpoint
from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.export import average_states
from geofed.regions.messages import RoundReport, rss_mb

from ..config import RunConfig
from ..config.strict import ConfigError
from .cluster import RegionActors, StartingActor, node_labels, start_region_actor
from .coordinator import Coordinator
from .emulation import add_emulated_region, configured_link
from .evaluation import RunEvaluation, consensus_from_sketches, fetched_bytes
from .export import params_by_region, write_model
from .faults import Faults
from .handles import RegionHandles, Reports
from .journal import Journal
from .loops import LoopEnds, one_initial_model
from .membership import AwaitingNode, Membership, requeue_unanswered
from .pacing import Pacing
from .privacy import DpBudget
from .progress import RunProgress
from .reattach import actor_names, detached
from .recovery import Interrupted, RunFailed, StopSignals, signal_name
from .resume import train_fn_name
from .rundir import Clock, read_jsonl, release_run_dir, write_json
from .setup import Opened, Ready, probe_links, route, set_up
from .shards import connect_shards
from .summary import build_summary, evaluate_average

__all__ = ["Runner", "RunFailed", "prepare_task", "round_record"]


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


def round_record(r: int, results: Reports, coordinator: Coordinator, *, t_start: float, t_end: float,
                 alive: list[str], emulator: Any = None, extra: dict | None = None) -> dict[str, Any]:
    """Round r's rounds.jsonl record (docs/RUNDIR.md): the plan, the links as measured (and as
    configured, when emulated), the regions that reported, mean loss, utilisation and bytes."""
    links = {}
    for m in results.values():
        for link, est in m.links.items():
            entry = dict(est)
            if emulator is not None:
                entry.update(configured_link(emulator, *link.split("->", 1)))
            links[link] = entry
    # None: a round without steps (the loop API's loop returned early, regions/loop.py)
    losses = [m.steps.train_loss for m in results.values() if m.steps.train_loss is not None]
    c = coordinator
    return {
        "round": r, "t_start": t_start, "t_end": t_end, "H": c.last_H,
        "codecs": {k: v.key for k, v in c.last_codecs.items()},
        "reason": c.last_reason, "policy": c.last_record.get("policy", {}),
        "links": links, "alive": list(alive), "regions_reported": sorted(results),
        "mean_train_loss": sum(losses) / len(losses) if losses else None,
        "utilization": sum(m.utilization for m in results.values()) / max(1, len(results)),
        "bytes_sent": sum(m.exchange.bytes_sent for m in results.values()), "driver_rss_mb": rss_mb(),
        **(extra or {})}


class Runner:
    """The driver of one run: set-up, then rounds until run.rounds, run.max_steps, run.target or
    privacy.dp.target_epsilon ends the run, surviving region faults. Call run(), then shutdown()
    whatever happened. `hostile`: region -> a callable of its built Region (the actor's `plugin`),
    for `geofed bench attack`'s geofed.bench.adversary.Adversary (no config can set it).
    `train_fn`: the user's training loop, run in every region actor (orchestrator/trainer.py; None:
    the task's built-in stepper)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, *, show_progress: bool = True, resume: bool = False,
                 verbose: bool = False, hostile: dict | None = None, train_fn: Callable[[Any], None] | None = None):
        self.cfg, self.run_dir, self.resume, self.verbose = cfg, Path(run_dir), resume, verbose
        self.hostile = dict(hostile or {})
        self.train_fn = train_fn
        self.show_progress = show_progress
        self.clock = Clock()  # from launch until set-up is done, then from round 0
        self.journal = Journal(self.clock)
        self.opened = Opened()
        self.stop = StopSignals()
        self.evaluation = RunEvaluation(cfg)
        self.dp = DpBudget(cfg, self.journal)
        self.loops = LoopEnds()  # the loop API: regions whose training loop ended (driver/loops.py)
        self.outcome = "FAILED"  # for the trackers: FINISHED once the summary is written, KILLED when stopped
        self.bytes_sent = 0  # updates pushed by every region so far (the progress line)
        self.setup_s: float | None = None
        self.startup_s: float | None = None
        # Set up by run(): what set-up handed over, and the loop's parts that need the regions.
        self.ready: Ready | None = None
        self.regions: RegionHandles | None = None
        self.coordinator: Coordinator | None = None
        self.faults: Faults | None = None
        self.pacing: Pacing | None = None
        self.membership: Membership | None = None
        # A resume's round that re-attached regions finished after their driver died: their reports (driver/reattach.py)
        self.replay: dict[str, RoundReport] = {}

    # What callers watching a run read (benches, tests).
    @property
    def next_round(self) -> int:
        return self.journal.round

    @property
    def actors(self) -> RegionActors | None:
        return self.opened.actors

    @property
    def emulator(self) -> Any:
        return self.opened.emulator

    @property
    def addresses(self) -> dict[str, str]:
        return {} if self.regions is None else self.regions.addresses

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Set up and run rounds until run.rounds, run.max_steps or run.target ends the run; returns the
        summary (also in summary.json). A stop signal checkpoints and raises Interrupted between rounds.
        """
        with self.stop:
            self.stop.notify = self._on_signal
            if self.show_progress:
                print(f"geofed: setting up {len(self.cfg.regions.names)} regions (Ray, region actors, TLS, link "
                      f"probes); run directory {self.run_dir}", file=sys.stderr, flush=True)
            self._set_up()
            progress = self.journal.progress = RunProgress(
                self.cfg.run.rounds, enabled=self.show_progress, start=self.next_round,
                max_steps=self.cfg.run.max_steps, start_steps=self.coordinator.steps_done)
            try:
                for r in range(self.next_round, self.cfg.run.rounds):
                    if self.stop.requested:
                        self._stop_cleanly()
                    self._round(r)
                    if self.coordinator.done or self.evaluation.hit is not None or self.dp.stopped or self.loops.all_ended:
                        break  # run.max_steps spent, run.target reached, privacy.dp.target_epsilon reached, loops over
                if self.stop.requested:
                    self._stop_cleanly()
                return self._finish()
            finally:
                progress.stop()

    def _set_up(self) -> None:
        ready = self.ready = set_up(self.cfg, self.run_dir, self.opened, self.journal, resume=self.resume,
                                    verbose=self.verbose, stop=self.stop, hostile=self.hostile, train_fn=self.train_fn)
        self.regions, self.coordinator = ready.regions, ready.coordinator
        self.faults = Faults(self.cfg, self.regions, self.journal, reconnect=self._connect)
        self.pacing = Pacing(self.cfg, self.regions, self.journal, on_late=self._late)
        self.membership = Membership(self.run_dir, self.regions, self.journal, busy=lambda: self.pacing.busy,
                                     drain=self._drain, spawn=self._spawn, rejoin=self._join, probe=self._probe,
                                     grow=self._grow, connect=self._connect,
                                     start=lambda region: ray.get(self.regions.start_ref(region), timeout=60))
        self.dp.plan(self.opened.actors.info)  # the noise for target_epsilon (a resume then restores the accountant)
        if self.resume:  # a join or leave its killed predecessor took but never answered is taken again
            requeue_unanswered(self.run_dir)
        if ready.restored is not None:
            self._restore(*ready.restored)
        elif self.train_fn is not None:
            self._one_initial_model()
        self.setup_s, self.startup_s = probe_links(self.cfg, ready, self.journal)

    def _one_initial_model(self) -> None:
        """A fresh loop-API run: every region starts from the first one's model (driver/loops.py)."""
        regions, timeout_s = self.regions, self.cfg.sync.deadline.max_s
        took = one_initial_model(
            list(regions.alive), lambda names: regions.sketch(names, timeout=600),
            lambda donors: regions.catch_up(donors, "initial model", timeout_s=timeout_s, timeout=timeout_s + 120),
            self.journal.note)
        if took:
            self.journal.event("initial_model", donor=regions.alive[0], regions=took)

    def _on_signal(self, name: str) -> None:
        # Runs in the signal handler: no Ray calls, no locks; the loop acts on it between rounds.
        print(f"geofed: {name}: stopping after the round in flight (again to stop at once)", file=sys.stderr)

    def _round(self, r: int) -> None:
        cfg, regions, coordinator, journal = self.cfg, self.regions, self.coordinator, self.journal
        self.membership.poll(r)  # leave requests in RUN_DIR/control, taken between rounds (driver/membership.py)
        self.bytes_sent += self.faults.revive(r)
        evaluate = self.evaluation.due(r)
        if self.emulator is not None:
            self.emulator.set_round(r)
        t_start = self.clock.now()
        participants, absent = self.pacing.participants(r)
        participants = self.loops.looping(participants)  # a region whose loop ended has left (driver/loops.py)
        muted, back = self.faults.muted_for(r)  # members whose updates never arrive (issue 36, N2)
        for region, rounds_apart in back.items():
            self.pacing.mark_behind(region, rounds_apart)
        plans = self.dp.plans(r, coordinator.plan(r, alive=participants, evaluate=evaluate, muted=muted,
                                                  optional=self.faults.on_probation))
        if coordinator.at_eval_mark:
            self.evaluation.force(r)
        if plans is None:  # privacy.dp: the round would go past target_epsilon (on_target: stop)
            return
        results = self._run_round(r, plans)
        self.membership.note_reports(results)  # a SIGTERM's spot notice: it leaves before the next round
        self.loops.note(r, results, regions.alive)
        self.faults.flush_for_resync(r, results)
        self.faults.watch_withholding(r, results, participants, coordinator.round_links)
        t_end = self.clock.now()
        coordinator.observe(results)
        self.bytes_sent += sum(m.exchange.bytes_sent for m in results.values())
        self.evaluation.note_round(r, results, steps=coordinator.steps_done)
        extra = {**self.evaluation.of_round(r, results, regions.alive, self._fetch_params, t_end=t_end),
                 **self.dp.spend(results)}
        self._log_round(r, results, t_start, t_end, extra={**extra, "participants": participants,
                                                           "absent": sorted(absent), "in_flight": sorted(self.pacing.busy),
                                                           **({"muted": sorted(muted)} if muted else {}),
                                                           **({"members_out": sorted(self.membership.out)}
                                                              if self.membership.out else {})})
        if extra.get("eval_avg") and self.evaluation.check(extra):
            journal.event("target_reached", **self.evaluation.hit)
        journal.round = r + 1
        self.faults.resync(r, results)
        if cfg.run.checkpoint_every and (r + 1) % cfg.run.checkpoint_every == 0:
            self._checkpoint(r)
        codecs = sorted({c.key for c in coordinator.last_codecs.values()}) or ["-"]
        journal.progress.update(round_=r, loss=coordinator.loss, H=coordinator.last_H, mb_sent=self.bytes_sent / 1e6,
                                note=f"down: {','.join(sorted(regions.dead))}" if regions.dead else "",
                                codec=",".join(codecs),
                                utilization=sum(m.utilization for m in results.values()) / max(1, len(results)),
                                elapsed_s=t_end, steps_done=coordinator.steps_done)

    def _run_round(self, r: int, plans: dict[str, Any]) -> Reports:
        kept, self.replay = self.replay, {}
        if kept:
            # Run by the re-attached regions after their driver died: their reports are the round, taken as if
            # just read (driver/reattach.py); `planned` differs only if this plan is not the one they ran.
            results = {g: m for g, m in kept.items() if m.round == r}
            self.journal.event("round_replayed", round=r, regions=sorted(results),
                               **({"planned": sorted(plans)} if set(plans) != set(results) else {}))
        else:
            refs = self.pacing.dispatch(plans, self.faults.muted(r))
            results = self.pacing.gather(refs, r, timeout=self.cfg.sync.deadline.max_s * 3 + 600,
                                         on_result=lambda region, m, waiting: self._notice_done(r, region, m, waiting))
        now = round(self.clock.now(), 4)
        for region, m in results.items():
            results[region] = dataclasses.replace(m, t_start=round(now - m.wall_s, 4), t_end=now)
            self.journal.count("peers_left_out", len(m.exchange.peers_missing))
            if m.security.refusals:
                self.journal.event("refused", region=region, by_reason=m.security.refusals)
            if m.security.rolled_back:  # a non-finite round undone (regions/rollback.py)
                self.journal.count("rollbacks")
                self.journal.event("rolled_back", region=region, **m.security.rolled_back)
        return results

    def _notice_done(self, r: int, region: str, m: RoundReport, waiting: Collection[str]) -> None:
        """`region` reported round r: the regions still in it whose receive may wait for its update
        learn that it is done (regions/region.py, senders_done): a member that withholds costs them a
        short grace, not a deadline (issue 36, N2). Only pushes it says were delivered or never made
        count: one still in flight (a slow link) is not cut."""
        done = m.exchange.pushes_done or {}
        if done.get("round") != r:
            return  # an overlapped round reports an earlier exchange
        for peer in sorted(set(done.get("peers") or ()) & set(waiting)):
            self.regions.senders_done(peer, r, [region])

    def _late(self, region: str, m: RoundReport) -> None:
        """A round that reported after its quorum round closed (pacing.py): its step time and
        links still count, its record goes to metrics.jsonl."""
        self.bytes_sent += m.exchange.bytes_sent
        self.coordinator.observe_late(region, m)
        self.ready.metrics_log.write(m.to_record())

    def _connect(self) -> None:
        regions = self.regions
        regions.connect(lambda src, dst: route(self.emulator, regions.addresses, src, dst))
        # regions.shard_exchange: worker k of every region dials worker k of the others (driver/shards.py)
        connect_shards(self.cfg, regions.actors.handles, list(regions.alive))

    def _drain(self, region: str) -> None:
        """A leaver's exchange in flight (overlap) is finished first: its update of its last round reaches its peers."""
        if self.cfg.sync.overlap:
            self.regions.finish_pending([region], timeout=self.cfg.sync.deadline.max_s * 2 + 120)

    def _spawn(self, region: str, cfg: RunConfig | None = None,
               label: str | None = None) -> tuple[Any, StartingActor | AwaitingNode]:
        """A joiner's new actor (`geofed join`) built from `cfg` (the run's, with the regions joined under
        new names; None: the run's), placed as set-up places the region's, or on a node labelled `label`;
        not waited for: membership brings it in once it answers, the rounds go on meanwhile. With no
        node carrying `label` yet, the actor is made once one does (membership.AwaitingNode: looked for
        each round until regions.placement_timeout_s; the handle is None until then)."""
        cfg = cfg or self.cfg
        if self.cfg.regions.workers > 1 or self.hostile:
            raise ValueError("joins place one actor a region: not with regions.workers > 1 or hostile regions")
        # detached and named as set-up's regions are: it outlives a killed driver too (driver/reattach.py)
        named = actor_names(self.run_dir, [region]) if detached(self.cfg, hostile=self.hostile, train_fn=self.train_fn) else {}

        def make() -> StartingActor:
            starting = start_region_actor(cfg, str(self.run_dir), region, pin=bool(self.cfg.ray.address) or label is not None,
                                          train_fn=self.train_fn, named=named.get(region))
            self.actors.named.update(named)  # ended at the run's end, or by its orphan timeout, as theirs are
            return starting

        if label is not None and label not in node_labels(cfg.regions.label_key):
            # no node carries it yet: looked for again each round, not waited for (regions.placement_timeout_s)
            waiting = AwaitingNode(cfg.regions.label_key, label, timeout_s=cfg.regions.placement_timeout_s,
                                   seen=node_labels, make=make)
            return None, waiting
        starting = make()
        return starting.handle, starting

    def _grow(self, region: str, label: str | None) -> None:
        """A region joined under a new name: the coordinator plans over it, the emulator shapes its links."""
        self.coordinator.add_region(region)
        if self.emulator is not None:
            like = add_emulated_region(self.emulator, self.membership.config(), region, label)
            self.journal.event("links_added", region=region, like=like)

    def _join(self, region: str, r: int, info: dict) -> None:
        self.bytes_sent += self.faults.join(region, r, info)

    def _probe(self, regions: list[str], joiner: str) -> None:
        """Set-up's link probes again, after a join: the joiner's links are measured before they carry
        updates. A region back under its old name (geofed leave, then join) whose links to every region
        in the run were measured before is not probed again: those links are the ones the estimates
        describe, and the probes (3 s of a join's 4 s round on the 2-core host, docs/reliability.md)
        would stall every region. Its first rounds' transfers refresh the estimates, as a restarted
        region's do."""
        view = self.coordinator.link_view
        others = [r for r in regions if r != joiner]
        known = [view.estimate(f"{a}->{b}") for o in others for a, b in ((joiner, o), (o, joiner))]
        if others and all(e.bandwidth_bps or e.rtt_s for e in known):
            self.journal.event("links_probed", links=self.coordinator.links_record(), after="join", probes={},
                               skipped=f"{joiner}'s links to every region in the run were measured before it left")
            return
        probes = self.regions.probe(regions, timeout=2 * (self.cfg.network.probe_s + 30.0) + 60.0)
        self.coordinator.observe_probe(probes)
        self.journal.event("links_probed", links=self.coordinator.links_record(), after="join",
                           probes={r: m["transfers"] for r, m in probes.items() if m["transfers"]})

    def _fetch_params(self) -> dict[str, Any]:
        return self.regions.get_params(self.regions.alive, timeout=600)

    def _log_round(self, r: int, results: Reports, t_start: float, t_end: float, extra: dict | None = None) -> None:
        for region in self.regions.names:
            if region in results:
                self.ready.metrics_log.write(results[region].to_record())
        record = round_record(r, results, self.coordinator, t_start=t_start, t_end=t_end, alive=self.regions.alive,
                              emulator=self.emulator, extra=extra)
        self.ready.rounds_log.write(record)
        self.ready.trackers.log_round(record)

    # -- checkpoints, resume, stop, end ------------------------------------------------------
    def _checkpoint(self, r: int) -> None:
        """Regions first, then the driver's: a driver checkpoint of round r means every region
        alive then has one too (a crash between the two resumes from the previous pair). A region
        whose quorum round is in flight keeps its last one (a resume catches it up from a peer)."""
        busy, alive = self.pacing.busy, self.regions.alive
        self.regions.save_checkpoint([reg for reg in alive if reg not in busy], timeout=300)
        state = {"round": r, "clock": self.clock.now(), "coordinator": self.coordinator.state_dict(),
                 "faults": dict(self.journal.counts), "alive": list(alive), "withhold": self.faults.state_dict(),
                 "membership": self.membership.state_dict(),
                 **self.dp.state_dict()}
        d = self.run_dir / "checkpoints" / "driver"
        checkpoint.save_atomic(checkpoint.checkpoint_path(d, r), state)
        checkpoint.prune(d, self.cfg.run.keep_checkpoints)
        self.journal.last_checkpoint = r

    def _restore(self, r: int, state: dict, skipped: list[str], lost: list[int]) -> None:
        """Each region's own checkpoint of round r, or a peer's model when its own is missing or corrupt."""
        journal, regions = self.journal, self.regions
        for why in skipped:
            journal.event("checkpoint_skipped", who="driver", why=why)
        # who left stays gone; a joiner under a new name takes its live actor back (driver/reattach.py)
        self.membership.load_state_dict(state.get("membership") or {}, live=self.ready.live)
        # Regions that outlived their killed driver keep their state when it fits the checkpoint (driver/reattach.py)
        live, decision = self.ready.live, self.ready.decision
        kept = [g for g in regions.alive if g in live]
        restore = [g for g in regions.alive if g not in live]
        if decision is not None:
            journal.event("regions_reattached", regions=kept, pids={g: live[g].info.get("pid") for g in kept},
                          restored=restore, replay_round=decision.replay, rounds=decision.rounds,
                          why_restored=decision.why, gone=self.ready.gone)
        self._restore_regions(r, restore, kept=kept)
        if decision is not None and decision.replay is not None:
            self.replay = {g: live[g].report for g in kept}
            lost = [x for x in lost if x != decision.replay]  # logged again from the reports, not done again
        self.coordinator.load_state_dict(state["coordinator"])
        journal.counts.update(state["faults"])
        self.faults.load_state_dict(state.get("withhold") or {})  # muted members stay muted
        self.dp.load_state_dict(state)
        self.clock.restart(state["clock"])
        journal.round = r + 1
        journal.last_checkpoint = r
        # The progress counts bytes over the whole run, as the summary does.
        self.bytes_sent = sum(rec.get("bytes_sent") or 0 for rec in read_jsonl(self.run_dir / "rounds.jsonl"))
        journal.event("resumed", from_checkpoint=r, lost_rounds=lost)

    def _restore_regions(self, r: int, names: list[str], *, kept: list[str]) -> None:
        """`names` restore their own checkpoint of round r, or take the model of a region that has it
        (or of a `kept` one, whose state is of round r) when theirs is missing or corrupt."""
        journal, regions = self.journal, self.regions
        got = regions.restore_checkpoint(names, r, timeout=300) if names else {}
        exact = [reg for reg, g in got.items() if g["round"] == r] + kept
        for reg, g in got.items():
            for why in g["skipped"]:
                journal.event("checkpoint_skipped", who=reg, why=why)
        behind = [reg for reg, g in got.items() if g["round"] != r]
        if behind and not exact:
            raise RunFailed(f"{self.run_dir}: no region has a usable checkpoint of round {r}")
        for reg in behind:
            # Its checkpoint of round r is missing or corrupt: the model of a region that has it.
            donor, _ = ray.get(regions.catch_up_ref(reg, exact), timeout=300)
            journal.event("region_state_from_peer", region=reg, own_round=got[reg]["round"], donor=donor)

    def _stop_cleanly(self) -> None:
        last = self.next_round - 1
        if last >= 0 and self.journal.last_checkpoint != last:
            self._checkpoint(last)
        self.journal.event("stopped", signal=signal_name(self.stop.signum), last_round=last)
        # What a scheduler's SIGTERM leaves: the run so far, marked; no final evaluation (it could
        # outlast the grace period), the last one stands.
        self._write_summary(self.evaluation.last, None, None,
                            interrupted={"signal": signal_name(self.stop.signum), "last_round": last})
        self.outcome = "KILLED"
        raise Interrupted(self.stop.signum, last)

    def _finish(self) -> dict[str, Any]:
        regions, last = self.regions, self.next_round - 1
        self.membership.end_joins(last)  # a joiner still starting is answered, not left waiting
        self.pacing.drain(timeout=self.cfg.sync.deadline.max_s * 3 + 600)
        self.pacing.catch_up_behind(self.faults.muted(last))
        regions.finish_pending(regions.alive, timeout=self.cfg.sync.deadline.max_s * 2 + 120)
        self._checkpoint(last)
        per_region = regions.evaluate(regions.alive, timeout=600)
        if algorithm_traits(self.cfg.sync.algorithm).mixes_models:
            states = regions.result_state(regions.alive, timeout=600)
            params = params_by_region(self.cfg, states)
            self.evaluation.fetch_bytes += fetched_bytes(params)
            avg_eval, consensus = evaluate_average(self.cfg, params)
        else:  # every region holds the synchronised model now: one evaluation, one model fetched (the export)
            sketches = regions.sketch(regions.alive, timeout=600)
            alive = self.loops.freshest_first(regions.alive)  # a loop that ended early holds an older model
            muted = self.faults.muted(last)  # a muted member trained alone: not the run's model
            first = next((reg for reg in alive if reg not in muted), alive[0] if alive else None)
            avg_eval = per_region.get(first) if first else None
            consensus = consensus_from_sketches([sketches[r] for r in alive if r in sketches])
            states = regions.result_state([first] if first else [], timeout=600)
        # Last: the loop API's functions run on once told the run is over (their ctx.report), while
        # every call above uses the model their loops hold parked.
        reports = regions.finish_loop(regions.alive, timeout=120) if self.train_fn is not None else {}
        self.ready.trackers.log_reports(last, reports)
        summary = self._write_summary(avg_eval, per_region, consensus, reports=reports)
        self.outcome = "FINISHED"
        if states:
            write_model(self.run_dir / "model.safetensors", self.cfg, average_states(list(states.values())),
                        round_=last, regions=list(states), eval_=avg_eval, trained_by=train_fn_name(self.train_fn))
        return summary

    def _write_summary(self, avg_eval, per_region, consensus, *, interrupted: dict | None = None,
                       reports: dict[str, dict] | None = None) -> dict[str, Any]:
        idle = [reg for reg in self.regions.alive if reg not in self.pacing.busy]  # a stop does not wait for a round in flight
        stats = self.regions.transport_stats(idle, timeout=60)
        tail = self.regions.take_refusals(idle, timeout=60)  # refused since each one's last round
        summary = build_summary(self.cfg, self.run_dir, eval_avg=avg_eval, eval_per_region=per_region,
                                consensus=consensus, transport_stats=stats, faults=self.journal.counts,
                                placement=self.opened.actors.info, emulator=self.emulator, wall_s=self.clock.now(),
                                refusals_since_last_round=tail)
        summary.update(self.evaluation.summary_fields())
        summary["setup_s"] = None if self.setup_s is None else round(self.setup_s, 3)
        timer = self.ready.timer
        summary["startup"] = {"process_to_round0_s": self.startup_s, "phases_s": timer.wall, "phases_cpu_s": timer.cpu}
        summary["interrupted"] = interrupted
        summary["pacing"] = {"mode": self.pacing.mode, **self.pacing.stats}
        summary["privacy"] = self.dp.summary()
        summary.update(self.membership.summary_fields())  # `left`: who left the run, when, why
        summary["reports"] = reports or {}  # the loop API's ctx.report, by region (none on a stop: no loop returned)
        if self.train_fn is not None:  # the model is the training function's; the config's task was not trained
            summary["config"]["task"] = f"train_fn {train_fn_name(self.train_fn)}"
            summary.update(self.loops.summary_fields())
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def shutdown(self) -> None:
        """Close the logs, the region actors (then kill them, or leave pooled ones for the next run),
        the emulator and a Ray this driver started; safe after a failed or partial set-up."""
        self.journal.close()
        self.opened.close(warm_pool_s=self.cfg.ray.warm_pool_s, outcome=self.outcome)
        release_run_dir(self.run_dir)
