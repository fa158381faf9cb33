"""How the driver survives region faults (docs/reliability.md): what the round loop does about
regions the handle (handles.py) left out, and about regions that missed an update.

Dead regions are probed each round without blocking and rejoin once Ray has restarted them;
stalled ones rejoin once their pending call returns. Regions that missed an update resync from
one that did not. Members whose updates never arrive are muted (recovery.WithholdWatch).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray
from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.messages import ExchangeStats, RoundReport
from geofed.regions.sync.common import merge_exchange_metrics

from ..config import RunConfig
from .failures import ACTOR_DEATHS, STALLED
from .handles import RegionHandles, Reports
from .journal import Journal
from .recovery import RunFailed, WithholdWatch, first_line, plan_resync

log = logging.getLogger("geofed.orchestrator.driver.run")

_ACTOR_GONE = (*ACTOR_DEATHS, ray.exceptions.GetTimeoutError)


class Faults:
    """Revivals, resyncs and muted members across the round loop; owns the WithholdWatch. The loop
    calls `revive` before a round, `muted_for` while planning it, `flush_for_resync` and
    `watch_withholding` once its results are in, and `resync` after it is logged."""

    def __init__(self, cfg: RunConfig, regions: RegionHandles, journal: Journal, *, reconnect: Callable[[], None]):
        self.cfg, self.regions, self.journal = cfg, regions, journal
        self.reconnect = reconnect  # every alive region connects to the others again (set-up's routes)
        self.withhold = WithholdWatch()
        s = cfg.sync
        # Quorum rounds leave the slowest out on purpose; its update comes late, not never. With
        # overlap the exchange in flight is applied first (flush_for_resync).
        self.resync_on = (s.resync_after_miss and not algorithm_traits(s.algorithm).mixes_models and s.topology == "full"
                          and s.pacing.mode != "quorum")

    def revive(self, r: int) -> int:
        """A dead region is probed without blocking the round; once Ray has restarted it, it
        rejoins. A region past its max_restarts keeps failing the probe and stays out. Returns
        the bytes that donors' flushed exchanges sent meanwhile (no round record reports them)."""
        regions, sent = self.regions, 0
        for region in sorted(regions.dead):
            if region in regions.stalled:
                sent += self._revive_stalled(region, r)
                continue
            if self.cfg.regions.workers > 1:  # worker 0 restarted, then its group formed again (regroup.py)
                info = regions.regroup.poll(region)
                if info is not None:
                    sent += self._rejoin(region, r, info)
                continue
            probe = regions.probes.get(region)
            if probe is None:
                regions.probes[region] = regions.node_info_ref(region)
                continue
            if not ray.wait([probe], timeout=0)[0]:
                continue
            del regions.probes[region]
            try:
                info = ray.get(probe)
            except ACTOR_DEATHS:
                continue  # still restarting, or gone for good: probe again next round
            sent += self._rejoin(region, r, info)
        return sent

    def _revive_stalled(self, region: str, r: int) -> int:
        """A stalled region's pending call returned: it answers again and rejoins (its result is
        dropped: the round went on without it). One that never returns is, after the call's own
        timeout, killed for Ray to restart, as a region that did not finish in time always was."""
        regions = self.regions
        probe, st = regions.probes[region], regions.stalled[region]
        if not ray.wait([probe], timeout=0)[0]:
            if time.monotonic() > st["give_up_at"]:
                del regions.stalled[region], regions.probes[region]
                self.journal.count("region_failures")
                self.journal.event("region_failed", region=region, why=f"stalled for {time.monotonic() - st['since']:.0f}s; "
                                   "killed for Ray to restart", cause=STALLED)
                regions.kill(region)
            return 0
        del regions.stalled[region], regions.probes[region]
        try:
            ray.get(probe)
        except ACTOR_DEATHS:
            return 0  # it died meanwhile: a dead region now, probed for its restart from the next round
        except ray.exceptions.RayTaskError as exc:
            log.warning("region %s: its late call failed (%s); it rejoins anyway", region, first_line(exc))
        return self._rejoin(region, r, dict(regions.actors.info.get(region) or {}), after="stall",
                            stalled_s=time.monotonic() - st["since"])

    def join(self, region: str, r: int, info: dict) -> int:
        """A region that left comes back in a new actor (`geofed join`, driver/membership.py): the
        same path as a restarted region's (new server, everyone reconnects, the current model and
        outer state from a peer), before round r; the bytes donors' flushes sent."""
        return self._rejoin(region, r, info, after="join")

    def _rejoin(self, region: str, r: int, info: dict, *, after: str = "restart", stalled_s: float | None = None) -> int:
        """New server (after a restart or a join), reconnect everyone, own checkpoint, then the current
        model from a peer. A region back from a stall keeps its server and address."""
        regions = self.regions
        restarted = after != "stall"
        try:
            address = ray.get(regions.start_ref(region), timeout=60) if restarted else regions.addresses[region]
            restored = ray.get(regions.restore_ref(region, r - 1), timeout=120)
        except _ACTOR_GONE as exc:
            log.warning("region %s did not come back yet: %s", region, first_line(exc))
            # the dead-region path restarts it: a fresh actor whose start() works; a region of several
            # workers formed its group again around this worker 0, and a fresh one forms it anew (regroup.py)
            if not restarted or self.cfg.regions.workers > 1:
                regions.kill(region)
            return 0
        regions.rejoin(region, address, info)
        self.reconnect()
        donors, sent = self._flush_donors(r, [p for p in regions.alive if p != region])
        donor, state_round = None, restored["round"]
        if donors and region in regions.alive:
            try:
                donor, state_round = ray.get(regions.catch_up_ref(region, donors),
                                             timeout=self.cfg.sync.deadline.max_s + 60)
            except ACTOR_DEATHS as exc:
                death = regions.death_of(region, exc)
                regions.fail(region, f"died while catching up ({death.cause})", death=death)
                return sent
            except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as exc:
                # Its own checkpoint is the best it has; a resync after its first round realigns it.
                log.warning("region %s: no peer gave its state: %s", region, first_line(exc))
        if after == "restart":
            self.journal.count("region_restarts")
        self.journal.event("region_rejoined", region=region, pid=info.get("pid"), grpc_address=address,
                           restored_round=restored["round"], skipped_checkpoints=restored["skipped"],
                           donor=donor, state_round=state_round, after=after,
                           **({} if stalled_s is None else {"stalled_s": round(stalled_s, 2)}))
        self.journal.note(f"region {region} rejoined at round {r} after a {after} "
                          f"(checkpoint {restored['round']}, state of round {state_round} from {donor})", style="green")
        return sent

    def flush_for_resync(self, r: int, results: Reports) -> None:
        """Overlap: a round reports the exchange of the round before, so a miss shows while this
        round's exchange is still in flight, and a donor's global model and outer state would lack
        the update that the receiver's pending exchange still applies. Every region that reported
        applies its exchange in flight first (its metrics join the round's; its misses count for
        the resync): then donor and receiver stand at the same round boundary, no exchange pending,
        and the receiver takes exactly the donor's state. It costs the overlap of this one round.
        `results` gets each flushed region's report with the flush merged in."""
        if not (self.resync_on and self.cfg.sync.overlap and any(m.exchange.peers_missing for m in results.values())):
            return
        regions = [reg for reg in self.regions.alive if reg in results]
        flushed = self.regions.flush_exchange(regions, timeout=self.cfg.sync.deadline.max_s * 2 + 120)
        for region, more in flushed.items():
            if not more:
                continue  # nothing was in flight (the last round flushes its own)
            more = dict(more)
            exchange_round = more.pop("exchange_round", None)
            # Merged as records: the flush's evaluation moves the round's to evals_earlier (merge_exchange_metrics).
            record = merge_exchange_metrics(results[region].to_record(), more)
            record["flushed_exchange_round"] = exchange_round
            results[region] = dataclasses.replace(RoundReport.from_metrics(record), sketch=results[region].sketch)
        self.journal.event("overlap_flushed", regions=sorted(flushed), exchange_round=r, why="miss",
                           missing={reg: m.get("peers_missing") for reg, m in flushed.items() if m.get("peers_missing")})

    def _flush_donors(self, r: int, donors: list[str]) -> tuple[list[str], int]:
        """Overlap: before round r every donor still has round r-1's exchange in flight, which a
        region rejoining now took no part in; a state taken without it would leave the region one
        outer update behind for good. The donors apply it first (their misses in it resync them);
        returns the donors still alive and the bytes their flushes sent."""
        if not (self.cfg.sync.overlap and donors):
            return donors, 0
        flushed = {reg: m for reg, m in self.regions.flush_exchange(
            donors, timeout=self.cfg.sync.deadline.max_s * 2 + 120).items() if m}
        sent = 0
        if flushed:
            sent = sum(int(m.get("bytes_sent", 0)) for m in flushed.values())
            self.journal.event("overlap_flushed", regions=sorted(flushed), exchange_round=r - 1, why="rejoin",
                               bytes_sent=sent,
                               missing={reg: m["peers_missing"] for reg, m in flushed.items() if m.get("peers_missing")})
            self._resync(r - 1, {reg: ExchangeStats.of(m) for reg, m in flushed.items()})
        return [p for p in donors if p in self.regions.alive], sent

    # -- members whose updates never arrive (issue 36, N2) ---------------------------------------
    def muted(self, r: int) -> set[str]:
        """The members left out of round r (alive or not)."""
        return self.withhold.muted(r)

    @property
    def on_probation(self) -> set[str]:
        """Muted members tried again: they take part, but nobody waits for their update."""
        return self.withhold.on_probation

    def muted_for(self, r: int) -> tuple[set[str], dict[str, int]]:
        """The regions muted in round r (recovery.WithholdWatch), and those whose time out ends now
        (region -> rounds its state may lie from the others'): they are planned again, and first
        take the model of a current region (they trained alone meanwhile)."""
        alive = set(self.regions.alive)
        back = {}
        for region in sorted(self.withhold.back(r) & alive):
            back[region] = max(1, r - self.withhold.since.pop(region, r))
            self.journal.event("member_probation", region=region)
        return self.withhold.muted(r) & alive, back

    def watch_withholding(self, r: int, results: Reports, participants: list[str],
                          round_links: Callable[[int, list[str]], list[str]]) -> None:
        """A region that reported the round but whose update most of its expecting peers missed
        (withheld, or refused) for WithholdWatch.after rounds in a row is muted: left out of the plan
        like a stalled region, so no deadline waits or widens for it. `round_links(r, regions)`: the
        coordinator's links of a round between those regions."""
        muted = self.withhold.muted(r)
        expecting: dict[str, set[str]] = {}
        for link in round_links(r, [reg for reg in participants if reg not in muted]):
            src, dst = link.split("->", 1)
            expecting.setdefault(src, set()).add(dst)
        for rec in self.withhold.observe(r, {reg: m.exchange for reg, m in results.items()}, expecting):
            self.journal.count("members_muted")
            self.journal.event("member_muted", **rec)
            self.journal.note(f"region {rec['region']}: its update missed by {len(rec['missed_by'])} of "
                              f"{len(rec['expected_by'])} peers in round {r} (withheld or refused); left out of the "
                              f"next {rec['rounds_out']} rounds")

    def resync(self, r: int, results: Reports) -> None:
        """Regions that missed an update this round take the model of one that did not (never of one
        whose update they missed, nor of a muted member)."""
        self._resync(r, {reg: m.exchange for reg, m in results.items()})

    def _resync(self, r: int, exchanges: Mapping[str, ExchangeStats]) -> None:
        if not self.resync_on:
            return
        regions = self.regions
        jobs = plan_resync(exchanges, [reg for reg in regions.names if reg in regions.alive],
                           left_out=self.withhold.muted(r))
        timeout = self.cfg.sync.deadline.max_s
        try:
            got = regions.catch_up({j.region: list(j.donors) for j in jobs}, "resync", timeout_s=timeout,
                                   timeout=timeout * len(regions.names) + 30)
        except RunFailed as exc:  # no donor answered (a cut link): it stays on its own model
            log.warning("resync after round %d incomplete: %s", r, exc)
            self.journal.event("resync_failed", why=str(exc))
            return
        for region, (donor, state_round) in got.items():
            self.journal.count("resyncs")
            self.journal.event("resync", region=region, donor=donor, state_round=state_round)

    def state_dict(self) -> dict[str, Any]:
        return self.withhold.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.withhold.load_state_dict(state)
