"""What a sync policy reads (Measurements) and what it answers (Decision).

Both are plain frozen values so that a policy stays a pure function of them and of its own
state: the runtime builds a Measurements after every round, calls ``Policy.decide`` and writes
``Decision.to_record()`` into rounds.jsonl, which is what the report reads to show why H moved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from geofed.compression import CodecSpec


@dataclass(frozen=True, kw_only=True)
class LinkEstimate:
    """p2p's LinkEstimator view of one directed link ``"a->b"``; None until measured.

    ``bandwidth_bps`` is in bits per second of payload (application goodput) that a push got
    while ``concurrent`` pushes of its sender ran at once (they share the sender's egress);
    ``rtt_s`` in seconds.
    """

    bandwidth_bps: float | None = None
    rtt_s: float | None = None
    concurrent: int | None = None

    def __post_init__(self) -> None:
        if self.bandwidth_bps is not None and not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise ValueError(f"bandwidth_bps: must be a positive finite number or None, got {self.bandwidth_bps}")
        if self.rtt_s is not None and not (self.rtt_s >= 0 and math.isfinite(self.rtt_s)):
            raise ValueError(f"rtt_s: must be a finite number >= 0 or None, got {self.rtt_s}")

    @property
    def measured(self) -> bool:
        """Anything known; with only an RTT the sync cost is a lower bound (see cost.sync_time)."""
        return self.bandwidth_bps is not None or self.rtt_s is not None


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Everything a policy may look at when it decides the next round."""

    now_s: float                   # run clock (seconds since start), passed in: policies never read a clock
    round: int                     # the round being decided
    step_time_s: float | None      # seconds per inner step (slowest region); None (or <= 0) before it is measured
    loss: float | None             # mean train loss of the last round
    lr: float                      # current inner lr
    lr0: float                     # initial inner lr (AdaComm's lr ratio)
    model_numel: int               # floats in one update
    links: Mapping[str, LinkEstimate]  # every directed link that carries traffic in the round being decided
    overlap: bool                  # the exchange runs while the next round computes
    last_sync_s: float | None = None   # measured sync wall time of the last round (its exposed part)
    # Seconds per round that neither compute nor the exchange explain and overlap cannot hide:
    # the control plane (plan, dispatch, collect, log, checkpoint). None: not measured.
    round_overhead_s: float | None = None

    def __post_init__(self) -> None:
        if self.model_numel < 1:
            raise ValueError(f"model_numel: must be >= 1, got {self.model_numel}")
        if self.round < 0:
            raise ValueError(f"round: must be >= 0, got {self.round}")
        if self.round_overhead_s is not None and not (self.round_overhead_s >= 0 and math.isfinite(self.round_overhead_s)):
            raise ValueError(f"round_overhead_s: must be a finite number >= 0 or None, got {self.round_overhead_s}")
        for name in self.links:
            if "->" not in name:
                raise ValueError(f"links: link names are 'src->dst', got {name!r}")


def measured_step_s(m: Measurements) -> float:
    """``m.step_time_s`` for code that runs only once it is measured (a policy answers an unmeasured
    step time, None or <= 0, before it gets there): anything else is our bug, not the user's."""
    step = m.step_time_s
    assert step is not None and step > 0, step
    return step


@dataclass(frozen=True, kw_only=True)
class Decision:
    """H and the codec of every link for the next round, and why.

    ``codecs`` maps every link of ``Measurements.links`` to its CodecSpec; a link the runtime
    did not pass gets ``default_codec`` (the strongest codec chosen this round: the safe guess
    for an unknown link).
    ``details`` is JSON-serialisable and explains the decision (see docs/policies.md).
    """

    H: int
    codecs: Mapping[str, CodecSpec]
    reason: str
    default_codec: CodecSpec | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert isinstance(self.H, int) and self.H >= 1, self.H
        assert "\n" not in self.reason, "reason is one line"

    def codec_for(self, link: str) -> CodecSpec | None:
        """The codec of `link`: its own, else the decision's default (None when the decision has neither)."""
        return self.codecs.get(link, self.default_codec)

    def to_record(self) -> dict[str, Any]:
        """The policy's part of a rounds.jsonl line (codecs by their keys)."""
        return {"H": self.H, "codecs": {link: spec.key for link, spec in self.codecs.items()}, "reason": self.reason,
                "policy": dict(self.details)}


@runtime_checkable
class Policy(Protocol):
    """A sync policy: ``decide`` is a pure function of the measurements and the policy's own
    state, which ``state_dict``/``load_state_dict`` carry through checkpoints (plain JSON-able
    values: a resumed policy decides exactly as the uninterrupted one would)."""

    def decide(self, m: Measurements) -> Decision:
        """H and the codecs for round ``m.round``; may update the policy's own state (hysteresis,
        intervals), never read a clock or anything else outside `m`."""

    def state_dict(self) -> dict[str, Any]:
        """The policy's state as plain JSON-able values, including its ``kind``."""

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output; ValueError when `d` is another kind's."""
