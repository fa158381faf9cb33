"""`geofed run`: the driver. Sets up Ray, TLS, region actors and (optionally) the WAN emulator,
then paces rounds: plan -> every region runs its round -> log -> checkpoint."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import ray

from geofed.p2p.tls import make_pki
from geofed.regions import checkpoint

from .cluster import PlacementError, RegionActors, create_region_actors, init_ray, wait_alive
from .config import RunConfig, config_from_mapping, load_config
from .coordinator import Coordinator
from .emulation import start_emulation
from .progress import RunProgress, print_summary
from .rundir import Clock, JsonlLog, new_run_dir, truncate_jsonl, write_json
from .strict import ConfigError, parse_yaml
from .summary import build_summary, evaluate_average

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot go on (fail-fast region loss, diverged training, ...)."""


def run_from_args(args) -> int:
    if args.resume:
        cfg, run_dir = _resume_config(Path(args.resume), args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = None
    cfg = _with_address(cfg, args.address)
    cfg = prepare_task(cfg, source=args.resume or args.config or "default config")
    if run_dir is None:  # only once the config and its data are known to be good
        run_dir = new_run_dir(cfg, args.out)
    runner = Runner(cfg, run_dir, show_progress=not args.quiet, resume=bool(args.resume))
    try:
        summary = runner.run()
    except KeyboardInterrupt:
        runner.interrupted()
        print(f"geofed: interrupted; checkpoint in {run_dir}; continue with: geofed run --resume {run_dir}")
        return 130
    except (PlacementError, RunFailed) as exc:
        print(f"geofed: {exc}")
        return 1
    finally:
        runner.shutdown()
    print_summary(summary, str(run_dir))
    if cfg.run.report and not args.no_report:
        from .report import write_report

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


def _resume_config(run_dir: Path, overrides) -> tuple[RunConfig, Path]:
    path = run_dir / "config.yaml"
    if not path.exists():
        raise ConfigError("", "not a run directory (no config.yaml)", source=str(run_dir))
    data = parse_yaml(path.read_bytes(), source=str(path))
    return config_from_mapping(data, overrides, source=str(path)), run_dir


class Runner:
    def __init__(self, cfg: RunConfig, run_dir: Path, *, show_progress: bool = True, resume: bool = False):
        self.cfg, self.run_dir, self.resume = cfg, Path(run_dir), resume
        self.regions = list(cfg.regions.names)
        self.show_progress = show_progress
        self.ray = None
        self.actors: RegionActors | None = None
        self.emulator = None
        self.addresses: dict[str, str] = {}
        self.alive: list[str] = []
        self.dead: dict[str, str] = {}
        self.next_round = 0
        self.clock = Clock()
        self.faults = {"region_restarts": 0, "region_failures": 0, "peers_left_out": 0, "late_dropped": 0}
        self.progress: RunProgress | None = None

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        make_pki(self.run_dir / "tls", self.regions)  # idempotent: a resumed run keeps its CA
        self.ray = init_ray(self.cfg)
        pin = bool(self.cfg.ray.address)
        self.actors = create_region_actors(self.cfg, str(self.run_dir), pin=pin)
        self.alive = list(self.regions)
        self.addresses = dict(zip(self.regions, ray.get([self.actors.handles[r].start.remote() for r in self.regions])))
        for region, address in self.addresses.items():
            self.actors.info[region]["grpc_address"] = address  # summary.json placement
        self.emulator = start_emulation(self.cfg, self.regions)
        self._connect_all()
        info = self.actors.info[self.regions[0]]
        self.coordinator = Coordinator(self.cfg, model_numel=info["params"], clock=self.clock)
        self.metrics_log = JsonlLog(self.run_dir / "metrics.jsonl")
        self.rounds_log = JsonlLog(self.run_dir / "rounds.jsonl")
        self.events_log = JsonlLog(self.run_dir / "events.jsonl")
        if self.resume:
            self._restore()

    def _connect_all(self) -> None:
        refs = []
        for src in self.alive:
            peers = {dst: self._route(src, dst) for dst in self.alive if dst != src}
            refs.append(self.actors.handles[src].connect.remote(peers))
        ray.get(refs, timeout=60)

    def _route(self, src: str, dst: str) -> str:
        if self.emulator is None:
            return self.addresses[dst]
        return self.emulator.route(src, dst, self.addresses[dst])

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.setup()
        if not self.resume:
            self.clock = Clock()  # wall time counts training, not Ray start-up
            self.coordinator.clock = self.clock
        cfg = self.cfg
        self.progress = RunProgress(cfg.run.rounds, enabled=self.show_progress, start=self.next_round)
        mb_sent = 0.0
        try:
            for r in range(self.next_round, cfg.run.rounds):
                self._revive_dead(r)
                evaluate = bool(cfg.run.eval_every) and (r + 1) % cfg.run.eval_every == 0
                if self.emulator is not None:
                    self.emulator.set_round(r)
                t_start = self.clock.now()
                plans = self.coordinator.plan(r, alive=self.alive, evaluate=evaluate)
                results = self._run_round(r, plans)
                t_end = self.clock.now()
                self.coordinator.observe(results)
                mb_sent += sum(m["bytes_sent"] for m in results.values()) / 1e6
                self._log_round(r, results, t_start, t_end, extra=self._consensus() if evaluate else None)
                self.next_round = r + 1
                if cfg.run.checkpoint_every and (r + 1) % cfg.run.checkpoint_every == 0:
                    self._checkpoint(r)
                self.progress.update(round_=r, loss=self.coordinator.loss, H=self.coordinator.last_H, mb_sent=mb_sent,
                                     note=f"down: {','.join(sorted(self.dead))}" if self.dead else "")
                if self.coordinator.done:  # run.max_steps spent
                    break
            return self._finish()
        finally:
            self.progress.stop()

    def _run_round(self, r: int, plans) -> dict[str, dict[str, Any]]:
        refs = {self.actors.handles[reg].run_round.remote(plan): reg for reg, plan in plans.items()}
        timeout = self.cfg.sync.deadline.max_s * 3 + 600
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        results = {}
        for ref in ready:
            region = refs[ref]
            try:
                results[region] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._region_failed(region, r, f"actor died: {type(exc).__name__}")
            except ray.exceptions.RayTaskError as exc:
                raise RunFailed(f"region {region} failed in round {r}: {exc.cause!r}") from None
        for ref in pending:
            self._region_failed(refs[ref], r, f"round {r} did not finish within {timeout:.0f}s")
            ray.kill(self.actors.handles[refs[ref]], no_restart=False)
        for region, m in results.items():
            m["t_start"], m["t_end"] = round(self.clock.now() - m["wall_s"], 4), round(self.clock.now(), 4)
            self.faults["peers_left_out"] += len(m.get("peers_missing", []))
        return results

    def _region_failed(self, region: str, r: int, why: str) -> None:
        self.faults["region_failures"] += 1
        self.events_log.write({"t": self.clock.now(), "round": r, "event": "region_failed", "region": region, "why": why})
        if self.cfg.run.on_region_failure == "fail-fast":
            raise RunFailed(f"region {region} failed in round {r} ({why}); run.on_region_failure is fail-fast")
        if region in self.alive:
            self.alive.remove(region)
        self.dead[region] = why
        if not self.alive:
            raise RunFailed(f"every region has failed (last: {region} in round {r}: {why})")
        if self.progress is not None:
            self.progress.log(f"[yellow]region {region} failed in round {r}: {why}; carrying on without it")

    def _revive_dead(self, r: int) -> None:
        """A region Ray restarted comes back: new server, reconnect, state from checkpoint + a peer."""
        for region in sorted(self.dead):
            handle = self.actors.handles[region]
            if wait_alive(handle, timeout_s=2.0) is None:
                continue
            self.addresses[region] = ray.get(handle.start.remote(), timeout=60)
            restored = ray.get(handle.restore_checkpoint.remote(), timeout=120)
            self.alive.append(region)
            self.alive.sort(key=self.regions.index)
            del self.dead[region]
            self._connect_all()
            donors = [p for p in self.alive if p != region]
            donor, _ = ray.get(handle.catch_up.remote(donors), timeout=self.cfg.sync.deadline.max_s + 60)
            self.faults["region_restarts"] += 1
            self.events_log.write({"t": self.clock.now(), "round": r, "event": "region_rejoined", "region": region,
                                   "restored_round": restored, "donor": donor})
            if self.progress is not None:
                self.progress.log(f"[green]region {region} rejoined at round {r} (checkpoint {restored}, state from {donor})")

    def _consensus(self) -> dict[str, Any]:
        """Eval rounds: the averaged model's metric and how far apart the regions' models are
        (what gossip drives to zero); rounds.jsonl keeps them, the report plots them."""
        handles = [self.actors.handles[reg] for reg in self.alive]
        try:
            params = dict(zip(self.alive, ray.get([h.get_params.remote() for h in handles], timeout=600)))
        except ray.exceptions.RayError as exc:  # a region died since its round: next eval round
            log.warning("consensus distance skipped this round: %s", exc)
            return {}
        avg, consensus = evaluate_average(self.cfg, params)
        return {"consensus_distance": consensus, "eval_avg": avg}

    def _log_round(self, r: int, results, t_start: float, t_end: float, extra: dict | None = None) -> None:
        for region in self.regions:
            if region in results:
                self.metrics_log.write(results[region])
        links = {}
        for m in results.values():
            for link, est in m.get("links", {}).items():
                entry = dict(est)
                if self.emulator is not None:
                    src, dst = link.split("->", 1)
                    spec = self.emulator.configured(src, dst)
                    entry["configured_bandwidth_mbps"] = spec.bandwidth_mbps
                    entry["configured_rtt_ms"] = 2 * spec.latency_ms
                links[link] = entry
        losses = [m["train_loss"] for m in results.values()]
        self.rounds_log.write({
            "round": r, "t_start": t_start, "t_end": t_end, "H": self.coordinator.last_H,
            "codecs": {k: _spec_str(v) for k, v in self.coordinator.last_codecs.items()},
            "reason": self.coordinator.last_reason, "policy": self.coordinator.last_record.get("policy", {}),
            "links": links, "alive": list(self.alive),
            "mean_train_loss": sum(losses) / len(losses) if losses else None,
            "utilization": sum(m["utilization"] for m in results.values()) / max(1, len(results)),
            "bytes_sent": sum(m["bytes_sent"] for m in results.values()), **(extra or {})})

    # -- checkpoints, resume, end ------------------------------------------------------------
    def _checkpoint(self, r: int) -> None:
        ray.get([self.actors.handles[reg].save_checkpoint.remote() for reg in self.alive], timeout=300)
        state = {"round": r, "clock": self.clock.now(), "coordinator": self.coordinator.state_dict(),
                 "faults": dict(self.faults), "alive": list(self.alive)}
        d = self.run_dir / "checkpoints" / "driver"
        checkpoint.save_atomic(checkpoint.checkpoint_path(d, r), state)
        checkpoint.prune(d, self.cfg.run.keep_checkpoints)

    def _restore(self) -> None:
        found = checkpoint.load_latest(self.run_dir / "checkpoints" / "driver")
        if found is None:
            raise RunFailed(f"{self.run_dir}: no usable driver checkpoint to resume from")
        r, state = found
        got = ray.get([self.actors.handles[reg].restore_checkpoint.remote(r) for reg in self.regions], timeout=300)
        for reg, rr in zip(self.regions, got):
            if rr != r:
                # This region's checkpoint for round r is missing/corrupt: take state from a peer.
                donors = [p for p, q in zip(self.regions, got) if q == r]
                ray.get(self.actors.handles[reg].catch_up.remote(donors), timeout=300)
        self.coordinator.load_state_dict(state["coordinator"])
        self.faults.update(state["faults"])
        self.clock = Clock(offset=state["clock"])
        self.coordinator.clock = self.clock
        self.next_round = r + 1
        for name in ("metrics.jsonl", "rounds.jsonl"):
            truncate_jsonl(self.run_dir / name, lambda rec: rec.get("round", -1) <= r)
        self.events_log.write({"t": self.clock.now(), "event": "resumed", "round": r + 1})

    def _finish(self) -> dict[str, Any]:
        handles = [self.actors.handles[reg] for reg in self.alive]
        ray.get([h.finish_pending.remote() for h in handles], timeout=self.cfg.sync.deadline.max_s * 2 + 120)
        self._checkpoint(self.next_round - 1)
        per_region = dict(zip(self.alive, ray.get([h.evaluate.remote() for h in handles], timeout=600)))
        params = dict(zip(self.alive, ray.get([h.get_params.remote() for h in handles], timeout=600)))
        avg_eval, consensus = evaluate_average(self.cfg, params)
        stats = dict(zip(self.alive, ray.get([h.transport_stats.remote() for h in handles], timeout=60)))
        summary = build_summary(self.cfg, self.run_dir, eval_avg=avg_eval, eval_per_region=per_region,
                                consensus=consensus, transport_stats=stats, faults=self.faults,
                                placement=self.actors.info, emulator=self.emulator, wall_s=self.clock.now())
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def interrupted(self) -> None:
        """Ctrl-C: keep the last completed round's checkpoint; the resume starts after it."""
        if self.actors is None or self.next_round == 0:
            return
        try:
            self._checkpoint(self.next_round - 1)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out; the previous checkpoint stays
            log.warning("checkpoint on interrupt failed: %s", exc)

    def shutdown(self) -> None:
        for logf in ("metrics_log", "rounds_log", "events_log"):
            if hasattr(self, logf):
                getattr(self, logf).close()
        if self.actors is not None:
            try:
                ray.get([h.close.remote() for h in self.actors.handles.values()], timeout=10)
            except Exception:  # noqa: BLE001 - dead actors cannot close; they are killed next
                pass
            self.actors.kill()
        if self.emulator is not None:
            self.emulator.stop()
        if self.ray is not None:
            self.ray.shutdown()


def _spec_str(spec: Any) -> str:
    from geofed.regions.exchange import spec_key

    return spec_key(spec)
