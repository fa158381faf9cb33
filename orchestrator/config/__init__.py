"""The run config: one frozen keyword-only dataclass per component, loaded strictly from YAML.

Every key is documented by its field's ``doc``; ``geofed config-docs`` prints the table that
docs/CONFIG.md holds (a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geofed.compression import CodecSpec
from geofed.regions.algorithm_traits import AlgorithmTraits, algorithm_traits
from geofed.regions.tasks.configs import PluginTaskConfig, load_task_factory, task_config_class

from . import paths, strict
from ..launch.config import LaunchSection
from .cluster import MAX_REGIONS, RESERVED_REGION_NAMES, NetworkSection, RaySection, RegionsSection
from .common import _doc
from .overrides import apply_overrides
from .privacy import PrivacySection, check_privacy_rules
from .regionrefs import check_run_refs
from .run import RunSection
from .strict import ConfigError
from .sync_parts import OUTER_KINDS, DeadlineSection, GossipSection, InnerOptimizer, OuterOptimizer, SyncSection
from .updates import CompressionSection, SecuritySection

# The sections live in sibling modules by concern; this package is their one import surface.
__all__ = [
    "CompressionSection", "ConfigError", "DEFAULT_CONFIG", "DeadlineSection", "GossipSection", "InnerOptimizer",
    "LaunchSection", "MAX_REGIONS", "NetworkSection", "OuterOptimizer", "PrivacySection", "RESERVED_REGION_NAMES",
    "RaySection", "RegionsSection", "RunConfig", "RunSection", "SecuritySection", "SyncSection",
    "config_from_mapping", "default_config_path", "load_config", "load_mapping", "strict", "to_mapping",
]

DEFAULT_CONFIG = "local-wan.yaml"


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
        check_run_refs(self)  # links, schedules, prices and the head region name real regions
        if self.regions.device.startswith("cuda") and self.regions.num_gpus <= 0:
            raise ValueError(f"regions.num_gpus: must be > 0 with regions.device {self.regions.device!r} "
                             f"(Ray hides the GPUs from an actor that reserves none)")
        traits = algorithm_traits(self.sync.algorithm)
        if self.regions.device.startswith("cuda") and traits.cpu_only:
            raise ValueError("regions.device: gossip keeps its copies in host memory and runs on the CPU; "
                             "set regions.device to cpu or auto (auto trains gossip on the CPU)")
        if traits.mixes_models and self.sync.gossip.choco:
            _check_choco_compression(self.compression)
        if self.sync.pacing.quorum > len(self.regions.names):
            raise ValueError(f"sync.pacing.quorum: {self.sync.pacing.quorum} is more than the "
                             f"{len(self.regions.names)} regions of regions.names")
        robust = self.security.robust_aggregation
        if robust in ("trimmed-mean", "median") and (traits.mixes_models or self.sync.topology != "full"):
            raise ValueError(f"security.robust_aggregation: {robust} replaces the mix of full-topology diloco or "
                             f"allreduce, not {self.sync.algorithm} over {self.sync.topology} (use clip)")
        check_privacy_rules(self)
        if self.run.eval_at_steps and self.sync.pacing.mode == "time-budget":
            raise ValueError("run.eval_at_steps: time-budget rounds (sync.pacing.mode) run as many steps as fit a "
                             "budget, so no round ends at a given step count; use run.eval_every")
        if self.regions.workers > 1:
            _check_workers(self, traits)
        if self.regions.per_process > 1:
            _check_per_process(self)
        if self.sync.fragments > 1 and self.security.secure_aggregation:
            raise ValueError("sync.fragments: secure aggregation (security.secure_aggregation) masks whole-model "
                             "updates; it does not combine with fragments")
        if self.sync.fragments > 1 and self.privacy.dp.mode == "update":
            raise ValueError("sync.fragments: update-level DP (privacy.dp.mode: update) clips whole-model "
                             "pseudo-gradients; it does not combine with fragments (record-level DP does)")


def _check_workers(cfg: RunConfig, traits: AlgorithmTraits) -> None:
    """regions.workers > 1: what the region's workers do not carry yet (docs/regions-as-clusters.md).
    Worker 0 alone takes anything that changes the model outside an inner step, and the others
    follow its steps, so what steps on worker 0 alone (gradient tracking, a thread's gap filling,
    per-example DP) or outlives the run (a warm pool) would split the workers' models."""
    n = cfg.regions.workers
    if not traits.outer_step:
        raise ValueError(f"regions.workers: {n} workers a region need an outer-step algorithm (diloco), "
                         f"not sync.algorithm {cfg.sync.algorithm}")
    if cfg.privacy.dp.mode == "record":
        raise ValueError(f"regions.workers: {n} workers a region do not combine with record-level DP "
                         f"(privacy.dp.mode: record) yet")
    if cfg.sync.pacing.mode == "time-budget" and cfg.sync.pacing.fill_gaps:
        raise ValueError(f"regions.workers: {n} workers a region do not fill gaps between rounds yet; "
                         f"set sync.pacing.fill_gaps false")
    if cfg.ray.warm_pool_s > 0:
        raise ValueError(f"regions.workers: {n} workers a region are not pooled; set ray.warm_pool_s 0")
    if cfg.regions.shard_exchange:
        _check_shard_exchange(cfg)


def _check_shard_exchange(cfg: RunConfig) -> None:
    """regions.shard_exchange with regions.workers > 1 (regions/shards.py): what the sharded exchange
    does not carry. Each refused feature reads or changes the whole update in one place (a masked sum,
    clipping and noise of the whole pseudo-gradient, a score of the whole model), runs the exchange
    beside the next round's steps (overlap), or shapes one proxy link per pair of regions (a worker's
    shard would bypass it)."""
    why = None
    if cfg.sync.overlap:
        why = f"sync.overlap {cfg.sync.overlap!r} is not sharded yet; set sync.overlap false"
    elif cfg.sync.fragments > 1:
        why = "sync.fragments > 1 is not sharded (the shards are the fragments of one round); set sync.fragments 1"
    elif cfg.security.secure_aggregation:
        why = "secure aggregation masks whole-model updates; set security.secure_aggregation false"
    elif cfg.privacy.dp.mode == "update":
        why = "update-level DP clips whole-model pseudo-gradients; set privacy.dp.mode off"
    elif cfg.security.score_updates and cfg.security.robust_aggregation != "none":
        why = "security.score_updates scores whole-model updates; set it false"
    elif cfg.network.emulation.mode != "none":
        why = (f"network.emulation.mode {cfg.network.emulation.mode!r} shapes one link a pair of regions, which a "
               f"worker's shard would bypass; set it none (shape the nodes' own links instead)")
    if why is not None:
        raise ValueError(f"regions.shard_exchange: {why}")


def _check_per_process(cfg: RunConfig) -> None:
    """regions.per_process > 1: what a process of several regions (regions/host.py) does not carry.
    Its regions share the process's cores and torch's generator, so a thread filling gaps in one
    region would take another's turn; a pooled process would outlive its run with K regions."""
    k = cfg.regions.per_process
    if cfg.regions.workers > 1:
        raise ValueError(f"regions.per_process: {k} regions a process need regions.workers 1, "
                         f"got {cfg.regions.workers}")
    if cfg.ray.warm_pool_s > 0:
        raise ValueError(f"regions.per_process: {k} regions a process are not pooled; set ray.warm_pool_s 0")
    if cfg.sync.pacing.mode == "time-budget" and cfg.sync.pacing.fill_gaps:
        raise ValueError(f"regions.per_process: {k} regions a process do not fill gaps between rounds; "
                         f"set sync.pacing.fill_gaps false")


def _check_choco_compression(c: CompressionSection) -> None:
    """CHOCO sends Q(x - x_hat): what Q drops stays in the next difference, so error feedback
    would count it twice, and an unbiased rescaled codec makes the public copies drift."""
    if c.error_feedback:
        raise ValueError("compression.error_feedback: must be false with CHOCO gossip (sync.gossip.choco): "
                         "the difference to the public copy already carries what the codec dropped")
    for key, spec in [("codec", c.codec)] + [(f"ladder.{i}", s) for i, s in enumerate(c.ladder)]:
        if not spec.parameters().contractive:
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
    """Load and validate a run config; ConfigError names the file and the dotted key. Relative paths
    in the file name files beside it; in `overrides`, files from the working directory (paths.py)."""
    path = Path(path) if path is not None else default_config_path()
    source = str(path)
    return config_from_mapping(load_mapping(path, overrides), source=source)


def load_mapping(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The mapping load_config builds its RunConfig from: the file's YAML with its relative paths
    resolved against its folder, then the `--set` overrides applied (a kind switches its section,
    overrides.py), their paths resolved against the working directory. For a tool that writes a
    config derived from another (`geofed plan --write-config`) and must keep what it names."""
    path = Path(path)
    source = str(path)
    data = strict.parse_yaml_file(path, source=source)
    try:
        paths.resolve_file_paths(data, RunConfig, path.parent)
        _apply_overrides(data, overrides)
    except ConfigError as exc:
        raise exc.with_source(source) from None
    return data


def config_from_mapping(data: dict, overrides=(), *, source: str = "<config>") -> RunConfig:
    """Apply `--set` overrides to a parsed YAML mapping (in place) and build the RunConfig strictly;
    a plug-in task's factory is looked up (imported, not called). ConfigError names `source` and the key.
    The mapping's relative paths stay as they are (from the working directory): load_config
    resolves a file's against its folder.
    """
    try:
        _apply_overrides(data, overrides)
        cfg = strict.build(RunConfig, data)
        _check_plugin_task(cfg.task)
        _check_plugin_outer(cfg.sync.outer)
        return cfg
    except ConfigError as exc:
        raise exc.with_source(source) from None


def _apply_overrides(data: dict, overrides) -> None:
    set_keys = apply_overrides(data, overrides, RunConfig)
    paths.resolve_set_paths(data, RunConfig, set_keys)


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


def _check_plugin_outer(outer: Any) -> None:
    """The same for a plug-in outer optimizer (sync.outer.kind: python:module:Name): its module is
    imported, with torch, only when a config names one (regions/sync/outer.py)."""
    if outer.kind in OUTER_KINDS:
        return
    from geofed.regions.sync.outer import load_outer_factory

    try:
        load_outer_factory(outer.kind, outer.path)
    except ValueError as exc:
        key, _, rest = str(exc).partition(": ")
        raise ConfigError(key, rest) from None


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
