"""Shared fixtures. One real local Ray cluster per test session (Ray's testing guide)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ROOT.parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with a fixed number of CPUs, shared by every test that needs Ray.

    geofed's runner reuses an initialised Ray and leaves it running, so `geofed run` inside
    tests costs no extra cluster start.
    """
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}})
    yield ray
    ray.shutdown()


@pytest.fixture
def datasets() -> Path:
    if not DATASETS.is_dir():
        pytest.skip(f"shared datasets not found at {DATASETS}")
    return DATASETS


def pytest_collection_modifyitems(config, items):
    """`slow` tests run when asked for with `-m slow` (CI runs them after the default suite): the
    long variants of tests that always run in a shorter form (the 200-round soak, the 30 s
    outage), and the minute-long ones (bench smoke runs, the shaped-namespace cluster, a driver
    SIGKILL and resume) that keep the default suite well under 20 minutes on 2 cores."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest -m slow` (CI does, after the default suite)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
