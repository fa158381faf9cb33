"""regions.per_process without Ray: the config's rules and the packing of regions into processes
(orchestrator/driver/hosts.py). The hosted regions themselves run in tests/integration/test_regions_per_process.py."""

from __future__ import annotations

import pytest

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.hosts import pack
from geofed.orchestrator.driver.reattach import detached


def _cfg(sync=None, ray=None, run=None, **regions):
    return config_from_mapping({"run": {"name": "t", **(run or {})}, "task": {"kind": "mlp-digits"},
                                "regions": {"names": ["a", "b", "c"], **regions},
                                **({"sync": sync} if sync else {}), **({"ray": ray} if ray else {})})


def test_per_process_defaults_to_one_and_is_checked():
    assert _cfg().regions.per_process == 1
    assert _cfg(per_process=16).regions.per_process == 16
    with pytest.raises(Exception, match=r"regions\.per_process.*must be in \[1, 256\], got 0"):
        _cfg(per_process=0)
    with pytest.raises(Exception, match="per_process: 2 regions a process need regions.workers 1, got 2"):
        _cfg(per_process=2, workers=2)
    with pytest.raises(Exception, match="per_process: 2 regions a process are not pooled; set ray.warm_pool_s 0"):
        _cfg(per_process=2, ray={"warm_pool_s": 30})
    with pytest.raises(Exception, match="per_process: 2 regions a process do not fill gaps"):
        _cfg(per_process=2, sync={"pacing": {"mode": "time-budget", "fill_gaps": True}})


def test_a_host_is_never_detached():
    """run.orphan_timeout_s keeps a cluster's region actors alive past their driver; a host is not kept."""
    assert detached(_cfg(ray={"address": "10.0.0.1:6379"}, run={"orphan_timeout_s": 300}))
    assert not detached(_cfg(per_process=2, ray={"address": "10.0.0.1:6379"}, run={"orphan_timeout_s": 300}))


def test_pack_takes_regions_in_order():
    names = [f"r{i}" for i in range(7)]
    assert pack(names, 3) == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    assert pack(names, 16) == [names]
    assert pack(names, 1) == [[n] for n in names]

