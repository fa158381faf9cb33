"""The faults of `geofed bench churn`: a plan of them in rotation, and the thread that lays them on
a live run whose driver is a `geofed run` process of its own (so that it can be killed -9).

The rotation (one fault every `every_s` seconds from the run's first round):

* ``region-kill``: SIGKILL of a region's process (Ray restarts it; it rejoins with a peer's state);
* ``leave-join``: `geofed leave RUN_DIR NAME`, then `geofed join RUN_DIR --region NAME` `rejoin_after_s` later;
* ``region-stop``: SIGSTOP of a region's process for `stop_s`, then SIGCONT;
* ``link-outage``: one directed link cut for `outage_s` (the WAN emulator's schedule, stall mode;
  it lives in the run's config as `at_round`, so a driver that resumes keeps it: see `outage_event`);
* ``driver-kill``: SIGKILL of the driver process, then `geofed run --resume RUN_DIR` at once.

Regions are taken in turn from every region but the first, so that no region takes two faults in a
row while others take none. Every action is recorded (what, when, the pid it hit, whether it
worked); one that cannot act (the region's pid unknown, a command that failed) is recorded with
the reason and the bench goes on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geofed.orchestrator.driver.rundir import read_jsonl

# The join of a leave-join comes `rejoin_after_s` later, with the next fault: that one hits another
# region (regions are taken in turn), and the driver kill is the farthest from it.
KINDS = ("region-kill", "leave-join", "region-stop", "link-outage", "driver-kill")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault of the plan: `kind` at `at_s` seconds from the driver's first launch, on `region`
    (a link outage: the link region -> `peer`)."""

    at_s: float
    kind: str
    region: str
    peer: str | None = None


@dataclass(frozen=True, kw_only=True)
class Timing:
    """How long each timed fault lasts (the issue's: 30 s apart, a 10 s stop and outage, a join 30 s after the leave)."""

    every_s: float = 30.0
    stop_s: float = 10.0
    outage_s: float = 10.0
    rejoin_after_s: float = 30.0


def plan_faults(regions: Sequence[str], *, until_s: float, timing: Timing, kinds: Sequence[str] = KINDS) -> list[Fault]:
    """Faults every `timing.every_s` from `every_s` on, the kinds in rotation, none starting after
    `until_s` less its own length (a fault must end inside the run to be measured)."""
    if len(regions) < 3:
        raise ValueError(f"regions: the churn bench needs at least 3 (a leave must leave two to train), got {len(regions)}")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds: expected some of {', '.join(KINDS)}, got {list(kinds)}")
    length = {"region-stop": timing.stop_s, "link-outage": timing.outage_s, "leave-join": timing.rejoin_after_s}
    hurt = list(regions[1:])
    out: list[Fault] = []
    k = 0
    while True:
        at = timing.every_s * (k + 1)
        kind = kinds[k % len(kinds)]
        if at + length.get(kind, 0.0) > until_s:
            return out
        region = hurt[k % len(hurt)]
        peer = regions[0] if kind == "link-outage" else None
        out.append(Fault(at_s=at, kind=kind, region=region, peer=peer))
        k += 1


def outage_event(fault: Fault, *, round_s: float, outage_s: float) -> dict[str, Any]:
    """The emulator schedule entry of a link outage: at the round the run is expected to be in at
    `fault.at_s` (round_s: seconds a round takes, measured on the undisturbed arm), so that a resumed
    driver, whose emulator's clock starts again, still cuts the link once and at the same round."""
    return {"link": f"{fault.region}->{fault.peer}", "at_round": max(1, int(fault.at_s / round_s)),
            "outage_s": outage_s}


def region_pids(run_dir: Path) -> dict[str, int]:
    """The regions' current process ids, from events.jsonl: the last `started` (every region), then
    each restart, join and leave after it."""
    pids: dict[str, int] = {}
    for e in read_jsonl(run_dir / "events.jsonl"):
        kind = e.get("event")
        if kind == "started":
            pids = {r: int(i["pid"]) for r, i in (e.get("regions") or {}).items() if i.get("pid")}
        elif kind in ("region_rejoined", "region_joined") and e.get("pid"):
            pids[e["region"]] = int(e["pid"])
        elif kind == "region_left":
            pids.pop(e.get("region"), None)
    return pids


class DriverProcess:
    """The run's driver: `geofed run CONFIG --out RUN_DIR` in a process of its own, and the
    `geofed run --resume RUN_DIR` that replaces it after a kill."""

    def __init__(self, config: Path, run_dir: Path, *, address: str, log: Path, overrides: Sequence[str] = ()):
        self.config, self.run_dir, self.address, self.log = config, run_dir, address, log
        self.overrides = list(overrides)  # the same --set on the resume: no change of the run's config
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.launches = 0

    def _cmd(self, resume: bool) -> list[str]:
        cli = [sys.executable, "-m", "geofed.orchestrator.cli", "run"]
        where = ["--resume", str(self.run_dir)] if resume else [str(self.config), "--out", str(self.run_dir)]
        sets = [a for item in self.overrides for a in ("--set", item)]
        return [*cli, *where, *sets, "--address", self.address, "--no-report", "--quiet"]

    def start(self) -> None:
        with self.lock:
            self._launch(resume=False)

    def _launch(self, *, resume: bool) -> None:
        with self.log.open("a") as f:
            f.write(f"--- {'resume' if resume else 'start'} at {time.time():.3f}\n")
            f.flush()
            self.proc = subprocess.Popen(self._cmd(resume), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.launches += 1

    def kill_and_resume(self) -> int | None:
        """SIGKILL of the driver, then `geofed run --resume` in its place (under the lock: `wait`
        never sees the gap); the killed pid, or None when the run had already ended."""
        with self.lock:
            proc = self.proc
            if proc is None or proc.poll() is not None:
                return None
            proc.kill()
            proc.wait(30)
            self._launch(resume=True)
            return proc.pid

    def wait(self, timeout_s: float) -> int:
        """Wait for the driver of the moment (a resumed one replaces a killed one) to end; its exit code."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                code = None if self.proc is None else self.proc.poll()
            if code is not None:
                return code
            time.sleep(0.2)
        raise TimeoutError(f"the run in {self.run_dir} did not end within {timeout_s:.0f} s")

    def stop(self) -> None:
        """The bench is ending early (an error, Ctrl-C): no driver is left behind."""
        with self.lock:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # a clean stop: the driver ends its regions
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


class Injector:
    """Lays `faults` on the run of `driver` on a thread of its own, each `at_s` after the run's first
    round began (its set-up, 15-50 s, is the same in both arms: a fault in it would hit no round, or
    kill a driver that has no checkpoint to resume from); `actions` records each thing it did, `t_s`
    from `t0` (time.monotonic() of the driver's first launch), and `round0_s` when round 0 began."""

    def __init__(self, driver: DriverProcess, faults: Sequence[Fault], *, t0: float, timing: Timing,
                 cli_timeout_s: float = 90.0, clock: Callable[[], float] = time.monotonic):
        self.driver, self.faults, self.t0, self.timing = driver, list(faults), t0, timing
        self.cli_timeout_s, self.clock = cli_timeout_s, clock
        self.actions: list[dict[str, Any]] = []
        self.round0_s: float | None = None
        self.done = threading.Event()  # set when the run ended: no more faults
        self._stopped: set[int] = set()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._main, name="churn-injector", daemon=True)

    def start(self) -> Injector:
        self._thread.start()
        return self

    def join(self, timeout_s: float = 120.0) -> None:
        self.done.set()
        self._thread.join(timeout_s)
        for th in self._threads:
            th.join(timeout_s)
        for pid in list(self._stopped):  # never leave a process stopped
            self._signal(pid, signal.SIGCONT)

    def _record(self, kind: str, region: str | None, ok: bool, **detail: Any) -> None:
        self.actions.append({"t_s": round(self.clock() - self.t0, 2), "kind": kind, "region": region, "ok": ok, **detail})

    def _sleep_until(self, at_s: float) -> bool:
        """Until `at_s` after round 0 began; False when the run ended first."""
        return not self.done.wait(max(0.0, self.t0 + (self.round0_s or 0.0) + at_s - self.clock()))

    def _wait_set_up(self) -> bool:
        """Until the driver of the moment is done setting up (a setup_done event for each launch: a
        region killed while a resumed driver re-attaches to it fails that driver's set-up, not its
        rounds); False when the run ended first."""
        while sum(e.get("event") == "setup_done" for e in read_jsonl(self.driver.run_dir / "events.jsonl")) < \
                max(1, self.driver.launches):
            if self.done.wait(0.2):
                return False
        return True

    def _wait_round0(self) -> bool:
        """Until the driver's first set-up is done; False when the run ended first."""
        if not self._wait_set_up():
            return False
        self.round0_s = round(self.clock() - self.t0, 2)
        return True

    def _main(self) -> None:
        if not self._wait_round0():
            return
        for fault in self.faults:
            if not self._sleep_until(fault.at_s) or not self._wait_set_up():
                return
            try:
                self._act(fault)
            except Exception as exc:  # noqa: BLE001 - a fault that could not act is a row, not the bench's end
                self._record(fault.kind, fault.region, False, why=f"{type(exc).__name__}: {exc}")

    def _act(self, fault: Fault) -> None:
        kind, region = fault.kind, fault.region
        if kind == "link-outage":  # in the config's schedule: the emulator cuts it, this records when it was due
            self._record(kind, region, True, link=f"{region}->{fault.peer}", outage_s=self.timing.outage_s)
        elif kind == "driver-kill":
            pid = self.driver.kill_and_resume()
            if pid is None:
                self._record(kind, None, False, why="the driver had already ended")
            else:
                self._record(kind, None, True, pid=pid)
        elif kind == "leave-join":
            self._later(lambda: self._cli(["leave", str(self.driver.run_dir), region], "leave", region))
            self._later(lambda: self._sleep_until(fault.at_s + self.timing.rejoin_after_s)
                        and self._cli(["join", str(self.driver.run_dir), "--region", region], "join", region))
        else:
            pid = region_pids(self.driver.run_dir).get(region)
            if pid is None:
                self._record(kind, region, False, why="its pid is not in events.jsonl (it left, or has not started)")
            elif kind == "region-kill":
                self._record(kind, region, self._signal(pid, signal.SIGKILL), pid=pid)
            else:
                ok = self._signal(pid, signal.SIGSTOP)
                self._stopped.add(pid)
                self._record(kind, region, ok, pid=pid, stop_s=self.timing.stop_s)
                self.done.wait(self.timing.stop_s)
                self._signal(pid, signal.SIGCONT)
                self._stopped.discard(pid)

    def _later(self, fn: Callable[[], Any]) -> None:
        th = threading.Thread(target=fn, daemon=True)
        self._threads.append(th)
        th.start()

    def _cli(self, args: list[str], kind: str, region: str) -> bool:
        if self.done.is_set():
            return False
        cmd = [sys.executable, "-m", "geofed.orchestrator.cli", *args, "--wait", str(int(self.cli_timeout_s))]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.cli_timeout_s + 30,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            self._record(kind, region, False, why=f"no answer within {self.cli_timeout_s + 30:.0f} s")
            return False
        said = (p.stdout.strip() or p.stderr.strip()).splitlines()
        self._record(kind, region, p.returncode == 0, exit_code=p.returncode, said=said[-1] if said else "")
        return p.returncode == 0

    @staticmethod
    def _signal(pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False
