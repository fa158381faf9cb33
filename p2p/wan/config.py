"""Config of the WAN emulator (``network.emulation``). Owned by p2p.wan; loaded by the strict loader."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

_NETNS_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")


def parse_link_key(key: str) -> tuple[str, str, bool]:
    """Split 'a->b' / 'a<->b' into (a, b, both_directions); ValueError names what is wrong."""
    both = "<->" in key
    parts = key.split("<->") if both else key.split("->")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise ValueError(f"link key {key!r} must be 'a->b' or 'a<->b'")
    a, b = (p.strip() for p in parts)
    if a == b:
        raise ValueError(f"link key {key!r} names the same region twice")
    return a, b, both


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One directed link's shape. Unset fields fall back to the preset, then to `default`."""

    latency_ms: float | None = field(default=None, metadata={"doc": "one-way latency in ms (RTT = both directions)"})
    bandwidth_mbps: float | None = field(default=None, metadata={"doc": "bandwidth in Mbit/s of payload (token bucket on bytes)"})
    jitter_ms: float | None = field(default=None, metadata={"doc": "uniform +-jitter on each chunk's latency, ms; never reorders bytes of one stream"})
    loss: float | None = field(default=None, metadata={"doc": "loss probability per 1448-byte packet; a loss stalls the stream one RTO (max(200 ms, RTT + 4 jitter))"})

    def __post_init__(self):
        for name in ("latency_ms", "bandwidth_mbps", "jitter_ms"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < 1e9:
                raise ValueError(f"{name}: must be >= 0, got {v}")
        if self.bandwidth_mbps is not None and self.bandwidth_mbps == 0:
            raise ValueError("bandwidth_mbps: must be > 0 (use an outage in `schedule` to cut a link)")
        if self.latency_ms is not None and self.latency_ms > 60_000:
            raise ValueError(f"latency_ms: must be <= 60000, got {self.latency_ms}")
        if self.loss is not None and not 0 <= self.loss < 1:
            raise ValueError(f"loss: must be in [0, 1), got {self.loss}")

    def merged(self, over: "LinkSpec") -> "LinkSpec":
        """This spec with every field that `over` sets replaced."""
        return LinkSpec(**{k: (getattr(over, k) if getattr(over, k) is not None else getattr(self, k))
                           for k in ("latency_ms", "bandwidth_mbps", "jitter_ms", "loss")})


@dataclass(frozen=True, kw_only=True)
class ScheduleEvent:
    """At `at_s` seconds from run start, or at round `at_round`, change `link` ("a->b", "a<->b" or "*")."""

    link: str = field(metadata={"doc": "'a->b', 'a<->b' or '*' for every link"})
    at_s: float | None = field(default=None, metadata={"doc": "seconds from the start of the emulator (the run)"})
    at_round: int | None = field(default=None, metadata={"doc": "or: when the run enters this round"})
    set: LinkSpec | None = field(default=None, metadata={"doc": "new link shape (unset fields unchanged; bandwidth_scale still applies)"})
    outage_s: float | None = field(default=None, metadata={"doc": "cut the link for this many seconds (1e9: until an end_outage event)"})
    outage_mode: Literal["stall", "reset"] = field(
        default="stall", metadata={"doc": "stall: bytes stop both ways and new connections wait, all resume after; "
                                          "reset: open connections are reset and new ones refused for the window"})
    end_outage: bool = field(default=False, metadata={"doc": "end every outage in force on the link now"})

    def __post_init__(self):
        if self.link != "*":
            parse_link_key(self.link)
        if (self.at_s is None) == (self.at_round is None):
            raise ValueError("at_s: give exactly one of at_s or at_round")
        if self.at_s is not None and not 0 <= self.at_s < 1e9:
            raise ValueError(f"at_s: must be >= 0, got {self.at_s}")
        if self.at_round is not None and self.at_round < 0:
            raise ValueError(f"at_round: must be >= 0, got {self.at_round}")
        if self.set is None and self.outage_s is None and not self.end_outage:
            raise ValueError("set: give `set` (a new link shape), `outage_s` or `end_outage: true`")
        if self.outage_s is not None and self.end_outage:
            raise ValueError("end_outage: an event either starts (outage_s) or ends an outage, not both")
        if self.outage_s is not None and not 0 < self.outage_s <= 1e9:
            raise ValueError(f"outage_s: must be > 0, got {self.outage_s}")


@dataclass(frozen=True, kw_only=True)
class EmulationConfig:
    """The ``network.emulation`` section: how the links between regions are shaped (mode, preset
    table, per-link overrides, schedule of changes and outages). Field docs are in each field's metadata.
    """

    mode: Literal["none", "proxy", "kernel"] = field(
        default="proxy", metadata={"doc": "none: direct; proxy: user-space shaping TCP proxy; kernel: netns + veth + tc tbf for bandwidth (root), the proxy for latency"})
    preset: str | None = field(default="aws", metadata={"doc": "table of measured inter-region links (see p2p/wan/presets.yaml), or null"})
    bandwidth_scale: float = field(default=1.0, metadata={"doc": "multiply every bandwidth (run the same geometry slower on a laptop)"})
    default: LinkSpec = field(default_factory=lambda: LinkSpec(latency_ms=40.0, bandwidth_mbps=50.0, jitter_ms=0.0, loss=0.0),
                              metadata={"doc": "link shape for pairs the preset does not know"})
    links: dict[str, LinkSpec] = field(default_factory=dict, metadata={"doc": "per-link overrides: 'a->b' or 'a<->b' -> shape ('a->b' wins over 'a<->b')"})
    schedule: tuple[ScheduleEvent, ...] = field(default=(), metadata={"doc": "changes during the run"})
    seed: int = field(default=0, metadata={"doc": "seed of the jitter and loss draws"})
    bind_host: str = field(default="127.0.0.1", metadata={"doc": "address the proxy listens on (proxy mode)"})
    max_buffer_mb: float = field(default=32.0, metadata={"doc": "cap on the bytes one direction of one connection holds in flight"})
    endpoints_in_netns: bool = field(default=False, metadata={"doc": "kernel mode: servers and clients run inside the region namespaces (ip netns exec); false: in the host namespace, relayed through them"})
    kernel_latency: Literal["proxy", "packet"] = field(
        default="proxy", metadata={"doc": "kernel mode: proxy: latency/jitter/loss/outages by the TCP proxy over veth pairs; packet: by a user-space "
                                          "IP packet delay line over TUN pairs (delays handshake and ACKs, TCP sees the RTT; Python: a few hundred Mbit/s)"})
    kernel_mtu: int = field(default=1500, metadata={"doc": "kernel mode: MTU of the links between namespaces"})
    netns_prefix: str = field(default="gfw", metadata={"doc": "kernel mode: namespace name prefix (`geofed net cleanup` removes <prefix>*)"})
    slow_start_after_idle: bool = field(
        default=False, metadata={"doc": "proxy: after an idle gap longer than an RTO, a connection's congestion window restarts "
                                        "(halved per RTO, down to 10 segments), as Linux reno/cubic do with "
                                        "net.ipv4.tcp_slow_start_after_idle=1 (its default); false: the window stays open, as "
                                        "with BBR (this host's and the issue-14 cluster's congestion control) or that sysctl at 0"})
    tbf_burst_kb: int = field(default=64, metadata={"doc": "kernel mode: tbf burst in KiB (kept fixed: shrinking it mid-flow stalls)"})

    def __post_init__(self):
        if not 0 < self.bandwidth_scale <= 1000:
            raise ValueError(f"bandwidth_scale: must be in (0, 1000], got {self.bandwidth_scale}")
        if self.default.latency_ms is None or self.default.bandwidth_mbps is None:
            raise ValueError("default: must set latency_ms and bandwidth_mbps")
        for key in self.links:
            try:
                parse_link_key(key)
            except ValueError as exc:
                raise ValueError(f"links: {exc}") from None
        if not 0.25 <= self.max_buffer_mb <= 4096:
            raise ValueError(f"max_buffer_mb: must be in [0.25, 4096], got {self.max_buffer_mb}")
        if not _NETNS_PREFIX_RE.match(self.netns_prefix):
            raise ValueError(f"netns_prefix: must match {_NETNS_PREFIX_RE.pattern}, got {self.netns_prefix!r}")
        if not 576 <= self.kernel_mtu <= 65000:
            raise ValueError(f"kernel_mtu: must be in [576, 65000], got {self.kernel_mtu}")
        if not 16 <= self.tbf_burst_kb <= 65536:
            raise ValueError(f"tbf_burst_kb: must be in [16, 65536], got {self.tbf_burst_kb}")
