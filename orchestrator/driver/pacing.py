"""The driver's side of sync.pacing and of the compute emulation's absences (docs/heterogeneity.md).

* Absent regions (regions.emulation.availability) are not dispatched for the round; they are not
  failed, restarted or counted as faults.
* Quorum rounds: a round closes once `quorum` of the regions dispatched for it have reported and a
  grace has passed; the others keep running their round (in flight) and are not dispatched again
  until it returns. Their result is logged as a late round; their update reaches the peers late
  and is applied there with a staleness weight (regions/pacing.py).
* A region that missed a round's outer update (absent, or in flight) takes the current model from
  a region that has it before its next round: one state fetch by that region (Ray runs an actor's
  calls in order, so the fetch is queued ahead of its round and the driver does not wait for it).

The round loop passes a Pacing in: `participants` before a round, `dispatch` and `gather_quorum`
for it, `drain` and `catch_up_behind` at the end of the run.
"""

from __future__ import annotations

import logging
import dataclasses
import time
from collections.abc import Callable, Collection
from typing import Any

import ray
from geofed.regions.emulation import absent_regions
from geofed.regions.messages import RoundReport

from ..config import RunConfig
from .failures import ACTOR_DEATHS
from .handles import RegionHandles, Reports
from .journal import Journal
from .recovery import first_line

log = logging.getLogger("geofed.orchestrator.driver.run")


class Pacing:
    """Who runs a round (absent and busy regions sit it out) and how a quorum round is gathered.
    `on_late(region, report)`: the loop's bookkeeping of a round that reported after it closed
    (the coordinator's measurements, metrics.jsonl, the bytes sent)."""

    def __init__(self, cfg: RunConfig, regions: RegionHandles, journal: Journal, *,
                 on_late: Callable[[str, RoundReport], None]):
        self.cfg, self.regions, self.journal, self.on_late = cfg, regions, journal, on_late
        self.mode = cfg.sync.pacing.mode
        self._inflight: dict[Any, tuple[str, int]] = {}   # ref -> (region, round) still running
        self._behind: set[str] = set()                    # missed an outer update: catch up first
        self._current: set[str] = set(regions.names)      # reported the last round in time
        self._catch_ups: dict[Any, str] = {}              # catch_up refs, checked when they end
        self.stats = {"absent_region_rounds": 0, "late_rounds": 0, "catch_ups": 0}
        self._rounds_apart: dict[str, int] = {}  # behind region -> rounds its state may lag (a muted member's time out)

    @property
    def busy(self) -> set[str]:
        """Regions whose quorum round is still in flight."""
        return {region for region, _ in self._inflight.values()}

    def mark_behind(self, region: str, rounds_apart: int | None = None) -> None:
        """`region` takes the model of a current one before its next round (`rounds_apart`: how
        far its state may lie from theirs, a muted member back on probation)."""
        self._behind.add(region)
        if rounds_apart is not None:
            self._rounds_apart[region] = rounds_apart

    def participants(self, r: int) -> tuple[list[str], set[str]]:
        """This round's regions (alive, not absent, not busy), and the absent ones."""
        emulation = self.cfg.regions.emulation
        alive = self.regions.alive
        absent = absent_regions(emulation, r, self.regions.names) & set(alive) if emulation.active else set()
        if absent and emulation.availability.mid_round:
            # They take part and leave mid-round by themselves (regions/secagg/round.py).
            self.journal.event("drop_mid_round", regions=sorted(absent))
            absent = set()
        if absent:
            self.stats["absent_region_rounds"] += len(absent)
            self._behind |= absent
            self.journal.event("absent", regions=sorted(absent))
        busy = self.busy
        parts = [reg for reg in alive if reg not in absent and reg not in busy]
        while not parts and self._inflight:  # every present region is busy: wait for one
            self._collect_late(block=True, timeout=self.cfg.sync.deadline.max_s * 3 + 600)
            parts = [reg for reg in self.regions.alive if reg not in absent and reg not in self.busy]
        return parts, absent

    def dispatch(self, plans: dict[str, Any], muted: Collection[str]) -> dict[Any, str]:
        """Start each planned region's round; one that missed an outer update first takes the model
        of a region that has it (queued ahead of its round on the same actor), not of a `muted` one
        (it trained alone)."""
        donors = [reg for reg in plans if reg not in self._behind and reg in self._current and reg not in muted]
        refs = {}
        for region, plan in plans.items():
            if region in self._behind and donors:
                ref = self.regions.catch_up_ref(region, donors, timeout_s=self.cfg.sync.deadline.max_s,
                                                before_round=plan.round, rounds_apart=self._rounds_apart.pop(region, None))
                self._catch_ups[ref] = region
                self.stats["catch_ups"] += 1
            self._behind.discard(region)
            refs[self.regions.run_round(region, plan)] = region
        return refs

    def gather(self, refs: dict[Any, str], r: int, *, timeout: float,
               on_result: Callable[[str, Any, Collection[str]], None] | None = None) -> Reports:
        """The round's results: a barrier (or time-budget) round waits for every region (the
        handle's gather); a quorum round for `quorum` of them (gather_quorum)."""
        if self.mode == "quorum":
            return self._gather_quorum(refs, r, timeout=timeout)
        results = self.regions.gather(refs, f"round {r}", timeout=timeout, on_result=on_result)
        self._current = set(results)
        return results

    def _gather_quorum(self, refs: dict[Any, str], r: int, *, timeout: float) -> Reports:
        """Results of this round's regions once `quorum` of them are in and the grace has passed;
        the rest stay in flight. Late results of earlier rounds that come in meanwhile are logged."""
        pacing = self.cfg.sync.pacing
        k = pacing.quorum_of(len(refs))
        for ref, region in refs.items():
            self._inflight[ref] = (region, r)
        out: Reports = {}
        t0 = time.monotonic()
        end = t0 + timeout
        while self._inflight and time.monotonic() < end:
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=max(0.0, end - time.monotonic()))
            for ref in ready:
                region, rnd = self._inflight.pop(ref)
                got: dict[str, Any] = {}
                self.regions.collect(ref, region, f"round {rnd}", got)
                if region not in got:
                    continue
                if rnd == r:
                    out[region] = got[region]
                else:
                    self._late_result(region, got[region])
            if len(out) >= k:
                if not any(rnd == r for _, rnd in self._inflight.values()):
                    break
                end = min(end, time.monotonic() + pacing.grace_s)
        for ref, (region, rnd) in list(self._inflight.items()):
            if rnd == r and len(out) < k:  # not even the quorum in time: the call's timeout, as the handle's gather
                del self._inflight[ref]
                self.regions.fail(region, f"round {r} did not finish within {timeout:.0f}s")
                self.regions.kill(region)
        self._current = set(out)
        self._check_catch_ups()
        return out

    def _collect_late(self, *, block: bool, timeout: float = 0.0) -> None:
        """Log the rounds in flight that have finished (block: wait up to `timeout` for at least one;
        rounds still running then are failed, as the handle's gather fails a call past its timeout)."""
        if not self._inflight:
            return
        ready, _ = ray.wait(list(self._inflight), num_returns=1 if block else len(self._inflight),
                            timeout=timeout if block else 0)
        if block and not ready:
            for ref, (region, rnd) in list(self._inflight.items()):
                del self._inflight[ref]
                self.regions.fail(region, f"round {rnd} did not finish within {timeout:.0f}s")
                self.regions.kill(region)
            return
        for ref in ready:
            region, rnd = self._inflight.pop(ref)
            got: dict[str, Any] = {}
            self.regions.collect(ref, region, f"round {rnd}", got)
            if region in got:
                self._late_result(region, got[region])

    def drain(self, *, timeout: float) -> None:
        """Wait for every round still in flight (the run's end, a stop); their results are logged."""
        end = time.monotonic() + timeout
        while self._inflight:
            self._collect_late(block=True, timeout=max(1.0, end - time.monotonic()))
        self._check_catch_ups()

    def _late_result(self, region: str, m: RoundReport) -> None:
        """A region's round that ended after its round closed: logged, its bytes and links counted;
        the region missed outer updates meanwhile and catches up before its next round."""
        now = round(self.journal.clock.now(), 4)
        m = dataclasses.replace(m, t_start=round(now - m.wall_s, 4), t_end=now, late=True, sketch=None)
        self.stats["late_rounds"] += 1
        self.on_late(region, m)
        self._behind.add(region)
        self.journal.event("late_round", region=region, of_round=m.round, wall_s=round(m.wall_s, 3))

    def _check_catch_ups(self) -> None:
        """Catch-ups that ended: a failed one is logged; the region trains on its own model until
        its next catch-up (it is marked behind again)."""
        done = [ref for ref in self._catch_ups if ray.wait([ref], timeout=0)[0]]
        for ref in done:
            region = self._catch_ups.pop(ref)
            try:
                donor, state_round = ray.get(ref)
                self.journal.event("caught_up", region=region, donor=donor, state_round=state_round)
            except (ray.exceptions.RayTaskError, *ACTOR_DEATHS) as exc:  # an OOM kill is no RayActorError
                log.warning("region %s: catching up failed: %s", region, first_line(exc))
                self._behind.add(region)

    def catch_up_behind(self, muted: Collection[str]) -> None:
        """Before the end of the run: every region that is behind takes the model of a current one
        (not of a `muted` one)."""
        alive = self.regions.alive
        donors = [reg for reg in alive if reg in self._current and reg not in self._behind and reg not in muted]
        behind = [reg for reg in alive if reg in self._behind]
        if not behind or not donors:
            return
        got = self.regions.catch_up({reg: donors for reg in behind}, "catch_up", timeout_s=self.cfg.sync.deadline.max_s,
                                    timeout=self.cfg.sync.deadline.max_s + 60)
        for region, (donor, state_round) in got.items():
            self.stats["catch_ups"] += 1
            self._behind.discard(region)
            self.journal.event("caught_up", region=region, donor=donor, state_round=state_round)
