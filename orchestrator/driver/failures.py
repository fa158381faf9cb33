"""Why a region's actor died, in a few words the user reads (docs/reliability.md, "Failures that
say so"): `OOM` when Ray's memory monitor killed it, else what Ray can tell.

What a pending call raises does not say it (Ray 2.60): an OOM kill of an actor Ray restarts shows
as `ActorUnavailableError` ("The actor was restarted"), exactly as a SIGKILL does; only an actor
past its restarts gets `OutOfMemoryError`, which is no `RayActorError`. The GCS worker table keeps
each dead worker's exit type (`NODE_OUT_OF_MEMORY`, `SYSTEM_ERROR`...) and Ray's own detail, so
the driver reads it by the region's pid. A kernel OOM kill (not Ray's monitor) is a SIGKILL to Ray
too: `process died`, and Ray's detail names the OOM killer among the likely causes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import ray

log = logging.getLogger("geofed.orchestrator.driver.run")

# What the gather treats as a region's actor gone: OutOfMemoryError is no RayActorError.
ACTOR_DEATHS = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)

OOM = "OOM"
PROCESS_DIED = "process died"
NODE_DIED = "node died"
PREEMPTED = "node preempted"
TIMEOUT = "timeout"
STALLED = "stalled"
# regions.workers > 1: the region's process group was lost while no worker's process died (a collective
# that passed regions.group_timeout_s on a worker that hangs, a worker that left the group alive)
GROUP_LOST = "worker group lost"
STOPPED = "stopped by Ray"

# Ray's memory monitor's own words (raylet: "N worker(s) were killed due to the node running low on
# memory"; older Rays: "... running out of memory", "killed due to memory pressure"). Not "the OOM
# killer": Ray's detail for any SIGKILL lists "killed by the OOM killer" as one possible cause.
_MONITOR_WORDS = ("node running low on memory", "node running out of memory", "due to memory pressure",
                  "node_out_of_memory")
# SYSTEM_ERROR (a SIGKILL, a crash, the kernel's OOM killer) and USER_ERROR say no more than the text.
_EXIT_CAUSES = {"NODE_OUT_OF_MEMORY": OOM, "INTENDED_USER_EXIT": STOPPED, "INTENDED_SYSTEM_EXIT": STOPPED}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerExit:
    """A dead worker's row of the GCS worker table: Ray's exit type name and its detail."""

    exit_type: str
    detail: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Death:
    """Why a region's actor died: `cause` in a few words (OOM, process died, ...), `detail` Ray's
    own first line about it (events.jsonl keeps it)."""

    cause: str
    detail: str


def cause_of_text(text: str) -> str:
    """The cause a region_failed event's text names (a `why` written without a cause, or Ray's
    message): OOM, timeout, stalled, node died, worker group lost, or process died."""
    low = text.lower()
    if any(w in low for w in _MONITOR_WORDS) or "outofmemoryerror" in low:
        return OOM
    if "did not finish within" in low:
        return TIMEOUT
    if "stalled" in low or "liveness probe" in low:
        return STALLED
    if "node has died" in low or "node died" in low or "nodediederror" in low:
        return NODE_DIED
    # regions/workers.py's GroupLost words: the group went, no process with it (a death is read first)
    if "lost its region's process group" in low or "holds no process group" in low:
        return GROUP_LOST
    return PROCESS_DIED


def death_cause(exc: BaseException, exit_: WorkerExit | None = None) -> Death:
    """Why the actor behind `exc` (what its pending call raised) died; `exit_` is its worker's row
    of the GCS worker table when known (worker_exit), which is what tells an OOM kill of an actor
    that Ray restarts from a SIGKILL."""
    text = str(exc)
    if isinstance(exc, ray.exceptions.OutOfMemoryError):
        return Death(cause=OOM, detail=_first_line(text))
    if exit_ is not None and exit_.exit_type in _EXIT_CAUSES:
        return Death(cause=_EXIT_CAUSES[exit_.exit_type], detail=_first_line(exit_.detail))
    if isinstance(exc, ray.exceptions.RayActorError) and exc.preempted:
        return Death(cause=PREEMPTED, detail=_first_line(text))
    if isinstance(exc, ray.exceptions.NodeDiedError):
        return Death(cause=NODE_DIED, detail=_first_line(text))
    detail = exit_.detail if exit_ is not None else text
    return Death(cause=cause_of_text(f"{text}\n{detail}"), detail=_first_line(detail))


def worker_exit(pid: int | None, *, wait_s: float = 2.0) -> WorkerExit | None:
    """The GCS worker table's row of the dead worker `pid` (a region's actor process), or None when
    there is none or Ray will not say. The task's failure can reach the driver before the raylet's
    report of the death reaches the GCS, so a row still alive is read again for up to `wait_s`."""
    if not pid:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            row = _worker_row(pid)
        except Exception as exc:  # noqa: BLE001 - a private Ray API: without it the cause is Ray's message alone
            log.debug("no GCS worker table: %s", exc)
            return None
        if row is not None and (found := exit_of_row(row)) is not None:
            return found
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def _worker_row(pid: int) -> Any:
    # No public API reads the worker table without Ray's dashboard (ray.util.state needs it; geofed
    # starts Ray without it): the GCS accessor ray._private.state uses itself.
    from ray._private.state import state as gcs_state
    from ray.core.generated import gcs_pb2

    newest = None
    for raw in gcs_state._connect_and_get_accessor().get_worker_table():
        row = gcs_pb2.WorkerTableData.FromString(raw)
        if row.pid == pid and (newest is None or row.end_time_ms >= newest.end_time_ms):
            newest = row  # a pid the system reused: the worker that ended last
    return newest


def exit_of_row(row: Any) -> WorkerExit | None:
    """A GCS worker table row (gcs_pb2.WorkerTableData) as a WorkerExit; None while it is alive."""
    from ray.core.generated import common_pb2

    if row.is_alive:
        return None
    exit_type = common_pb2.WorkerExitType.Name(row.exit_type) if row.HasField("exit_type") else ""
    return WorkerExit(exit_type=exit_type, detail=row.exit_detail)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""
