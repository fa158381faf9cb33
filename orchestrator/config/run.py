"""``run`` and ``run.target``: length, seed, output folder, checkpoints, evaluation, target."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .common import NAME_RE as _NAME_RE, _doc


@dataclass(frozen=True, kw_only=True)
class TargetSection:
    """``run.target``: the evaluated metric value at which the run stops early."""

    metric: str = field(metadata=_doc(
        "the task's evaluation metric, as its evaluation names it: accuracy (mlp-digits, gcn-planetoid), loss (char-lm)"))
    value: float = field(metadata=_doc(
        "the run ends at the first evaluation that reaches this: at or above it when the metric is higher-is-better, "
        "at or below otherwise"))

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.metric):
            raise ValueError(f"metric: a metric name (letters, digits, _.-), got {self.metric!r}")


@dataclass(frozen=True, kw_only=True)
class RunSection:
    """``run``: length (rounds, step budget), seed, output folder, checkpoints, evaluation, target,
    and what a region failure does to the run.
    """

    name: str = field(default="geofed", metadata=_doc("run name; the run directory is runs/<name>-<UTC timestamp>"))
    rounds: int = field(default=30, metadata=_doc("number of sync rounds"))
    max_steps: int = field(default=0, metadata=_doc(
        "stop once every region has run this many inner steps, the last round's H cut to fit (0: no step limit; "
        "run.rounds still bounds the run): equal compute for runs whose H differs"))
    seed: int = field(default=0, metadata=_doc("seed for models, data shards and sampling"))
    out_dir: str = field(default="runs", metadata=_doc(
        "parent folder of run directories, relative to the working directory even in a config file (Paths, above): "
        "no '..', not absolute; to write elsewhere pass --out on the command line"))
    checkpoint_every: int = field(default=1, metadata=_doc("checkpoint every N rounds (0: only at the end)"))
    keep_checkpoints: int = field(default=3, metadata=_doc(
        "how many checkpoints to keep per region and for the driver (>= 2: a crash between the regions' and the "
        "driver's checkpoint must leave a round both have)"))
    eval_every: int = field(default=0, metadata=_doc(
        "evaluate every N rounds (0: only at the end, or every round when run.target is set). An evaluation reads the "
        "synchronised model where it already is (DiLoCo: one region's global model): nothing crosses the wire, the "
        "overlapped exchange is not waited for, and the trained model is the same with or without it; gossip's "
        "average needs every region's model, a fetch counted as eval_fetch_bytes"))
    eval_at_steps: tuple[int, ...] = field(default=(), metadata=_doc(
        "also evaluate the synchronised model when every region has run exactly these many inner steps, e.g. [800] "
        "(a round that would pass one is cut to end there, as run.max_steps cuts the last): held-out quality at equal "
        "examples for runs whose H differs (geofed bench wan); not with sync.pacing time-budget, whose rounds have no "
        "fixed step count"))
    target: TargetSection | None = field(default=None, metadata=_doc(
        "stop when the evaluated model reaches a metric value, e.g. {metric: accuracy, value: 0.95}; summary.json then "
        "has time_to_target_s, steps_to_target and bytes_to_target (null: run all rounds)"))
    on_region_failure: Literal["elastic", "fail-fast"] = field(
        default="elastic", metadata=_doc(
            "elastic: carry on without a crashed region while Ray restarts it (regions.max_restarts), which then "
            "rejoins from a peer's state; fail-fast: stop, naming the region (resume from the last checkpoint). Either "
            "way the failure is named with its cause (OOM or not) and the rounds it missed: summary.json "
            "faults.by_region, the end-of-run table, report.html, and the run's last line when it ends with fewer "
            "regions than it started with (docs/reliability.md, \"Failures that say so\")"))
    orphan_timeout_s: float = field(default=300.0, metadata=_doc(
        "seconds a run's region actors outlive a driver that died (SIGKILL, a lost machine) before they end "
        "themselves; meanwhile `geofed run --resume RUN_DIR` re-attaches to them and keeps their in-memory state (no "
        "set-up, no checkpoint restore, docs/reliability.md). Only when the driver joined a Ray cluster that outlives "
        "it (ray.address) and ray.warm_pool_s is 0; 0: the regions die with their driver"))
    report: bool = field(default=True, metadata=_doc("write report.html at the end"))
    trackers: tuple[Literal["tensorboard", "mlflow"], ...] = field(default=(), metadata=_doc(
        "experiment trackers that get every round's loss, eval, H, bytes, utilisation and per-link bandwidth and RTT, "
        "and the config as params, in local stores inside the run directory (no server): tensorboard "
        "(RUN_DIR/tensorboard/, pip install 'geofed[tensorboard]'), mlflow (RUN_DIR/mlflow.db, pip install "
        "'geofed[mlflow]'); docs/trackers.md"))

    def __post_init__(self):
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"name: must match {_NAME_RE.pattern}, got {self.name!r}")
        if not 1 <= self.rounds <= 10_000_000:
            raise ValueError(f"rounds: must be in [1, 10000000], got {self.rounds}")
        if not 0 <= self.seed < 2**32:  # torch seeds are 64-bit; regions derive seed * 1000 + index
            raise ValueError(f"seed: must be in [0, 2**32), got {self.seed}")
        if not 0 <= self.max_steps <= 10**12:
            raise ValueError(f"max_steps: must be in [0, 1e12], got {self.max_steps}")
        for key in ("checkpoint_every", "eval_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}: must be >= 0, got {getattr(self, key)}")
        if any(not 1 <= s <= 10**12 for s in self.eval_at_steps):
            raise ValueError(f"eval_at_steps: every step count must be in [1, 1e12], got {list(self.eval_at_steps)}")
        if list(self.eval_at_steps) != sorted(set(self.eval_at_steps)):
            raise ValueError(f"eval_at_steps: must be increasing, without repeats, got {list(self.eval_at_steps)}")
        if not 0 <= self.orphan_timeout_s <= 7 * 86400:
            raise ValueError(f"orphan_timeout_s: must be in [0, 604800] seconds, got {self.orphan_timeout_s}")
        if not 2 <= self.keep_checkpoints <= 1000:
            raise ValueError(f"keep_checkpoints: must be in [2, 1000], got {self.keep_checkpoints}")
        _check_out_dir(self.out_dir)


def _check_out_dir(out_dir: str) -> None:
    """A config may be someone else's file: it must not make geofed write outside the working
    directory. The operator's own --out is the way to put a run anywhere else."""
    path = Path(out_dir)
    if not out_dir.strip() or "\0" in out_dir:
        raise ValueError("out_dir: must be a non-empty relative path")
    bad = next((c for c in out_dir if unicodedata.category(c) == "Cc"), None)
    if bad is not None:  # a newline or an escape in a folder name corrupts logs and terminals
        raise ValueError(f"out_dir: {out_dir!r} holds the control character U+{ord(bad):04X}; names must be printable")
    if path.is_absolute() or out_dir.startswith("~"):
        raise ValueError(f"out_dir: {out_dir!r} is outside the working directory (absolute); "
                         "a config may only name a folder inside it; use --out DIR to write elsewhere")
    if ".." in path.parts:
        raise ValueError(f"out_dir: {out_dir!r} climbs out of the working directory ('..'); "
                         "use --out DIR to write elsewhere")
