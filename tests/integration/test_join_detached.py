"""Issue 41, item 3, for a region that joins mid-run: on a run that detaches its regions
(run.orphan_timeout_s, orchestrator/driver/reattach.py) the joiner's actor is made as set-up makes
the others' (cluster.create_region_actor -> _new_region_actor): detached and named under the run's
id, so it outlives a killed driver and a resume's look-up (reattach.find_live) re-attaches to it.
A region that joins again under its name takes the name back from its retired predecessor, whose
name Ray frees only once it is dead. One region actor at a time over the session's Ray, no run."""

from __future__ import annotations

import pytest
import ray
from geofed.orchestrator.driver.cluster import create_region_actor
from geofed.orchestrator.driver.reattach import RUN_NAMESPACE, actor_name, find_live, run_id
from geofed.orchestrator.driver.warmpool import end_pooled
from geofed.p2p.tls import make_pki
from reliability_harness import small_config

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120),
              pytest.mark.slow]  # slow: two region actors started one after the other, 14 s at a load of 12 on 2 cores

REGION = "eu-west-1"


def test_a_joiners_actor_is_named_under_the_run_and_a_resume_finds_it(tmp_path):
    cfg = small_config(regions=["us-east-1", REGION], run={"orphan_timeout_s": 60.0})
    make_pki(tmp_path / "tls", list(cfg.regions.names))
    name = actor_name(run_id(tmp_path), REGION)
    first, info = create_region_actor(cfg, str(tmp_path), REGION, pin=False, named=name)
    handle = first
    try:
        held = ray.get_actor(name, namespace=RUN_NAMESPACE)
        assert held._actor_id == first._actor_id
        assert next(a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name)
        # `geofed leave` retires it (handles.retire: ray.kill), and the region joins again at once under its name
        ray.kill(first, no_restart=True)
        handle, again = create_region_actor(cfg, str(tmp_path), REGION, pin=False, named=name)
        assert again["pid"] != info["pid"]
        address = ray.get(handle.start.remote(), timeout=60)
        # a resumed driver's look-up (setup.reattach) finds it live, with its server and its pid
        live, gone = find_live({REGION: name}, job=ray.get_runtime_context().get_job_id(), timeout_s=30,
                               orphan_timeout_s=60.0)
        assert gone == {} and live[REGION].info["pid"] == again["pid"]
        assert live[REGION].info["grpc_address"] == address
    finally:
        end_pooled(name, handle)
