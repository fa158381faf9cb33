"""Everything a run does before round 0 (the Runner's set-up, orchestrator/driver/runner.py):
TLS material, Ray, the region actors and their servers, the emulator, the connections, the logs
and a resume's checkpoint, the link probes; each phase timed for the setup_done event.

A mixin on the Runner's attributes (cfg, run_dir, resume, verbose, regions, clock, stop, ...).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import ray
from geofed.p2p.tls import RENEW_WITHIN_DAYS, make_pki, renew_expiring

from .cluster import create_region_actors, init_ray
from .coordinator import Coordinator
from .emulation import start_emulation
from .recovery import marked_processes, record_processes
from .resume import emulation_for_resume, load_driver_checkpoint, reap_previous_driver
from geofed.regions.warm import process_age_s

from .rundir import Clock, JsonlLog, ensure_private_dir, lock_run_dir
from .trackers import Trackers


class SetUp:
    """The Runner's set-up phase."""

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
        self.actors = create_region_actors(self.cfg, str(self.run_dir), pin=pin, hostile=getattr(self, "hostile", None))
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
                    regions={r: {"pid": i.get("pid"), "grpc_address": i.get("grpc_address"), "node_ip": i.get("node_ip"),
                                 "start": i.get("start")}
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
        # CPU seconds beside wall seconds: on a shared host wall time says how busy the others were,
        # CPU time what set-up itself costs (this driver's; each actor's is in `started`'s start.cpu_s).
        self._event("setup_done", setup_s=self.setup_s, process_to_round0_s=self.startup_s, phases_s=self.setup_phases,
                    phases_cpu_s=self.setup_phases_cpu, process_cpu_s=round(time.process_time(), 3))
        if restored is None:
            # Wall time counts training; set-up (Ray, actors, TLS, warming the links) is setup_s.
            self.clock = Clock()
            self.coordinator.clock = self.clock

    def _phase_marker(self):
        """Seconds each set-up phase took, for the setup_done event (where start-up time goes)."""
        self.setup_phases: dict[str, float] = {}
        self.setup_phases_cpu: dict[str, float] = {}  # this process's CPU seconds in each phase
        last = [self.clock.now(), time.process_time()]

        def mark(name: str) -> None:
            now, cpu = self.clock.now(), time.process_time()
            self.setup_phases[name] = round(now - last[0], 3)
            self.setup_phases_cpu[name] = round(cpu - last[1], 3)
            last[:] = [now, cpu]
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
