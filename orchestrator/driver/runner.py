"""`geofed run`: the driver. Sets up Ray, TLS, region actors and (optionally) the WAN emulator,
then paces rounds: plan -> every region runs its round -> log -> checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

import ray
from geofed.p2p.tls import RENEW_WITHIN_DAYS, make_pki, renew_expiring
from geofed.regions import checkpoint
from geofed.regions.export import average_states
from geofed.regions.worker import rss_mb

from .cluster import PlacementError, RegionActors, create_region_actors, init_ray
from ..config import RunConfig, load_config
from ..config.devicecheck import local_device_problem
from .coordinator import Coordinator
from .emulation import configured_link, start_emulation
from .evaluation import RunEvaluation, consensus_from_sketches, fetched_bytes
from .export import params_by_region, write_model
from .faults import FaultHandling
from .pacing import PacedRounds
from .privacy import DpAccounting
from .progress import RunProgress, print_summary
from .recovery import Interrupted, RunFailed, StopSignals, first_line, marked_processes, record_processes, signal_name
from .resume import emulation_for_resume, load_driver_checkpoint, reap_previous_driver, resume_config
from .rundir import Clock, JsonlLog, ensure_private_dir, read_jsonl, lock_run_dir, new_run_dir, process_age_s, release_run_dir, write_json
from ..config.strict import ConfigError
from .summary import build_summary, evaluate_average
from .trackers import Trackers, check_trackers


log = logging.getLogger(__name__)


def run_from_args(args) -> int:
    """`geofed run`: load or resume the config, run it, print the summary and write the report; returns
    the exit code (143/130 after a clean stop on SIGTERM/SIGINT, 130 after an immediate one, 1 on a failed run).
    """
    if args.resume:
        cfg, run_dir = resume_config(Path(args.resume), args.overrides, getattr(args, "allow_config_change", None) or ())
        lock_run_dir(run_dir, key="--resume")  # at once: a run still going there is named before any work
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = None
    cfg = _with_address(cfg, args.address)
    if (problem := local_device_problem(cfg)) is not None:
        raise ConfigError("", problem, source=args.resume or args.config or "default config")
    if len(cfg.regions.names) == 1:
        print(f"geofed: warning: one region ({cfg.regions.names[0]}): nothing is exchanged, no link is measured; "
              "list two or more in regions.names to train across regions", file=sys.stderr)
    cfg = prepare_task(cfg, source=args.resume or args.config or "default config")
    check_trackers(cfg, source=str(args.resume or args.config or "default config"))
    if run_dir is None:  # only once the config and its data are known to be good
        run_dir = new_run_dir(cfg, args.out)
    runner = Runner(cfg, run_dir, show_progress=not args.quiet, resume=bool(args.resume),
                    verbose=bool(getattr(args, "verbose", False)))
    try:
        summary = runner.run()
    except Interrupted as stop:
        print(f"geofed: {stop}; checkpoint of round {stop.round} in {run_dir}; "
              f"continue with: geofed run --resume {run_dir}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print(f"geofed: stopped at once; the last checkpoint in {run_dir} stands; "
              f"continue with: geofed run --resume {run_dir}", file=sys.stderr)
        return 130
    except (PlacementError, RunFailed) as exc:
        print(f"geofed: {exc}", file=sys.stderr)
        return 1
    finally:
        runner.shutdown()
    print_summary(summary, str(run_dir))
    if cfg.run.report and not args.no_report:
        from ..report import write_report

        print(f"report: {write_report(run_dir)}")
    print(f"run directory: {run_dir}")
    return 0


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


def _with_address(cfg: RunConfig, address: str | None) -> RunConfig:
    if not address:
        return cfg
    return dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, address=address))


class Runner(FaultHandling, PacedRounds, DpAccounting):
    """The driver of one run: sets up TLS, Ray, the region actors, the emulator and the links, then
    paces rounds (plan, run, log, evaluate, checkpoint) and survives region faults (FaultHandling).
    Call run(), then shutdown() whatever happened.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, *, show_progress: bool = True, resume: bool = False,
                 verbose: bool = False):
        self.cfg, self.run_dir, self.resume, self.verbose = cfg, Path(run_dir), resume, verbose
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
        # Quorum rounds leave the slowest out on purpose; its update comes late, not never.
        self._resync_on = (s.resync_after_miss and s.algorithm in ("diloco", "allreduce") and s.topology == "full"
                           and not s.overlap and s.pacing.mode != "quorum")
        self._init_pacing()

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        """Everything before round 0: TLS material, Ray, the region actors and their servers, the
        emulator, the connections, the logs (a resume restores its checkpoint), the link probes.
        """
        ensure_private_dir(self.run_dir)  # 0700, also for a Runner started without new_run_dir
        lock_run_dir(self.run_dir)  # held until shutdown(); new_run_dir or --resume may hold it already
        mark = self._phase_marker()
        self._make_tls()
        mark("tls")
        reaped = reap_previous_driver(self.run_dir) if self.resume else []
        with marked_processes(self.run_dir) as token:  # what a later --resume may end proves it is ours
            self.ray = init_ray(self.cfg, verbose=self.verbose)
        mark("ray")
        self.stop.reclaim()
        pin = bool(self.cfg.ray.address)
        self.actors = create_region_actors(self.cfg, str(self.run_dir), pin=pin)
        mark("actors")
        if self.ray.started_here:
            record_processes(self.run_dir, token)
        self.alive = list(self.regions)
        starts = [self.actors.handles[r].start.remote() for r in self.regions]
        self.addresses = dict(zip(self.regions, ray.get(starts, timeout=120)))
        for region, address in self.addresses.items():
            self.actors.info[region]["grpc_address"] = address  # summary.json placement
        # A resume rewrites the logs (dropping rounds after its checkpoint) before they are opened.
        restored = load_driver_checkpoint(self.run_dir) if self.resume else None
        self.emulator = start_emulation(emulation_for_resume(self.cfg, restored), self.regions)
        self._connect_all()
        mark("servers_connected")
        info = self.actors.info[self.regions[0]]
        self.coordinator = Coordinator(self.cfg, model_numel=info["params"], clock=self.clock)
        self.metrics_log = JsonlLog(self.run_dir / "metrics.jsonl")
        self.rounds_log = JsonlLog(self.run_dir / "rounds.jsonl")
        self.events_log = JsonlLog(self.run_dir / "events.jsonl")
        self.trackers = Trackers(self.cfg, self.run_dir)
        self._event("started", driver_pid=os.getpid(), resume=self.resume,
                    regions={r: {"pid": i.get("pid"), "grpc_address": i.get("grpc_address"), "node_ip": i.get("node_ip")}
                             for r, i in self.actors.info.items()})
        if reaped:
            self._event("reaped_previous_driver", processes=reaped)
        if getattr(self, "_tls_renewed", None):
            self._event("tls_renewed", certificates=self._tls_renewed)
        self._plan_privacy()  # the noise for privacy.dp.target_epsilon (a resume then restores the accountant)
        if restored is not None:
            self._restore(*restored)
        mark("logs_restore")
        probes = self._probe()
        self._event("links_probed", links=self.coordinator.links_record(),
                    probes={r: m["transfers"] for r, m in probes.items() if m["transfers"]})
        mark("probes")
        self.setup_s = self.clock.now() if restored is None else None
        self.startup_s = process_age_s()  # from `geofed run` (this process) to round 0
        self._event("setup_done", setup_s=self.setup_s, process_to_round0_s=self.startup_s, phases_s=self.setup_phases)
        if restored is None:
            # Wall time counts training; set-up (Ray, actors, TLS, warming the links) is setup_s.
            self.clock = Clock()
            self.coordinator.clock = self.clock

    def _phase_marker(self):
        """Seconds each set-up phase took, for the setup_done event (where start-up time goes)."""
        self.setup_phases: dict[str, float] = {}
        last = [self.clock.now()]

        def mark(name: str) -> None:
            now = self.clock.now()
            self.setup_phases[name] = round(now - last[0], 3)
            last[0] = now
        return mark

    def _make_tls(self) -> None:
        tls = self.run_dir / "tls"
        names = ["ca", *self.regions]
        if self.resume and all((tls / f"{n}.pem").is_file() and (tls / f"{n}.key").is_file() for n in names):
            # A resumed run keeps its CA and certificates, renewing those about to expire (30-day certificates).
            self._tls_renewed = renew_expiring(tls, self.regions)
            if self._tls_renewed:
                print(f"geofed: renewed TLS certificates expiring within {RENEW_WITHIN_DAYS} days from the run's CA: "
                      f"{', '.join(self._tls_renewed)}", file=sys.stderr)
            return
        make_pki(tls, self.regions)

    def _connect_all(self) -> None:
        refs = {}
        for src in self.alive:
            peers = {dst: self._route(src, dst) for dst in self.alive if dst != src}
            refs[self.actors.handles[src].connect.remote(peers)] = src
        self._gather(refs, "connect", timeout=60)

    def _probe(self) -> dict[str, dict[str, Any]]:
        """Every region warms and measures its connections, all at once (network.probe_s), so
        round 0 is planned from measured links and pays no handshake."""
        per_probe = self.cfg.network.probe_s + 30.0
        results = self._call(self.alive, "probe", timeout=2 * per_probe + 60.0)
        self.coordinator.observe_probe(results)
        return results

    def _route(self, src: str, dst: str) -> str:
        if self.emulator is None:
            return self.addresses[dst]
        return self.emulator.route(src, dst, self.addresses[dst])

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
            self.progress = RunProgress(self.cfg.run.rounds, enabled=self.show_progress, start=self.next_round)
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
        plans = self._dp_plans(r, self.coordinator.plan(r, alive=participants, evaluate=evaluate))
        if plans is None:  # privacy.dp: the round would go past target_epsilon (on_target: stop)
            return
        results = self._run_round(r, plans)
        t_end = self.clock.now()
        self.coordinator.observe(results)
        self._bytes_sent += sum(m["bytes_sent"] for m in results.values())
        self.evaluation.note_round(r, results, steps=self.coordinator.steps_done)
        extra = {**self.evaluation.of_round(r, results, self.alive, self._fetch_params, t_end=t_end),
                 **self._dp_spend(results)}
        self._log_round(r, results, t_start, t_end, extra={**extra, "participants": participants,
                                                           "absent": sorted(absent), "in_flight": sorted(self.busy)})
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
                             elapsed_s=t_end)

    def _run_round(self, r: int, plans) -> dict[str, dict[str, Any]]:
        refs = self._dispatch(plans)
        timeout = self.cfg.sync.deadline.max_s * 3 + 600
        if self.pacing.mode == "quorum":
            results = self._gather_quorum(refs, r, timeout=timeout)
        else:
            results = self._gather(refs, f"round {r}", timeout=timeout)
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
                 "faults": dict(self.faults), "alive": list(self.alive), **self._dp_state()}
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
            avg_eval = per_region.get(self.alive[0]) if self.alive else None
            consensus = consensus_from_sketches([sketches[r] for r in self.alive if r in sketches])
            states = self._call(self.alive[:1], "result_state", timeout=600)
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
        summary["startup"] = {"process_to_round0_s": self.startup_s, "phases_s": self.setup_phases}
        summary["interrupted"] = interrupted
        summary["pacing"] = {"mode": self.pacing.mode, **self.pacing_stats}
        summary["privacy"] = self._dp_summary()
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def shutdown(self) -> None:
        """Close the logs, the region actors (then kill them), the emulator and a Ray this driver
        started; safe after a failed or partial setup.
        """
        for logf in ("metrics_log", "rounds_log", "events_log"):
            if hasattr(self, logf):
                getattr(self, logf).close()
        if hasattr(self, "trackers"):
            self.trackers.close(self.outcome)
        if self.actors is not None:
            try:
                ray.get([h.close.remote() for h in self.actors.handles.values()], timeout=10)
            except Exception as exc:  # noqa: BLE001 - dead actors cannot close; they are killed next
                log.debug("closing the region actors: %s", first_line(exc))
            self.actors.kill()
        if self.emulator is not None:
            self.emulator.stop()
        if self.ray is not None:
            self.ray.shutdown()
        release_run_dir(self.run_dir)
