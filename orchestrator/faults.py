"""How the driver survives region faults (docs/reliability.md), as a base class of Runner.

Every call to the regions goes through ``_gather``: an actor that died, or did not answer in
time, fails its region (elastic: the run carries on without it; fail-fast: RunFailed). Dead
regions are probed each round without blocking and rejoin once Ray has restarted them; regions
that missed an update resync from one that did not.

It works on the Runner's state: ``cfg``, ``regions``, ``actors``, ``alive``, ``dead``,
``_probes``, ``addresses``, ``faults``, ``next_round``, ``progress``, ``_last_checkpoint``,
``run_dir``, and its ``_event`` and ``_connect_all``.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from .recovery import RunFailed, first_line, plan_resync

log = logging.getLogger("geofed.orchestrator.runner")

_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)


class FaultHandling:
    def _gather(self, refs: dict, what: str, *, timeout: float) -> dict[str, Any]:
        """region -> result of one call per region. A region whose actor died, or that did not
        answer within `timeout` (then it is killed for Ray to restart), is failed: elastic runs
        carry on without it, fail-fast runs stop. An exception inside the call stops the run."""
        if not refs:
            return {}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        out = {}
        for ref in ready:
            region = refs[ref]
            try:
                out[region] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._region_failed(region, f"actor died during {what}: {first_line(exc)}")
            except ray.exceptions.RayTaskError as exc:
                raise RunFailed(f"region {region} failed in {what}: {exc.cause!r}") from None
        for ref in pending:
            region = refs[ref]
            self._region_failed(region, f"{what} did not finish within {timeout:.0f}s")
            ray.kill(self.actors.handles[region], no_restart=False)
        return out

    def _call(self, regions, method: str, *args, timeout: float, **kwargs) -> dict[str, Any]:
        refs = {getattr(self.actors.handles[r], method).remote(*args, **kwargs): r for r in regions}
        return self._gather(refs, method, timeout=timeout)

    def _region_failed(self, region: str, why: str) -> None:
        r = self.next_round
        self.faults["region_failures"] += 1
        self._event("region_failed", region=region, why=why)
        if self.cfg.run.on_region_failure == "fail-fast":
            raise RunFailed(f"region {region} failed in round {r} ({why}); run.on_region_failure is fail-fast; "
                            f"the checkpoint of round {self._last_checkpoint} stands: geofed run --resume {self.run_dir}")
        if region in self.alive:
            self.alive.remove(region)
        self.dead[region] = why
        self._probes.pop(region, None)
        if not self.alive:
            raise RunFailed(f"every region has failed (last: {region} in round {r}: {why})")
        if self.progress is not None:
            self.progress.log(f"[yellow]region {region} failed in round {r}: {why}; carrying on without it")

    def _revive_dead(self, r: int) -> None:
        """A dead region is probed without blocking the round; once Ray has restarted it, it
        rejoins. A region past its max_restarts keeps failing the probe and stays out."""
        for region in sorted(self.dead):
            probe = self._probes.get(region)
            if probe is None:
                self._probes[region] = self.actors.handles[region].node_info.remote()
                continue
            if not ray.wait([probe], timeout=0)[0]:
                continue
            del self._probes[region]
            try:
                info = ray.get(probe)
            except ray.exceptions.RayActorError:
                continue  # still restarting, or gone for good: probe again next round
            self._rejoin(region, r, info)

    def _rejoin(self, region: str, r: int, info: dict) -> None:
        """New server, reconnect everyone, own checkpoint, then the current model from a peer."""
        handle = self.actors.handles[region]
        try:
            address = ray.get(handle.start.remote(), timeout=60)
            restored = ray.get(handle.restore_checkpoint.remote(r - 1), timeout=120)
        except _ACTOR_GONE as exc:
            log.warning("region %s did not come back yet: %s", region, first_line(exc))
            return
        self.addresses[region] = address
        self.actors.info[region] = {**self.actors.info.get(region, {}), **info, "grpc_address": address}
        self.alive = [reg for reg in self.regions if reg in self.alive or reg == region]
        del self.dead[region]
        self._connect_all()
        donors = [p for p in self.alive if p != region]
        donor, state_round = None, restored["round"]
        if donors and region in self.alive:
            try:
                donor, state_round = ray.get(handle.catch_up.remote(donors), timeout=self.cfg.sync.deadline.max_s + 60)
            except ray.exceptions.RayActorError as exc:
                self._region_failed(region, f"died while catching up: {first_line(exc)}")
                return
            except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as exc:
                # Its own checkpoint is the best it has; a resync after its first round realigns it.
                log.warning("region %s: no peer gave its state: %s", region, first_line(exc))
        self.faults["region_restarts"] += 1
        self._event("region_rejoined", region=region, pid=info.get("pid"), grpc_address=address,
                    restored_round=restored["round"], skipped_checkpoints=restored["skipped"],
                    donor=donor, state_round=state_round)
        if self.progress is not None:
            self.progress.log(f"[green]region {region} rejoined at round {r} "
                              f"(checkpoint {restored['round']}, state of round {state_round} from {donor})")

    def _resync(self, r: int, results: dict[str, dict[str, Any]]) -> None:
        """Regions that missed an update this round take the model of one that did not."""
        if not self._resync_on:
            return
        jobs = plan_resync(results, [reg for reg in self.regions if reg in self.alive])
        timeout = self.cfg.sync.deadline.max_s
        refs = {self.actors.handles[j.region].catch_up.remote(list(j.donors), timeout_s=timeout): j.region for j in jobs}
        try:
            got = self._gather(refs, "resync", timeout=timeout * len(self.regions) + 30)
        except RunFailed as exc:  # no donor answered (a cut link): it stays on its own model
            log.warning("resync after round %d incomplete: %s", r, exc)
            self._event("resync_failed", why=str(exc))
            return
        for region, (donor, state_round) in got.items():
            self.faults["resyncs"] += 1
            self._event("resync", region=region, donor=donor, state_round=state_round)
