"""A region probes the peers of its last connect, the regions the driver says are in the run: after a
join, a region that left (geofed leave) is no peer to probe. Probing every configured name failed a
joiner whose run had lost a region ('peer ... is not connected'), and the run with it (bench churn)."""

from __future__ import annotations

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions


def test_probe_measures_only_the_regions_of_the_last_connect(tmp_path):
    cfg = config_from_mapping({
        "run": {"name": "t", "seed": 0},
        "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["a", "b", "c"]},
        "network": {"emulation": {"mode": "none"}, "probe_s": 0.05, "probe_max_mb": 1},
    })
    with InProcessRegions(cfg, tmp_path) as c:
        a = c.workers["a"]
        assert {t["peer"] for t in a.probe()["transfers"]} == {"b", "c"}
        a.connect({"a": "inmem:a", "b": "inmem:b"})  # c left the run
        assert {t["peer"] for t in a.probe()["transfers"]} == {"b"}
