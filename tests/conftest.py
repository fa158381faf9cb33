"""Shared fixtures. One real local Ray cluster per test session (Ray's testing guide)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The project's test mirror: the raw dataset files, served over a local HTTP server and fetched
# with `geofed data`'s own code into a temporary cache ($GEOFED_DATA) for the whole session.
# Beside the checkout (../shared/datasets), or wherever $GEOFED_TEST_DATASETS says.
DATASETS = Path(os.environ.get("GEOFED_TEST_DATASETS") or ROOT.parent / "shared" / "datasets")
NO_DATA = "needs the test datasets: no mirror at {} (set GEOFED_TEST_DATASETS)"
FETCHED = ("cora", "citeseer", "tinyshakespeare")
TEST_NODE_LABEL, TEST_NODE_VALUE = "geofed-test-node", "any"


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with a fixed number of CPUs, shared by every test that needs Ray.

    geofed's runner reuses an initialised Ray and leaves it running, so `geofed run` inside
    tests costs no extra cluster start.
    """
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # The label: a `geofed run` subprocess that joins this Ray (ray.address) pins every region to this node
    # (regions.label_key TEST_NODE_LABEL, each region's label TEST_NODE_VALUE: tests/e2e/test_driver_reattach.py)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, labels={TEST_NODE_LABEL: TEST_NODE_VALUE},
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}})
    yield ray
    ray.shutdown()


@pytest.fixture
def data_mirror():
    """A mirror of the test datasets on 127.0.0.1 (tests/support/httpmirror.py)."""
    from support.httpmirror import MirrorServer

    if not DATASETS.is_dir():
        pytest.skip(NO_DATA.format(DATASETS))
    with MirrorServer(DATASETS) as server:
        yield server


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """A data cache for the session: cora, citeseer and tinyshakespeare fetched from the local HTTP
    mirror and $GEOFED_DATA pointed at it, so `task.dataset: cora` resolves as for a user who ran
    `geofed data fetch`. None (and $GEOFED_DATA untouched) when the mirror's source is absent."""
    if not DATASETS.is_dir():
        yield None
        return
    from geofed.regions.datasets import ENV_DATA, FetchOptions, fetch_dataset
    from support.httpmirror import MirrorServer

    root = tmp_path_factory.mktemp("geofed-data")
    with MirrorServer(DATASETS) as server:
        for name in FETCHED:
            fetch_dataset(name, FetchOptions(mirror=server.url, retries=0), root=root)
    old = os.environ.get(ENV_DATA)
    os.environ[ENV_DATA] = str(root)
    yield root
    if old is None:
        os.environ.pop(ENV_DATA, None)
    else:
        os.environ[ENV_DATA] = old


def _cached(name: str) -> Path:
    from geofed.regions.datasets import product_path

    path = product_path(name)
    if not path.is_file():
        pytest.skip(f"dataset {name} not in the test data cache; " + NO_DATA.format(DATASETS))
    return path


@pytest.fixture(scope="session")
def cora_npz(data_cache) -> Path:
    """Cora's graph .npz, as `geofed data fetch cora` writes it."""
    return _cached("cora")


@pytest.fixture(scope="session")
def tinyshakespeare_txt(data_cache) -> Path:
    """tinyshakespeare's text, as `geofed data fetch tinyshakespeare` writes it."""
    return _cached("tinyshakespeare")


@pytest.fixture(scope="session")
def citeseer_npz(data_cache) -> Path:
    """CiteSeer's graph .npz, as `geofed data fetch citeseer` writes it."""
    return _cached("citeseer")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Without the test mirror (a checkout with no ../shared/datasets) and no datasets in the
    user's cache, a test whose config names a dataset stops at the config's own check ("is not in
    the data cache"): that is a skip naming what is missing, not a failure. With the mirror, as in
    CI, nothing is changed."""
    try:
        return (yield)
    except Exception as exc:
        if not DATASETS.is_dir() and "is not in the data cache" in str(exc):
            pytest.skip(NO_DATA.format(DATASETS))
        raise


def pytest_collection_modifyitems(config, items):
    """`slow` tests run when asked for with `-m slow` (CI runs them after the default suite): the
    minute-long ones (bench smoke runs, the shaped-namespace cluster, a driver
    SIGKILL and resume) that keep the default suite well under 20 minutes on 2 cores."""
    markexpr = config.getoption("markexpr") or ""
    # `soak` tests (the 200-round soak, the 30 s outage) are long runs of what the default suite
    # checks in a short form: they are run by hand (`pytest -m soak`, docs/reliability.md), not in CI.
    if "soak" not in markexpr:
        soak = pytest.mark.skip(reason="soak: a long run, by hand with `pytest -m soak` (not in CI)")
        for item in items:
            if "soak" in item.keywords:
                item.add_marker(soak)
    if "slow" in markexpr:
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest -m slow` (CI does, after the default suite)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
