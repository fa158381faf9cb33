"""Per directed link: bandwidth and RTT from the transfers and pings that happen anyway.

This is the one link estimator of geofed: each region keeps one per out-link (regions/exchange.py)
and reports its snapshot with the round's metrics; the coordinator hands those snapshots to the
sync policy as they are.

RTT: windowed minimum of pings and of transfer durations that undercut it (a sender-timed
transfer takes at least one RTT), as BBR does: queueing only ever adds delay, so the minimum is
the path. The first pings of a run go out while every region computes and read 2-4x the real
RTT, hence a long window.

Bandwidth: ``rate = bits / (seconds - RTT)`` of sender-timed transfers (send start -> ack, which
includes one RTT), the windowed maximum of the last ``window`` rates (BBR: noise only ever slows a
transfer down). What is not a sample:

* a transfer on a *cold* connection (the first after a connect or a reconnect): it paid the TCP
  and TLS handshakes and slow start. On a real 4-node cluster at 80 ms RTT the first int8 push of a
  small model read 3.7 Mbit/s on a link that gave 16.7 (FIELD-NOTES), and the policy raised H
  10-20x on it. The transport warms every connection before round 0 and says which sends were cold;
* a latency-bound transfer, whose exposed time ``seconds - RTT`` is under ``min_exposed_fraction``
  of the RTT or under ``min_exposed_s``: its exposed time is mostly scheduling noise (threads
  waiting for a core and the GIL: 40-70 ms on a loaded 2-core host, where a 9.7 kB update that the
  link serialises in 1.5 ms read as 1.9 Mbit/s on a 52 Mbit/s link), and ``bits / noise`` is no
  bandwidth;
* a transfer under ``min_bytes``.

A transfer smaller than ``raise_bytes`` may lower the estimate but never raise it: a shaper's
burst (tbf's bucket, a cloud NIC's credits) lets the first tens of KiB through at line rate, so a
small update reads fast (top-k payloads on a 2.5 Mbit/s link read 2-7 Mbit/s in geofed bench wan),
while nothing makes a transfer read slower than its link except the link or a loaded host. Large
transfers (the set-up probe, big updates) raise it.

A windowed maximum follows a fall only once every sample in the window is new (with overlap a
transfer is reported a round after it ran: a 10x drop took 4-5 rounds to show). A sample under
``1/drop_ratio`` of the estimate therefore replaces the window: load on a shared host slowed
transfers by 30-50%, never 3x. When the transfer is latency-bound at the current estimate (its
bytes would take under ``min_exposed_s`` to serialise), a slow reading is as likely a thread that
waited for a core: such a fall is taken once ``window`` readings in a row show it.

Each sample records how many pushes the sender had in flight at once (``concurrent``): a region's
pushes share its egress, so a link measured alongside two others gets about a third of what it
would alone when the sender's egress is the bottleneck. The estimate is what a push gets at that
concurrency, which is what a round with the same out-degree will see.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any


class LinkEstimator:
    """Bandwidth and RTT of one directed link, from its transfers and pings (see the module docstring
    for what counts as a sample). Not thread-safe: the Exchanger that keeps one per out-link
    serialises the updates with its own lock.
    """

    def __init__(self, *, window: int = 3, rtt_window: int = 30, min_exposed_fraction: float = 0.25,
                 min_exposed_s: float = 0.05, min_bytes: int = 1024, raise_bytes: int = 256 << 10,
                 drop_ratio: float = 3.0, srtt_gain: float = 0.125):
        if window < 1 or rtt_window < 1:
            raise ValueError(f"window: need window >= 1 and rtt_window >= 1, got {window}, {rtt_window}")
        if min_bytes < 1 or raise_bytes < min_bytes:
            raise ValueError(f"min_bytes: need 1 <= min_bytes <= raise_bytes, got {min_bytes}, {raise_bytes}")
        if not 0 < min_exposed_fraction <= 10:
            raise ValueError(f"min_exposed_fraction: must be in (0, 10], got {min_exposed_fraction}")
        if not drop_ratio > 1:
            raise ValueError(f"drop_ratio: must be > 1, got {drop_ratio}")
        self.window, self.rtt_window = window, rtt_window
        self.min_exposed_fraction, self.min_bytes, self.raise_bytes = min_exposed_fraction, min_bytes, raise_bytes
        self.min_exposed_s = min_exposed_s
        self.drop_ratio, self.srtt_gain = drop_ratio, srtt_gain
        self._rates: deque[float] = deque(maxlen=window)
        self._rtts: deque[float] = deque(maxlen=rtt_window)
        self._suspect: list[float] = []  # latency-bound readings of a fall, not yet confirmed
        self.srtt_s: float | None = None  # RFC 6298 smoothing, for display
        self.transfers = 0
        self.cold_transfers = 0
        self.spread_transfers = 0  # paced pushes that ended with their pace: no bandwidth sample
        self.concurrent: int | None = None  # pushes in flight at once when the last sample was taken

    def observe_rtt(self, seconds: float) -> None:
        """One ping's round trip (finite, > 0): a sample of the windowed-minimum RTT and of the smoothed SRTT."""
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds: an RTT must be a finite number > 0, got {seconds}")
        self._rtts.append(seconds)
        self.srtt_s = seconds if self.srtt_s is None else (1 - self.srtt_gain) * self.srtt_s + self.srtt_gain * seconds

    def observe_transfer(self, nbytes: int, seconds: float, *, includes_rtt: bool = True, cold: bool = False,
                         concurrent: int = 1, spread_s: float = 0.0) -> None:
        """One transfer of `nbytes` that took `seconds`: sender-timed (send -> ack, includes one
        RTT) by default, or receiver-timed (first -> last byte) with includes_rtt=False. `cold`:
        the first on its connection; `concurrent`: the sender's pushes in flight with it (itself
        included); `spread_s`: the sender paced it over that long (p2p/spread.py)."""
        if nbytes < 0 or not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds: need nbytes >= 0 and a finite seconds > 0, got {nbytes}, {seconds}")
        self.transfers += 1
        if cold:
            self.cold_transfers += 1
            return
        if spread_s > 0 and (self.rtt_s is None or seconds < spread_s + 2 * self.rtt_s):
            # It ended about when the pace let it: its duration is the pace's, not the link's. Only a
            # push that ran well past its spread was held back by the link, and then measures it.
            self.spread_transfers += 1
            return
        rtt = self.rtt_s
        if includes_rtt and (rtt is None or seconds < rtt):
            self.observe_rtt(seconds)  # it took at most one RTT: a better bound than the pings'
            rtt = seconds
        if nbytes < self.min_bytes:
            return
        if includes_rtt:
            exposed = seconds - rtt
            if exposed < max(self.min_exposed_fraction * rtt, self.min_exposed_s):
                return  # latency-bound: says little about the bandwidth
        else:
            exposed = seconds
        self._add_rate(nbytes * 8.0 / exposed, nbytes, concurrent)

    def _add_rate(self, rate: float, nbytes: int, concurrent: int) -> None:
        best = max(self._rates) if self._rates else None
        if best is not None and nbytes < self.raise_bytes and rate > best:
            return  # a small transfer's speed may be a shaper's burst: it cannot raise the estimate
        if best is not None and rate * self.drop_ratio < best:
            if nbytes * 8.0 / best < self.min_exposed_s:
                # At the estimate this transfer was latency-bound, so its slowness is as likely a
                # stalled thread as the link: a fall needs `window` such readings in a row.
                self._suspect.append(rate)
                if len(self._suspect) < self.window:
                    return
            self._rates.clear()  # a fall this large is the link, not noise
            self._rates.extend(self._suspect)
        self._suspect.clear()
        self._rates.append(rate)
        self.concurrent = max(1, int(concurrent))

    def set_bandwidth(self, bps: float) -> None:
        """Replace the samples with one figure (a measurement corrected by what it shared with:
        regions/exchange.py evens out concurrent probes of one egress)."""
        if not (bps > 0 and math.isfinite(bps)):
            raise ValueError(f"bps: must be a finite number > 0, got {bps}")
        self._rates.clear()
        self._rates.append(bps)

    @property
    def bandwidth_bps(self) -> float | None:
        """Bits per second of payload at the last sample's concurrency, or None before a sample."""
        return max(self._rates) if self._rates else None

    @property
    def rtt_s(self) -> float | None:
        """The windowed minimum RTT in seconds, or None before any ping or transfer."""
        return min(self._rtts) if self._rtts else None

    def predict_s(self, nbytes: int) -> float | None:
        """Expected sender-timed duration of a transfer: RTT + bytes / bandwidth."""
        bw, rtt = self.bandwidth_bps, self.rtt_s
        if bw is None:
            return None
        return (rtt or 0.0) + nbytes * 8 / bw

    def snapshot(self) -> dict[str, Any]:
        """The estimate for the round's metrics (Mbit/s, ms; None where unknown): what the policy is given."""
        bw, rtt = self.bandwidth_bps, self.rtt_s
        return {"bandwidth_mbps": None if bw is None else bw / 1e6, "rtt_ms": None if rtt is None else rtt * 1e3,
                "srtt_ms": None if self.srtt_s is None else self.srtt_s * 1e3, "transfers": self.transfers,
                "cold_transfers": self.cold_transfers, "spread_transfers": self.spread_transfers,
                "concurrent": self.concurrent}

    def state_dict(self) -> dict[str, Any]:
        """The samples and counters, for a checkpoint (`load_state_dict` restores them)."""
        return {"rates": list(self._rates), "rtts": list(self._rtts), "srtt_s": self.srtt_s,
                "transfers": self.transfers, "cold_transfers": self.cold_transfers,
                "spread_transfers": self.spread_transfers, "concurrent": self.concurrent}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore `state_dict()`'s samples; the window sizes stay this estimator's own."""
        self._rates = deque(d["rates"], maxlen=self.window)
        self._rtts = deque(d["rtts"], maxlen=self.rtt_window)
        self.srtt_s, self.concurrent = d.get("srtt_s"), d.get("concurrent")
        self.transfers, self.cold_transfers = int(d.get("transfers", 0)), int(d.get("cold_transfers", 0))
        self.spread_transfers = int(d.get("spread_transfers", 0))
