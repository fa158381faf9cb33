"""A spot notice: a SIGTERM to a region's process asks the run to let the region leave (issue 41;
docs/reliability.md, "Membership: leave and join").

Preemptible machines get a notice (30 s to 2 min) before they go, delivered as SIGTERM. A
region's actor installs `LeaveNotice` as that signal's handler: the region is marked as leaving
and says so in its next RoundReport (`extra["leaving"]`) and in every heartbeat, and the driver
treats it as a leave request (orchestrator/driver/membership.py): the round in flight finishes,
its update is delivered, and the region is retired after it. The notice gives
`regions.leave_grace_s`: a region still running its round then ends its process, as the machine
would, and the driver, which heard it was leaving, retires it instead of waiting for Ray to
restart it.

Ray also sends SIGTERM when it shuts a worker down. Once the region is closed (the end of the run,
or a retirement) the signal goes to the handler that was there before (Ray's: the process exits),
so orderly shutdowns stay as they were.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

__all__ = ["LeaveNotice"]


class LeaveNotice:
    """The SIGTERM handler of one region's process; `leaving` once a notice came, `record()` what
    the region's report and heartbeat carry. `exit` ends the process when the grace runs out
    (os._exit; a test passes its own)."""

    def __init__(self, grace_s: float, *, exit: Any = None):
        self.grace_s = float(grace_s)
        self.since: float | None = None
        self.closed = False
        self._exit = exit if exit is not None else (lambda: os._exit(0))
        self._previous: Any = None
        self._timer: threading.Timer | None = None

    def install(self) -> bool:
        """Handle SIGTERM in this process; False where it cannot (not the main thread: Python's rule)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.closed:  # an orderly end (the run's, a retirement): Ray's own handler ends the process
            previous = self._previous
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.since is not None:
            return  # a repeated notice changes nothing: the grace runs from the first
        self.since = time.monotonic()
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        if not self.closed:  # still in a round at the end of the grace: the machine goes now
            self._exit()

    @property
    def leaving(self) -> bool:
        return self.since is not None and not self.closed

    def record(self) -> dict[str, Any]:
        """{} without a notice; else `leaving` and the seconds of grace left."""
        if self.since is None:
            return {}
        return {"leaving": True, "grace_left_s": round(max(0.0, self.grace_s - (time.monotonic() - self.since)), 3)}

    def reopen(self, grace_s: float) -> None:
        """A pooled actor adopted by a new run (its handler stays installed): SIGTERMs are notices
        again, with the new run's grace; a notice of the last run is forgotten."""
        if self._timer is not None:
            self._timer.cancel()
        self.grace_s, self.since, self._timer, self.closed = float(grace_s), None, None, False

    def close(self) -> None:
        """The region is closed: a SIGTERM from now on is Ray's shutdown, not a notice."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
