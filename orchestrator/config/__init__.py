"""The run config: one frozen keyword-only dataclass per component, loaded strictly from YAML.

Every key is documented by its field's ``doc``; ``geofed config-docs`` prints the table that
docs/CONFIG.md holds (a test keeps the two equal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from geofed.compression import CodecSpec
from geofed.p2p.wan.config import EmulationConfig
from geofed.p2p.wan.prices import EgressConfig
from geofed.regions.emulation import ComputeEmulation
from geofed.regions.pacing import PacingSection
from geofed.regions.tasks.base import PluginTaskConfig, load_task_factory, task_config_class

from . import strict
from ..launch.config import LaunchSection
from ..policies import FixedPolicyConfig, policy_config_class
from .privacy import PrivacySection, check_privacy_rules
from .common import NAME_RE as _NAME_RE, _doc
from .run import RunSection
from .sync_parts import DeadlineSection, GossipSection, InnerOptimizer, OuterOptimizer
from .strict import ConfigError

MAX_REGIONS = 256
_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
# Names the run directory uses for itself: checkpoints/driver/, tls/ca.pem.
RESERVED_REGION_NAMES = ("driver", "ca")
DEFAULT_CONFIG = "local-wan.yaml"


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
    torch_threads: int = field(default=1, metadata=_doc("torch intra-op threads per region worker"))
    device: str = field(default="auto", metadata=_doc(
        "where each region trains, decided on its node: auto (its first GPU if any, else the CPU), cpu, cuda, "
        "cuda:N; cuda where the node has none is an error, never a silent fallback"))
    num_gpus: float = field(default=0.0, metadata=_doc(
        "GPUs Ray reserves per region actor (fractions share one GPU: 0.25 puts 4 regions on it)"))
    max_restarts: int = field(default=3, metadata=_doc("Ray restarts of a crashed region actor"))
    placement_timeout_s: float = field(default=60.0, metadata=_doc("fail if some region has no alive Ray node carrying its label within this (nodes may still be joining)"))
    start_timeout_s: float = field(default=180.0, metadata=_doc("fail if a region actor has not started (placed, torch imported, model and data built) within this"))
    heartbeat_timeout_s: float = field(default=10.0, metadata=_doc(
        "a region busy with a call that does not answer the driver's liveness probe (a Ray call served on its own "
        "thread) for this long is stalled (SIGSTOP, swap, a hung host): elastic runs go on without it and it "
        "rejoins when it answers again; fail-fast runs stop"))
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
        for k in self.labels:
            if k not in self.names:
                raise ValueError(f"labels: {k!r} is not a configured region")
        if self.num_cpus is not None and not 0 < self.num_cpus <= 1024:
            raise ValueError(f"num_cpus: must be in (0, 1024], got {self.num_cpus}")
        if not 1 <= self.torch_threads <= 256:
            raise ValueError(f"torch_threads: must be in [1, 256], got {self.torch_threads}")
        if self.max_restarts < 0 or self.placement_timeout_s <= 0:
            raise ValueError("max_restarts: must be >= 0 and placement_timeout_s > 0")
        if not 0 < self.start_timeout_s <= 86400:
            raise ValueError(f"start_timeout_s: must be in (0, 86400], got {self.start_timeout_s}")
        if not 0.5 <= self.heartbeat_timeout_s <= 86400:
            raise ValueError(f"heartbeat_timeout_s: must be in [0.5, 86400], got {self.heartbeat_timeout_s}")
        try:
            self.emulation.check_regions(self.names)
        except ValueError as exc:
            raise ValueError(f"emulation.{exc}") from None

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
class SyncSection:
    """``sync``: the algorithm, topology, H/codec policy, the optimizers, overlap, deadlines and
    resyncs. Refuses CHOCO gossip over a time-varying topology.
    """

    algorithm: Literal["diloco", "allreduce", "gossip"] = field(
        default="diloco", metadata=_doc("diloco: H local steps then outer step on mixed pseudo-gradients; allreduce: per-step gradient averaging (baseline); gossip: decentralized model mixing"))
    topology: str = field(default="full", metadata=_doc("full, ring, exponential, one-peer-exponential, random-matching"))
    policy: Any = field(default_factory=FixedPolicyConfig, metadata=_doc("how H (and codecs) are chosen; kind: fixed, bandwidth, adacomm", choose=policy_config_class))
    inner: InnerOptimizer = field(default_factory=InnerOptimizer, metadata=_doc("local optimizer"))
    outer: OuterOptimizer = field(default_factory=OuterOptimizer, metadata=_doc("outer optimizer (diloco)"))
    overlap: bool | Literal["eager"] = field(default=False, metadata=_doc(
        "exchange round r while round r+1 computes. true (delayed): the outer update of round r is applied one round "
        "late; eager: the region applies its own pseudo-gradient at once and corrects with the global mean when it "
        "arrives (arXiv 2502.12996)"))
    fragments: int = field(default=1, metadata=_doc(
        "streaming DiLoCo (arXiv 2501.18512): split the model into this many fragments (contiguous layers, even "
        "in size) and exchange one per round, fragment round % N; the policy's H stays each parameter's sync "
        "period, so a round runs H/N steps and sends 1/N of the model (diloco over a static topology; "
        "docs/bench-wan.md)"))
    deadline: DeadlineSection = field(default_factory=DeadlineSection, metadata=_doc("receive deadlines"))
    resync_after_miss: bool = field(default=True, metadata=_doc(
        "diloco/allreduce over the full topology without overlap: a region that missed an in-neighbour's update "
        "(deadline, outage, a crashed peer) pulls the model from one that missed none (FetchState) after the round, "
        "so every region trains one model; false: it keeps its own drifted copy"))
    gossip: GossipSection = field(default_factory=GossipSection, metadata=_doc("gossip algorithm settings"))
    pacing: PacingSection = field(default_factory=PacingSection, metadata=_doc(
        "whether a round waits for its slowest region: barrier, time-budget or quorum (docs/heterogeneity.md)"))

    def __post_init__(self):
        from geofed.p2p.topology import topology_names  # p2p owns the names

        if self.pacing.mode != "barrier" and (self.algorithm != "diloco" or self.topology != "full"):
            raise ValueError(f"pacing.mode: {self.pacing.mode} paces full-topology diloco, not {self.algorithm} "
                             f"over {self.topology}")
        if self.pacing.mode == "quorum" and self.overlap:
            raise ValueError("pacing.mode: quorum rounds and sync.overlap do not combine (a late region's update "
                             "would be two rounds old before it is applied); use time-budget with overlap")

        if self.topology not in topology_names():
            raise ValueError(f"topology: unknown topology {self.topology!r} (known: {', '.join(topology_names())})")
        self._check_fragments()
        if self.algorithm == "gossip" and self.gossip.choco and not _static_topology(self.topology):
            # One public copy per region is consistent only if every neighbour gets every message.
            raise ValueError(f"topology: CHOCO gossip (sync.gossip.choco) needs a static topology "
                             f"(full, ring, exponential), got {self.topology!r}")

    def _check_fragments(self) -> None:
        """sync.fragments > 1: what streaming fragments do not combine with, said here, not mid-run."""
        if not 1 <= self.fragments <= 1024:
            raise ValueError(f"fragments: must be in [1, 1024], got {self.fragments}")
        if self.fragments == 1:
            return
        if self.algorithm != "diloco":
            raise ValueError(f"fragments: {self.fragments} fragments need sync.algorithm diloco, not {self.algorithm}")
        if self.pacing.mode == "quorum":
            raise ValueError("fragments: quorum rounds (sync.pacing.mode) and sync.fragments do not combine "
                             "(a late region's update would belong to another fragment's round)")
        if not _static_topology(self.topology):
            # Fragment f meets the topology of rounds f, f+N, ... only: a time-varying one (one peer per
            # round) could pair a fragment with the same peer for ever.
            raise ValueError(f"fragments: sync.fragments needs a static topology (full, ring, exponential), "
                             f"got {self.topology!r}")


def _static_topology(name: str) -> bool:
    from geofed.p2p.topology import StaticTopology, make_topology

    return isinstance(make_topology(name, 4), StaticTopology)


@dataclass(frozen=True, kw_only=True)
class CompressionSection:
    """``compression``: the default codec, error feedback, and the ladder of codecs a policy may
    choose per link (all CodecSpecs: the loader parses every spelling).
    """

    codec: CodecSpec = field(default=CodecSpec(kind="fp16"), metadata=_doc(
        "a codec name (int8), a mapping ({kind: topk, fraction: 0.01, inner: int8}) or its key "
        "(topk(fraction=0.01,inner=int8)); see docs/compression.md"))
    error_feedback: bool = field(default=True, metadata=_doc("keep what a lossy codec dropped and send it later"))
    ladder: tuple[CodecSpec, ...] = field(default=(), metadata=_doc("codecs the policy may choose per link, least compression first"))

    def __post_init__(self):
        # The loader parses every spelling into a CodecSpec; code that builds a section must too.
        for key, spec in [("codec", self.codec)] + [(f"ladder.{i}", s) for i, s in enumerate(self.ladder)]:
            if not isinstance(spec, CodecSpec):
                raise TypeError(f"{key}: expected a CodecSpec (CodecSpec.parse(...)), got {type(spec).__name__}")


@dataclass(frozen=True, kw_only=True)
class SecuritySection:
    """``security``: mutual TLS, how far ahead updates may come, what admission does with outsized
    updates, and the rollback of rounds that turn a model non-finite.
    """

    tls: bool = field(default=True, metadata=_doc("mutual TLS on every channel (false: plaintext, warns)"))
    round_window: int = field(default=2, metadata=_doc("accept updates at most this many rounds ahead"))
    robust_aggregation: Literal["none", "clip", "trimmed-mean", "median"] = field(default="clip", metadata=_doc(
        "what an outsized peer update meets: clip: scaled down to norm_multiple x the recent median norm; "
        "trimmed-mean / median: refused (outlier) and the mix is coordinate-wise robust (full-topology diloco "
        "or allreduce); none: only the value bound (docs/p2p.md)"))
    max_update_value: float = field(default=1e6, metadata=_doc(
        "an update holding a value of larger magnitude is refused (out_of_bounds), in every mode"))
    norm_multiple: float = field(default=10.0, metadata=_doc(
        "an update whose L2 norm exceeds this multiple of the median of recent update norms (all senders and "
        "the region's own) is clipped or refused"))
    trim_fraction: float = field(default=0.25, metadata=_doc(
        "trimmed-mean: values dropped at each end of every coordinate, as a fraction of the regions present "
        "(at least 1 when 3 or more)"))
    rollback_on_nonfinite: bool = field(default=True, metadata=_doc(
        "a region whose loss or model turns non-finite goes back to its state at the start of the round and "
        "drops the round's inputs (an event), instead of failing the run; 3 in a row still fail it"))
    secure_aggregation: bool = field(default=False, metadata=_doc(
        "mask every region's update with pairwise X25519/ChaCha20 masks that cancel in the sum, so a region learns "
        "only the sum of the others' updates; full-topology diloco, >= 3 regions, TLS, and a codec that sums as "
        "integers (int8, int4, randomk; topk, sign and powersgd are refused). docs/privacy.md"))
    secagg_threshold: int | None = field(default=None, metadata=_doc(
        "Shamir threshold t of the per-round protocol's recovery (p2p/secagg.py; null: a majority, max(2, n // 2 + "
        "1), at most n - 1); the round loop's per-run-key protocol recovers from the survivors' own seeds and does "
        "not use it (docs/privacy.md)"))
    secagg_bits: Literal[8, 16, 32] = field(default=32, metadata=_doc(
        "the mask ring Z_2^bits: a masked value costs bits on the wire (32: 4x an int8 update); 8 keeps int8's "
        "bytes but leaves each region 127 // n levels so that the sum cannot wrap"))

    def __post_init__(self):
        if not 0 <= self.round_window <= 1000:
            raise ValueError(f"round_window: must be in [0, 1000], got {self.round_window}")
        if not 0 < self.max_update_value <= 3.4e38:
            raise ValueError(f"max_update_value: must be in (0, 3.4e38], got {self.max_update_value}")
        if not 1 < self.norm_multiple <= 1e6:
            raise ValueError(f"norm_multiple: must be in (1, 1e6], got {self.norm_multiple}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction: must be in [0, 0.5), got {self.trim_fraction}")


@dataclass(frozen=True, kw_only=True)
class RaySection:
    """``ray``: start a local Ray or join a cluster, and how long to wait for it."""

    address: str | None = field(default=None, metadata=_doc("null: start a local Ray; auto, HOST:PORT or ray://... joins a cluster"))
    num_cpus: int | None = field(default=None, metadata=_doc("CPUs of the local Ray (null: all)"))
    init_timeout_s: float = field(default=120.0, metadata=_doc("give up starting/joining Ray after this"))

    def __post_init__(self):
        if self.num_cpus is not None and not 1 <= self.num_cpus <= 4096:
            raise ValueError(f"num_cpus: must be in [1, 4096], got {self.num_cpus}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run config, one frozen section per component. Construction validates it, rules across
    sections included (CHOCO's codecs, robust aggregation's topology); load_config builds one from YAML.
    """

    run: RunSection = field(default_factory=RunSection, metadata=_doc("the run"))
    task: Any = field(metadata=_doc("what is trained: kind mlp-digits, char-lm, gcn-planetoid or python:module:function", choose=task_config_class))
    regions: RegionsSection = field(default_factory=RegionsSection, metadata=_doc("the regions"))
    network: NetworkSection = field(default_factory=NetworkSection, metadata=_doc("gRPC and WAN emulation"))
    sync: SyncSection = field(default_factory=SyncSection, metadata=_doc("how regions synchronise"))
    compression: CompressionSection = field(default_factory=CompressionSection, metadata=_doc("how updates are compressed"))
    security: SecuritySection = field(default_factory=SecuritySection, metadata=_doc("TLS and message validation"))
    ray: RaySection = field(default_factory=RaySection, metadata=_doc("the Ray cluster"))
    launch: LaunchSection = field(default_factory=LaunchSection, metadata=_doc("multi-region cloud launch: `geofed launch plan` (docs/launch.md)"))
    privacy: PrivacySection = field(default_factory=PrivacySection, metadata=_doc(
        "differential privacy (docs/privacy.md)"))

    def __post_init__(self):
        if self.regions.device.startswith("cuda") and self.regions.num_gpus <= 0:
            raise ValueError(f"regions.num_gpus: must be > 0 with regions.device {self.regions.device!r} "
                             f"(Ray hides the GPUs from an actor that reserves none)")
        if self.regions.device.startswith("cuda") and self.sync.algorithm == "gossip":
            raise ValueError("regions.device: gossip keeps its copies in host memory and runs on the CPU; "
                             "set regions.device to cpu or auto (auto trains gossip on the CPU)")
        if self.sync.algorithm == "gossip" and self.sync.gossip.choco:
            _check_choco_compression(self.compression)
        if self.sync.pacing.quorum > len(self.regions.names):
            raise ValueError(f"sync.pacing.quorum: {self.sync.pacing.quorum} is more than the "
                             f"{len(self.regions.names)} regions of regions.names")
        robust = self.security.robust_aggregation
        if robust in ("trimmed-mean", "median") and (self.sync.algorithm == "gossip" or self.sync.topology != "full"):
            raise ValueError(f"security.robust_aggregation: {robust} replaces the mix of full-topology diloco or "
                             f"allreduce, not {self.sync.algorithm} over {self.sync.topology} (use clip)")
        check_privacy_rules(self)
        if self.sync.fragments > 1 and self.security.secure_aggregation:
            raise ValueError("sync.fragments: secure aggregation (security.secure_aggregation) masks whole-model "
                             "updates; it does not combine with fragments")
        if self.sync.fragments > 1 and self.privacy.dp.mode == "update":
            raise ValueError("sync.fragments: update-level DP (privacy.dp.mode: update) clips whole-model "
                             "pseudo-gradients; it does not combine with fragments (record-level DP does)")


def _check_choco_compression(c: CompressionSection) -> None:
    """CHOCO sends Q(x - x_hat): what Q drops stays in the next difference, so error feedback
    would count it twice, and an unbiased rescaled codec makes the public copies drift."""
    if c.error_feedback:
        raise ValueError("compression.error_feedback: must be false with CHOCO gossip (sync.gossip.choco): "
                         "the difference to the public copy already carries what the codec dropped")
    for key, spec in [("codec", c.codec)] + [(f"ladder.{i}", s) for i, s in enumerate(c.ladder)]:
        if not spec.codec().contractive:
            raise ValueError(f"compression.{key}: CHOCO gossip needs a contractive codec, {spec.key} is not")


def default_config_path() -> Path:
    """configs/local-wan.yaml as installed (geofed.configs is a data-only namespace package)."""
    import geofed.configs

    # importlib.resources cannot read an editable install's namespace path (it holds a path hook
    # entry), so look in each real directory of the package path.
    for entry in geofed.configs.__path__:
        candidate = Path(entry) / DEFAULT_CONFIG
        if candidate.is_file():
            return candidate
    raise ConfigError("", f"the embedded default config {DEFAULT_CONFIG} is missing from this installation")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load and validate a run config; ConfigError names the file and the dotted key."""
    path = Path(path) if path is not None else default_config_path()
    source = str(path)
    data = strict.parse_yaml_file(path, source=source)
    return config_from_mapping(data, overrides, source=source)


def config_from_mapping(data: dict, overrides=(), *, source: str = "<config>") -> RunConfig:
    """Apply `--set` overrides to a parsed YAML mapping (in place) and build the RunConfig strictly;
    a plug-in task's factory is looked up (imported, not called). ConfigError names `source` and the key.
    """
    try:
        for assignment in overrides:
            strict.apply_override(data, assignment)
        cfg = strict.build(RunConfig, data)
        _check_plugin_task(cfg.task)
        return cfg
    except ConfigError as exc:
        raise exc.with_source(source) from None


def _check_plugin_task(task: Any) -> None:
    """Find a plug-in task's factory now, so `geofed validate` refuses one that is not marked as a
    geofed task factory. Nothing is called; the module is imported (a config naming a plug-in is
    code: regions/tasks/base.py)."""
    if not isinstance(task, PluginTaskConfig):
        return
    try:
        load_task_factory(task)
    except ValueError as exc:
        key, _, rest = str(exc).partition(": ")
        raise ConfigError(f"task.{key}", rest) from None


def to_mapping(cfg: Any) -> Any:
    """A plain mapping of a config (for config.yaml in the run directory)."""
    import dataclasses

    if isinstance(cfg, CodecSpec):
        return cfg.to_data()
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_mapping(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_mapping(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_mapping(v) for k, v in cfg.items()}
    return cfg
