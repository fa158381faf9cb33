"""How the driver survives region faults (docs/reliability.md), as a base class of Runner.

Every call to the regions goes through ``_gather``: an actor that died, or did not answer in
time, fails its region (elastic: the run carries on without it; fail-fast: RunFailed). While it
waits, ``_gather`` probes the regions it waits on (a heartbeat served on each actor's own thread):
one silent for regions.heartbeat_timeout_s is stalled (SIGSTOP, swap, a hung host) and left out
like a failed one, without a restart. Dead regions are probed each round without blocking and
rejoin once Ray has restarted them; stalled ones rejoin once their pending call returns. Regions
that missed an update resync from one that did not.

It works on the Runner's state: ``cfg``, ``regions``, ``actors``, ``alive``, ``dead``,
``_probes``, ``_stalled``, ``addresses``, ``faults``, ``next_round``, ``progress``, ``_last_checkpoint``,
``run_dir``, ``_resync_on``, ``_bytes_sent``, and its ``_event`` and ``_connect_all``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from geofed.regions.sync.common import merge_exchange_metrics

from .recovery import RunFailed, first_line, plan_resync

log = logging.getLogger("geofed.orchestrator.driver.runner")

_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)


class _Liveness:
    """The liveness probe of the regions a gather waits on: a `heartbeat` call, served on the
    actor's own thread (regions/actor.py), at most one in flight per region. A region busy with a
    long call answers it; a stopped or hung one does not."""

    def __init__(self, handles: dict, timeout_s: float):
        self.handles, self.timeout_s = handles, timeout_s
        self.every_s = min(1.0, timeout_s / 4)
        self.t0 = time.monotonic()
        self.last_ok: dict[str, float] = {}
        self.inflight: dict[str, Any] = {}

    def silent(self, regions) -> dict[str, float]:
        """region -> seconds since its last answer (since the gather began if none), for those
        of `regions` silent longer than the timeout."""
        now = time.monotonic()
        out = {}
        for region in regions:
            hb = self.inflight.get(region)
            if hb is not None and ray.wait([hb], timeout=0)[0]:
                del self.inflight[region]
                try:
                    ray.get(hb)
                    self.last_ok[region] = now
                except ray.exceptions.RayError:
                    pass  # it died: its pending call fails too, and says so
            if region not in self.inflight:
                self.inflight[region] = self.handles[region].heartbeat.remote()
            silent_s = now - self.last_ok.get(region, self.t0)
            if silent_s > self.timeout_s:
                out[region] = silent_s
        return out


class FaultHandling:
    """The Runner's fault handling (a base class working on its state): calls to the regions that
    survive dead, hung and stalled ones, revivals and resyncs (see the module docstring).
    """

    def _gather(self, refs: dict, what: str, *, timeout: float, on_result=None) -> dict[str, Any]:
        """region -> result of one call per region. A region whose actor died, or that did not
        answer within `timeout` (then it is killed for Ray to restart), is failed; one that stops
        answering the liveness probe for regions.heartbeat_timeout_s is stalled: the gather goes
        on without it. Elastic runs carry on without either, fail-fast runs stop. An exception
        inside the call stops the run. `on_result(region, result, still_waiting)` sees each result as it
        comes (the runner's senders-done notices), not a probe period later."""
        if not refs:
            return {}
        pending, out = dict(refs), {}
        probe = _Liveness(self.actors.handles, self.cfg.regions.heartbeat_timeout_s)
        t0 = t_last = time.monotonic()
        noted: set[str] = set()
        while pending and (left := timeout - (time.monotonic() - t0)) > 0:
            ready, _ = ray.wait(list(pending), num_returns=1 if on_result else len(pending),
                                timeout=min(left, probe.every_s))
            for ref in ready:
                region = pending.pop(ref)
                self._collect(ref, region, what, out)
                t_last = time.monotonic()
                if on_result is not None and region in out:
                    on_result(region, out[region], set(pending.values()))
            if not pending:
                break
            silent = probe.silent(pending.values())
            for ref, region in list(pending.items()):
                if region in silent:
                    del pending[ref]
                    self._region_stalled(region, ref, what, silent[region], give_up_at=t0 + timeout)
                elif out and region not in noted and time.monotonic() - t_last > probe.timeout_s:
                    noted.add(region)  # busy, not stalled: waited for, and said so once
                    self._note(f"waiting for region {region}: still in {what} "
                               f"{time.monotonic() - t_last:.0f}s after the others (it answers the liveness probe)")
                    self._event("waiting_for_region", region=region, what=what,
                                waited_s=round(time.monotonic() - t_last, 2))
        for region in pending.values():
            self._region_failed(region, f"{what} did not finish within {timeout:.0f}s")
            ray.kill(self.actors.handles[region], no_restart=False)
        return out

    def _collect(self, ref, region: str, what: str, out: dict[str, Any]) -> None:
        try:
            out[region] = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._region_failed(region, f"actor died during {what}: {first_line(exc)}")
        except ray.exceptions.RayTaskError as exc:
            raise RunFailed(f"region {region} failed in {what}: {exc.cause!r}") from None

    def _call(self, regions, method: str, *args, timeout: float, **kwargs) -> dict[str, Any]:
        refs = {getattr(self.actors.handles[r], method).remote(*args, **kwargs): r for r in regions}
        return self._gather(refs, method, timeout=timeout)

    def _note(self, message: str, style: str = "yellow") -> None:
        """A line on the terminal (above the progress bar), or a warning before there is one."""
        if self.progress is not None:
            self.progress.log(f"[{style}]{message}")
        else:
            log.warning("%s", message)

    def _region_failed(self, region: str, why: str) -> None:
        r = self.next_round
        self.faults["region_failures"] += 1
        self._event("region_failed", region=region, why=why)
        if self.cfg.run.on_region_failure == "fail-fast":
            raise RunFailed(f"region {region} failed in round {r} ({why}); run.on_region_failure is fail-fast; "
                            f"the checkpoint of round {self._last_checkpoint} stands: geofed run --resume {self.run_dir}")
        self._leave_out(region, why)
        self._note(f"region {region} failed in round {r}: {why}; carrying on without it")

    def _region_stalled(self, region: str, ref, what: str, silent_s: float, *, give_up_at: float) -> None:
        """Alive (Ray sees no death) but silent: the run goes on without it; its pending call is
        its probe: once that returns it rejoins (_revive_stalled)."""
        why = f"no answer to the liveness probe for {silent_s:.1f}s during {what} (stopped, swapping or hung)"
        self.faults["region_stalls"] = self.faults.get("region_stalls", 0) + 1
        pid = (self.actors.info.get(region) or {}).get("pid")
        self._event("region_stalled", region=region, what=what, silent_s=round(silent_s, 2), pid=pid)
        if self.cfg.run.on_region_failure == "fail-fast":
            self._region_failed(region, why)  # raises
        self._leave_out(region, why)
        self._probes[region] = ref
        self._stalled[region] = {"since": time.monotonic() - silent_s, "give_up_at": give_up_at}
        self._note(f"region {region} stalled in round {self.next_round}: {why}; carrying on without it; "
                   "it rejoins when it answers")

    def _leave_out(self, region: str, why: str) -> None:
        if region in self.alive:
            self.alive.remove(region)
        self.dead[region] = why
        self._probes.pop(region, None)
        if not self.alive:
            raise RunFailed(f"every region has failed (last: {region} in round {self.next_round}: {why})")

    def _revive_dead(self, r: int) -> None:
        """A dead region is probed without blocking the round; once Ray has restarted it, it
        rejoins. A region past its max_restarts keeps failing the probe and stays out."""
        for region in sorted(self.dead):
            if region in self._stalled:
                self._revive_stalled(region, r)
                continue
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

    def _revive_stalled(self, region: str, r: int) -> None:
        """A stalled region's pending call returned: it answers again and rejoins (its result is
        dropped: the round went on without it). One that never returns is, after the call's own
        timeout, killed for Ray to restart, as a region that did not finish in time always was."""
        probe, st = self._probes[region], self._stalled[region]
        if not ray.wait([probe], timeout=0)[0]:
            if time.monotonic() > st["give_up_at"]:
                del self._stalled[region], self._probes[region]
                self.faults["region_failures"] += 1
                self._event("region_failed", region=region, why=f"stalled for {time.monotonic() - st['since']:.0f}s; "
                            "killed for Ray to restart")
                ray.kill(self.actors.handles[region], no_restart=False)
            return
        del self._stalled[region], self._probes[region]
        try:
            ray.get(probe)
        except ray.exceptions.RayActorError:
            return  # it died meanwhile: a dead region now, probed for its restart from the next round
        except ray.exceptions.RayTaskError as exc:
            log.warning("region %s: its late call failed (%s); it rejoins anyway", region, first_line(exc))
        self._rejoin(region, r, dict(self.actors.info.get(region) or {}), restarted=False,
                     stalled_s=time.monotonic() - st["since"])

    def _rejoin(self, region: str, r: int, info: dict, *, restarted: bool = True, stalled_s: float | None = None) -> None:
        """New server (after a restart), reconnect everyone, own checkpoint, then the current
        model from a peer. A region back from a stall keeps its server and address."""
        handle = self.actors.handles[region]
        try:
            address = ray.get(handle.start.remote(), timeout=60) if restarted else self.addresses[region]
            restored = ray.get(handle.restore_checkpoint.remote(r - 1), timeout=120)
        except _ACTOR_GONE as exc:
            log.warning("region %s did not come back yet: %s", region, first_line(exc))
            if not restarted:  # the dead-region path restarts it: a fresh actor whose start() works
                ray.kill(handle, no_restart=False)
            return
        self.addresses[region] = address
        self.actors.info[region] = {**self.actors.info.get(region, {}), **info, "grpc_address": address}
        self.alive = [reg for reg in self.regions if reg in self.alive or reg == region]
        del self.dead[region]
        self._connect_all()
        donors = self._flush_donors(r, [p for p in self.alive if p != region])
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
        if restarted:
            self.faults["region_restarts"] += 1
        self._event("region_rejoined", region=region, pid=info.get("pid"), grpc_address=address,
                    restored_round=restored["round"], skipped_checkpoints=restored["skipped"],
                    donor=donor, state_round=state_round, after="restart" if restarted else "stall",
                    **({} if stalled_s is None else {"stalled_s": round(stalled_s, 2)}))
        if self.progress is not None:
            self.progress.log(f"[green]region {region} rejoined at round {r} after a {'restart' if restarted else 'stall'} "
                              f"(checkpoint {restored['round']}, state of round {state_round} from {donor})")

    def _flush_for_resync(self, r: int, results: dict[str, dict[str, Any]]) -> None:
        """Overlap: a round reports the exchange of the round before, so a miss shows while this
        round's exchange is still in flight, and a donor's global model and outer state would lack
        the update that the receiver's pending exchange still applies. Every region that reported
        applies its exchange in flight first (its metrics join the round's; its misses count for
        the resync): then donor and receiver stand at the same round boundary, no exchange pending,
        and the receiver takes exactly the donor's state. It costs the overlap of this one round."""
        if not (self._resync_on and self.cfg.sync.overlap and any(m.get("peers_missing") for m in results.values())):
            return
        regions = [reg for reg in self.alive if reg in results]
        flushed = self._call(regions, "flush_exchange", timeout=self.cfg.sync.deadline.max_s * 2 + 120)
        for region, more in flushed.items():
            if not more:
                continue  # nothing was in flight (the last round flushes its own)
            more = dict(more)
            exchange_round = more.pop("exchange_round", None)
            merge_exchange_metrics(results[region], more)
            results[region]["flushed_exchange_round"] = exchange_round
        self._event("overlap_flushed", regions=sorted(flushed), exchange_round=r, why="miss",
                    missing={reg: m.get("peers_missing") for reg, m in flushed.items() if m.get("peers_missing")})

    def _flush_donors(self, r: int, donors: list[str]) -> list[str]:
        """Overlap: before round r every donor still has round r-1's exchange in flight, which a
        region rejoining now took no part in; a state taken without it would leave the region one
        outer update behind for good. The donors apply it first (their misses in it resync them);
        returns the donors still alive."""
        if not (self.cfg.sync.overlap and donors):
            return donors
        flushed = {reg: m for reg, m in self._call(donors, "flush_exchange",
                                                   timeout=self.cfg.sync.deadline.max_s * 2 + 120).items() if m}
        if flushed:
            sent = sum(int(m.get("bytes_sent", 0)) for m in flushed.values())
            self._bytes_sent += sent  # the round records that would have reported them will not
            self._event("overlap_flushed", regions=sorted(flushed), exchange_round=r - 1, why="rejoin", bytes_sent=sent,
                        missing={reg: m["peers_missing"] for reg, m in flushed.items() if m.get("peers_missing")})
            self._resync(r - 1, flushed)
        return [p for p in donors if p in self.alive]

    # -- members whose updates never arrive (issue 36, N2) ---------------------------------------
    def _muted_for(self, r: int) -> set[str]:
        """The regions muted in round r (recovery.WithholdWatch). One whose time out ends now is
        planned again; it first takes the model of a current region (it trained alone meanwhile:
        its state may lie that many rounds from theirs)."""
        for region in sorted(self.withhold.back(r) & set(self.alive)):
            self._behind.add(region)
            self._rounds_apart[region] = max(1, r - self.withhold.since.pop(region, r))
            self._event("member_probation", region=region)
        return self.withhold.muted(r) & set(self.alive)

    def _watch_withholding(self, r: int, results: dict[str, dict[str, Any]], participants: list[str]) -> None:
        """A region that reported the round but whose update most of its expecting peers missed
        (withheld, or refused) for WithholdWatch.after rounds in a row is muted: left out of the plan
        like a stalled region, so no deadline waits or widens for it."""
        muted = self.withhold.muted(r)
        expecting: dict[str, set[str]] = {}
        for link in self.coordinator._round_links(r, [reg for reg in participants if reg not in muted]):
            src, dst = link.split("->", 1)
            expecting.setdefault(src, set()).add(dst)
        for rec in self.withhold.observe(r, results, expecting):
            self.faults["members_muted"] = self.faults.get("members_muted", 0) + 1
            self._event("member_muted", **rec)
            self._note(f"region {rec['region']}: its update missed by {len(rec['missed_by'])} of {len(rec['expected_by'])} "
                       f"peers in round {r} (withheld or refused); left out of the next {rec['rounds_out']} rounds")

    def _resync(self, r: int, results: dict[str, dict[str, Any]]) -> None:
        """Regions that missed an update this round take the model of one that did not (never of one
        whose update they missed, nor of a muted member)."""
        if not self._resync_on:
            return
        jobs = plan_resync(results, [reg for reg in self.regions if reg in self.alive], left_out=self.withhold.muted(r))
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
