"""The run's journal: events.jsonl, the lines on the terminal and the fault counts, each stamped
with where the run stands (the round in play, the last checkpoint). The round loop, set-up, the
region handle, faults, pacing and the privacy budget all write to the one journal they are given.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .progress import RunProgress
from .rundir import Clock, JsonlLog

log = logging.getLogger("geofed.orchestrator.driver.run")


class Journal:
    """Where a run stands and what it says about it: ``round`` is the round in play (the next one
    between rounds), ``last_checkpoint`` the last driver checkpoint (-1 before any), ``counts`` the
    fault counts that summary.json and the driver checkpoint keep."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.round = 0
        self.last_checkpoint = -1
        self.counts: dict[str, int] = {"region_restarts": 0, "region_failures": 0, "peers_left_out": 0,
                                       "late_dropped": 0, "resyncs": 0}
        self.progress: RunProgress | None = None
        self._events: JsonlLog | None = None

    def open(self, path: Path) -> None:
        """events.jsonl; opened once a resume has rewritten the logs it keeps."""
        self._events = JsonlLog(path)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()

    def event(self, event: str, **fields: Any) -> None:
        if self._events is None:  # before set-up opened the log: a failure in the very first calls
            log.warning("%s before events.jsonl was opened: %s", event, fields)
            return
        self._events.write({"t": round(self.clock.now(), 4), "round": self.round, "event": event, **fields})

    def note(self, message: str, style: str = "yellow") -> None:
        """A line on the terminal (above the progress bar), or a warning before there is one."""
        if self.progress is not None:
            self.progress.log(f"[{style}]{message}")
        else:
            log.warning("%s", message)

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n
