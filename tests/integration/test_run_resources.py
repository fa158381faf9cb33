"""Issue 19, trap 3: 16 regions on 2 cores gave 180 s of silence, then an error about region
labels; the cause was 16 x 0.5 CPUs requested from 2. Now the request is checked against the
cluster before any actor is created (exit 1 at once, the arithmetic, the key to change), and a
local run that leaves regions.num_cpus unset gets a share that fits."""

from __future__ import annotations

import time

import pytest
import ray
import yaml
from geofed.orchestrator.cli import main
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.cluster import PlacementError, region_cpus

pytestmark = pytest.mark.usefixtures("ray_session")  # a local Ray of 4 CPUs
NAMES = [f"r{i:02d}" for i in range(16)]


def _cfg(regions: dict) -> dict:
    return {"run": {"name": "cpus", "rounds": 1, "report": False},
            "task": {"kind": "mlp-digits", "hidden": 8},
            "regions": {"names": NAMES, "start_timeout_s": 10, **regions},
            "network": {"emulation": {"mode": "none"}}}


def test_sixteen_regions_asking_too_much_exit_1_at_once_with_the_arithmetic(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_cfg({"num_cpus": 0.5})))
    t0 = time.monotonic()
    assert main(["run", "run.yaml", "--out", "run", "--quiet", "--no-report"]) == 1
    assert time.monotonic() - t0 < 8  # not regions.start_timeout_s
    err = capsys.readouterr().err
    total = ray.cluster_resources()["CPU"]
    assert f"16 regions x regions.num_cpus 0.5 = 8 CPUs requested, but the Ray cluster has {total:g}" in err
    assert f"set regions.num_cpus to at most {total / 16:g}" in err


def test_unset_on_a_local_run_fits_the_cpus():
    total = ray.cluster_resources()["CPU"]
    cpus = region_cpus(config_from_mapping(_cfg({})), pin=False)
    assert cpus == min(0.5, total / 16) and 16 * cpus <= total
    two = config_from_mapping({**_cfg({}), "regions": {"names": ["a-1", "b-1"]}})
    assert region_cpus(two, pin=False) == 0.5  # the default when it fits


def test_pinned_regions_are_checked_per_label():
    cfg = config_from_mapping(_cfg({"num_cpus": 0.5}))  # no node carries the label: 0 CPUs each
    with pytest.raises(PlacementError, match=r"ray.io/availability-region=r00: 1 region\(s\) x regions.num_cpus 0.5"):
        region_cpus(cfg, pin=True)
