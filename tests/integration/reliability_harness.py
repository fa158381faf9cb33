"""Shared by tests/integration/test_reliability_*.py: a real run in a background thread (on the
session's Ray), waits with deadlines, and the run directory's logs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner

REGIONS3 = ["us-east-1", "eu-west-1", "ap-northeast-1"]


def small_config(*, regions=REGIONS3, rounds: int = 20, H: int = 10, **sections) -> Any:
    """A small real run: the digits MLP, DiLoCo over mutual-TLS gRPC, short deadlines."""
    base: dict[str, Any] = {
        "run": {"name": "rel", "rounds": rounds, "report": False, "checkpoint_every": 1, "seed": 0},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": list(regions), "num_cpus": 0.5, "max_restarts": 3},
        "network": {"emulation": {"mode": "none"}, "max_message_mb": 4},
        "sync": {"policy": {"kind": "fixed", "H": H}, "inner": {"lr": 0.01},
                 "deadline": {"initial_s": 3.0, "min_s": 0.5, "max_s": 4.0}},
    }
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return config_from_mapping(base)


class BackgroundRun:
    """Runner.run() in a thread, so the test can hurt the run while it trains."""

    def __init__(self, cfg, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.runner = Runner(cfg, self.run_dir, show_progress=False)
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="geofed-run", daemon=True)

    def _main(self) -> None:
        try:
            self.summary = self.runner.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        finally:
            self.runner.shutdown()

    def start(self) -> BackgroundRun:
        self._thread.start()
        return self

    def rounds_done(self) -> int:
        return len(read_jsonl(self.run_dir / "rounds.jsonl"))

    def wait_rounds(self, n: int, timeout_s: float) -> None:
        wait_for(lambda: self.rounds_done() >= n or not self._thread.is_alive(), timeout_s,
                 f"{n} rounds in {self.run_dir}")
        if self.rounds_done() < n:
            raise AssertionError(f"the run ended after {self.rounds_done()} rounds: {self.error!r}")

    def join(self, timeout_s: float) -> dict | None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the run did not finish within {timeout_s}s ({self.rounds_done()} rounds)"
        return self.summary


def wait_for(cond, timeout_s: float, what: str, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_jsonl(Path(run_dir) / "events.jsonl") if kind is None or e["event"] == kind]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
