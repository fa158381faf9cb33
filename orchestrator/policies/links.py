"""What the coordinator tells the policy about each link, from what the regions measured.

p2p's estimator measures bandwidth only from transfers of at least 256 KiB (on a real WAN a
smaller transfer is shaped by TCP's window and slow start, FIELD-NOTES). A compressed update of
a small model is much smaller than that, so a policy fed only p2p's estimate would see every
link as RTT-only: any codec looks free, and a bandwidth drop goes unseen (geofed bench wan
showed both). The tracker here takes every sender-timed transfer instead (over a warm gRPC
channel: one connection per peer kept for the run) and reads each as

    rate = bits / (seconds - RTT)

when its exposed time ``seconds - RTT`` is at least ``min_exposed_fraction`` of the RTT. A
transfer that took little more than one RTT is latency-bound: its exposed time is mostly noise
(a few ms of scheduling on a loaded host), ``bits / noise`` is a wild overestimate that the
windowed maximum would keep, and ``bits / seconds`` (p2p's fallback) a gross underestimate.
Such a transfer adds no bandwidth sample: the estimate keeps what larger transfers measured
(in geofed bench wan's drop scenario, top-k payloads on a 2.5 Mbit/s link read 2-7 Mbit/s and
flipped the ladder between codecs every few rounds). Bandwidth is the windowed maximum of the last ``window`` rates
(BBR's estimator: noise only ever slows a transfer down). RTT is the minimum over the last
``rtt_window`` rounds of what the sender's p2p estimator reports (its windowed minimum of pings
and small transfers) and of the transfers' own durations (a transfer takes at least one RTT):
the first pings of a run go out while every region computes and every link carries its first
update, and read 2-4x the emulated 80 ms.

After a rise the estimate follows at once. A windowed maximum follows a fall only once every
sample in the window is new; with overlap a transfer is reported a round after it ran, so a
10x drop took 4-5 rounds to show, each one waiting on the network. A sample under
``1/drop_ratio`` of the current estimate therefore replaces the window: load on a shared host
slowed transfers by 30-50%, never 3x.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from .types import LinkEstimate


class LinkTracker:
    def __init__(self, *, window: int = 3, rtt_window: int = 30, min_exposed_fraction: float = 0.25,
                 min_bytes: int = 1024, drop_ratio: float = 3.0):
        if window < 1 or rtt_window < 1:
            raise ValueError(f"window: need window >= 1 and rtt_window >= 1, got {window}, {rtt_window}")
        if not 0 < min_exposed_fraction <= 10:
            raise ValueError(f"min_exposed_fraction: must be in (0, 10], got {min_exposed_fraction}")
        self.window, self.rtt_window = window, rtt_window
        if not drop_ratio > 1:
            raise ValueError(f"drop_ratio: must be > 1, got {drop_ratio}")
        self.min_exposed_fraction, self.min_bytes, self.drop_ratio = min_exposed_fraction, min_bytes, drop_ratio
        self._rates: dict[str, deque[float]] = {}
        self._rtts: dict[str, deque[float]] = {}

    def observe(self, link: str, *, rtt_s: float | None, transfers: Iterable[tuple[int, float]] = ()) -> None:
        """One region's view of its out-link ``link`` after a round: its RTT estimate and the
        (payload bytes, sender-timed seconds) of the sends it completed."""
        transfers = [(int(b), float(s)) for b, s in transfers if s > 0 and math.isfinite(s)]
        bounds = [s for _, s in transfers]
        if rtt_s is not None and rtt_s > 0 and math.isfinite(rtt_s):
            bounds.append(rtt_s)
        if bounds:
            self._rtts.setdefault(link, deque(maxlen=self.rtt_window)).append(min(bounds))
        rtt = self.rtt_s(link)
        for nbytes, seconds in transfers:
            if nbytes < self.min_bytes:
                continue
            exposed = seconds - (rtt or 0.0)
            if rtt is None or exposed < self.min_exposed_fraction * rtt:
                continue  # latency-bound: says little about the bandwidth
            rate, rates = nbytes * 8.0 / exposed, self._rates.setdefault(link, deque(maxlen=self.window))
            if rates and rate * self.drop_ratio < max(rates):
                rates.clear()  # a fall this large is the link, not noise
            rates.append(rate)

    def observe_round(self, results: Mapping[str, Mapping[str, Any]]) -> None:
        """Every region's round metrics (``links`` snapshots and ``transfers``)."""
        for region, m in results.items():
            sends: dict[str, list[tuple[int, float]]] = {}
            for t in m.get("transfers", []):
                if t.get("direction") == "send":
                    sends.setdefault(f"{region}->{t['peer']}", []).append((int(t["bytes"]), float(t["seconds"])))
            for link in set(m.get("links", {})) | set(sends):
                rtt_ms = m.get("links", {}).get(link, {}).get("rtt_ms")
                self.observe(link, rtt_s=None if rtt_ms is None else rtt_ms / 1e3, transfers=sends.get(link, ()))

    def rtt_s(self, link: str) -> float | None:
        rtts = self._rtts.get(link)
        return min(rtts) if rtts else None

    def estimate(self, link: str) -> LinkEstimate:
        rates = self._rates.get(link)
        return LinkEstimate(bandwidth_bps=max(rates) if rates else None, rtt_s=self.rtt_s(link))

    def links(self) -> list[str]:
        return sorted(set(self._rtts) | set(self._rates))

    def state_dict(self) -> dict[str, Any]:
        return {"rates": {k: list(v) for k, v in self._rates.items()},
                "rtts": {k: list(v) for k, v in self._rtts.items()}}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self._rates = {k: deque(v, maxlen=self.window) for k, v in d["rates"].items()}
        self._rtts = {k: deque(v, maxlen=self.rtt_window) for k, v in d["rtts"].items()}
