"""What the driver does about faults, kept apart from the round loop (docs/reliability.md).

- ``StopSignals``: the first SIGINT/SIGTERM asks for a clean stop at the next round boundary
  (the round in flight finishes, a checkpoint is written, exit 130/143); a second one stops at
  once (KeyboardInterrupt; the previous checkpoint stands, so at most one round is lost).
- ``plan_resync``: after a round in which some regions missed an in-neighbour's update, which
  region pulls the model from which (DiLoCo/all-reduce over a full topology keep one model).
- ``Interrupted``: raised by the runner after a clean stop.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

log = logging.getLogger(__name__)

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


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
    region: str
    donors: tuple[str, ...]  # in preference order; the joiner's own rendezvous order spreads load


def plan_resync(results: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> list[Resync]:
    """Who pulls the model from whom after a round.

    With DiLoCo or all-reduce over a full topology every region that received every update holds
    the same model; a region that missed one folded the missing weight into its own update and
    drifted. The donors are the regions that missed nothing; when every region missed something
    (an outage of every link, a region that died mid-round) the one that missed fewest, first in
    `order`, is the donor and the others take its model: one model again, at the cost of one
    round of the others' local progress.
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
    return [Resync(region=r, donors=donors) for r in order if r in missing and missing[r] and r not in donors]
