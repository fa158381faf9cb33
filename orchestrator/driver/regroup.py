"""A region of several workers rebuilt after one of them died (regions.workers > 1,
docs/regions-as-clusters.md, "Restarts").

Any worker's death fails its whole region, as a one-worker region's death does: worker 0's shows
as its call's actor death; a follower's as GroupLost from worker 0's next collective (gloo sees
the closed connection at once; a collective that hears nothing gives up at regions.group_timeout_s),
which handles.py turns into the region's failure, naming the worker, and a kill of worker 0.

Worker 0 always comes back as a fresh process that Ray restarts (one of regions.max_restarts): a
worker 0 whose follower died was cut in the middle of a collective, its round half done, and a
fresh process takes the path every restarted region takes (own checkpoint, then a peer's current
model and outer state: faults.Faults._rejoin). Followers are not restarted by Ray (max_restarts 0):
a dead or stuck one is replaced by a new actor that the driver creates when worker 0 is back, so
the driver knows when it is up instead of guessing when Ray restarted it; a surviving one (its
`follow` ended with GroupLost) keeps its process. Then the group forms again as set-up forms it,
within regions.group_timeout_s, and worker 0, joined with `rebuilt`, broadcasts its whole state
before the first step.

Each step is polled without blocking from Faults.revive, round after round: the run goes on
without the region meanwhile. A step that fails or passes its deadline starts the rebuild again
with every worker new, at the cost of another of worker 0's restarts, so the tries end with them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from ..config import RunConfig
from .cluster import RegionActors, new_worker, region_cpus
from .failures import ACTOR_DEATHS, Death, cause_of_text, death_cause
from .journal import Journal

log = logging.getLogger("geofed.orchestrator.driver.run")

# How long the driver waits for a dead follower's `follow` to report its death once worker 0 said
# its group was lost: Ray's death notice trails the closed connection by a few hundred ms.
DEATH_NOTICE_S = 2.0


def worker_death(actors: RegionActors, region: str, lost: BaseException) -> tuple[int | None, Death]:
    """Which of `region`'s workers 1..N-1 died, and why, after worker 0 lost its group (`lost`, the
    GroupLost its call raised): (rank, its death), or (None, the group's loss) when none of them did
    (a collective that passed regions.group_timeout_s on a worker that hangs)."""
    refs = list(actors.following.get(region, []))
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DEATH_NOTICE_S) if refs else ([], [])
    for rank, ref in enumerate(refs, start=1):
        if ref not in ready:
            continue
        try:
            ray.get(ref)
        except ACTOR_DEATHS as exc:
            return rank, death_cause(exc)
        except ray.exceptions.RayError:
            pass  # it left the group alive (GroupLost): not the one that died
    cause = getattr(lost, "cause", None) or lost
    text = str(cause).strip()
    return None, Death(cause=cause_of_text(text), detail=text.splitlines()[0] if text else type(cause).__name__)


@dataclass
class _Rebuild:
    """One region's rebuild in progress: worker 0's restart, then its followers, then the group."""

    old_pid: int | None  # worker 0's process that failed: an answer from it is no restart
    since: float  # time.monotonic() of the failure
    probe: Any = None  # worker 0's node_info call, once it answers it has restarted
    info: dict[str, Any] | None = None  # worker 0's node_info, once restarted
    starting: dict[int, Any] = field(default_factory=dict)  # rank -> its node_info call (new or survivor)
    replaced: list[int] = field(default_factory=list)
    joins: dict[Any, int] | None = None  # join_group call -> rank, once every worker answered
    deadline: float = 0.0  # of the step in progress (starting, joining)
    renew_all: bool = False  # a try failed: every follower is replaced


class Regroup:
    """The rebuilds in progress, by region. `poll(region)`, from Faults.revive each round while the
    region is dead, moves its rebuild on without blocking and returns worker 0's node_info once the
    group has formed again: the region then rejoins as a restarted one-worker region does."""

    def __init__(self, cfg: RunConfig, actors: RegionActors, journal: Journal, run_dir: str | Path):
        self.cfg, self.actors, self.journal = cfg, actors, journal
        self.run_dir = str(Path(run_dir).resolve())  # an actor's working directory is not the driver's
        self.pin = bool(cfg.ray.address)  # as set-up placed the region's workers (setup.py)
        self.pending: dict[str, _Rebuild] = {}
        self.pids: dict[str, int] = {}  # region -> worker 0's pid when its group last formed again

    def poll(self, region: str) -> dict[str, Any] | None:
        """Worker 0's node_info once `region`'s group has formed again, else None (not yet)."""
        rb = self.pending.get(region)
        if rb is None:
            # its rejoin may have failed after the group formed (regions.rejoin had not yet read the new pid)
            old_pid = self.pids.get(region, (self.actors.info.get(region) or {}).get("pid"))
            rb = self.pending[region] = _Rebuild(old_pid=old_pid, since=time.monotonic())
        if rb.info is None:
            if not self._restarted(region, rb):
                return None
            self._start_followers(region, rb)
        if rb.joins is None:
            self._followers_up(region, rb)  # then the joins are in flight: the next round sees them done
            return None
        if not self._joined(region, rb):
            return None
        del self.pending[region]
        self.pids[region] = rb.info["pid"]
        self.actors.following[region] = [h.follow.remote() for h in self.actors.workers[region]]
        took = time.monotonic() - rb.since
        self.journal.event("region_regrouped", region=region, workers=self.cfg.regions.workers, pid=rb.info.get("pid"),
                           replaced=rb.replaced, rebuild_s=round(took, 2))
        return rb.info

    def _restarted(self, region: str, rb: _Rebuild) -> bool:
        """Worker 0 answers from a new process (Ray restarted it)."""
        if rb.probe is None:
            rb.probe = self.actors.handles[region].node_info.remote()
            return False
        if not ray.wait([rb.probe], timeout=0)[0]:
            return False
        probe, rb.probe = rb.probe, None
        try:
            info = ray.get(probe)
        except ACTOR_DEATHS:
            return False  # still restarting, or past its max_restarts: probed again next round
        if info.get("pid") == rb.old_pid:
            return False  # the old process answered before the kill reached it
        rb.info = info
        return True

    def _start_followers(self, region: str, rb: _Rebuild) -> None:
        """Each follower's node_info call: a survivor's (its `follow` ended: it left the group alive),
        or a new actor's in place of one that died, or that still waits in a collective of the lost group."""
        workers = self.actors.workers[region]
        following = self.actors.following.get(region) or [None] * len(workers)
        for rank, (handle, ref) in enumerate(zip(list(workers), following), start=1):
            if not rb.renew_all and ref is not None and _left_alive(ref):
                rb.starting[rank] = handle.node_info.remote()
                continue
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
            workers[rank - 1] = new_worker(self.cfg, self.run_dir, region, rank, pin=self.pin,
                                          cpus=region_cpus(self.cfg, pin=self.pin))
            rb.starting[rank] = workers[rank - 1].node_info.remote()
            rb.replaced.append(rank)
        self.actors.following.pop(region, None)
        rb.deadline = time.monotonic() + self.cfg.regions.start_timeout_s

    def _followers_up(self, region: str, rb: _Rebuild) -> None:
        """Once every follower answered, worker 0 opens the group and all join it (not waited for here)."""
        refs = list(rb.starting.values())
        if len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            if time.monotonic() > rb.deadline:
                self._again(region, rb, f"its workers did not start within {self.cfg.regions.start_timeout_s:g}s "
                                        "(regions.start_timeout_s)")
            return
        rc = self.cfg.regions
        try:
            ray.get(refs)
            # a call on a fresh actor that answered node_info: it answers at once
            address = ray.get(self.actors.handles[region].open_group.remote(), timeout=rc.start_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            self._again(region, rb, f"a worker died while the group formed: {_line(exc)}")
            return
        rb.joins = {self.actors.handles[region].join_group.remote(address, True): 0}
        rb.joins.update({h.join_group.remote(address): rank
                         for rank, h in enumerate(self.actors.workers[region], start=1)})
        # Each join gives up at the group's deadline itself (and says why); this bounds a hung actor.
        rb.deadline = time.monotonic() + rc.group_timeout_s + 30

    def _joined(self, region: str, rb: _Rebuild) -> bool:
        assert rb.joins is not None
        refs = list(rb.joins)
        if len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            if time.monotonic() > rb.deadline:
                self._again(region, rb, f"its workers did not join within regions.group_timeout_s "
                                        f"{self.cfg.regions.group_timeout_s:g}s + 30s")
            return False
        try:
            ray.get(refs)
        except ray.exceptions.RayError as exc:
            self._again(region, rb, _line(exc))
            return False
        return True

    def _again(self, region: str, rb: _Rebuild, why: str) -> None:
        """This try failed: worker 0 is killed for Ray to restart once more, every follower is replaced:
        a process whose init_process_group failed would name its next group apart from a fresh one's
        (torch counts the groups a process made, and only a destroyed group resets the count)."""
        self.journal.event("region_regroup_failed", region=region, why=why)
        log.warning("region %s: its group did not form again (%s); trying again with new workers", region, why)
        self.pending[region] = _Rebuild(old_pid=(rb.info or {}).get("pid", rb.old_pid), since=rb.since, renew_all=True)
        ray.kill(self.actors.handles[region], no_restart=False)


def _left_alive(ref: Any) -> bool:
    """A follower's `follow` call ended with the follower alive (it left the group: GroupLost)."""
    if not ray.wait([ref], timeout=0)[0]:
        return False  # still in a collective of the lost group: replaced rather than waited for
    try:
        ray.get(ref)
    except ACTOR_DEATHS:
        return False
    except ray.exceptions.RayError:
        return True
    return True


def _line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip()
    return text.splitlines()[0] if text else type(cause).__name__
