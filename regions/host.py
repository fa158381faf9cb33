"""regions.per_process: K regions in one Ray actor process (a host), for many regions on few cores.

A region actor is a process that imports torch (about 260 MB and 2-4 s each), so a 2-core machine
tops out near 16 regions. A host holds K Regions by name, each as it would be in its own actor
(a RegionActor built as a plain class: its own gRPC server, port, TLS identity and transport, the
WAN emulator's links unchanged); the process imports torch once and shares one task (the data is
loaded and partitioned once).

Concurrency. A region's round blocks in its exchange until its in-neighbours' updates arrive, and
those may be regions of the same host: the K regions' calls must run side by side, never queued
behind one another. Each region has a concurrency group of its own (`slot_group(i)`, one thread):
the driver's handle (orchestrator/driver/hosts.py) sends region i's calls to group i, so one
region's calls run one at a time and in order, as a region actor's do, and different regions'
run at once. Heartbeats, senders-done notices share the host's own groups (they return at once).

torch's global generator is the process's: each Region here is an `_OwnGeneratorRegion`
(regions/inprocess.py), which swaps its own generator state in under one lock around whatever
draws from it, so a region draws what it would draw alone (the GCN's dropout).

What a host does not do (refused by the config, orchestrator/config/__init__.py): warm pools,
detached actors (run.orphan_timeout_s), several workers a region, gap filling, the loop API.
A host's process that dies fails all its K regions; Ray restarts it with all of them.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import ray
import torch

from .actor import HEALTH_GROUP, NOTICE_GROUP, RegionActor, grpc_log_env, malloc_env
from .inprocess import _OwnGeneratorRegion
from .leave_notice import LeaveNotice
from .messages import RoundPlan, RoundReport


def slot_group(i: int) -> str:
    """The concurrency group of the host's i-th region: its calls run on this group's one thread."""
    return f"slot{i}"


class RegionHost:
    """The Ray actor of K regions of one run (regions.per_process). Every region call takes the
    region's name first and is RegionActor's for that region."""

    def __init__(self, cfg: Any, regions: list[str], run_dir: str, *, tls: dict[str, Any] | None = None):
        torch.set_num_threads(cfg.regions.torch_threads)  # once for the process (each Region sets it again)
        tls = tls or {}
        lock = threading.RLock()  # torch's generator, one per process: regions/inprocess.py
        # one SIGTERM handler for the process: a spot notice lets every region of it leave
        self._notice = LeaveNotice(getattr(cfg.regions, "leave_grace_s", 30.0))
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            self._notice.install()
        self.slots: dict[str, RegionActor] = {}
        self._closed: set[str] = set()
        task = None
        for region in regions:
            build = functools.partial(_OwnGeneratorRegion, rng_lock=lock, task=task)
            self.slots[region] = RegionActor(cfg, region, run_dir, tls=tls.get(region), build_region=build,
                                             notice=self._notice)
            task = self.slots[region].region.task  # the first region's task serves the others (one load)

    def _slot(self, region: str) -> RegionActor:
        try:
            return self.slots[region]
        except KeyError:
            raise RuntimeError(f"region {region} is not hosted here (pid {os.getpid()}: "
                               f"{', '.join(self.slots)})") from None

    # -- on the host's own threads ---------------------------------------------------------
    @ray.method(concurrency_group=HEALTH_GROUP)
    def heartbeat(self, region: str) -> dict[str, Any]:
        return self._slot(region).heartbeat()

    @ray.method(concurrency_group=NOTICE_GROUP)
    def senders_done(self, region: str, round_: int, senders: list[str]) -> None:
        self._slot(region).senders_done(round_, senders)

    # -- a region's calls, each on its region's group (slot_group) -------------------------
    def start(self, region: str) -> str:
        return self._slot(region).start()

    def connect(self, region: str, peers: dict[str, str]) -> None:
        return self._slot(region).connect(peers)

    def probe(self, region: str) -> dict[str, Any]:
        return self._slot(region).probe()

    def run_round(self, region: str, plan: RoundPlan) -> RoundReport:
        return self._slot(region).run_round(plan)

    def catch_up(self, region: str, peers: list[str], **kwargs: Any) -> tuple[str, int]:
        return self._slot(region).catch_up(peers, **kwargs)

    def finish_pending(self, region: str) -> dict[str, Any]:
        return self._slot(region).finish_pending()

    def flush_exchange(self, region: str) -> dict[str, Any]:
        return self._slot(region).flush_exchange()

    def get_params(self, region: str) -> list[Any]:
        return self._slot(region).get_params()

    def evaluate(self, region: str) -> dict[str, Any]:
        return self._slot(region).evaluate()

    def result_state(self, region: str) -> dict[str, Any]:
        return self._slot(region).result_state()

    def sketch(self, region: str) -> Any:
        return self._slot(region).sketch()

    def save_checkpoint(self, region: str) -> str:
        return self._slot(region).save_checkpoint()

    def restore_checkpoint(self, region: str, at_most: int | None = None) -> dict[str, Any]:
        return self._slot(region).restore_checkpoint(at_most)

    def take_refusals(self, region: str) -> dict[str, int]:
        return self._slot(region).take_refusals()

    def transport_stats(self, region: str) -> dict[str, Any]:
        return self._slot(region).transport_stats()

    def info(self, region: str) -> dict[str, Any]:
        return self._slot(region).info()

    def node_info(self, region: str) -> dict[str, Any]:
        """RegionActor.node_info, and which regions share the process (`hosted_with`)."""
        return {**self._slot(region).node_info(), "hosted_with": list(self.slots)}

    def finish_loop(self, region: str, timeout_s: float | None = None) -> dict[str, Any]:
        return self._slot(region).finish_loop(timeout_s)

    def close(self, region: str) -> None:
        """Close one region (it left the run, or the run is over); the last one closes the notice."""
        self._slot(region).close()
        self._closed.add(region)
        if self._closed >= set(self.slots):
            self._notice.close()


def region_host_class(*, regions: int, num_cpus: float, max_restarts: int,
                      label_selector: dict[str, str] | None = None, num_gpus: float = 0.0) -> Callable[..., Any]:
    """A remote RegionHost class for `regions` regions: a concurrency group (one thread) each."""
    groups = {HEALTH_GROUP: 1, NOTICE_GROUP: 1, **{slot_group(i): 1 for i in range(regions)}}
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts,
                               "max_task_retries": 0,
                               "runtime_env": {"env_vars": {**grpc_log_env(), **malloc_env()}},
                               "concurrency_groups": groups}
    if label_selector:
        options["label_selector"] = label_selector
    return ray.remote(**options)(RegionHost)
