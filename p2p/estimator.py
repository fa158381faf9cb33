"""Per directed link: bandwidth and RTT from the transfers and pings that happen anyway.

- RTT: windowed minimum of recent samples (pings, and transfers too small to measure
  bandwidth), as BBR does: queueing only ever adds delay, so the minimum is the path.
- Bandwidth: windowed maximum of the delivery rate of the last ``window`` transfers of at
  least ``min_bytes`` (BBR's estimator; noise only ever slows a transfer down). A transfer timed
  by the sender (send start -> ack) includes one RTT, which is subtracted when known:
  ``rate = bytes / (seconds - rtt)``. With window 3 the estimate follows a step change within
  3 transfers (down) or at once (up).

Transfers much smaller than the bandwidth-delay product measure latency, not bandwidth
(FIELD-NOTES), hence ``min_bytes``.
"""

from __future__ import annotations

from collections import deque


class LinkEstimator:
    def __init__(self, *, window: int = 3, rtt_window: int = 10, min_bytes: int = 256 << 10,
                 srtt_gain: float = 0.125):
        if window < 1 or rtt_window < 1:
            raise ValueError(f"window: need window >= 1 and rtt_window >= 1, got {window}, {rtt_window}")
        if min_bytes < 1:
            raise ValueError(f"min_bytes: must be >= 1, got {min_bytes}")
        self.min_bytes = min_bytes
        self.srtt_gain = srtt_gain
        self._rates: deque[float] = deque(maxlen=window)
        self._rtts: deque[float] = deque(maxlen=rtt_window)
        self.srtt_s: float | None = None  # RFC 6298 smoothing, for display
        self.transfers = 0

    def observe_rtt(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"seconds: an RTT must be > 0, got {seconds}")
        self._rtts.append(seconds)
        self.srtt_s = seconds if self.srtt_s is None else (1 - self.srtt_gain) * self.srtt_s + self.srtt_gain * seconds

    def observe_transfer(self, nbytes: int, seconds: float, *, includes_rtt: bool = True) -> None:
        """One transfer of `nbytes` that took `seconds`: sender-timed (send -> ack, includes one
        RTT) by default, or receiver-timed (first -> last byte) with includes_rtt=False."""
        if nbytes < 0 or not seconds > 0:
            raise ValueError(f"seconds: need nbytes >= 0 and seconds > 0, got {nbytes}, {seconds}")
        self.transfers += 1
        if nbytes < self.min_bytes:
            if includes_rtt:
                self.observe_rtt(seconds)
            return
        rtt = self.rtt_s if includes_rtt else None
        # If the RTT estimate is stale and larger than this transfer, fall back to the raw time.
        busy = seconds - rtt if rtt is not None and seconds - rtt > 0.05 * seconds else seconds
        self._rates.append(nbytes * 8 / busy)

    @property
    def bandwidth_bps(self) -> float | None:
        """Bits per second, or None before a transfer of at least min_bytes."""
        return max(self._rates) if self._rates else None

    @property
    def rtt_s(self) -> float | None:
        return min(self._rtts) if self._rtts else None

    def predict_s(self, nbytes: int) -> float | None:
        """Expected sender-timed duration of a transfer: RTT + bytes / bandwidth."""
        bw, rtt = self.bandwidth_bps, self.rtt_s
        if bw is None:
            return None
        return (rtt or 0.0) + nbytes * 8 / bw

    def snapshot(self) -> dict:
        bw, rtt = self.bandwidth_bps, self.rtt_s
        return {"bandwidth_mbps": None if bw is None else bw / 1e6, "rtt_ms": None if rtt is None else rtt * 1e3,
                "srtt_ms": None if self.srtt_s is None else self.srtt_s * 1e3, "transfers": self.transfers}
