"""The actor side of the warm pool (ray.warm_pool_s, docs/launch.md "Faster start"): a region actor
kept alive between runs on one Ray cluster, so the next run skips the new Python, the torch and
geofed imports and Ray's worker start (seconds each on a small host) and only rebuilds its worker.

A pooled actor is a detached, named Ray actor. Its current assignment (the run's config, region,
RUN_DIR, TLS material and the driver's Ray job) lives in Ray's key-value store under the actor's
name: Ray restarts an actor with its *creation* arguments, which name the run that created it, so
a restarted pooled actor reads the assignment of the run that holds it now instead.

An idle actor (released by its run, or held by a driver that died) ends itself after its idle
time, so it never holds its CPUs for good.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import ray
from ray import cloudpickle

log = logging.getLogger(__name__)

POOL_NAMESPACE = "geofed-warm-pool"
# How often a held actor checks that the driver holding it is still alive (a crashed `geofed run`
# never releases it), and how often the watch looks at its clocks.
_OWNER_CHECK_S = 5.0
_TICK_S = 1.0


def save_assignment(name: str, assignment: dict[str, Any]) -> None:
    """What the pooled actor `name` runs now (cfg, region, run_dir, tls, job): read again on a restart."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(name, cloudpickle.dumps(assignment), overwrite=True, namespace=POOL_NAMESPACE)


def load_assignment(name: str) -> dict[str, Any] | None:
    """The saved assignment of `name`, None if there is none (a new actor)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(name, namespace=POOL_NAMESPACE)
    return cloudpickle.loads(raw) if raw else None


def drop_assignment(name: str) -> None:
    """Forget the assignment of an actor that has ended."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(name, namespace=POOL_NAMESPACE)


def job_alive(job: str | None) -> bool:
    """Whether the Ray job (a driver) is still running; True when the job table cannot say."""
    if not job:
        return False
    try:
        from ray._private import state

        for entry in state.jobs():
            if entry.get("JobID") == job:
                return not entry.get("IsDead", False)
    except Exception as exc:  # noqa: BLE001 - an unreadable job table must not end a live run's actor
        log.debug("warm pool: job table unreadable: %s", exc)
        return True
    return False


class WarmSlot:
    """A pooled actor's state: which driver job holds it (None: idle), and when an idle one ends.

    A run's own detached region actor (run.orphan_timeout_s, orchestrator/driver/reattach.py) is
    held the same way: its assignment's `idle_s` is the orphan timeout, so a driver that died leaves
    it idle and it ends itself unless that run's resumed driver claims it first.

    `claim` runs on the actor's pool thread (a call from another driver must not wait behind a
    round), everything else on its main thread; one lock orders them."""

    def __init__(self, name: str, assignment: dict[str, Any]):
        self.name = name
        self._lock = threading.Lock()
        self._assignment = assignment
        self._job = assignment["job"]
        self._idle_s = float(assignment.get("idle_s", assignment["cfg"].ray.warm_pool_s))
        self._idle_since: float | None = None if self._job else time.monotonic()
        self._ending = False
        save_assignment(name, assignment)
        self._thread = threading.Thread(target=self._watch, name="geofed-warm-pool", daemon=True)
        self._thread.start()

    @property
    def job(self) -> str | None:
        return self._job

    def claim(self, job: str, idle_s: float | None = None) -> bool:
        """Take an idle actor for `job`; False when another live driver holds it or it is ending. A
        holder whose job is dead (a killed driver, not noticed yet by the watch) is taken over.
        `idle_s`: the claiming run's idle time (a resumed run's run.orphan_timeout_s)."""
        with self._lock:
            if self._ending or (self._job is not None and self._job != job and job_alive(self._job)):
                return False
            if idle_s is not None:
                self._idle_s = float(idle_s)
                self._assignment = {**self._assignment, "idle_s": float(idle_s)}
            if self._job != job or idle_s is not None:  # a restart from here on reads the job that holds it now
                self._assignment = {**self._assignment, "job": job}
                save_assignment(self.name, self._assignment)
            self._job, self._idle_since = job, None
            return True

    def assign(self, **assignment: Any) -> None:
        """The run holding the actor hands it its config, region, RUN_DIR and TLS material (adopt)."""
        with self._lock:
            self._assignment = {**assignment, "job": self._job}
            self._idle_s = float(assignment["cfg"].ray.warm_pool_s)
            save_assignment(self.name, self._assignment)

    def release(self, idle_s: float) -> None:
        """Idle from now; the actor ends itself after `idle_s` unless claimed again."""
        with self._lock:
            self._job, self._idle_s, self._idle_since = None, idle_s, time.monotonic()
            self._assignment = {**self._assignment, "job": None}
            save_assignment(self.name, self._assignment)

    def _watch(self) -> None:
        last_check = time.monotonic()
        while True:
            time.sleep(_TICK_S)
            with self._lock:
                job, since, idle_s = self._job, self._idle_since, self._idle_s
            now = time.monotonic()
            if job is not None:
                if now - last_check >= _OWNER_CHECK_S:
                    last_check = now
                    if not job_alive(job):
                        log.warning("warm pool: %s: the driver holding it (job %s) is gone; idle now", self.name, job)
                        with self._lock:
                            if self._job == job:
                                self._job, self._idle_since = None, time.monotonic()
                continue
            if since is None or now - since < idle_s:
                continue
            with self._lock:
                if self._job is not None or self._idle_since != since:
                    continue  # claimed meanwhile
                self._ending = True
            self._end()
            return

    def _end(self) -> None:
        """Idle too long: forget the assignment and end this actor for good (no restart)."""
        log.info("warm pool: %s idle for %.0fs: ending", self.name, self._idle_s)
        try:
            drop_assignment(self.name)
        finally:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def process_age_s(ndigits: int | None = None) -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): for `geofed run` the
    interpreter, imports and config check before the Runner; for an actor Ray's worker start and imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    age = max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    return age if ndigits is None else round(age, ndigits)
