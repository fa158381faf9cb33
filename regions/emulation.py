"""Compute emulation (``regions.emulation``), next to the WAN emulation of the links: regions of
unequal speed and regions that come and go, on one machine (docs/heterogeneity.md).

* ``slowdown``: a region's inner steps take ``factor`` times as long. After each real step the
  worker sleeps (factor - 1) x that step's measured duration, which models a slower device (or a
  region with fewer nodes) and not a noisy neighbour: the extra time scales with the work.
* ``availability``: windows of rounds in which a region is absent, and a per-round absence
  probability drawn from a seed. An absent region neither trains nor answers for that round; it is
  not a crash (no restart, no fault counted). The coordinator learns of the absence at the round's
  start, as a spot-interruption notice or a node leaving the Ray cluster would tell it; a region
  that vanishes unannounced is a fault (docs/reliability.md).

Both are pure: whether a region is absent in a round is a function of (seed, round, region), so a
resumed run replays the same schedule and every arm of a bench sees the same absences.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field


def _doc(text: str) -> dict:
    return {"doc": text}


@dataclass(frozen=True, kw_only=True)
class AbsenceWindow:
    """``regions.emulation.availability.schedule[i]``: `region` is absent in rounds from_round..to_round."""

    region: str = field(metadata=_doc("the absent region"))
    from_round: int = field(metadata=_doc("first round it is absent"))
    to_round: int = field(metadata=_doc("last round it is absent (inclusive)"))

    def __post_init__(self) -> None:
        if self.from_round < 0 or self.to_round < self.from_round:
            raise ValueError(f"to_round: need 0 <= from_round <= to_round, got {self.from_round}..{self.to_round}")


@dataclass(frozen=True, kw_only=True)
class AvailabilityConfig:
    """``regions.emulation.availability``: when regions are absent (windows and/or a probability)."""

    schedule: tuple[AbsenceWindow, ...] = field(default=(), metadata=_doc(
        "absence windows: [{region, from_round, to_round}]"))
    absent_p: float = field(default=0.0, metadata=_doc(
        "probability that a region is absent in a round, drawn independently per (round, region) from `seed`"))
    seed: int = field(default=0, metadata=_doc("seed of the absence draws (the same seed gives the same absences)"))
    keep_one: bool = field(default=True, metadata=_doc(
        "never make every region absent in one round: the region first in regions.names stays"))
    mid_round: bool = field(default=False, metadata=_doc(
        "absent regions leave mid-round instead of sitting the round out: they train and deal the round's "
        "secure-aggregation keys, then send nothing more (needs security.secure_aggregation; docs/privacy.md)"))

    def __post_init__(self) -> None:
        if not 0.0 <= self.absent_p < 1.0:
            raise ValueError(f"absent_p: must be in [0, 1), got {self.absent_p}")


@dataclass(frozen=True, kw_only=True)
class ComputeEmulation:
    """``regions.emulation``: slower regions and absent regions, emulated (docs/heterogeneity.md)."""

    slowdown: dict[str, float] = field(default_factory=dict, metadata=_doc(
        "region -> factor (>= 1): its inner steps take that many times longer (it sleeps (factor-1) x each "
        "step's measured duration after the step: a slower device)"))
    availability: AvailabilityConfig = field(default_factory=AvailabilityConfig, metadata=_doc(
        "regions absent for some rounds (they neither train nor answer; not a crash)"))

    def __post_init__(self) -> None:
        for region, factor in self.slowdown.items():
            if not 1.0 <= float(factor) <= 1000.0:
                raise ValueError(f"slowdown.{region}: a factor in [1, 1000], got {factor}")

    @property
    def active(self) -> bool:
        """Whether any emulation is configured (a run without it pays nothing)."""
        a = self.availability
        return bool(self.slowdown) or bool(a.schedule) or a.absent_p > 0

    def check_regions(self, names: Iterable[str]) -> None:
        """Every region this section names is a configured one (ValueError names the key)."""
        known = set(names)
        for region in self.slowdown:
            if region not in known:
                raise ValueError(f"slowdown.{region}: not a region of regions.names")
        for i, w in enumerate(self.availability.schedule):
            if w.region not in known:
                raise ValueError(f"availability.schedule.{i}.region: {w.region!r} is not a region of regions.names")


def _draw(seed: int, round_: int, region: str) -> float:
    """A uniform [0, 1) number fixed by (seed, round, region): no generator state to checkpoint."""
    digest = hashlib.blake2b(f"{seed}:{round_}:{region}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def absent_regions(emulation: ComputeEmulation, round_: int, regions: list[str]) -> set[str]:
    """The regions absent in `round_` (windows, then the probability draw). With keep_one, the first
    region of `regions` is never absent when every region would be."""
    a = emulation.availability
    out = {w.region for w in a.schedule if w.from_round <= round_ <= w.to_round}
    if a.absent_p > 0:
        out |= {r for r in regions if _draw(a.seed, round_, r) < a.absent_p}
    out &= set(regions)
    if a.keep_one and regions and out >= set(regions):
        out.discard(regions[0])
    return out


class Slowdown:
    """Stretches a region's steps by its factor: call `after_step(seconds_the_step_took)`."""

    def __init__(self, factor: float = 1.0):
        self.factor = float(factor)
        self.slept_s = 0.0

    def after_step(self, step_s: float) -> None:
        if self.factor > 1.0 and step_s > 0:
            extra = (self.factor - 1.0) * step_s
            time.sleep(extra)
            self.slept_s += extra


__all__ = ["AbsenceWindow", "AvailabilityConfig", "ComputeEmulation", "Slowdown", "absent_regions"]
