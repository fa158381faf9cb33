"""``regions``, ``network`` and ``ray``: where the region actors run, how their gRPC servers are
reached, and the Ray cluster they run on."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from geofed.p2p.wan.config import EmulationConfig
from geofed.p2p.wan.prices import EgressConfig
from geofed.regions.emulation import ComputeEmulation

from .common import NAME_RE as _NAME_RE, _doc
from .regionrefs import check_section_refs

MAX_REGIONS = 256
_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
# Names the run directory uses for itself: checkpoints/driver/, tls/ca.pem.
RESERVED_REGION_NAMES = ("driver", "ca")


@dataclass(frozen=True, kw_only=True)
class RegionsSection:
    """``regions``: the region names, which Ray nodes may host each (node labels), and each actor's
    CPUs, threads, restarts and timeouts.
    """

    names: tuple[str, ...] = field(
        default=("us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"),
        metadata=_doc("region names (cloud region ids); one worker actor each"))
    label_key: str = field(default="ray.io/availability-region", metadata=_doc("Ray node label that says a node's region"))
    labels: dict[str, str] = field(default_factory=dict, metadata=_doc("region -> label value when it differs from the name"))
    num_cpus: float | None = field(default=None, metadata=_doc(
        "CPUs Ray reserves per region actor (null: 0.5, or on a local Ray less, so that every region fits); a run "
        "asking for more than the cluster has stops before any actor starts (exit 1, with the arithmetic)"))
    workers: int = field(default=1, metadata=_doc(
        "worker actors per region (docs/regions-as-clusters.md): N > 1 places N-1 more actors like the region's "
        "(same label, num_cpus and num_gpus each), one torch.distributed group inside the region (gloo, nccl on "
        "cuda); inner steps are data-parallel, each worker a sync.inner.batch_size batch of the region's shard "
        "(N x it a step); 1: one actor, no group"))
    shard_exchange: bool = field(default=False, metadata=_doc(
        "regions.workers > 1: the WAN exchange sharded over the region's workers (docs/regions-as-clusters.md): "
        "worker k owns shard k of the flat parameters, encodes it with its own codec stream and error feedback and "
        "exchanges it with worker k of every peer region over its own gRPC server (the region's TLS identity), so a "
        "region's WAN bytes leave through all its workers; the mixed shards are gathered inside the region and "
        "every worker takes the same outer step. Refused with sync.overlap, sync.fragments > 1, secure "
        "aggregation, update-level DP, security.score_updates and an emulated WAN (network.emulation.mode). "
        "false: worker 0 alone exchanges the whole update; no effect with regions.workers 1"))
    per_process: int = field(default=1, metadata=_doc(
        "regions one actor process hosts (docs/many-regions.md): K > 1 packs the regions, K at a time in "
        "regions.names order, into processes that import torch once, each region with its own gRPC server and "
        "emulated links as before; regions.num_cpus is then each process's. Such a process is never pooled nor "
        "detached (run.orphan_timeout_s does not keep it), and its death fails its K regions. 1: an actor a region"))
    group_timeout_s: float = field(default=60.0, metadata=_doc(
        "regions.workers > 1: fail if a region's workers have not formed their process group within this (at "
        "set-up, and again when a region is rebuilt after a worker died), and the deadline of each collective "
        "inside the region: a dead worker's collective holds the region no longer"))
    torch_threads: int = field(default=1, metadata=_doc("torch intra-op threads per region worker"))
    device: str = field(default="auto", metadata=_doc(
        "where each region trains, decided on its node: auto (its first GPU if any, else the CPU), cpu, cuda, "
        "cuda:N; cuda where the node has none is an error, never a silent fallback"))
    num_gpus: float = field(default=0.0, metadata=_doc(
        "GPUs Ray reserves per region actor (fractions share one GPU: 0.25 puts 4 regions on it)"))
    max_restarts: int = field(default=3, metadata=_doc(
        "Ray restarts of a crashed region actor (regions.workers > 1: of worker 0, restarted by each rebuild "
        "after any of the region's workers died)"))
    placement_timeout_s: float = field(default=60.0, metadata=_doc("fail if some region has no alive Ray node carrying its label within this (nodes may still be joining)"))
    start_timeout_s: float = field(default=180.0, metadata=_doc("fail if a region actor has not started (placed, torch imported, model and data built) within this"))
    heartbeat_timeout_s: float = field(default=10.0, metadata=_doc(
        "a region busy with a call that does not answer the driver's liveness probe (a Ray call served on its own "
        "thread) for this long (a quarter of it, at least 2 s, once another region has finished the same call) is "
        "stalled (SIGSTOP, swap, a hung host): elastic runs go on without it and it rejoins when it answers "
        "again; fail-fast runs stop"))
    leave_grace_s: float = field(default=30.0, metadata=_doc(
        "a SIGTERM to a region's process (a spot notice) asks the run to let it leave: its round in flight "
        "finishes and it is retired after it; a round still running after this many seconds ends the process "
        "there and the region is retired at once (docs/reliability.md, membership)"))
    emulation: ComputeEmulation = field(default_factory=ComputeEmulation, metadata=_doc(
        "compute emulation: slower regions and absent rounds (docs/heterogeneity.md)"))

    def __post_init__(self):
        if not _DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 <= self.num_gpus <= 64:
            raise ValueError(f"num_gpus: must be in [0, 64], got {self.num_gpus}")
        if not 1 <= len(self.names) <= MAX_REGIONS:
            raise ValueError(f"names: need 1..{MAX_REGIONS} regions, got {len(self.names)}")
        for n in self.names:
            if not _NAME_RE.fullmatch(n):
                raise ValueError(f"names: region name {n!r} must match {_NAME_RE.pattern}")
        if len(set(self.names)) != len(self.names):
            raise ValueError("names: region names must be unique")
        reserved = sorted(set(self.names) & set(RESERVED_REGION_NAMES))
        if reserved:
            raise ValueError(f"names: {', '.join(reserved)} is reserved (the run directory uses it for its own files)")
        if self.num_cpus is not None and not 0 < self.num_cpus <= 1024:
            raise ValueError(f"num_cpus: must be in (0, 1024], got {self.num_cpus}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers: must be in [1, 64], got {self.workers}")
        if not 1 <= self.per_process <= MAX_REGIONS:
            raise ValueError(f"per_process: must be in [1, {MAX_REGIONS}], got {self.per_process}")
        if not 0 < self.group_timeout_s <= 86400:
            raise ValueError(f"group_timeout_s: must be in (0, 86400], got {self.group_timeout_s}")
        if not 1 <= self.torch_threads <= 256:
            raise ValueError(f"torch_threads: must be in [1, 256], got {self.torch_threads}")
        if self.max_restarts < 0 or self.placement_timeout_s <= 0:
            raise ValueError("max_restarts: must be >= 0 and placement_timeout_s > 0")
        if not 0 < self.start_timeout_s <= 86400:
            raise ValueError(f"start_timeout_s: must be in (0, 86400], got {self.start_timeout_s}")
        if not 0.5 <= self.heartbeat_timeout_s <= 86400:
            raise ValueError(f"heartbeat_timeout_s: must be in [0.5, 86400], got {self.heartbeat_timeout_s}")
        if not 0 < self.leave_grace_s <= 86400:
            raise ValueError(f"leave_grace_s: must be in (0, 86400], got {self.leave_grace_s}")
        check_section_refs(self)  # labels, slowdowns, absence windows: one wording, the known names listed

    def label_of(self, region: str) -> str:
        """The value of regions.label_key a node must carry to host `region`: its name unless regions.labels maps it."""
        return self.labels.get(region, region)


@dataclass(frozen=True, kw_only=True)
class NetworkSection:
    """``network``: where the gRPC servers bind and what they advertise, message and memory limits,
    the set-up link probes, and the WAN emulation.
    """

    bind_host: str = field(default="127.0.0.1", metadata=_doc("address each region's gRPC server binds"))
    advertised_host: str | None = field(default=None, metadata=_doc("address peers dial (default: bind_host, or the node IP when bind_host is 0.0.0.0)"))
    port_range: tuple[int, int] | None = field(default=None, metadata=_doc("[first, last] ports for gRPC servers; null: ephemeral"))
    max_message_mb: int | None = field(default=None, metadata=_doc(
        "largest update accepted from a peer, MiB; null: what the model needs (its largest encoded update over "
        "compression.codec and ladder, x 1.5, at least 1 MiB; docs/p2p.md)"))
    peer_memory_mb: int | None = field(default=None, metadata=_doc(
        "memory one peer's pushes may hold in a region at once (bodies in flight, updates waiting for their "
        "round), MiB; null: 2 messages in flight + security.round_window + 1 decoded updates (docs/p2p.md)"))
    chunk_kb: int = field(default=1024, metadata=_doc("client-stream chunk size, KiB (at most 1024)"))
    probe_s: float = field(default=0.25, metadata=_doc(
        "before round 0 every region warms each connection (TLS handshake, slow start, gRPC's flow-control windows) "
        "and measures it with a probe that streams this long (at least 3 RTTs) to all its peers at once; the first "
        "round's H and codecs then come from measured links. 0: no probes (the first rounds' pushes warm the links "
        "and are not bandwidth samples)"))
    probe_max_mb: int = field(default=8, metadata=_doc("most a probe sends to one peer, MiB (at most 16; a warm-up and a measuring probe per peer)"))
    emulation: EmulationConfig = field(default_factory=EmulationConfig, metadata=_doc("WAN emulation of every link"))
    egress: EgressConfig = field(default_factory=EgressConfig, metadata=_doc(
        "egress prices of the links: summary.json's egress_usd, the report's cost, `geofed plan` (docs/plan.md)"))

    def __post_init__(self):
        if self.port_range is not None:
            lo, hi = self.port_range
            if not 1 <= lo <= hi <= 65535:
                raise ValueError(f"port_range: need 1 <= first <= last <= 65535, got {list(self.port_range)}")
        if self.max_message_mb is not None and not 1 <= self.max_message_mb <= 65536:
            raise ValueError(f"max_message_mb: must be in [1, 65536], got {self.max_message_mb}")
        if self.peer_memory_mb is not None and not 1 <= self.peer_memory_mb <= 1 << 20:
            raise ValueError(f"peer_memory_mb: must be in [1, 1048576], got {self.peer_memory_mb}")
        if not 16 <= self.chunk_kb <= 1024:
            raise ValueError(f"chunk_kb: must be in [16, 1024], got {self.chunk_kb}")
        if not 0 <= self.probe_s <= 60:
            raise ValueError(f"probe_s: must be in [0, 60], got {self.probe_s}")
        if not 1 <= self.probe_max_mb <= 16:
            raise ValueError(f"probe_max_mb: must be in [1, 16], got {self.probe_max_mb}")


@dataclass(frozen=True, kw_only=True)
class RaySection:
    """``ray``: start a local Ray or join a cluster, and how long to wait for it."""

    address: str | None = field(default=None, metadata=_doc("null: start a local Ray; auto, HOST:PORT or ray://... joins a cluster"))
    num_cpus: int | None = field(default=None, metadata=_doc("CPUs of the local Ray (null: all)"))
    init_timeout_s: float = field(default=120.0, metadata=_doc("give up starting/joining Ray after this"))
    warm_pool_s: float = field(default=0.0, metadata=_doc(
        "keep the region actors alive this long after a run for the next run on the same cluster to reuse "
        "(no new Python, torch already imported: docs/launch.md, Faster start); they hold their CPUs meanwhile; "
        "0: off, each run starts and ends its own"))

    def __post_init__(self):
        if self.num_cpus is not None and not 1 <= self.num_cpus <= 4096:
            raise ValueError(f"num_cpus: must be in [1, 4096], got {self.num_cpus}")
        if not 0 <= self.warm_pool_s <= 86400:
            raise ValueError(f"warm_pool_s: must be in [0, 86400] seconds, got {self.warm_pool_s}")
