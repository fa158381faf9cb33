"""Config of the WAN emulator (``network.emulation``). Owned by p2p.wan; loaded by the strict loader."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One directed link's shape. Unset fields fall back to the preset, then to `default`."""

    latency_ms: float | None = field(default=None, metadata={"doc": "one-way latency in ms (RTT = both directions)"})
    bandwidth_mbps: float | None = field(default=None, metadata={"doc": "bandwidth in Mbit/s (token bucket on bytes)"})
    jitter_ms: float | None = field(default=None, metadata={"doc": "latency jitter in ms; never reorders bytes of one stream"})
    loss: float | None = field(default=None, metadata={"doc": "probability per chunk of a loss stall (TCP retransmit-like)"})

    def __post_init__(self):
        for name in ("latency_ms", "bandwidth_mbps", "jitter_ms"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name}: must be >= 0, got {v}")
        if self.bandwidth_mbps is not None and self.bandwidth_mbps == 0:
            raise ValueError("bandwidth_mbps: must be > 0 (use an outage in `schedule` to cut a link)")
        if self.loss is not None and not 0 <= self.loss < 1:
            raise ValueError(f"loss: must be in [0, 1), got {self.loss}")


@dataclass(frozen=True, kw_only=True)
class ScheduleEvent:
    """At `at_s` seconds from run start, or at round `at_round`, change `link` ("a->b", "a<->b" or "*")."""

    link: str = field(metadata={"doc": "'a->b', 'a<->b' or '*' for every link"})
    at_s: float | None = field(default=None, metadata={"doc": "seconds from the start of the run"})
    at_round: int | None = field(default=None, metadata={"doc": "or: at the start of this round"})
    set: LinkSpec | None = field(default=None, metadata={"doc": "new link shape (unset fields unchanged)"})
    outage_s: float | None = field(default=None, metadata={"doc": "cut the link for this many seconds"})

    def __post_init__(self):
        if (self.at_s is None) == (self.at_round is None):
            raise ValueError("at_s: give exactly one of at_s or at_round")
        if self.at_s is not None and self.at_s < 0:
            raise ValueError(f"at_s: must be >= 0, got {self.at_s}")
        if self.at_round is not None and self.at_round < 0:
            raise ValueError(f"at_round: must be >= 0, got {self.at_round}")
        if self.set is None and self.outage_s is None:
            raise ValueError("set: give `set` (a new link shape) or `outage_s`")
        if self.outage_s is not None and self.outage_s <= 0:
            raise ValueError(f"outage_s: must be > 0, got {self.outage_s}")


@dataclass(frozen=True, kw_only=True)
class EmulationConfig:
    mode: Literal["none", "proxy", "kernel"] = field(
        default="proxy", metadata={"doc": "none: direct; proxy: user-space shaping TCP proxy; kernel: netns + tc tbf (root)"})
    preset: str | None = field(default="aws", metadata={"doc": "table of measured inter-region links (see p2p/wan/presets.yaml), or null"})
    bandwidth_scale: float = field(default=1.0, metadata={"doc": "multiply every bandwidth (run the same geometry slower on a laptop)"})
    default: LinkSpec = field(default_factory=lambda: LinkSpec(latency_ms=40.0, bandwidth_mbps=50.0, jitter_ms=0.0, loss=0.0),
                              metadata={"doc": "link shape for pairs the preset does not know"})
    links: dict[str, LinkSpec] = field(default_factory=dict, metadata={"doc": "per-link overrides: 'a->b' or 'a<->b' -> shape"})
    schedule: tuple[ScheduleEvent, ...] = field(default=(), metadata={"doc": "changes during the run"})

    def __post_init__(self):
        if not 0 < self.bandwidth_scale <= 1000:
            raise ValueError(f"bandwidth_scale: must be in (0, 1000], got {self.bandwidth_scale}")
        for key in self.links:
            if "->" not in key:
                raise ValueError(f"links: key {key!r} must be 'a->b' or 'a<->b'")
