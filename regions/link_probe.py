"""Set-up probes: warm every connection of a region and measure its out-links before round 0.

Why before round 0: the first transfer on a fresh TLS channel pays the TCP and TLS handshakes and
slow start, and read 3.6-3.8 Mbit/s on a real cluster's 16.7 Mbit/s links (issue 14), which the
policy took for the link. So connections are opened and warmed here, inside set-up, and the
rounds start with an estimate.

The phases, each with every peer at once (as a round's pushes share this region's egress):

1. **Warm-up**: a ping and a probe of WARM_BYTES per peer that open the connection (handshakes,
   slow start, gRPC's flow-control windows). Cold: not a bandwidth sample; its duration sizes the
   next probe.
2. **Measure**: a ping, then a probe sized to take about `duration_s` (at least 2 RTTs) at 1.5x
   the rate the warm-up read. Sizes, not durations: a sender can queue megabytes in socket
   buffers before the link slows it, so a probe that stops on a timer measures the buffer.
3. **Again**, up to PROBE_RETRIES times, PROBE_GROWTH times larger, for the peers whose last
   probe was latency-bound (no sample): the cold probe reads a fast link low (slow start), so
   the probe it sizes can be over in less time than scheduling noise.

Tried and left out (2026-12-03, the shaped 4-node test, 2 interleaved pairs): 3 more pings once
warm, and probing every peer again at `duration_s` x its rate when the measuring probe was
exposed under half of `duration_s`. Both arms read 0.95-1.06 of the true rate on a quiet host
and 0.55-0.59 on a host too busy to carry the links (plain TCP bulk flows read 6-14 Mbit/s of
16.1), and the extra phases cost 0.28 s of set-up. Also tried (2026-12-03 evening, 15 runs,
docs/bench-cluster.md): a settling probe of 1-2x `duration_s` at the warm rate replacing the
reading, and a 4 MiB `grpc.http2.lookahead_bytes`. Neither held 10%: a probe's rate swings with
gRPC's HTTP/2 flow-control window of the moment (907 KB probes ran at ~8 Mbit/s per flow, a
64-85 KiB window per RTT, right after 280 KB ones at ~14), so a longer probe samples another window.

In every phase the pings to all peers go first, then all probes start together (a barrier), and
concurrent probes of one egress are evened out over their whole span, first start to last ack
(`even_out_shares`). Before (2026-12-04), each probe's thread pinged its peer first, so probes
started up to the pings' spread apart, and each region's share was the bits over the longest
probe's own time: the shaped 4-node test read 0.91-1.09 of the true rate over 4 quiet runs and
passed its 10% check in 3; after it, 0.93-0.99 in 3 of 3. A peer that fails is left to the
rounds (logged).

**Re-probes during the rounds** (`Reprober`, issue 37): updates under a link's bandwidth-delay
product are no bandwidth samples (p2p/estimator.py), so on the default run (10 kB updates) nothing
after set-up would measure a link again. An estimate that is stale or doubted
(`LinkEstimator.needs_probe`) is measured again by a window-opening probe (over twice the BDP,
and REPROBE_EXPOSED_S of the estimate's rate; sent twice back to back, the first to open gRPC's
flow-control window; the faster of the two is the reading), one link of the region at a time, started after the
round's pushes and pings (so a ping never queues behind it) on the send pool: the round does not
wait for it. While the link's pings run REPROBE_MAX_NOISE_S over the path the hosts are busy and
it is not probed (at load average 47 a probe sized past 200 ms of ping noise was 8 MiB and still
read the CPU); a probe the hosts' CPU slowed anyway is no sample, and that link's next re-probe
waits twice as long (REPROBE_MIN_INTERVAL_S up to REPROBE_MAX_INTERVAL_S), so a busy host costs
few bytes; except a link's first, free re-probe: when it reads busy (the pings' noise, or the
sender's own threads stalled beside it, which a StallMeter reads) it stays free for
REPROBE_BUSY_REFUNDS more tries at REPROBE_MIN_INTERVAL_S, so a load that comes and goes within
the run does not leave the link on a reading made under it. Its
bytes are counted with the set-up probes' (`probe_bytes_sent`, egress) and its record goes into
the next round's transfers (`"direction": "probe", "reprobe": true`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any

from geofed.p2p.estimator import StallMeter
from geofed.p2p.prober import LinkProber
from geofed.p2p.transport import TransportError

log = logging.getLogger(__name__)
WARM_BYTES = 256 << 10      # a connection's first probe: about one BDP of a 25 Mbit/s, 80 ms link
MIN_PROBE_BYTES = 64 << 10
PROBE_RETRIES = 2           # larger probes of a link whose measuring probe was latency-bound
PROBE_GROWTH = 4
SHARE_SPREAD = 1.5          # concurrent probes within this ratio read as even shares of one egress
REPROBE_EXPOSED_S = 0.2     # a re-probe's time at the estimate's rate: 4x the estimator's min_exposed_s
REPROBE_BLIND_BYTES = 1 << 20  # a re-probe of a link without an estimate (its set-up probes failed)
REPROBE_MIN_INTERVAL_S = 10.0  # per link between re-probes; doubled while they read busy
REPROBE_MAX_INTERVAL_S = 60.0
REPROBE_MAX_NOISE_S = 0.05     # pings this far over the path: the hosts are busy, a probe would measure them
# A region's re-probe bytes past each link's first re-probe: at most this share of the update bytes it
# has sent (the default run's re-probes cost 32-73 MB against 3.4 MB of updates, paid per GB of egress).
REPROBE_BUDGET_FRACTION = 0.1
# Re-probes that read busy do not use up a link's first, free re-probe, this many times: the default
# run's load came and went within 20 s, and a link whose one re-probe read busy kept its set-up
# reading to the end (eu-west-1->us-east-1 at 0.61 of its link, 39 s old). Two cost 39-61 MB of
# re-probes per default run (3 runs), one 38-41 MB (2 runs), against 3.45 MB of updates; the one
# free re-probe alone cost 23 MB, with a link left on a reading made under the load.
REPROBE_BUSY_REFUNDS = 2


class SetupProbes:
    """The set-up probes of one region's out-links, through its link prober, on its send pool."""

    def __init__(self, links: LinkProber, pool: Executor, *, send_timeout_s: float):
        self.links, self.pool, self.send_timeout_s = links, pool, send_timeout_s
        self.first_probe: dict[str, float] = {}  # peer -> seconds its warm-up probe took
        self._spans: dict[str, tuple[float, float]] = {}  # peer -> (start, end) of its last probe

    def run(self, peers: Sequence[str], *, duration_s: float, max_bytes: int) -> list[dict]:
        """Warm and measure the links to `peers` (the module docstring); the probes as transfer records."""
        records: list[dict] = []
        timeout_s = min(self.send_timeout_s, 60.0)
        warm = {p: min(max_bytes, WARM_BYTES) for p in peers}
        done = self._probe_round(warm, timeout_s, False, records)
        sizes: dict[str, int | None] = {p: self._probe_size(p, warm[p], duration_s, max_bytes) for p in done}
        for attempt in range(1 + PROBE_RETRIES):
            if attempt:
                sizes = self._probe_again(sizes, max_bytes)
            done = self._probe_round(sizes, timeout_s, True, records)
            self.even_out_shares(done)
        return records

    def _probe_round(self, sizes: Mapping[str, int | None], timeout_s: float, measured: bool,
                     records: list[dict]) -> dict[str, Any]:
        """One probe to each peer of `sizes` at once; records appended, samples taken when `measured`.

        The pings go first, all of them, then every probe starts together (a barrier): a ping
        inside each probe's thread staggered the starts by the pings' spread (81-125 ms on an
        81 ms path), so the first probes out had the egress to themselves for a while, and a
        region's probes read up to 1.09x of its egress share on the shaped cluster.
        """
        peers = [p for p, n in sizes.items() if n]
        for fut in [self.pool.submit(self.links.measure_rtt, p, warm_up=not measured) for p in peers]:
            fut.result(timeout=timeout_s + 15.0)
        start = threading.Barrier(len(peers)) if peers else None
        done, spans = {}, {}
        # A region's set-up can be busy (the default run's us-east-1 read 4 Mbit/s on all three of
        # its 26-52 Mbit/s links): the probes' time is the sender's CPU for the share its threads
        # waited to run, which makes such a reading a lower bound (p2p/estimator.py).
        with StallMeter() as meter:
            futures = {p: self.pool.submit(self._probe_one, p, sizes[p], timeout_s, start) for p in peers}
            for peer, fut in futures.items():
                try:
                    done[peer], spans[peer] = fut.result(timeout=timeout_s + 15.0)
                except (TransportError, TimeoutError, threading.BrokenBarrierError) as exc:
                    log.warning("probe of the link to %s failed: %s", peer, exc)
        for peer, stats in done.items():
            if measured:
                self.links.observe(peer, stats, len(futures), stall_s=meter.share * stats.seconds)
            else:
                self.first_probe[peer] = stats.seconds
            records.append({"peer": peer, "direction": "probe", "bytes": stats.bytes,
                            "seconds": round(stats.seconds, 6), "concurrent": len(futures), "cold": stats.cold,
                            "measured": measured, "stall_s": round(meter.share * stats.seconds, 4)})
        self._spans = spans
        return done

    def _probe_again(self, sizes: Mapping[str, int | None], max_bytes: int) -> dict[str, int]:
        """Larger probes for the peers whose last one gave no bandwidth sample (latency-bound)."""
        with self.links.lock:
            unmeasured = [p for p, n in sizes.items() if n and self.links.estimator(p).bandwidth_bps is None]
        return {p: min(max_bytes, sizes[p] * PROBE_GROWTH) for p in unmeasured if sizes[p] < max_bytes}

    def even_out_shares(self, done: Mapping[str, Any]) -> None:
        """Concurrent probes that read within SHARE_SPREAD of each other shared this region's
        egress: TCP splits a bottleneck unevenly over a few RTTs (14.1 / 16.4 / 17.9 Mbit/s for
        an even 16.1 on a real shaped cluster), so each gets an even share of the egress. The
        egress is all their bits over the time to the last one's end (they start together), not
        the sum of their own rates: a probe that ends early leaves the egress to the others,
        whose own rates then read high (18.0-18.4 for an even 16.1, three links of one region
        12-14% over, on the shaped cluster). A spread past SHARE_SPREAD is links of their own (a
        slower path), kept as measured."""
        with self.links.lock:
            rates = {p: self.links.estimator(p).bandwidth_bps for p in done}
            if len(rates) < 2 or None in rates.values() or max(rates.values()) > SHARE_SPREAD * min(rates.values()):
                return
            spans = self._spans
            if all(p in spans for p in rates):
                # Every probe of the region from the first start to the last ack, less the RTT of the
                # one that ended last: the egress's time, whatever the starts' skew.
                last = max(rates, key=lambda p: spans[p][1])
                span = spans[last][1] - min(spans[p][0] for p in rates) - (self.links.estimator(last).rtt_s or 0.0)
            else:
                span = max(done[p].seconds - (self.links.estimator(p).rtt_s or 0.0) for p in rates)
            if span <= 0:
                return
            egress = sum(done[p].bytes * 8.0 for p in rates) / span
            share = min(egress / len(rates), max(rates.values()))
            for peer in rates:
                self.links.estimator(peer).set_bandwidth(share)

    def _probe_size(self, peer: str, warm_bytes: int, duration_s: float, max_bytes: int) -> int | None:
        seconds = self.first_probe.get(peer)
        if seconds is None:
            return None
        with self.links.lock:
            rtt = self.links.estimator(peer).rtt_s or 0.0
        rate = warm_bytes / max(seconds - rtt, 1e-3)  # bytes/s; a cold transfer reads low, hence 1.5x
        return int(min(max_bytes, max(MIN_PROBE_BYTES, 1.5 * rate * max(duration_s, 2 * rtt))))

    def _probe_one(self, peer: str, nbytes: int, timeout_s: float, start: threading.Barrier | None):
        """One probe, started with the region's others; its stats and (start, end) on the monotonic clock."""
        if start is not None:
            start.wait(timeout=timeout_s)
        t0 = time.monotonic()
        stats = self.links.probe(peer, nbytes, timeout_s=timeout_s)
        return stats, (t0, time.monotonic())


class Reprober:
    """Window-opening re-probes of stale or doubted out-links during the rounds, within an egress
    budget (the module docstring)."""

    def __init__(self, links: LinkProber, pool: Executor, *, send_timeout_s: float, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic, budget_fraction: float = REPROBE_BUDGET_FRACTION):
        if not budget_fraction >= 0:
            raise ValueError(f"budget_fraction: must be >= 0, got {budget_fraction}")
        self.links, self.pool, self.send_timeout_s = links, pool, send_timeout_s
        self.max_bytes, self._clock = max_bytes, clock
        self.budget_fraction = budget_fraction
        self._running: Future | None = None
        self._next_t: dict[str, float] = {}     # peer -> clock() before which it is not probed again
        self._interval: dict[str, float] = {}   # peer -> its current interval between re-probes
        self._records: list[dict] = []          # finished re-probes, appended by the pool's thread
        self.update_bytes = 0     # update bytes this region sent (count_updates)
        self.spent_bytes = 0      # re-probe bytes sent, both probes of each, its first per link included
        self._free_bytes = 0      # the first re-probe of each link: outside the fraction
        self._checked: set[str] = set()  # links that had their first re-probe
        self.put_off = 0          # due re-probes the budget did not allow
        self._busy_refunds: dict[str, int] = {}  # peer -> busy readings that left its free re-probe unused

    def count_updates(self, nbytes: int) -> None:
        """Update bytes this region sent: they earn the re-probes' budget."""
        self.update_bytes += int(nbytes)

    def budget_left(self) -> float:
        """Bytes the re-probes may still send, besides the first re-probe of a link not yet checked."""
        return self.budget_fraction * self.update_bytes + self._free_bytes - self.spent_bytes

    def after_round(self, peers: Sequence[str], after: Sequence[Future]) -> None:
        """Start one re-probe, once `after` (the round's pings) are done; nothing when one is still
        running. Of the `peers` that need one, links without an estimate go first, then doubted ones,
        then stale ones, each by confidence; the first whose two probes fit the budget (or that has
        not had its first re-probe) is probed. None fits: the estimates keep their age and confidence."""
        if self._running is not None and not self._running.done():
            return
        now = self._clock()
        with self.links.lock:
            due = [(_urgency(est), est.confidence, p, self._size(est)) for p in peers
                   if (est := self.links.estimators.get(p)) is not None and est.needs_probe()
                   and now >= self._next_t.get(p, 0.0) and est.noise_s < REPROBE_MAX_NOISE_S]
        left = self.budget_left()
        for _, _, peer, nbytes in sorted(due):
            free = peer not in self._checked
            if free or 2 * nbytes <= left:
                break
        else:
            self.put_off += bool(due)
            return
        self._checked.add(peer)
        self._next_t[peer] = now + self._interval.get(peer, REPROBE_MIN_INTERVAL_S)
        self._running = self.pool.submit(self._probe, peer, nbytes, free, list(after))

    def _size(self, est) -> int:
        nbytes = est.window_bytes(REPROBE_EXPOSED_S) or REPROBE_BLIND_BYTES
        return min(self.max_bytes, max(WARM_BYTES, nbytes))

    def _probe(self, peer: str, nbytes: int, free: bool, after: list[Future]) -> str | None:
        timeout_s = min(self.send_timeout_s, 60.0)
        wait(after, timeout=timeout_s)
        sent = 0
        try:
            # Two back to back: after rounds of small updates gRPC's flow-control window has shrunk to
            # what they needed (its BDP estimator), and a lone probe spent most of its time opening it
            # again (the default run: 0.46-0.66 of a 51 Mbit/s link, 0.3-0.8 MB probes, quiet pings).
            sent = nbytes  # a probe that fails may have sent its bytes: it is charged as sent
            with StallMeter() as m1:
                first = self.links.probe(peer, nbytes, timeout_s=timeout_s)
            sent = first.bytes + nbytes
            with StallMeter() as m2:
                second = self.links.probe(peer, nbytes, timeout_s=timeout_s)
            sent = first.bytes + second.bytes
        except TransportError as exc:
            log.info("re-probe of the link to %s failed: %s", peer, exc)
            return None
        finally:
            self.spent_bytes += sent
            if free:
                self._free_bytes += sent
        # The faster of the two is the reading: a closed window and a stalled thread only slow a
        # transfer (at load average 30 the second of a pair took 0.54 s where the first took 0.29).
        second_read = second.seconds <= first.seconds or first.cold
        (opener, stats), stall_s = ((first, second), m2.stall_s) if second_read else ((second, first), m1.stall_s)
        with self.links.lock:
            verdict = self.links.estimator(peer).observe_transfer(stats.bytes, stats.seconds, cold=stats.cold,
                                                               stall_s=stall_s)
        interval = self._interval.get(peer, REPROBE_MIN_INTERVAL_S)
        refund = free and verdict in ("busy", "busy-ignored") and self._busy_refunds.get(peer, 0) < REPROBE_BUSY_REFUNDS
        if refund:
            # The CPU's reading, not the link's: the link keeps its free re-probe for a calmer moment,
            # at the usual interval (a doubled one outlasted the default run's load).
            self._busy_refunds[peer] = self._busy_refunds.get(peer, 0) + 1
            self._checked.discard(peer)
        self._interval[peer] = (REPROBE_MIN_INTERVAL_S if verdict == "sample" or refund
                                else min(REPROBE_MAX_INTERVAL_S, 2 * interval))
        self._records.append({"peer": peer, "direction": "probe", "bytes": opener.bytes, "seconds": round(opener.seconds, 6),
                              "concurrent": 1, "cold": opener.cold, "measured": False, "reprobe": True})
        self._records.append({"peer": peer, "direction": "probe", "bytes": stats.bytes,
                              "seconds": round(stats.seconds, 6), "concurrent": 1, "cold": stats.cold,
                              "measured": True, "reprobe": True, "verdict": verdict, "stall_s": round(stall_s, 4),
                              "t_end": round(time.time(), 4)})
        return verdict

    def take_records(self) -> list[dict]:
        """The re-probes finished since the last call, as transfer records."""
        out = []
        while self._records:
            out.append(self._records.pop(0))  # pop is atomic against the pool thread's append
        return out

    def wait(self, timeout_s: float) -> None:
        """Until the running re-probe (if any) ends: tests and a clean shutdown."""
        if self._running is not None:
            wait([self._running], timeout=timeout_s)


def _urgency(est) -> int:
    """Which re-probes go first: 0 a link without an estimate, 1 a doubted one (a reading the
    estimate could not explain), 2 one that is only old."""
    if est.bandwidth_bps is None:
        return 0
    return 1 if est.doubts > 0 else 2
