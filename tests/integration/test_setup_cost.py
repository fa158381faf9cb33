"""Set-up is measured in CPU seconds beside wall seconds (issue 37 item 4): on a shared 2-core
host the wall time of a phase says mostly how busy the other jobs were, the CPU time what the
phase itself costs. The driver's CPU per phase is in setup_done (phases_cpu_s, process_cpu_s)
and summary.json's startup; each region actor's process CPU up to the end of its __init__
(Ray's worker start, the imports, the build) is in `started` (regions.<r>.start.cpu_s)."""

from __future__ import annotations

import json

import pytest
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner
from reliability_harness import small_config

pytestmark = pytest.mark.usefixtures("ray_session")


def test_setup_done_and_started_carry_cpu_seconds(tmp_path):
    """Failed before on the committed code (setup_done had wall seconds only, `start` no cpu_s):
    with only the driver's half in, KeyError: 'cpu_s' at the starts' line."""
    runner = Runner(small_config(regions=["us-east-1", "eu-west-1"], rounds=1), tmp_path, show_progress=False)
    try:
        runner.run()
    finally:
        runner.shutdown()
    ev = read_jsonl(tmp_path / "events.jsonl")
    done = next(e for e in ev if e["event"] == "setup_done")
    assert set(done["phases_cpu_s"]) == set(done["phases_s"])
    assert all(v >= 0 for v in done["phases_cpu_s"].values())
    # The driver's CPU from its start covers its phases' CPU (and the imports before set-up).
    assert sum(done["phases_cpu_s"].values()) <= done["process_cpu_s"] + 0.01
    starts = [r["start"] for r in next(e for e in ev if e["event"] == "started")["regions"].values()]
    # A region's process imports torch and builds its model before it answers: well over 0.1 CPU s.
    assert len(starts) == 2 and all(s["cpu_s"] > 0.1 for s in starts)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["startup"]["phases_cpu_s"] == done["phases_cpu_s"]
