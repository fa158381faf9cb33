"""The sync cost model the adaptive policies share.

One sync over a directed link costs ``D = k * RTT + bytes(codec) / bandwidth`` (DeCo-SGD,
arXiv 2507.17346; a warm gRPC client stream measured 1.03-1.09x of ``bytes*8/rate + RTT``,
FIELD-NOTES). Links of a round transfer in parallel, so the round's sync time is the largest
``D`` (the bottleneck link). Two ways to pay for it:

* serial (no overlap): a round lasts ``H*step + D``; keeping communication at most a fraction
  ``f`` of it needs ``H*step >= D*(1-f)/f``;
* overlap: round r's exchange runs during round r+1's ``H`` steps; it is hidden when
  ``H*step >= margin*D`` (DeCo-SGD's ``tau*step_time >= RTT + bytes/bandwidth``).

The inverse of both gives a link's time budget for a given H, which is what the per-link
codec choice compares against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from geofed.compression import CodecSpec

from .types import LinkEstimate

FP32_BYTES = 4
_EPS = 1e-9  # so that an H computed as 117.0000000001 is 117, not 118

RatioFn = Callable[[CodecSpec, int], float]


def compression_ratio(spec: CodecSpec, numel: int) -> float:
    """fp32 bytes / wire bytes of ``spec`` for an update of ``numel`` floats (compression library)."""
    from geofed.compression import make_codec  # torch: only when a ratio is estimated

    return float(make_codec(spec).estimate_ratio(numel))


@dataclass(frozen=True)
class Rung:
    """One codec of a ladder with its estimated compression ratio for the model's size."""

    spec: CodecSpec
    ratio: float


class Ladder:
    """Codecs a policy may choose, ordered from least to most compression.

    Ordered by their estimated ratio (stable), so a ladder written in another order still
    means "prefer the least compression". Ratios are cached per model size.
    """

    def __init__(self, specs: Sequence[CodecSpec], ratio: RatioFn = compression_ratio):
        if not specs:
            raise ValueError("ladder: needs at least one codec")
        self._specs = list(specs)
        assert all(isinstance(s, CodecSpec) for s in self._specs), self._specs
        self._ratio = ratio
        self._cache: dict[int, list[Rung]] = {}

    def rungs(self, numel: int) -> list[Rung]:
        """The codecs with their ratios for an update of `numel` floats, least compression first."""
        if numel not in self._cache:
            rungs = []
            for spec in self._specs:
                r = float(self._ratio(spec, numel))
                if not (r > 0 and math.isfinite(r)):
                    raise ValueError(f"codec {spec.key}: estimate_ratio gave {r}, need a positive number")
                rungs.append(Rung(spec, r))
            self._cache[numel] = sorted(rungs, key=lambda g: g.ratio)
        return self._cache[numel]

    def index_of(self, spec: CodecSpec, numel: int) -> int | None:
        """Position of `spec` among rungs(numel), or None when it is not in the ladder."""
        for i, g in enumerate(self.rungs(numel)):
            if g.spec == spec:
                return i
        return None

    @property
    def specs(self) -> list[CodecSpec]:
        """The codecs in the order they were given (not sorted by ratio)."""
        return list(self._specs)


def payload_bytes(numel: int, ratio: float) -> float:
    """Wire bytes of an update of `numel` fp32 values at compression `ratio`."""
    return FP32_BYTES * numel / ratio


def sync_time(link: LinkEstimate, nbytes: float, rtt_factor: float) -> float:
    """``k*RTT + bytes/bandwidth`` in seconds; an unknown RTT counts as 0.

    Without a bandwidth estimate only ``k*RTT`` is counted: p2p's estimator measures bandwidth
    only from transfers of at least ``min_bytes`` (smaller ones measure latency, FIELD-NOTES),
    so a link that has carried only small updates is taken as latency-bound.
    """
    serial = 0.0 if link.bandwidth_bps is None else nbytes * 8.0 / link.bandwidth_bps
    return rtt_factor * (link.rtt_s or 0.0) + serial


def H_for_sync(D: float, step_s: float, *, overlap: bool, comm_fraction: float, margin: float,
               overhead: float = 0.0) -> float:
    """The real-valued H that pays for a sync of D seconds (before rounding and bounds).

    ``overhead`` is the per-round control-plane time that overlap cannot hide: serial rounds
    pay it with the sync (``D + overhead`` is at most the fraction ``f``); with overlap it alone
    must stay under ``f`` (``H*step >= overhead*(1-f)/f``) besides hiding D.
    """
    assert step_s > 0 and 0 < comm_fraction < 1
    if overlap:
        return max(margin * D, compute_for_overhead(overhead, comm_fraction)) / step_s
    return (D + overhead) * (1.0 - comm_fraction) / (comm_fraction * step_s)


def compute_for_overhead(overhead: float, comm_fraction: float) -> float:
    """Compute seconds per round that keep a fixed per-round overhead under ``comm_fraction``."""
    return overhead * (1.0 - comm_fraction) / comm_fraction


def budget_for_H(H: float, step_s: float, *, overlap: bool, comm_fraction: float, margin: float,
                 overhead: float = 0.0) -> float:
    """Seconds a link may spend on one sync when a round has H steps (inverse of H_for_sync)."""
    if overlap:
        return H * step_s / margin
    return max(0.0, H * step_s * comm_fraction / (1.0 - comm_fraction) - overhead)


def ceil_H(x: float) -> int:
    """The smallest integer H >= x (at least 1), ignoring float noise just above an integer."""
    return max(1, math.ceil(x - _EPS))


def least_fitting(costs: Sequence[float], budget: float) -> int:
    """Index of the first (least compressed) rung whose cost fits the budget; the last if none does."""
    for i, c in enumerate(costs):
        if c <= budget:
            return i
    return len(costs) - 1


# Per-round time that neither compute nor the exchange explains and overlap cannot hide: the
# driver's Ray calls (dispatch, collect), logging and the round's checkpoint. The median residual
# of the 12 runs of a first `geofed bench plan` on the 2-core machine (0.01-0.04 s; docs/plan.md),
# then checked on a second, fresh bench; a policy gets the measured value
# (Measurements.round_overhead_s) once the run has one.
DEFAULT_ROUND_OVERHEAD_S = 0.025


def round_time(compute_s: float, sync_s: float, *, overlap: bool, codec_s: float = 0.0, overhead_s: float = 0.0) -> float:
    """Predicted wall seconds of one round: ``H*step`` of compute, the exchange (encoding and decoding
    ``codec_s`` plus the bottleneck link's ``sync_s``) and the control plane's ``overhead_s``.

    Serial rounds pay all three; with overlap the exchange of round r runs during round r+1's
    compute, so a round lasts the longer of the two, plus the overhead.
    """
    exchange = codec_s + sync_s
    if overlap:
        return max(compute_s, exchange) + overhead_s
    return compute_s + exchange + overhead_s
