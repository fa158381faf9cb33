"""Regions as network namespaces joined by a user-space router: one shaped egress per region.

Each region gets a namespace ``<prefix><run id>-<i>`` with one TUN device (``wan0``, address
``10.<net>.0.<i+1>/24``, also the default route) and tc tbf on that device's egress: every flow
the region sends, to any peer, shares that one rate, like a cloud VM's NIC. The TUN devices'
other ends are file descriptors held by a `router.PacketRouter` in this process, which carries
each packet to the destination region's device after the pair's one-way latency (this kernel
has no netem). So a region's three concurrent pushes share its egress (each gets about a
third), the TCP and TLS handshakes and slow start cross the real RTT, and the router counts
every flow's bytes.

tbf here counts IP packets (a TUN device has no Ethernet header): ``rate_mbps`` is the rate of
IP bytes, of which TCP payload is at most ``mss / mtu`` (1448/1500 with timestamps).

Needs root and iproute2 (kernel.kernel_unavailable says what is missing). `down()` (also at
exit) removes the namespaces; `geofed net cleanup --prefix P` removes those of a process that
was killed.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from geofed.p2p.wan.kernel import TBF_BURST_S, in_namespace, kernel_unavailable, open_tun, run_tool
from .router import PacketRouter

log = logging.getLogger(__name__)

DEVICE = "wan0"
TCP_IP_HEADERS = 52        # IPv4 20 + TCP 20 + timestamps 12: what every full segment carries
# tbf's burst: a head start every transfer after an idle gap gets at the device's speed. 64 KiB
# (kernel.py's floor for veths) made 600 kB pushes of three concurrent flows read 16.45 Mbit/s for
# a 16.09 share; 16 KiB read 16.06 with the same bulk rate (15.89 vs 15.94); 8 KiB was erratic
# (14.2-24.2). It is set once and never shrunk under a flow (FIELD-NOTES: that stalled flows).
MIN_BURST = 16 << 10


@dataclass(frozen=True, kw_only=True)
class RegionLinks:
    """The shape of a RegionNet: every region's egress rate and every pair's one-way latency."""

    egress_mbps: Mapping[str, float]            # region -> tbf rate of its egress (IP bytes)
    latency_ms: Mapping[tuple[str, str], float]  # (src, dst) -> one-way latency

    @classmethod
    def uniform(cls, regions: Sequence[str], *, egress_mbps: float, latency_ms: float) -> RegionLinks:
        return cls(egress_mbps={r: egress_mbps for r in regions},
                   latency_ms={(a, b): latency_ms for a in regions for b in regions if a != b})

    def __post_init__(self):
        for r, mbps in self.egress_mbps.items():
            if not 0.01 <= mbps <= 10_000:
                raise ValueError(f"egress_mbps: {r}'s egress must be in [0.01, 10000] Mbit/s, got {mbps}")
        for (a, b), ms in self.latency_ms.items():
            if not 0 <= ms < 5000:
                raise ValueError(f"latency_ms: {a}->{b} must be in [0, 5000) ms, got {ms}")


class RegionNet:
    """The namespaces, TUN devices, qdiscs and router of one set of regions; down() removes them."""

    def __init__(self, regions: Sequence[str], links: RegionLinks, *, prefix: str = "gfh",
                 run_id: str | None = None, mtu: int = 1500, net: int | None = None):
        reason = kernel_unavailable()
        if reason:
            raise RuntimeError(f"RegionNet {reason}")
        if not 2 <= len(regions) <= 250:
            raise ValueError(f"regions: a RegionNet joins 2 to 250 regions, got {len(regions)}")
        missing = [r for r in regions if r not in links.egress_mbps]
        if missing:
            raise ValueError(f"egress_mbps: no rate for region(s) {', '.join(missing)}")
        self.regions = list(regions)
        self.links = links
        self.run_id = run_id or secrets.token_hex(3)
        self.names = {r: f"{prefix}{self.run_id}-{i}" for i, r in enumerate(self.regions)}
        # A second octet of our own: namespaces are isolated, but distinct subnets keep logs unambiguous.
        self.net = net if net is not None else 64 + secrets.randbelow(128)
        self.addresses = {r: f"10.{self.net}.0.{i + 1}" for i, r in enumerate(self.regions)}
        self.region_of = {a: r for r, a in self.addresses.items()}
        self.mtu = mtu
        self.router: PacketRouter | None = None
        self._fds: dict[str, int] = {}
        self._made: list[str] = []

    def namespace(self, region: str) -> str:
        return self.names[region]

    def address(self, region: str) -> str:
        return self.addresses[region]

    @property
    def payload_efficiency(self) -> float:
        """TCP payload per IP byte of a full segment: the most of the tbf rate a bulk flow carries."""
        return (self.mtu - TCP_IP_HEADERS) / self.mtu

    # -- lifecycle -----------------------------------------------------------------------------
    def up(self) -> RegionNet:
        atexit.register(self.down)
        try:
            for r in self.regions:
                self._namespace(r)
            latency = {(self.addresses[a], self.addresses[b]): ms / 1e3 for (a, b), ms in self.links.latency_ms.items()}
            self.router = PacketRouter({self.addresses[r]: fd for r, fd in self._fds.items()},
                                       lambda a, b: latency.get((a, b), 0.0))
            self.router.start()
        except BaseException:
            self.down()
            raise
        return self

    def _namespace(self, region: str) -> None:
        ns = self.names[region]
        run_tool("ip", "netns", "add", ns)
        self._made.append(ns)
        run_tool("ip", "-n", ns, "link", "set", "lo", "up")
        # IPv4 only: no IPv6 link-local chatter (router solicitations) on the device or in the counts.
        run_tool("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1")
        self._fds[region] = in_namespace(ns, lambda: open_tun(DEVICE))
        run_tool("ip", "-n", ns, "addr", "add", f"{self.addresses[region]}/24", "dev", DEVICE)
        run_tool("ip", "-n", ns, "link", "set", DEVICE, "mtu", str(self.mtu), "txqueuelen", "1000", "up")
        # Anything not on the subnet goes to the router too, which drops it (no_route): nothing
        # leaves the namespaces, and software that looks for a default route finds one.
        run_tool("ip", "-n", ns, "route", "add", "default", "dev", DEVICE)
        self.set_egress(region, self.links.egress_mbps[region])

    def set_egress(self, region: str, mbps: float) -> None:
        """tbf on the region's TUN egress: `mbps` of IP bytes, shared by all its flows."""
        bps = mbps * 1e6
        burst = max(MIN_BURST, int(bps / 8 * TBF_BURST_S))
        limit = max(4 * burst, int(bps / 8 * 0.05))   # ~50 ms of queue, as a NIC's ring plus qdisc
        run_tool("tc", "-n", self.names[region], "qdisc", "replace", "dev", DEVICE, "root", "tbf",
             "rate", f"{int(bps)}bit", "burst", str(burst), "limit", str(limit))

    def down(self) -> None:
        """Stop the router, close the devices, delete the namespaces. Idempotent."""
        if self.router is not None:
            self.router.stop()
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}
        for ns in self._made:
            try:
                run_tool("ip", "netns", "delete", ns)
            except RuntimeError as exc:
                if "No such file" not in str(exc):
                    log.warning("%s", exc)
        self._made = []
        atexit.unregister(self.down)

    def __enter__(self) -> RegionNet:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- what the kernel counted ---------------------------------------------------------------
    def nic(self, region: str) -> dict[str, int]:
        """The region's TUN device counters (the kernel's): tx = what it sent, rx = what it got."""
        data = json.loads(run_tool("ip", "-n", self.names[region], "-s", "-j", "link", "show", "dev", DEVICE))[0]
        st = data["stats64"]
        return {"tx_bytes": st["tx"]["bytes"], "tx_packets": st["tx"]["packets"], "tx_dropped": st["tx"]["dropped"],
                "rx_bytes": st["rx"]["bytes"], "rx_packets": st["rx"]["packets"], "rx_dropped": st["rx"]["dropped"]}

    def qdisc(self, region: str) -> dict[str, int]:
        """tbf's counters on the region's egress: bytes and packets it sent, drops, overlimits."""
        text = run_tool("tc", "-n", self.names[region], "-s", "qdisc", "show", "dev", DEVICE)
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
        if not m:
            raise RuntimeError(f"tc: no tbf counters on {self.names[region]}/{DEVICE}: {text.strip()}")
        sent, pkts, dropped, over = (int(g) for g in m.groups())
        return {"bytes": sent, "packets": pkts, "dropped": dropped, "overlimits": over}
