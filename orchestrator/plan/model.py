"""The planner's predictions: per candidate (H, codec), round time, utilisation, bytes and dollars.

Pure arithmetic over plain values (no torch, no sockets): the sync time of a link and the round
time come from the policies' cost model (policies/cost.py), the traffic from the topology's
out-neighbours, the dollars from the links' $/GB. docs/plan.md states the assumptions.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from geofed.p2p.wan.prices import GB

from ..policies import cost
from ..policies.types import LinkEstimate

T = TypeVar("T")

# Control-plane CPU seconds per round with a core to itself: what neither compute nor the exchange
# explains (Ray dispatch and collect, mixing, the outer step, gRPC handling), scaled by the
# contention. Calibrated once: the median over the 16 runs of a `geofed bench plan` (2026-12-02,
# docs/plan.md; 4.4-11 ms each) of (measured round - the model's round without it) / the run's
# contention (2.7-4.9 there); before, an unscaled 0.025 s, the median residual at a contention of ~3.
ROUND_OVERHEAD_ALONE_S = 0.006


@dataclass(frozen=True, kw_only=True)
class Link:
    """One directed link as the planner sees it: its estimate and its price (None: unpriced)."""

    estimate: LinkEstimate
    usd_per_gb: float | None = None


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A stretch of the run with one link matrix: from round `start` on (a schedule changes it later)."""

    start: int
    links: Mapping[str, Link]
    stall_s: float = 0.0   # outage seconds that begin in this segment (a stalled link holds its round up)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What every candidate shares: the task's step time and size, the run's shape, the link matrix."""

    step_s: float
    rounds: int
    max_steps: int                   # 0: rounds x H steps
    overlap: bool
    out_links: Sequence[str]         # directed links that carry an update every round (the topology's)
    segments: Sequence[Segment]      # at least one, the first from round 0
    rtt_factor: float = 1.0
    overhead_s: float = ROUND_OVERHEAD_ALONE_S  # control-plane CPU seconds per round on an uncontended core
    # Regions' step time over the step time alone on the same machine (>= 1): the share of a core each
    # region gets. The codec and the control plane (Ray dispatch and collect, mixing, the outer step,
    # gRPC handling) are CPU work in the same processes, so they stretch by it as the steps do.
    contention: float = 1.0
    # Each round's compute as a multiple of H*step_s, equally likely: on a shared or loaded machine
    # rounds vary (a run's per-round compute over its median). A round lasts cost.round_time of its
    # own compute, so the mean round is the mean over these, not the round of the mean: with overlap
    # max(compute, sync) gains from every round whose compute outlasts the sync (E max >= max E).
    compute_spread: tuple[float, ...] = (1.0,)

    def __post_init__(self):
        if not (self.step_s > 0 and math.isfinite(self.step_s)):
            raise ValueError(f"step_s: must be a positive number of seconds, got {self.step_s}")
        if not (self.contention >= 1.0 and math.isfinite(self.contention)):
            raise ValueError(f"contention: must be a number >= 1 (step time shared / alone), got {self.contention}")
        if not self.compute_spread or not all(f > 0 and math.isfinite(f) for f in self.compute_spread):
            raise ValueError(f"compute_spread: must be positive multiples of H*step_s, got {self.compute_spread}")
        assert self.segments and self.segments[0].start == 0, self.segments


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration to predict: H, a codec key, and its wire bytes per link per round."""

    H: int
    codec: str
    wire_bytes: int                  # one encoded update on one link, with the transport's framing
    codec_s: float = 0.0             # encode once + decode every in-neighbour's update, per round


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the planner predicts for one candidate (JSON keys of `geofed plan --json`)."""

    H: int
    codec: str
    round_s: float
    utilization: float
    bytes_per_round: int
    rounds: int
    steps: int
    bytes_to_end: int
    run_s: float
    egress_usd_per_hour: float | None
    egress_usd_per_run: float | None
    bottleneck: str | None
    sync_s: float
    unpriced_links: tuple[str, ...] = ()

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["unpriced_links"] = list(self.unpriced_links)
        return d


def link_sync_s(link: Link, nbytes: float, rtt_factor: float) -> float:
    """cost.sync_time of one link (k*RTT + bytes/bandwidth)."""
    return cost.sync_time(link.estimate, nbytes, rtt_factor)


def _round_of(setup: Setup, seg: Segment, c: Candidate) -> tuple[float, float, str | None, float | None, list[str]]:
    """(round_s, sync_s, bottleneck, usd per round, unpriced) of candidate `c` on one segment."""
    sync, bottleneck, usd, unpriced = 0.0, None, 0.0, []
    for name in setup.out_links:
        link = seg.links[name]
        d = link_sync_s(link, c.wire_bytes, setup.rtt_factor)
        if bottleneck is None or d > sync:
            sync, bottleneck = d, name
        if link.usd_per_gb is None:
            unpriced.append(name)
        else:
            usd += c.wire_bytes / GB * link.usd_per_gb
    r = statistics.fmean(cost.round_time(c.H * setup.step_s * f, sync, overlap=setup.overlap,
                                         codec_s=c.codec_s * setup.contention,
                                         overhead_s=setup.overhead_s * setup.contention) for f in setup.compute_spread)
    return r, sync, bottleneck, (None if unpriced else usd), unpriced


def mean_spread(setup: Setup) -> float:
    """The mean round's compute over H*step_s (1 without a spread)."""
    return statistics.fmean(setup.compute_spread)


def rounds_of(setup: Setup, H: int) -> tuple[int, int]:
    """(rounds, steps) a run of this H makes: run.rounds, cut by run.max_steps when it is set."""
    if setup.max_steps > 0:
        n = min(setup.rounds, -(-setup.max_steps // H))
        return n, min(setup.max_steps, n * H)
    return setup.rounds, setup.rounds * H


def predict(setup: Setup, c: Candidate) -> Prediction:
    """Round time, utilisation, bytes and dollars of candidate `c` over the whole run.

    The run is cut into segments where the link matrix changes; a segment's rounds all take its
    round time, an outage adds its stall once, and with overlap the last round drains its exchange. Round time, utilisation and the bottleneck are the
    run's averages (the bottleneck: the one of the segment that costs the most time).
    """
    n_rounds, steps = rounds_of(setup, c.H)
    bounds = [s.start for s in setup.segments[1:]] + [n_rounds]
    total_s, usd, worst, unpriced = 0.0, 0.0, (-1.0, None, 0.0), set()
    for seg, end in zip(setup.segments, bounds):
        k = max(0, min(end, n_rounds) - seg.start)
        if k == 0:
            continue
        r, sync, bottleneck, seg_usd, missing = _round_of(setup, seg, c)
        total_s += k * r + seg.stall_s
        unpriced.update(missing)
        usd = None if usd is None or seg_usd is None else usd + k * seg_usd
        if k * r > worst[0]:
            worst = (k * r, bottleneck, sync)
    total_s += drain_s(setup, c)
    round_s = total_s / n_rounds
    per_round = c.wire_bytes * len(setup.out_links)
    return Prediction(
        H=c.H, codec=c.codec, round_s=round_s, utilization=min(1.0, c.H * setup.step_s * mean_spread(setup) / round_s),
        bytes_per_round=per_round, rounds=n_rounds, steps=steps, bytes_to_end=per_round * n_rounds, run_s=total_s,
        egress_usd_per_hour=None if usd is None else usd / total_s * 3600, egress_usd_per_run=usd,
        bottleneck=worst[1], sync_s=worst[2], unpriced_links=tuple(sorted(unpriced)))


def round_times(setup: Setup, c: Candidate) -> list[float]:
    """Predicted seconds of every round of the run, in order (a segment's outage in its first round)."""
    n_rounds, _ = rounds_of(setup, c.H)
    bounds = [s.start for s in setup.segments[1:]] + [n_rounds]
    out: list[float] = []
    for seg, end in zip(setup.segments, bounds):
        k = max(0, min(end, n_rounds) - seg.start)
        r = _round_of(setup, seg, c)[0]
        out += [r + (seg.stall_s if i == 0 else 0.0) for i in range(k)]
    if setup.overlap and out:
        out[-1] += drain_s(setup, c)
    return out


def drain_s(setup: Setup, c: Candidate) -> float:
    """With overlap the last round also waits for its own exchange (nothing left to hide it behind)."""
    if not setup.overlap:
        return 0.0
    n_rounds, _ = rounds_of(setup, c.H)
    last = [s for s in setup.segments if s.start < n_rounds][-1]
    _, sync, _, _, _ = _round_of(setup, last, c)
    return c.codec_s * setup.contention + sync


def choose(items: Sequence[T], *, floor: float, utilization: Callable[[T], float],
           s_per_step: Callable[[T], float], usd_per_step: Callable[[T], float]) -> tuple[T | None, bool]:
    """The recommendation rule, shared by `geofed plan` and `geofed bench plan`: (pick, met_floor).

    * Some item's utilisation meets the floor: the cheapest of those in egress $ per training step,
      ties to the faster (seconds per step), then to the higher utilisation.
    * None does: the fastest per step of all, ties to the cheaper. For one task the step time is
      the same for every candidate and s/step = step / utilisation, so this is also the one that
      comes closest to the floor; a cheaper one would only lose more of the compute.

    An unpriced item costs +inf (never the cheapest while a priced one qualifies).
    """
    if not items:
        return None, False
    meeting = [x for x in items if utilization(x) >= floor - 1e-12]
    if meeting:
        return min(meeting, key=lambda x: (usd_per_step(x), s_per_step(x), -utilization(x))), True
    return min(items, key=lambda x: (s_per_step(x), usd_per_step(x))), False


def pred_usd_per_step(p: Prediction) -> float:
    """Egress dollars per training step (+inf when a link is unpriced)."""
    return math.inf if p.egress_usd_per_run is None else p.egress_usd_per_run / p.steps


def pred_s_per_step(p: Prediction) -> float:
    """Wall seconds per training step."""
    return p.round_s / p.H


def recommend(preds: Sequence[Prediction], *, utilization_floor: float,
              budget_usd_per_hour: float | None = None) -> dict[str, Any]:
    """`choose`'s pick (`recommended`; `met_floor` says which branch of the rule chose it), the
    cheapest meeting the floor (None when none does), and the fastest (seconds per step) whose
    dollars per hour are within the budget (None when none is).

    Per step, not per run or per hour: a larger H runs the same steps in fewer rounds, so dollars
    per step is what one pays for the same training.
    """
    pick, met = choose(preds, floor=utilization_floor, utilization=lambda p: p.utilization,
                       s_per_step=pred_s_per_step, usd_per_step=pred_usd_per_step)
    within = [p for p in preds if budget_usd_per_hour is None
              or (p.egress_usd_per_hour is not None and p.egress_usd_per_hour <= budget_usd_per_hour)]
    fastest = min(within, key=lambda p: (pred_s_per_step(p), pred_usd_per_step(p)), default=None)
    return {"recommended": pick, "met_floor": met, "cheapest_meeting_floor": pick if met else None,
            "fastest_under_budget": fastest}
