"""What the driver and a region say to each other across the Ray boundary: `RoundPlan`, what one
round asks of a region, and `RoundReport`, what the region reports of it (the region itself is
regions/region.py; its actor regions/actor.py).

`rss_mb` is here too: both sides put their own process's memory in their records with it
(metrics.jsonl's `rss_mb`, rounds.jsonl's `driver_rss_mb`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from geofed.compression import CodecSpec


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """What the coordinator asks of a region for one round: H local steps, the codec of each
    out-link, the lr scale, evaluation and sketch flags, whether it is the last round, and which
    regions it believes are up.
    """

    round: int
    H: int
    codecs: dict[str, CodecSpec] = field(default_factory=dict)  # peer -> codec of my link to it
    lr_scale: float = 1.0
    evaluate: bool = False
    alive: tuple[str, ...] | None = None  # regions the coordinator believes are up (None: all)
    final: bool = False  # the run's last round: apply an exchange still in flight (overlap) before returning
    sketch: bool = False  # report a count sketch of the synchronised model (the driver's consensus distance)
    # sync.pacing (regions/pacing.py): time-budget rounds step until budget_s (at most max_steps) and
    # scale their pseudo-gradient by norm_steps / steps; quorum rounds close a receive at `quorum`.
    budget_s: float | None = None
    budget_until: float | None = None  # time.time() when the budget ends, whenever the round starts
    max_steps: int | None = None
    norm_steps: float | None = None
    quorum: int | None = None
    grace_s: float = 0.0
    # privacy.dp (regions/privacy/dp.py): the mechanism, its clip and the noise multiplier the driver's
    # PrivacyBudget chose; record: DP-SGD inner steps, update: DiLoCo's sent pseudo-gradient noised.
    dp_mode: str = "off"
    dp_clip: float = 1.0
    dp_noise: float | None = None
    # sync.pacing.fill_gaps (regions/gapfill.py): after returning, step until the next call arrives.
    fill: bool = False
    # In-neighbours on probation (a member muted for withholding, tried again: recovery.WithholdWatch):
    # their update is taken if it comes with the others, and nobody waits for it (p2p/mailbox.py).
    optional: tuple[str, ...] = ()
    # The run's regions in topology order once a region joined under a new name (regions.names, then
    # the joiners: orchestrator/driver/membership.py); None while they are regions.names.
    members: tuple[str, ...] | None = None


# -- what comes back: RoundReport ------------------------------------------------------------------
# Each part's fields are metrics.jsonl keys of the same name (docs/RUNDIR.md). A field without a
# default is in every record; one defaulting to None is in the record only when the round has it,
# so that to_record() gives back exactly the record a region always wrote.


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """The round's inner steps: mean loss, how many, and their time (compute only, no network)."""

    train_loss: float | None
    steps: int
    compute_s: float
    step_time_s: float
    step_time_steady_s: float | None = None  # the mean step without the round's first (time-budget sizing)
    lr: float | None = None
    fednova_scale: float | None = None  # time-budget rounds with FedNova scaling
    budget_late_s: float | None = None  # the budget a region lost by starting late


@dataclass(frozen=True, kw_only=True)
class ExchangeStats:
    """The round's exchange as the transport counted it (headers included) and whom it missed."""

    bytes_sent: int
    bytes_received: int
    transfers: list[dict[str, Any]]
    peers_missing: list[str]
    send_failures: dict[str, Any]
    wait_s: float
    # Everything between the end of the round's compute and its end; a round rolled back in its inner
    # steps (regions/rollback.py) never got there and has none.
    sync_s: float | None = None
    late_dropped: int | None = None
    overlap_wait_s: float | None = None
    # Overlap: the round whose exchange completed in this one (None in the first round: none did).
    exchange_round: int | None = None
    # Whose pushes this region finished in which round ({"round", "peers"}): the driver tells their
    # receivers to stop waiting for it (issue 36, N2). Not in a round without pushes.
    pushes_done: dict[str, Any] | None = None

    @classmethod
    def of(cls, metrics: Mapping[str, Any]) -> ExchangeStats:
        """The stats of an exchange outside a round's report (a flushed one, Region.flush_exchange:
        regions/sync/common.exchange_metrics' keys)."""
        return _take(cls, dict(metrics))


@dataclass(frozen=True, kw_only=True)
class EvalStats:
    """The synchronised model's evaluation, in the region that evaluated and rounds where it ran."""

    eval: dict[str, Any] | None = None
    eval_s: float | None = None
    eval_age_s: float | None = None  # overlap: evaluated when the exchange completed, this long before the report
    evals_earlier: list[dict[str, Any]] | None = None


@dataclass(frozen=True, kw_only=True)
class SecurityStats:
    """What the receive side refused or changed this round (docs/reliability.md): refusals by
    reason, and by sender the updates clipped, scored harmful or quarantined."""

    refused: int
    refusals: dict[str, int]
    harmful: dict[str, int]
    quarantined: dict[str, int]
    clipped: dict[str, int]
    rolled_back: dict[str, Any] | None = None  # a non-finite round undone (regions/rollback.py)


_Part = TypeVar("_Part", StepStats, ExchangeStats, EvalStats, SecurityStats)


@dataclass(frozen=True, kw_only=True)
class RoundReport:
    """What a region reports of one round (Region.run_round), in typed parts. `extra` holds the
    keys only one algorithm or hook writes (fragments, gossip's resyncs, secure aggregation's
    phases, ...), as they wrote them. `to_record()` is the round's metrics.jsonl record."""

    round: int
    region: str
    H: int
    codecs: dict[str, str]  # peer -> the key of the codec of my link to it
    wall_s: float
    utilization: float
    rss_mb: float
    steps: StepStats
    exchange: ExchangeStats
    links: dict[str, dict[str, Any]]  # "me->peer" -> this region's estimate of the out-link
    evaluation: EvalStats
    security: SecurityStats
    sketch: Any = None  # a count sketch of the synchronised model (plan.sketch); never in the record
    # The driver's clock (seconds since the run started) when the round began and was reported:
    # the driver adds them before it logs the record (absent from a region's own report).
    t_start: float | None = None
    t_end: float | None = None
    late: bool | None = None  # the driver's: reported after its quorum round closed (None: in time)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> RoundReport:
        """The report of a round's metrics dict (the algorithm's, the hooks' and the region's keys)."""
        rest = dict(metrics)
        parts = {name: _take(part, rest) for name, part in _PARTS.items()}
        top = {f.name: rest.pop(f.name) for f in dataclasses.fields(cls)
               if f.name in rest and f.name not in _PARTS and f.name != "extra"
               and not (f.name in _DRIVER_KEYS and rest[f.name] is None)}
        return cls(**top, **parts, extra=rest)

    def to_record(self) -> dict[str, Any]:
        """The metrics.jsonl record: the same keys and values the metrics dict had, less the sketch."""
        record: dict[str, Any] = {"round": self.round, "region": self.region, "H": self.H, "codecs": self.codecs,
                                  "wall_s": self.wall_s, "utilization": self.utilization, "rss_mb": self.rss_mb,
                                  "links": self.links}
        for name in _PARTS:
            record.update(_present(getattr(self, name)))
        record.update({k: getattr(self, k) for k in _DRIVER_KEYS if getattr(self, k) is not None})
        record.update(self.extra)
        return record


_DRIVER_KEYS = ("t_start", "t_end", "late")  # set by the driver, in the record only once set
_PARTS: dict[str, Any] = {"steps": StepStats, "exchange": ExchangeStats, "evaluation": EvalStats,
                          "security": SecurityStats}


def _take(part: type[_Part], rest: dict[str, Any]) -> _Part:
    """`part` built from its keys in `rest`, which loses them. An optional key present with the
    value None stays in `rest` (the record keeps it; the field's None means absent)."""
    values = {}
    for f in dataclasses.fields(part):
        optional = f.default is None
        if f.name in rest and not (optional and rest[f.name] is None):
            values[f.name] = rest.pop(f.name)
    return part(**values)


def _present(part: Any) -> dict[str, Any]:
    return {f.name: getattr(part, f.name) for f in dataclasses.fields(part)
            if f.default is not None or getattr(part, f.name) is not None}


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux /proc; 0.0 where it is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        return 0.0


__all__ = ["EvalStats", "ExchangeStats", "RoundPlan", "RoundReport", "SecurityStats", "StepStats", "rss_mb"]

