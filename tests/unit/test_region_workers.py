"""regions.workers (regions/workers.py) without Ray: the config's rules and the group's deadline."""

from __future__ import annotations

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.workers import GroupError, WorkerGroup


def _cfg(**regions):
    return config_from_mapping({"run": {"name": "t"}, "task": {"kind": "mlp-digits"},
                                "regions": {"names": ["a", "b"], **regions}})


def test_workers_default_to_one_and_are_checked():
    assert _cfg().regions.workers == 1
    assert _cfg(workers=4).regions.workers == 4
    with pytest.raises(Exception, match="workers: must be in"):
        _cfg(workers=0)
    with pytest.raises(Exception, match="outer-step algorithm.*not sync.algorithm allreduce"):
        config_from_mapping({"run": {"name": "t"}, "task": {"kind": "mlp-digits"}, "sync": {"algorithm": "allreduce"},
                             "regions": {"names": ["a", "b"], "workers": 2}})


def test_a_group_that_does_not_form_within_its_deadline_names_the_region_and_the_worker():
    """Worker 0 opens the group and joins; its other worker never comes: GroupError at the deadline."""
    group = WorkerGroup("eu-west-1", 0, 2, timeout_s=1.0)
    address = group.open("127.0.0.1")
    with pytest.raises(GroupError, match=r"region eu-west-1: worker 0 of 2 did not join the region's process "
                                          r"group \(gloo\) at 127\.0\.0\.1:\d+ within 1s \(regions\.group_timeout_s"):
        group.join(address, torch.device("cpu"))
    assert not torch.distributed.is_initialized()  # nothing half-formed is left in the process
    with pytest.raises(GroupError, match="holds no process group"):
        group.lead_step(None, 1.0)


def test_split_gives_each_worker_every_nth_batch():
    stream = iter(range(10))
    assert list(WorkerGroup("r", 1, 3, timeout_s=1).split(stream)) == [1, 4, 7]
