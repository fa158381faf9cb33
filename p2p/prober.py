"""The link prober: pings and probes of one region's out-links over its transport, and the link
estimators they (and the pushes' timings) feed.

A ping is a round trip (``send(..., stream=PING)``); a probe is filler the peer counts and drops,
timed like a push (``send(..., stream=PROBE)``), so it measures the link as an update would use
it. Neither is part of the transport's interface of its own: both go through ``send``.
Pings are meant for quiet links (after a round's exchange): a ping queued behind a push in the
emulator's (or a real router's) buffer measures the queue, not the path.

The estimators are shared by the sending threads, the set-up probes and the re-probes
(regions/link_probe.py): whoever reads or updates one holds ``lock``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .estimator import LinkEstimator
from .transport import PING, PROBE, TransferStats, Transport, TransportError

__all__ = ["LinkProber"]

log = logging.getLogger("geofed.p2p")


class LinkProber:
    """Pings, probes and link estimators of one region's out-links (the module docstring)."""

    def __init__(self, transport: Transport, *, ping_timeout_s: float = 10.0):
        self.transport = transport
        self.ping_timeout_s = ping_timeout_s
        self.estimators: dict[str, LinkEstimator] = {}
        self.lock = threading.Lock()

    def estimator(self, peer: str) -> LinkEstimator:
        """The estimator of the out-link to `peer` (made on first use); callers that update it hold `lock`."""
        return self.estimators.setdefault(peer, LinkEstimator())

    def ping(self, peer: str, *, timeout_s: float) -> float:
        """Round-trip time to `peer` in seconds; TransportError if it fails."""
        return self.transport.send(peer, -1, b"", timeout_s=timeout_s, stream=PING).seconds

    def probe(self, peer: str, nbytes: int, *, timeout_s: float) -> TransferStats:
        """Send `nbytes` of filler that `peer` counts and drops, timed like a push (send -> ack):
        warms the connection and measures the link. Raises TransportError."""
        return self.transport.send(peer, -1, bytes(nbytes), timeout_s=timeout_s, stream=PROBE)

    def measure_rtt(self, peer: str, *, warm_up: bool = False) -> None:
        """Ping `peer` and teach its estimator the RTT; `warm_up`: an unrecorded ping first (the first
        on a fresh channel pays the TCP and TLS handshakes, several RTTs). A failure is logged."""
        try:
            if warm_up:
                self.ping(peer, timeout_s=self.ping_timeout_s)
            rtt = self.ping(peer, timeout_s=self.ping_timeout_s)
        except TransportError as exc:
            log.info("ping %s failed: %s", peer, exc)
            return
        with self.lock:
            self.estimator(peer).observe_rtt(rtt)

    def is_cold(self, peer: str) -> bool:
        """No RTT measured to `peer` yet (its channel may not even be open)."""
        with self.lock:
            return self.estimator(peer).rtt_s is None

    def observe(self, peer: str, stats: TransferStats, concurrent: int, stall_s: float = 0.0) -> None:
        """A push's (or probe's) sender-timed transfer as a sample of the link to `peer`."""
        with self.lock:
            # Sender-timed (send -> ack = RTT + bytes/bandwidth); the RTT comes from quiet-time
            # probes. Receiver timing was tried: it starts at the header, after the shaper's
            # burst has already let the first chunks through, and overestimates by 5-15%.
            self.estimator(peer).observe_transfer(stats.bytes, stats.seconds, cold=stats.cold, concurrent=concurrent,
                                                  spread_s=stats.spread_s, stall_s=stall_s)

    def link_estimates(self, region: str) -> dict[str, dict[str, Any]]:
        """Every out-link's estimate keyed 'region->peer'."""
        with self.lock:
            return {f"{region}->{peer}": est.snapshot() for peer, est in self.estimators.items()}

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {peer: est.state_dict() for peer, est in self.estimators.items()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        with self.lock:
            for peer, sd in d.items():
                self.estimator(peer).load_state_dict(sd)
