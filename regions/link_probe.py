"""Set-up probes: warm every connection of a region and measure its out-links before round 0.

Why before round 0: the first transfer on a fresh TLS channel pays the TCP and TLS handshakes and
slow start, and read 3.6-3.8 Mbit/s on a real cluster's 16.7 Mbit/s links (issue 14), which the
policy took for the link. So connections are opened and warmed here, inside set-up, and the
rounds start with an estimate.

The phases, each with every peer at once (as a round's pushes share this region's egress):

1. **Warm-up**: a ping and a probe of WARM_BYTES per peer that open the connection (handshakes,
   slow start, gRPC's flow-control windows). Cold: not a bandwidth sample; its duration sizes the
   next probe.
2. **RTT**: RTT_PINGS more pings per peer on the now quiet, warm connections. The estimator's RTT
   is the minimum of its pings (queueing and a busy host only add delay), and a probe's rate is
   ``bits / (seconds - RTT)``: one ping that waited 40 ms for a core (125 ms for an 81 ms path on
   a loaded 2-core host) made every short probe after it read fast.
3. **Measure**: a probe sized to take about `duration_s` (at least 2 RTTs) at 1.5x the rate the
   warm-up read. Sizes, not durations: a sender can queue megabytes in socket buffers before the
   link slows it, so a probe that stops on a timer measures the buffer.
4. **Again**, up to PROBE_RETRIES times, while some peer's last probe said too little: one that
   was latency-bound (no sample) grows PROBE_GROWTH times; one whose exposed time (seconds - RTT)
   was under half of `duration_s` had been sized from a slow-start reading far below the link
   (a warm-up that read 5 Mbit/s on a 16 Mbit/s share) and is resized to `duration_s` at the rate
   it measured, so an error in the RTT weighs a quarter as much. Every peer is probed again
   with it, since a share of the egress read at another concurrency is another share.

After each measuring phase, concurrent probes of one egress are evened out (`even_out_shares`).
A peer that fails is left to the rounds (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import wait
from typing import TYPE_CHECKING, Any

from geofed.p2p.transport import TransportError

if TYPE_CHECKING:
    from .exchange import Exchanger

log = logging.getLogger(__name__)
WARM_BYTES = 256 << 10      # a connection's first probe: about one BDP of a 25 Mbit/s, 80 ms link
MIN_PROBE_BYTES = 64 << 10
RTT_PINGS = 3               # pings per peer once warm, before the measuring probes
PROBE_RETRIES = 2           # probes again of a link whose last probe was latency-bound or short
PROBE_GROWTH = 4
SHORT_EXPOSED = 0.5         # a probe exposed for under this share of duration_s is resized
SHARE_SPREAD = 1.5          # concurrent probes within this ratio read as even shares of one egress


class LinkProber:
    """The set-up probes of one Exchanger's out-links (its transport, estimators, lock and pool)."""

    def __init__(self, exchanger: Exchanger):
        self.ex = exchanger
        self.first_probe: dict[str, float] = {}  # peer -> seconds its warm-up probe took

    def run(self, peers: Sequence[str], *, duration_s: float, max_bytes: int) -> list[dict]:
        """Warm and measure the links to `peers` (the module docstring); the probes as transfer records."""
        records: list[dict] = []
        timeout_s = min(self.ex.send_timeout_s, 60.0)
        warm = {p: min(max_bytes, WARM_BYTES) for p in peers}
        done = self._probe_round(warm, timeout_s, False, records)
        self._pings([p for p in peers if p in done])
        sizes = {p: self._probe_size(p, warm[p], duration_s, max_bytes) for p in done}
        for _ in range(1 + PROBE_RETRIES):
            done = self._probe_round(sizes, timeout_s, True, records)
            self.even_out_shares(done)
            sizes = self._next_sizes(sizes, done, duration_s, max_bytes)
            if not sizes:
                break
        return records

    def _pings(self, peers: Sequence[str]) -> None:
        def ping(peer: str) -> None:
            for _ in range(RTT_PINGS):
                self.ex._probe_rtt(peer)

        wait([self.ex._pool.submit(ping, p) for p in peers], timeout=60.0)

    def _probe_round(self, sizes: Mapping[str, int | None], timeout_s: float, measured: bool,
                     records: list[dict]) -> dict[str, Any]:
        """One probe to each peer of `sizes` at once; records appended, samples taken when `measured`."""
        futures = {p: self.ex._pool.submit(self._probe_one, p, n, timeout_s, not measured)
                   for p, n in sizes.items() if n}
        done = {}
        for peer, fut in futures.items():
            try:
                done[peer] = fut.result(timeout=timeout_s + 15.0)
            except (TransportError, TimeoutError) as exc:
                log.warning("probe of the link to %s failed: %s", peer, exc)
        for peer, stats in done.items():
            if measured:
                self.ex._observe(peer, stats, len(futures))
            else:
                self.first_probe[peer] = stats.seconds
            records.append({"peer": peer, "direction": "probe", "bytes": stats.bytes,
                            "seconds": round(stats.seconds, 6), "concurrent": len(futures), "cold": stats.cold,
                            "measured": measured})
        return done

    def _next_sizes(self, sizes: Mapping[str, int | None], done: Mapping[str, Any], duration_s: float,
                    max_bytes: int) -> dict[str, int]:
        """What to probe again: nothing, or every peer of `done` at once (a share read at another
        concurrency than a round's is another share), latency-bound ones PROBE_GROWTH times larger,
        the others sized to `duration_s` at their estimate, none smaller than before."""
        again, nxt = False, {}
        with self.ex._est_lock:
            for peer, stats in done.items():
                size, est = sizes[peer] or 0, self.ex.estimator(peer)
                if est.bandwidth_bps is None:
                    nxt[peer] = min(max_bytes, size * PROBE_GROWTH)
                    again |= size < max_bytes
                    continue
                want = int(min(max_bytes, est.bandwidth_bps / 8 * duration_s))
                nxt[peer] = max(size, want)
                exposed = stats.seconds - (est.rtt_s or 0.0)
                again |= exposed < SHORT_EXPOSED * duration_s and want > 1.5 * size
        return nxt if again else {}

    def even_out_shares(self, done: Mapping[str, Any]) -> None:
        """Concurrent probes that read within SHARE_SPREAD of each other shared this region's
        egress: TCP splits a bottleneck unevenly over a few RTTs (14.1 / 16.4 / 17.9 Mbit/s for
        an even 16.1 on a real shaped cluster), so each gets an even share of the egress. The
        egress is all their bits over the time to the last one's end (they start together), not
        the sum of their own rates: a probe that ends early leaves the egress to the others,
        whose own rates then read high (18.0-18.4 for an even 16.1, three links of one region
        12-14% over, on the shaped cluster). A spread past SHARE_SPREAD is links of their own (a
        slower path), kept as measured."""
        with self.ex._est_lock:
            rates = {p: self.ex.estimator(p).bandwidth_bps for p in done}
            if len(rates) < 2 or None in rates.values() or max(rates.values()) > SHARE_SPREAD * min(rates.values()):
                return
            exposed = {p: done[p].seconds - (self.ex.estimator(p).rtt_s or 0.0) for p in rates}
            if min(exposed.values()) <= 0:
                return
            egress = sum(done[p].bytes * 8.0 for p in rates) / max(exposed.values())
            share = min(egress / len(rates), max(rates.values()))
            for peer in rates:
                self.ex.estimator(peer).set_bandwidth(share)

    def _probe_size(self, peer: str, warm_bytes: int, duration_s: float, max_bytes: int) -> int | None:
        seconds = self.first_probe.get(peer)
        if seconds is None:
            return None
        with self.ex._est_lock:
            rtt = self.ex.estimator(peer).rtt_s or 0.0
        rate = warm_bytes / max(seconds - rtt, 1e-3)  # bytes/s; a cold transfer reads low, hence 1.5x
        return int(min(max_bytes, max(MIN_PROBE_BYTES, 1.5 * rate * max(duration_s, 2 * rtt))))

    def _probe_one(self, peer: str, nbytes: int, timeout_s: float, first: bool):
        self.ex._probe_rtt(peer, warm_up=first)
        return self.ex.transport.probe(peer, nbytes, timeout_s=timeout_s)
