"""What the driver does about faults, kept apart from the round loop (docs/reliability.md).

- ``StopSignals``: the first SIGINT/SIGTERM asks for a clean stop at the next round boundary
  (the round in flight finishes, a checkpoint is written, exit 130/143); a second one stops at
  once (KeyboardInterrupt; the previous checkpoint stands, so at most one round is lost).
- ``plan_resync``: after a round in which some regions missed an in-neighbour's update, which
  region pulls the model from which (DiLoCo/all-reduce over a full topology keep one model).
- ``Interrupted``: raised by the runner after a clean stop.
- what a killed driver left running: orchestrator/driver/leftovers.py (re-exported here).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

# What a killed driver left running lives in leftovers.py; its names stay importable from here.
from .leftovers import DRIVER_FILE, marked_processes, process_tree, reap_previous, record_processes  # noqa: F401

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
        self._notify = notify
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
        if self._notify is not None:
            self._notify(signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        return self.signum is not None


@dataclass(frozen=True, kw_only=True)
class Resync:
    """One region that missed an update and pulls the model from one of `donors`, which missed none."""

    region: str
    donors: tuple[str, ...]  # any of them will do; the joiner's rendezvous order spreads the load


def plan_resync(results: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> list[Resync]:
    """Who pulls the model from whom after a round.

    With DiLoCo or all-reduce over a full topology every region that received every update holds
    the same model; a region that missed one folded the missing weight into its own update and
    drifted. The donors are the regions that missed nothing; when every region missed something
    (an outage of every link, a region that died mid-round) the one that missed fewest, first in
    `order`, is the donor and the others take its model: one model again, at the cost of one
    round of the others' local progress.

    A region fetches only from donors whose update reached it this round when there are such:
    that proves the donor -> region direction works, while the link that made it miss an update
    may still be down (a FetchState over it would stall until its timeout).
    """
    missing = {r: len(m.get("peers_missing") or ()) for r, m in results.items()}
    if not any(missing.values()):
        return []
    complete = [r for r in order if missing.get(r) == 0]
    if complete:
        donors = tuple(complete)
    else:
        fewest = min(missing.values())
        donors = (next(r for r in order if missing.get(r) == fewest),)
    jobs = []
    for r in order:
        if r in missing and missing[r] and r not in donors:
            heard = {t.get("peer") for t in results[r].get("transfers") or () if t.get("direction") == "recv"}
            jobs.append(Resync(region=r, donors=tuple(d for d in donors if d in heard) or donors))
    return jobs


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
