"""What the processes of a run import before round 0 (issue 37 item 4: set-up by phase, and cut
it). Every region actor and the driver pay each import on a 2-core host, so one that a default
run never uses is set-up time for nothing. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in {watch!r} if m in sys.modules)))
"""


def _imported(module: str, watch: tuple[str, ...]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module=module, watch=watch)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["geofed.orchestrator.driver.run", "geofed.regions.actor"])
def test_a_run_without_dp_imports_no_scipy(module):
    """scipy.fft serves only the PRV accountant (privacy.dp.target_epsilon), yet the driver imported
    it for every run (runner -> driver.privacy -> regions.privacy.budget -> prv -> prv_compose):
    ~0.2-0.3 s of CPU. Failed before with ['scipy'] for geofed.orchestrator.driver.run."""
    assert _imported(module, ("scipy", "sklearn", "networkx", "sympy")) == []
