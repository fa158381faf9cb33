"""What the driver does about faults, kept apart from the round loop (docs/reliability.md).

- ``StopSignals``: the first SIGINT/SIGTERM asks for a clean stop at the next round boundary
  (the round in flight finishes, a checkpoint is written, exit 130/143); a second one stops at
  once (KeyboardInterrupt; the previous checkpoint stands, so at most one round is lost).
- ``plan_resync``: after a round in which some regions missed an in-neighbour's update, which
  region pulls the model from which (DiLoCo/all-reduce over a full topology keep one model); never
  from a region whose update it missed or refused.
- ``WithholdWatch``: a member that answers heartbeats but whose updates never arrive is left out of
  the plan, and tried again later.
- ``Interrupted``: raised by the runner after a clean stop.
- what a killed driver left running: orchestrator/driver/leftovers.py (re-exported here).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

# What a killed driver left running lives in leftovers.py; its names stay importable from here.
from .leftovers import DRIVER_FILE, marked_processes, process_tree, reap_previous, record_processes  # noqa: F401

if TYPE_CHECKING:  # annotations only: the CLI's light commands import this module without torch
    from geofed.regions.messages import ExchangeStats

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class RunFailed(RuntimeError):
    """The run cannot go on (fail-fast region loss, diverged training, no usable checkpoint...)."""


def signal_name(signum: int | None) -> str | None:
    """'SIGTERM' for signal 15 and so on; None for None."""
    return None if signum is None else signal.Signals(signum).name


def first_line(exc: BaseException) -> str:
    """'ExcType: first line of its message', for one-line logs and events."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class Interrupted(Exception):
    """The run stopped cleanly on a signal after `round` (the last completed round, -1: none)."""

    def __init__(self, signum: int, round_: int):
        self.signum, self.round = signum, round_
        super().__init__(f"stopped by {signal.Signals(signum).name} after round {round_}")

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 130)


class StopSignals:
    """Turn SIGINT/SIGTERM into a request the round loop polls. Only the main thread can own
    signal handlers: elsewhere (a Runner inside a test thread) this is inert."""

    def __init__(self, notify=None):
        self.signum: int | None = None
        self.notify = notify  # called with the signal's name, in the handler: no Ray calls, no locks
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for s in EXIT_CODES:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def reclaim(self) -> None:
        """Take the signals back after ray.init(), whose core worker installs its own SIGTERM
        handler (it logs and kills the driver, skipping the clean stop)."""
        for s in self._old:
            signal.signal(s, self._handle)

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        self.signum = signum
        if self.notify is not None:
            self.notify(signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        return self.signum is not None


@dataclass(frozen=True, kw_only=True)
class Resync:
    """One region that missed an update and pulls the model from `donors` (checked, and combined
    when several answer: regions/region.py), none of which it missed or refused."""

    region: str
    donors: tuple[str, ...]  # the ones it heard from first; the joiner's rendezvous order spreads the load


def suspects(results: Mapping[str, ExchangeStats], order: Sequence[str]) -> set[str]:
    """Regions that more than half of the other reporting regions missed this round: each withheld
    its update or had it refused (or its uplink is down). Such a region missed nothing itself, as it
    received everyone's, so by miss counts alone it would be everyone's donor (issue 36, N1)."""
    reporters = [r for r in order if r in results]
    missed_by = Counter(p for r in reporters for p in set(results[r].peers_missing))
    found = {d for d in reporters if 2 * missed_by[d] > len(reporters) - 1}
    # Half the run or more at once is a network event (an outage of every link), not members
    # withholding (n >= 2f + 1): suspecting them all left no donor, nobody resynced, and the short
    # soak ended on four models (consensus distance 0.04).
    return set() if 2 * len(found) >= len(reporters) else found


def plan_resync(results: Mapping[str, ExchangeStats], order: Sequence[str], *,
                left_out: Collection[str] = ()) -> list[Resync]:
    """Who pulls the model from whom after a round (`results`: each reporting region's exchange).

    With DiLoCo or all-reduce over a full topology every region that received every update holds
    the same model; a region that missed one folded the missing weight into its own update and
    drifted. The donors are the regions that missed nothing, less the suspects (`suspects`: most
    peers missed them); when every other region missed something (an outage of every link, a
    region that died mid-round, a member that withholds its update) the one that missed fewest,
    first in `order`, is the donor and the others, suspects included, take its model: one model
    again, at the cost of one round of the others' local progress.

    A region does not take state from a region whose update it missed or refused this round: a
    member that withholds its update from a region must not then hand it a model. Among the
    others it tries first the donors whose update reached it this round: that proves the donor ->
    region direction works. Only a region that missed every donor takes theirs (its own network
    failed; a suspect never is a donor). `left_out` (regions muted for withholding: WithholdWatch)
    are neither donors nor resynced.
    """
    results = {r: m for r, m in results.items() if r not in left_out}
    missing = {r: set(m.peers_missing) for r, m in results.items()}
    if not any(missing.values()):
        return []
    reporters = [r for r in order if r in missing]
    suspect = suspects(results, order)
    pool = [r for r in reporters if r not in suspect]
    if not pool:
        return []
    fewest = min(len(missing[r]) for r in pool)
    donors = [r for r in pool if not missing[r]] if fewest == 0 else [next(r for r in pool if len(missing[r]) == fewest)]
    jobs = []
    for r in reporters:
        if r in donors or not (missing[r] or r in suspect):
            continue
        heard = {t.get("peer") for t in results[r].transfers if t.get("direction") == "recv"}
        eligible = [d for d in donors if d != r and d not in missing[r]]
        ranked = [d for d in eligible if d in heard] + [d for d in eligible if d not in heard]
        if not ranked:
            # It missed every donor: a network fault of its own (one member cannot make a region miss
            # every other region), not a member that withheld from it, and those donors are no
            # suspects. It takes their model, checked and combined, rather than drift for good.
            ranked = [d for d in donors if d != r]
        if ranked:
            jobs.append(Resync(region=r, donors=tuple(ranked)))
    return jobs


class WithholdWatch:
    """Members that answer heartbeats but whose updates never arrive (withheld, or refused by
    their receivers) are left out of the plan like a stalled region (issue 36, N2).

    A region is *withheld* in a round when it reported the round and more than half of the (at
    least two) regions that expected its update missed it. After `after` such rounds in a row it
    is muted (after `strong_after` rounds, default 1, when every region that expected it missed it and
    each of those received all its other in-neighbours): its in-neighbours stop waiting for it (so their receive deadlines never widen for
    it) and it trains alone. After `first_out` rounds it is tried again (probation): it first takes
    the model of a current region, then is planned like any other; an update that arrives puts it
    back for good, one more withheld round mutes it again at once, for twice as long as the last
    time (at most `max_out` rounds). Its state is in the driver's checkpoint (`state_dict`).
    """

    def __init__(self, *, after: int = 2, first_out: int = 2, max_out: int = 32, strong_after: int = 1):
        if after < 1 or first_out < 1 or max_out < first_out or not 1 <= strong_after <= after:
            raise ValueError(f"after, first_out, strong_after: must be >= 1, max_out >= first_out and "
                             f"strong_after <= after, got {after}, {first_out}, {max_out}, {strong_after}")
        self.after, self.first_out, self.max_out = after, first_out, max_out
        self.strong_after = strong_after
        self.streak: Counter[str] = Counter()
        self.out_until: dict[str, int] = {}  # muted region -> first round it is tried again
        self.tries: Counter[str] = Counter()  # how many times it was muted without a good round since
        self.on_probation: set[str] = set()
        self.since: dict[str, int] = {}  # muted region -> the round it was muted after

    def muted(self, round_: int) -> set[str]:
        """The regions left out of `round_`."""
        return {r for r, until in self.out_until.items() if round_ < until}

    def back(self, round_: int) -> set[str]:
        """Regions whose time out ends at `round_`: they are planned again (and catch up first)."""
        due = {r for r, until in self.out_until.items() if round_ >= until}
        for r in due:
            del self.out_until[r]
        self.on_probation |= due
        return due

    def observe(self, round_: int, results: Mapping[str, ExchangeStats],
                expecting: Mapping[str, Collection[str]]) -> list[dict[str, Any]]:
        """Fold in one round (`results`: each reporting region's exchange): `expecting[x]` are the
        regions that expected x's update this round.
        Returns one record per region muted now ({"region", "rounds_out", "missed_by", "expected_by"})."""
        muted_now = []
        out = self.muted(round_)
        heard_by = {r: {y for y, exp in expecting.items() if r in exp and y != r} for r in results}
        withheld: dict[str, tuple[list[str], list[str]]] = {}
        for x in [x for x in results if x not in out]:
            by = [r for r in expecting.get(x, ()) if r in results and r != x]
            # A miss is evidence against x only from a region whose own network worked this round:
            # it received most of its other in-neighbours. When everyone missed everyone (an outage,
            # a stalled driver), nobody withheld anything (the short soak muted all four regions).
            missed = [r for r in by if x in set(results[r].peers_missing)
                      and 2 * len(set(results[r].peers_missing) - {x}) < max(1, len(heard_by[r] - {x}))]
            if len(by) >= 2 and 2 * len(missed) > len(by):
                withheld[x] = (by, missed)
        if 2 * len(withheld) >= len(results):
            withheld = {}  # half the run or more at once is a network event, not members withholding
        for x in [x for x in results if x not in out]:
            if x not in withheld:
                by = [r for r in expecting.get(x, ()) if r in results and r != x]
                self.streak[x] = 0
                if x in self.on_probation and len(by) >= 2:
                    self.on_probation.discard(x)  # an update that arrived: back for good
                    self.tries[x] = 0
                continue
            by, missed = withheld[x]
            self.streak[x] += 1
            # Strong evidence: every peer that expected x missed it, and each of them received all
            # its other in-neighbours (no network trouble of theirs to blame): mute after strong_after.
            strong = len(missed) == len(by) and all(set(results[r].peers_missing) <= {x} for r in by)
            if self.streak[x] >= (self.strong_after if strong else self.after) or x in self.on_probation:
                rounds_out = min(self.max_out, self.first_out * 2 ** self.tries[x])
                self.tries[x] += 1
                self.streak[x] = 0
                self.on_probation.discard(x)
                self.out_until[x] = round_ + 1 + rounds_out
                self.since[x] = round_
                muted_now.append({"region": x, "rounds_out": rounds_out, "missed_by": sorted(missed),
                                  "expected_by": sorted(by)})
        return muted_now

    def state_dict(self) -> dict[str, Any]:
        return {"streak": dict(self.streak), "out_until": dict(self.out_until), "tries": dict(self.tries),
                "on_probation": sorted(self.on_probation), "since": dict(self.since)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.streak = Counter({str(k): int(v) for k, v in (d.get("streak") or {}).items()})
        self.out_until = {str(k): int(v) for k, v in (d.get("out_until") or {}).items()}
        self.tries = Counter({str(k): int(v) for k, v in (d.get("tries") or {}).items()})
        self.on_probation = {str(r) for r in d.get("on_probation") or ()}
        self.since = {str(k): int(v) for k, v in (d.get("since") or {}).items()}


def schedule_after(schedule: Sequence[Any], *, next_round: int, elapsed_s: float) -> tuple:
    """The WAN emulator schedule a resumed run plays (it starts a fresh emulator, whose clock
    and rounds would otherwise replay the whole schedule): events already past keep their link
    changes, applied at once, and lose their outages, which are over; later `at_s` events move
    earlier by the time already run."""
    out = []
    for ev in schedule:
        past = ((ev.at_round is not None and ev.at_round < next_round)
                or (ev.at_s is not None and ev.at_s < elapsed_s))
        if not past:
            out.append(ev if ev.at_s is None else dataclasses.replace(ev, at_s=ev.at_s - elapsed_s))
        elif ev.set is not None:
            when = {"at_s": 0.0} if ev.at_s is not None else {}
            out.append(dataclasses.replace(ev, outage_s=None, end_outage=False, **when))
    return tuple(out)
