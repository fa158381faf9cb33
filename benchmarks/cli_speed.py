"""How long the light commands take, from process start to exit: `geofed -h`, `geofed validate`
of the default config and `geofed run -h` (each should stay under 1 s: they import neither torch
nor Ray, tests/unit/test_cli_imports.py).

    python benchmarks/cli_speed.py [--reps 5]

The commands run interleaved (one of each per repetition, so a burst of load from someone else
hits all of them alike); prints the median, min and max per command and the load average before
and after, since on a shared machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "geofed -h": ["-h"],
    "geofed validate configs/local-wan.yaml": ["validate", str(REPO / "configs" / "local-wan.yaml")],
    "geofed run -h": ["run", "-h"],
}


def geofed() -> list[str]:
    """The installed console script beside this interpreter, else the module."""
    script = Path(sys.executable).parent / "geofed"
    if script.is_file():
        return [str(script)]
    found = shutil.which("geofed")
    return [found] if found else [sys.executable, "-m", "geofed.orchestrator.cli"]


def time_once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="runs of each command (default 5)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps: must be >= 1")
    base = geofed()
    for extra in COMMANDS.values():  # one uncounted run each: the page cache, .pyc files
        time_once(base + extra)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.reps):
        for name, extra in COMMANDS.items():
            times[name].append(time_once(base + extra))
    load_after = os.getloadavg()
    print(f"{args.reps} runs each, interleaved; {os.cpu_count()} CPUs; load average (1/5/15 min) "
          f"before {' '.join(f'{x:.1f}' for x in load_before)}, after {' '.join(f'{x:.1f}' for x in load_after)}\n")
    print("| command | median | min | max |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        print(f"| `{name}` | {statistics.median(ts):.2f} s | {min(ts):.2f} s | {max(ts):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
