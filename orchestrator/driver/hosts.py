"""regions.per_process > 1: the driver's side of processes that host several regions (regions/host.py).

Each region still has a handle of its own in RegionActors.handles: a `HostedRegion`, which the
rest of the driver calls as it calls a region actor (`handle.run_round.remote(plan)`). It sends
the call to the host with the region's name first, on the region's concurrency group there, so
that a region's calls keep their order and the regions of one process run side by side (a round
waits on its in-neighbours, which may share its process). Heartbeats and senders-done notices go
to the host's own groups. Killing a hosted region kills its host: all its regions fail, and Ray
restarts the process with all of them (`actor_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geofed.regions.host import region_host_class, slot_group

from ..config import RunConfig

@dataclass(frozen=True)
class _HostedMethod:
    method: Any  # the host's Ray actor method, on the region's group
    region: str

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.method.remote(self.region, *args, **kwargs)


@dataclass(frozen=True)
class HostedRegion:
    """A region hosted by `host` (a RegionHost actor) as its `slot`-th region, called as a region actor
    is: one property per RegionHost method (no call goes by a name in a string), each on the region's
    concurrency group there, but the heartbeat and the senders-done notice, which RegionHost declares
    on groups of their own."""

    host: Any
    region: str
    slot: int

    def _on_slot(self, method: Any) -> _HostedMethod:
        return _HostedMethod(method.options(concurrency_group=slot_group(self.slot)), self.region)

    @property
    def heartbeat(self) -> _HostedMethod:
        return _HostedMethod(self.host.heartbeat, self.region)

    @property
    def senders_done(self) -> _HostedMethod:
        return _HostedMethod(self.host.senders_done, self.region)

    @property
    def start(self) -> _HostedMethod:
        return self._on_slot(self.host.start)

    @property
    def connect(self) -> _HostedMethod:
        return self._on_slot(self.host.connect)

    @property
    def probe(self) -> _HostedMethod:
        return self._on_slot(self.host.probe)

    @property
    def run_round(self) -> _HostedMethod:
        return self._on_slot(self.host.run_round)

    @property
    def catch_up(self) -> _HostedMethod:
        return self._on_slot(self.host.catch_up)

    @property
    def finish_pending(self) -> _HostedMethod:
        return self._on_slot(self.host.finish_pending)

    @property
    def flush_exchange(self) -> _HostedMethod:
        return self._on_slot(self.host.flush_exchange)

    @property
    def get_params(self) -> _HostedMethod:
        return self._on_slot(self.host.get_params)

    @property
    def evaluate(self) -> _HostedMethod:
        return self._on_slot(self.host.evaluate)

    @property
    def result_state(self) -> _HostedMethod:
        return self._on_slot(self.host.result_state)

    @property
    def sketch(self) -> _HostedMethod:
        return self._on_slot(self.host.sketch)

    @property
    def save_checkpoint(self) -> _HostedMethod:
        return self._on_slot(self.host.save_checkpoint)

    @property
    def restore_checkpoint(self) -> _HostedMethod:
        return self._on_slot(self.host.restore_checkpoint)

    @property
    def take_refusals(self) -> _HostedMethod:
        return self._on_slot(self.host.take_refusals)

    @property
    def transport_stats(self) -> _HostedMethod:
        return self._on_slot(self.host.transport_stats)

    @property
    def info(self) -> _HostedMethod:
        return self._on_slot(self.host.info)

    @property
    def node_info(self) -> _HostedMethod:
        return self._on_slot(self.host.node_info)

    @property
    def finish_loop(self) -> _HostedMethod:
        return self._on_slot(self.host.finish_loop)

    @property
    def close(self) -> _HostedMethod:
        return self._on_slot(self.host.close)


def actor_of(handle: Any) -> Any:
    """The Ray actor behind a region's handle: its host's for a hosted region (what ray.kill takes)."""
    return handle.host if isinstance(handle, HostedRegion) else handle


def pack(names: list[str], per_process: int) -> list[list[str]]:
    """The regions of each process: `per_process` at a time in regions.names order (the last may hold fewer)."""
    return [names[i:i + per_process] for i in range(0, len(names), per_process)]


def create_hosts(cfg: RunConfig, run_dir: str, *, tls: dict[str, Any], cpus: float, pin: bool) -> dict[str, HostedRegion]:
    """One RegionHost per regions.per_process regions; region -> its handle. With `pin`, a process's
    regions must share their node label (regions.label_key): it is placed by it."""
    rc = cfg.regions
    handles: dict[str, HostedRegion] = {}
    for group in pack(list(rc.names), rc.per_process):
        labels = {rc.label_of(r) for r in group}
        if pin and len(labels) > 1:
            raise ValueError(f"regions.per_process: {rc.per_process} regions a process must share a node label "
                             f"({rc.label_key}), but {', '.join(group)} have {', '.join(sorted(labels))}; order "
                             f"regions.names so that each process's regions share one, or set regions.per_process 1")
        selector = {rc.label_key: labels.pop()} if pin else None
        cls = region_host_class(regions=len(group), num_cpus=cpus, num_gpus=rc.num_gpus,
                                max_restarts=rc.max_restarts, label_selector=selector)
        host = cls.options(name=None).remote(cfg, group, run_dir, tls={r: tls[r] for r in group})
        handles.update({r: HostedRegion(host, r, i) for i, r in enumerate(group)})
    return handles
