"""regions.workers (regions/workers.py) without Ray: the config's rules, the group's deadline, and a
worker killed mid-run (worker 1 in a process of its own: tests/support/group_peer.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.group_peer import OneParameter

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.workers import GroupError, GroupLost, WorkerGroup


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


def _peer(region: str, timeout_s: float) -> subprocess.Popen:
    """Worker 1 of `region` in a new process: it joins at the address written to its stdin."""
    return subprocess.Popen([sys.executable, "-m", "support.group_peer", region, str(timeout_s)],
                            cwd=Path(__file__).resolve().parents[1], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _step(group: WorkerGroup, region: OneParameter) -> None:
    """Worker 0's inner step as Region.inner_steps takes it: the command, then its own backward."""
    group.lead_step(region, 1.0)
    region.forward_backward()


def test_a_worker_killed_mid_run_loses_the_group_and_it_forms_again_with_worker_0s_whole_state():
    """The pieces of a region's rebuild (orchestrator/driver/regroup.py), in worker 0's process: worker
    1 SIGKILLed between steps makes worker 0's next step raise GroupLost (the driver's cue to rebuild
    the region, not a fault of the run), and worker 0 leaves the group. The group then forms again in
    the same process (as a survivor re-joins) with a new worker 1, and `rebuilt` makes worker 0's
    first command its whole state: the new worker holds worker 0's weight, not its own seed's.
    Before the deadline test: a process whose init_process_group failed names its next group apart
    from a fresh process's (torch counts the groups it made; a destroyed group resets the count, a
    failed one does not), which is why a failed rebuild replaces every follower (regroup.py)."""
    dying, fresh = _peer("eu-west-1", 10), _peer("eu-west-1", 10)  # both now: their imports overlap
    try:
        group = WorkerGroup("eu-west-1", 0, 2, timeout_s=10)
        region = OneParameter(group)
        address = group.open("127.0.0.1")
        dying.stdin.write(address + "\n")
        dying.stdin.flush()
        group.join(address, torch.device("cpu"))
        _step(group, region)  # one step together: worker 1 now waits for the next command
        dying.send_signal(signal.SIGKILL)
        dying.wait(timeout=30)
        with pytest.raises(GroupLost, match=r"region eu-west-1: worker 0 of 2 lost its region's process group "
                                            r"during (an inner step|the gradient all_reduce)"):
            _step(group, region)
        assert not torch.distributed.is_initialized()  # it left the group: a new one can form
        with pytest.raises(GroupLost, match="holds no process group"):
            _step(group, region)

        with torch.no_grad():
            region.model.weight.fill_(3.0)
        address = group.open("127.0.0.1")
        fresh.stdin.write(address + "\n")
        fresh.stdin.flush()
        group.join(address, torch.device("cpu"), rebuilt=True)
        _step(group, region)
        group.close()  # STOP: worker 1's follow returns
        out, err = fresh.communicate(timeout=60)
        assert fresh.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"steps": 1, "seen": ["state", "step"], "weight": 3.0}
    finally:
        for peer in (dying, fresh):
            if peer.poll() is None:
                peer.kill()
                peer.wait(timeout=30)


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
