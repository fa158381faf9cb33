"""The driver's typed handle to the region actors (docs/reliability.md): one Python method per call
the driver makes, and who of the regions is still in the run.

Every call to several regions is gathered: an actor that died, or did not answer in time, fails
its region (elastic: the run carries on without it; fail-fast: RunFailed). While it waits, the
gather probes the regions it waits on (a heartbeat served on each actor's own thread): one silent
for regions.heartbeat_timeout_s (a quarter of it, at least 2 s, once another region has answered)
is stalled (SIGSTOP, swap, a hung host) and left out like a
failed one, without a restart; its pending call is its probe (faults.py revives it). What each
method returns is what the region's method returns, region by region: a round's RoundReport
(regions/messages.py, `Reports`), dicts for the other calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import ray
from geofed.regions.messages import RoundPlan, RoundReport
from geofed.regions.workers import GroupLost

from ..config import RunConfig
from .cluster import RegionActors
from .failures import ACTOR_DEATHS, Death, cause_of_text, death_cause, worker_exit
from .hosts import HostedRegion, actor_of
from .journal import Journal
from .recovery import RunFailed
from .regroup import Regroup, worker_death

Results = dict[str, dict[str, Any]]
Reports = dict[str, RoundReport]  # a round's reports by region (run_round's refs, gathered)
OnResult = Callable[[str, Any, Collection[str]], None]


def _quick_stall(timeout_s: float) -> float:
    """How long a region may be silent once another region of the gather has finished its call: a
    quarter of regions.heartbeat_timeout_s, at least 2 s (never more than the timeout). The probe is
    served on the actor's own thread, so a busy region answers it within milliseconds (a 12,000-step
    round of 3 s answered every probe of a 1 s timeout: tests/security/test_stalled_region.py); a
    region silent for 2 s while its peers are done is stopped or hung, and every second more is a
    second every other region waits (a 10 s SIGSTOP held the whole run 10 s: docs/reliability.md)."""
    return min(timeout_s, max(2.0, timeout_s / 4))


class _Liveness:
    """The liveness probe of the regions a gather waits on: a `heartbeat` call, served on the
    actor's own thread (regions/actor.py), at most one in flight per region. A region busy with a
    long call answers it; a stopped or hung one does not."""

    def __init__(self, handles: dict[str, Any], timeout_s: float, leaving: dict[str, dict] | None = None):
        self.handles, self.timeout_s = handles, timeout_s
        self.leaving = {} if leaving is None else leaving  # region -> the heartbeat that said it is leaving
        self.every_s = min(1.0, timeout_s / 4)
        self.t0 = time.monotonic()
        self.last_ok: dict[str, float] = {}
        self.inflight: dict[str, Any] = {}

    def silent(self, regions: Iterable[str], timeout_s: float | None = None) -> dict[str, float]:
        """region -> seconds since its last answer (since the gather began if none), for those
        of `regions` silent longer than `timeout_s` (the probe's timeout when None)."""
        now = time.monotonic()
        out = {}
        for region in regions:
            hb = self.inflight.get(region)
            if hb is not None and ray.wait([hb], timeout=0)[0]:
                del self.inflight[region]
                try:
                    answer = ray.get(hb)
                    self.last_ok[region] = now
                    if answer.get("leaving"):  # a SIGTERM (spot notice) came mid-call: regions/leave_notice.py
                        self.leaving.setdefault(region, answer)
                except ray.exceptions.RayError:
                    pass  # it died: its pending call fails too, and says so
            if region not in self.inflight:
                self.inflight[region] = self.handles[region].heartbeat.remote()
            silent_s = now - self.last_ok.get(region, self.t0)
            if silent_s > (self.timeout_s if timeout_s is None else timeout_s):
                out[region] = silent_s
        return out


class RegionHandles:
    """The region actors as the driver sees them: `alive` (in the run, in regions.names order),
    `dead` (left out: region -> why), `stalled` and `probes` (what faults.py watches to revive
    them), `addresses` (each one's gRPC server), and one method per call the driver makes."""

    def __init__(self, cfg: RunConfig, actors: RegionActors, journal: Journal, run_dir: Path):
        self.cfg, self.actors, self.journal, self.run_dir = cfg, actors, journal, run_dir
        self.names = list(cfg.regions.names)
        self.alive = list(self.names)
        self.dead: dict[str, str] = {}
        self.probes: dict[str, Any] = {}  # dead region -> node_info ref: answers once Ray restarted it
        self.stalled: dict[str, dict[str, float]] = {}  # stalled region (in dead; its probe is its pending call)
        self.addresses: dict[str, str] = {}
        self.leaving: dict[str, dict] = {}  # region -> its heartbeat saying it got a SIGTERM (driver/membership.py)
        self.regroup = Regroup(cfg, actors, journal, run_dir)  # regions.workers > 1: rebuilt after a worker died

    # -- gathering ---------------------------------------------------------------------------
    def gather(self, refs: dict[Any, str], what: str, *, timeout: float, on_result: OnResult | None = None) -> dict[str, Any]:
        """region -> result of one call per region. A region whose actor died, or that did not
        answer within `timeout` (then it is killed for Ray to restart), is failed; one that stops
        answering the liveness probe for regions.heartbeat_timeout_s is stalled: the gather goes
        on without it; once another region of the gather has answered its call, a quarter of that
        (at least 2 s) is enough (`_quick_stall`). Elastic runs carry on without either, fail-fast runs stop. An exception
        inside the call stops the run. `on_result(region, result, still_waiting)` sees each result as it
        comes (the loop's senders-done notices), not a probe period later."""
        if not refs:
            return {}
        pending = dict(refs)
        out: dict[str, Any] = {}
        probe = _Liveness(self.actors.handles, self.cfg.regions.heartbeat_timeout_s, self.leaving)
        t0 = t_last = time.monotonic()
        noted: set[str] = set()
        while pending and (left := timeout - (time.monotonic() - t0)) > 0:
            ready, _ = ray.wait(list(pending), num_returns=1 if on_result else len(pending),
                                timeout=min(left, probe.every_s))
            for ref in ready:
                region = pending.pop(ref)
                self.collect(ref, region, what, out)
                t_last = time.monotonic()
                if on_result is not None and region in out:
                    on_result(region, out[region], set(pending.values()))
            if not pending:
                break
            silent = probe.silent(pending.values(), timeout_s=_quick_stall(probe.timeout_s) if out else None)
            for ref, region in list(pending.items()):
                if region in silent:
                    del pending[ref]
                    self._stall(region, ref, what, silent[region], give_up_at=t0 + timeout)
                elif out and region not in noted and time.monotonic() - t_last > probe.timeout_s:
                    noted.add(region)  # busy, not stalled: waited for, and said so once
                    self.journal.note(f"waiting for region {region}: still in {what} "
                                      f"{time.monotonic() - t_last:.0f}s after the others (it answers the liveness probe)")
                    self.journal.event("waiting_for_region", region=region, what=what,
                                       waited_s=round(time.monotonic() - t_last, 2))
        for region in pending.values():
            self.fail(region, f"{what} did not finish within {timeout:.0f}s")
            self.kill(region)
        return out

    def collect(self, ref: Any, region: str, what: str, out: dict[str, Any]) -> None:
        """One finished call into `out`; a dead actor fails its region (with why it died: OOM or
        not, driver/failures.py), an error in the call the run."""
        n = self.cfg.regions.workers
        try:
            out[region] = ray.get(ref)
        except ACTOR_DEATHS as exc:
            death = self.death_of(region, exc)
            if n > 1:
                self.fail(region, f"worker 0 of {n} died during {what} ({death.cause})", death=death, worker=0)
            else:
                self.fail(region, f"actor died during {what} ({death.cause})", death=death)
        except ray.exceptions.RayTaskError as exc:
            if not isinstance(exc.cause, GroupLost):
                raise RunFailed(f"region {region} failed in {what}: {exc.cause!r}") from None
            # One of its other workers died (regions.workers): the region fails, worker 0 restarts (regroup.py)
            rank, death = worker_death(self.actors, region, exc)
            who = f"worker {rank} of {n} died" if rank is not None else "its workers lost their process group"
            self.fail(region, f"{who} during {what} ({death.cause})", death=death, worker=rank)
            self.kill(region)

    def kill(self, region: str) -> None:
        """Kill a region's actor for Ray to restart (it did not finish a call in time); a hosted
        region's is its host's (regions.per_process): the host's other regions fail with it."""
        ray.kill(actor_of(self.actors.handles[region]), no_restart=False)

    def death_of(self, region: str, exc: BaseException) -> Death:
        """Why `region`'s actor died, from what its call raised and its worker's row in Ray's GCS."""
        return death_cause(exc, worker_exit((self.actors.info.get(region) or {}).get("pid")))

    # -- membership --------------------------------------------------------------------------
    def fail(self, region: str, why: str, *, death: Death | None = None, worker: int | None = None) -> None:
        """The region failed: left out (elastic) or the run stops (fail-fast). `death`: why its actor
        died, when it did (else the cause is read from `why`: a timeout, a stall); `worker`: which of
        a region's workers died (regions.workers > 1), when it is known."""
        if region in self.leaving:  # its spot notice's grace ran out mid-call: it leaves (driver/membership.py)
            self.leave_out(region, f"{why} (after a SIGTERM: leaving)")
            return
        r = self.journal.round
        death = death or Death(cause=cause_of_text(why), detail="")
        self.journal.count("region_failures")
        self.journal.event("region_failed", region=region, why=why, cause=death.cause,
                           **({"detail": death.detail} if death.detail else {}),
                           **({"worker": worker} if worker is not None else {}))
        if self.cfg.run.on_region_failure == "fail-fast":
            raise RunFailed(f"region {region} failed in round {r} ({why}); run.on_region_failure is fail-fast; "
                            f"the checkpoint of round {self.journal.last_checkpoint} stands: "
                            f"geofed run --resume {self.run_dir}")
        self.leave_out(region, why)
        self.journal.note(f"region {region} failed in round {r}: {why}; carrying on without it")

    def _stall(self, region: str, ref: Any, what: str, silent_s: float, *, give_up_at: float) -> None:
        """Alive (Ray sees no death) but silent: the run goes on without it; its pending call is
        its probe: once that returns it rejoins (faults.Faults.revive)."""
        why = f"no answer to the liveness probe for {silent_s:.1f}s during {what} (stopped, swapping or hung)"
        self.journal.count("region_stalls")
        pid = (self.actors.info.get(region) or {}).get("pid")
        self.journal.event("region_stalled", region=region, what=what, silent_s=round(silent_s, 2), pid=pid)
        if self.cfg.run.on_region_failure == "fail-fast":
            self.fail(region, why)  # raises
        self.leave_out(region, why)
        self.probes[region] = ref
        self.stalled[region] = {"since": time.monotonic() - silent_s, "give_up_at": give_up_at}
        self.journal.note(f"region {region} stalled in round {self.journal.round}: {why}; carrying on without it; "
                          "it rejoins when it answers")

    def leave_out(self, region: str, why: str) -> None:
        if region in self.alive:
            self.alive.remove(region)
        self.dead[region] = why
        self.probes.pop(region, None)
        if not self.alive:
            raise RunFailed(f"every region has failed (last: {region} in round {self.journal.round}: {why})")

    def retire(self, region: str) -> None:
        """The region leaves the run for good (driver/membership.py): out of `alive` and `dead`, its
        actor closed (its server stops) and killed with no restart."""
        if region in self.alive:
            self.alive.remove(region)
        for watched in (self.dead, self.probes, self.stalled, self.leaving):
            watched.pop(region, None)
        self.actors.pooled.pop(region, None)  # killed, not pooled: its process held a region that left
        self.actors.following.pop(region, None)
        handle = self.actors.handles.pop(region, None)
        if handle is not None:
            try:
                ray.get(handle.close.remote(), timeout=10)
            except ray.exceptions.RayError:
                pass  # dead or hung: the kill below ends it either way
            if not isinstance(handle, HostedRegion):  # a host's other regions go on (regions.per_process)
                ray.kill(handle, no_restart=True)
        for worker in self.actors.workers.pop(region, []):  # regions.workers > 1: its workers 1..N-1 go with it
            ray.kill(worker, no_restart=True)

    def rejoin(self, region: str, address: str, info: dict[str, Any]) -> None:
        """The region is back in the run, at its place in regions.names order."""
        self.addresses[region] = address
        self.actors.info[region] = {**self.actors.info.get(region, {}), **info, "grpc_address": address}
        self.alive = [reg for reg in self.names if reg in self.alive or reg == region]
        del self.dead[region]

    # -- the calls, gathered -----------------------------------------------------------------
    def start(self, *, timeout: float) -> dict[str, str]:
        """Every region starts its gRPC server; region -> its address (also in the placement info)."""
        starts = [self.actors.handles[r].start.remote() for r in self.names]
        self.addresses = dict(zip(self.names, ray.get(starts, timeout=timeout)))
        for region, address in self.addresses.items():
            self.actors.info[region]["grpc_address"] = address  # summary.json placement
        return self.addresses

    def connect(self, route: Callable[[str, str], str]) -> None:
        """Every alive region connects to every other alive one at `route(src, dst)`."""
        refs = {}
        for src in self.alive:
            peers = {dst: route(src, dst) for dst in self.alive if dst != src}
            refs[self.actors.handles[src].connect.remote(peers)] = src
        self.gather(refs, "connect", timeout=60)

    def _each(self, regions: Iterable[str], what: str, call: Callable[[Any], Any], *, timeout: float) -> dict[str, Any]:
        return self.gather({call(self.actors.handles[r]): r for r in regions}, what, timeout=timeout)

    def probe(self, regions: Iterable[str], *, timeout: float) -> Results:
        return self._each(regions, "probe", lambda h: h.probe.remote(), timeout=timeout)

    def get_params(self, regions: Iterable[str], *, timeout: float) -> dict[str, Any]:
        return self._each(regions, "get_params", lambda h: h.get_params.remote(), timeout=timeout)

    def save_checkpoint(self, regions: Iterable[str], *, timeout: float) -> dict[str, Any]:
        return self._each(regions, "save_checkpoint", lambda h: h.save_checkpoint.remote(), timeout=timeout)

    def restore_checkpoint(self, regions: Iterable[str], round_: int, *, timeout: float) -> Results:
        return self._each(regions, "restore_checkpoint", lambda h: h.restore_checkpoint.remote(round_), timeout=timeout)

    def finish_pending(self, regions: Iterable[str], *, timeout: float) -> dict[str, Any]:
        return self._each(regions, "finish_pending", lambda h: h.finish_pending.remote(), timeout=timeout)

    def evaluate(self, regions: Iterable[str], *, timeout: float) -> Results:
        return self._each(regions, "evaluate", lambda h: h.evaluate.remote(), timeout=timeout)

    def result_state(self, regions: Iterable[str], *, timeout: float) -> dict[str, Any]:
        return self._each(regions, "result_state", lambda h: h.result_state.remote(), timeout=timeout)

    def sketch(self, regions: Iterable[str], *, timeout: float) -> dict[str, Any]:
        return self._each(regions, "sketch", lambda h: h.sketch.remote(), timeout=timeout)

    def transport_stats(self, regions: Iterable[str], *, timeout: float) -> Results:
        return self._each(regions, "transport_stats", lambda h: h.transport_stats.remote(), timeout=timeout)

    def take_refusals(self, regions: Iterable[str], *, timeout: float) -> dict[str, Any]:
        return self._each(regions, "take_refusals", lambda h: h.take_refusals.remote(), timeout=timeout)

    def flush_exchange(self, regions: Iterable[str], *, timeout: float) -> Results:
        return self._each(regions, "flush_exchange", lambda h: h.flush_exchange.remote(), timeout=timeout)

    def finish_loop(self, regions: Iterable[str], *, timeout: float) -> Results:
        """The loop API's end (regions/loop.py): each region's loop sees should_stop and its function
        returns; region -> what it passed to ctx.report ({} without a training function)."""
        return self._each(regions, "finish_loop", lambda h: h.finish_loop.remote(), timeout=timeout)

    def catch_up(self, donors_of: dict[str, list[str]], what: str, *, timeout_s: float | None,
                 timeout: float) -> dict[str, tuple[str, int]]:
        """Each region takes the model of the first of its donors that gives it; region -> (donor, its round)."""
        refs = {self.actors.handles[region].catch_up.remote(donors, timeout_s=timeout_s): region
                for region, donors in donors_of.items()}
        return self.gather(refs, what, timeout=timeout)

    # -- one region, not waited for here (the caller waits, or watches the ref) ---------------
    def run_round(self, region: str, plan: RoundPlan) -> ray.ObjectRef[RoundReport]:
        """Start `region`'s round; the ref of its RoundReport (gathered: `Reports`)."""
        return self.actors.handles[region].run_round.remote(plan)

    def catch_up_ref(self, region: str, donors: list[str], *, timeout_s: float | None = None,
                     before_round: int | None = None, rounds_apart: int | None = None) -> Any:
        """The ref of `region`'s catch-up (queued ahead of its next call on the same actor)."""
        return self.actors.handles[region].catch_up.remote(donors, timeout_s=timeout_s, before_round=before_round,
                                                           rounds_apart=rounds_apart)

    def start_ref(self, region: str) -> Any:
        return self.actors.handles[region].start.remote()

    def restore_ref(self, region: str, round_: int) -> Any:
        return self.actors.handles[region].restore_checkpoint.remote(round_)

    def node_info_ref(self, region: str) -> Any:
        return self.actors.handles[region].node_info.remote()

    def senders_done(self, region: str, round_: int, senders: list[str]) -> None:
        """Tell `region` that `senders` are done with round_ (not waited for: the notice races the round)."""
        self.actors.handles[region].senders_done.remote(round_, senders)
