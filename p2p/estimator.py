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
transfer down). Three, not more: a step of 2.5x down must show within three transfers
(tests/integration/test_p2p_estimator_wan.py). What is not a sample:

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
transfers by 30-50%, never 3x, but one re-probe on the default run at load average 47 read 6.7
Mbit/s on a 51 Mbit/s link with quiet pings: a fall is taken once two readings in a row show it
(the first doubts the estimate, so a re-probe follows). When the transfer is latency-bound at the
current estimate (its bytes would take under ``min_exposed_s`` to serialise), a slow reading is as
likely a thread that waited for a core: such a fall is taken once ``window`` readings in a row
show it.

What sets a transfer's time on a busy host (issue 37: links of 18-57 Mbit/s ended the default run
at 0.3-1.5 Mbit/s after one CPU stall, since 10 kB updates could lower an estimate and never raise
it) is not a sample either, in either direction:

* a transfer under the bandwidth-delay product at the estimate (``bytes * 8 < bandwidth * RTT``):
  the link carries it within one RTT, so its time is latency plus however long the sender, the
  receiver and any proxy between waited for a core. It only informs the RTT, and *doubts* the
  estimate when it ran far slower (or far faster) than the estimate allows;
* a transfer whose exposed time is under ``busy_factor`` times the host's scheduling noise: the
  median of the last pings over the windowed-minimum RTT (pings carry no bytes, so whatever they
  take past the path is the hosts' scheduling). A loaded host's pings read 2-4x the path, and a
  transfer that such stalls could account for measures the CPU. As a lower bound of the link's
  rate it may still give a first estimate or raise one (never lower it), at low confidence;
* a transfer during which the sender's own threads waited to run (for a core or the GIL) for over
  ``STALL_SHARE`` of its exposed time (``stall_s``, read by a ``StallMeter`` beside it): its time
  was the sender's CPU, not the link. The pings do not show that: a ping is one message, a few ms
  of waiting, while a probe's stream waits at every step. On the default run under load the
  evaluating region's probes read 0.3-0.6 of its links with its pings within 50 ms of the path;
  two threads busy beside an in-process probe of a 40 Mbit/s link read 15-17 Mbit/s with the
  meter's thread late for 0.5 s of the probe's 0.55 (quiet ones: 0.01-0.07 s of 0.26-0.29). Treated
  like the noise above: a lower bound at most.

Each estimate has an age (seconds since its last sample) and a confidence in [0, 1]: 1 after a
clean sample, halved by every ``stale_s`` of age, by every two doubts, and once when it rests on a
busy reading. ``needs_probe()`` (confidence under one half) asks regions/link_probe.py's
``Reprober`` for a window-opening transfer, which is large enough to be a sample.

Each sample records how many pushes the sender had in flight at once (``concurrent``): a region's
pushes share its egress, so a link measured alongside two others gets about a third of what it
would alone when the sender's egress is the bottleneck. The estimate is what a push gets at that
concurrency, which is what a round with the same out-degree will see.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

STALE_S = 15.0       # an estimate this old has confidence 1/2 and is re-probed
BUSY_FACTOR = 4.0    # exposed time under this many times the hosts' scheduling noise is the CPU's
NOISE_PINGS = 3      # the noise is the median excess of this many latest pings
DOUBT_RATIO = 3.0    # an under-BDP transfer this far off the estimate (beyond the noise) doubts it
STALL_SHARE = 0.5    # the sender's threads waited to run for over this share of a transfer: the CPU's reading
STALL_TICK_S = 0.002  # the StallMeter's sleep: the GIL's switch interval is 5 ms, a stalled wake shows


class StallMeter:
    """How long this process's threads waited to run while something else ran: a thread that
    sleeps STALL_TICK_S at a time and sums how late it woke (waiting for a core or for the GIL).
    ``with StallMeter() as m: transfer()`` then ``m.stall_s``, ``m.elapsed_s``, ``m.share``.

    Why a thread and not the pings: a transfer's stream needs its sender's threads at every write
    and window update, a ping once; and why not process CPU time: a region computes beside its
    sends all the time (overlap), which costs a transfer nothing while torch holds no GIL.
    """

    def __init__(self, *, tick_s: float = STALL_TICK_S):
        if not tick_s > 0:
            raise ValueError(f"tick_s: must be > 0, got {tick_s}")
        self.tick_s = tick_s
        self.stall_s = self.elapsed_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            time.sleep(self.tick_s)
            self.stall_s += max(0.0, time.monotonic() - t - self.tick_s)

    def __enter__(self) -> StallMeter:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="geofed-stall-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.elapsed_s = time.monotonic() - self._t0

    @property
    def share(self) -> float:
        """The part of the metered time this process's threads spent waiting to run."""
        return self.stall_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


class LinkEstimator:
    """Bandwidth and RTT of one directed link, from its transfers and pings (see the module docstring
    for what counts as a sample). Not thread-safe: the Exchanger that keeps one per out-link
    serialises the updates with its own lock.
    """

    def __init__(self, *, window: int = 3, rtt_window: int = 30, min_exposed_fraction: float = 0.25,
                 min_exposed_s: float = 0.05, min_bytes: int = 1024, raise_bytes: int = 256 << 10,
                 drop_ratio: float = 3.0, srtt_gain: float = 0.125, busy_factor: float = BUSY_FACTOR,
                 stale_s: float = STALE_S, clock: Callable[[], float] = time.monotonic):
        if window < 1 or rtt_window < 1:
            raise ValueError(f"window: need window >= 1 and rtt_window >= 1, got {window}, {rtt_window}")
        if min_bytes < 1 or raise_bytes < min_bytes:
            raise ValueError(f"min_bytes: need 1 <= min_bytes <= raise_bytes, got {min_bytes}, {raise_bytes}")
        if not 0 < min_exposed_fraction <= 10:
            raise ValueError(f"min_exposed_fraction: must be in (0, 10], got {min_exposed_fraction}")
        if not drop_ratio > 1:
            raise ValueError(f"drop_ratio: must be > 1, got {drop_ratio}")
        if not (busy_factor >= 0 and stale_s > 0):
            raise ValueError(f"stale_s: need busy_factor >= 0 and stale_s > 0, got {busy_factor}, {stale_s}")
        self.busy_factor, self.stale_s, self._clock = busy_factor, stale_s, clock
        self._pings: deque[float] = deque(maxlen=NOISE_PINGS)
        self._sample_t: float | None = None  # clock() at the last bandwidth sample
        self._busy_based = False  # the estimate rests on a reading the hosts' CPU may have slowed
        self.doubts = 0  # non-samples since the last sample that disagreed with the estimate
        self.busy_transfers = 0  # readings the hosts' scheduling noise could account for
        self.under_bdp_transfers = 0
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
        self._pings.append(seconds)
        self._add_rtt(seconds)

    def _add_rtt(self, seconds: float) -> None:
        self._rtts.append(seconds)
        self.srtt_s = seconds if self.srtt_s is None else (1 - self.srtt_gain) * self.srtt_s + self.srtt_gain * seconds

    def observe_transfer(self, nbytes: int, seconds: float, *, includes_rtt: bool = True, cold: bool = False,
                         concurrent: int = 1, spread_s: float = 0.0, stall_s: float = 0.0) -> str:
        """One transfer of `nbytes` that took `seconds`: sender-timed (send -> ack, includes one
        RTT) by default, or receiver-timed (first -> last byte) with includes_rtt=False. `cold`:
        the first on its connection; `concurrent`: the sender's pushes in flight with it (itself
        included); `spread_s`: the sender paced it over that long (p2p/spread.py); `stall_s`: how
        long the sender's threads waited to run meanwhile (a StallMeter's reading). Returns what it
        was taken for: "sample", "busy" (a lower bound taken), or why it was no sample: "cold",
        "spread", "small", "under-bdp", "latency-bound", "busy-ignored", "burst", "suspect"."""
        if nbytes < 0 or not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds: need nbytes >= 0 and a finite seconds > 0, got {nbytes}, {seconds}")
        if not (stall_s >= 0 and math.isfinite(stall_s)):
            raise ValueError(f"stall_s: must be a finite number >= 0, got {stall_s}")
        self.transfers += 1
        if cold:
            self.cold_transfers += 1
            return "cold"
        if spread_s > 0 and (self.rtt_s is None or seconds < spread_s + 2 * self.rtt_s):
            # It ended about when the pace let it: its duration is the pace's, not the link's. Only a
            # push that ran well past its spread was held back by the link, and then measures it.
            self.spread_transfers += 1
            return "spread"
        rtt = self.rtt_s
        if includes_rtt and (rtt is None or seconds < rtt):
            self._add_rtt(seconds)  # it took at most one RTT: a better bound than the pings'
            rtt = seconds
        if nbytes < self.min_bytes:
            return "small"
        exposed = seconds - rtt if includes_rtt else seconds
        best = self.bandwidth_bps
        verdict = self._verdict(nbytes, exposed, rtt, includes_rtt, best, stall_s)
        if verdict is None:
            return self._add_rate(nbytes * 8.0 / max(exposed, 1e-9), nbytes, concurrent)
        if verdict == "busy" and (best is None or (nbytes * 8.0 / exposed > best and nbytes >= self.raise_bytes)):
            # The CPU slowed it, so the link carried at least this much: a lower bound may give a
            # first estimate or raise one (at low confidence), never lower one.
            self._add_rate(nbytes * 8.0 / exposed, nbytes, concurrent, busy=True)
            return "busy"
        if best is not None:
            self._doubt(nbytes, exposed, best)
        return "busy-ignored" if verdict == "busy" else verdict

    def _verdict(self, nbytes: int, exposed: float, rtt: float | None, includes_rtt: bool,
                 best: float | None, stall_s: float = 0.0) -> str | None:
        """Why a transfer is no clean bandwidth sample, or None when it is one."""
        if best is not None and rtt and nbytes * 8.0 < best * rtt:
            self.under_bdp_transfers += 1
            return "under-bdp"  # the link carries it within one RTT: latency and scheduling set its time
        if includes_rtt and exposed < max(self.min_exposed_fraction * rtt, self.min_exposed_s):
            return "latency-bound"  # says little about the bandwidth
        if exposed < self.busy_factor * self.noise_s or stall_s > STALL_SHARE * exposed:
            self.busy_transfers += 1
            return "busy"
        return None

    def _doubt(self, nbytes: int, exposed: float, best: float) -> None:
        """A non-sample that the estimate and the noise together cannot explain lowers its confidence
        (and so asks for a re-probe) without moving it: a link that really fell (or rose) is then
        measured by a transfer large enough to say so."""
        expected = nbytes * 8.0 / best
        slack = self.min_exposed_s + self.busy_factor * self.noise_s
        if exposed > DOUBT_RATIO * expected + slack or (expected > self.min_exposed_s and exposed * DOUBT_RATIO < expected):
            self.doubts += 1

    def _add_rate(self, rate: float, nbytes: int, concurrent: int, *, busy: bool = False) -> str:
        best = max(self._rates) if self._rates else None
        if best is not None and nbytes < self.raise_bytes and rate > best:
            return "burst"  # a small transfer's speed may be a shaper's burst: it cannot raise the estimate
        if best is not None and rate * self.drop_ratio < best:
            # At the estimate a latency-bound transfer's slowness is as likely a stalled thread as the
            # link: such a fall needs `window` readings in a row; any other, two.
            self._suspect.append(rate)
            if len(self._suspect) < (self.window if nbytes * 8.0 / best < self.min_exposed_s else 2):
                self.doubts += 2
                return "suspect"
            self._rates.clear()  # a fall this large is the link, not noise
            self._rates.extend(self._suspect)
        self._suspect.clear()
        self._rates.append(rate)
        self.concurrent = max(1, int(concurrent))
        self._sampled(busy=busy)
        return "busy" if busy else "sample"

    def _sampled(self, *, busy: bool) -> None:
        self._sample_t, self._busy_based, self.doubts = self._clock(), busy, 0

    def set_bandwidth(self, bps: float) -> None:
        """Replace the samples with one figure (a measurement corrected by what it shared with:
        regions/exchange.py evens out concurrent probes of one egress)."""
        if not (bps > 0 and math.isfinite(bps)):
            raise ValueError(f"bps: must be a finite number > 0, got {bps}")
        self._rates.clear()
        self._rates.append(bps)
        self._sampled(busy=self._busy_based)

    @property
    def bandwidth_bps(self) -> float | None:
        """Bits per second of payload at the last sample's concurrency, or None before a sample."""
        return max(self._rates) if self._rates else None

    @property
    def rtt_s(self) -> float | None:
        """The windowed minimum RTT in seconds, or None before any ping or transfer."""
        return min(self._rtts) if self._rtts else None

    @property
    def noise_s(self) -> float:
        """How far the latest pings ran over the path's RTT (their median): the time the hosts took
        to schedule them, since a ping carries no bytes. 0 before any ping."""
        rtt = self.rtt_s
        if rtt is None or not self._pings:
            return 0.0
        return max(0.0, statistics.median(self._pings) - rtt)

    @property
    def age_s(self) -> float | None:
        """Seconds since the estimate's last sample, or None without one."""
        return None if self._sample_t is None or not self._rates else max(0.0, self._clock() - self._sample_t)

    @property
    def confidence(self) -> float:
        """In [0, 1]: 0 without an estimate; 1 after a clean sample, halved per `stale_s` of age, per
        two doubts since (a suspected fall counts two), and once when the estimate rests on a busy
        reading."""
        age = self.age_s
        if age is None:
            return 0.0
        # Two doubts halve it: on a loaded host one update in a few stalls past the slack, and a
        # re-probe per doubt cost 15-27x the default run's update bytes.
        return (0.5 if self._busy_based else 1.0) * 0.5 ** (age / self.stale_s + min(self.doubts, 60) / 2)

    def needs_probe(self) -> bool:
        """Whether a window-opening probe should measure this link again: no estimate (once the RTT
        is known), or a confidence under one half (stale, doubted, or resting on a busy reading)."""
        if self.bandwidth_bps is None:
            return self.rtt_s is not None
        return self.confidence < 0.5

    def window_bytes(self, exposed_s: float) -> int | None:
        """A transfer that opens the link's windows and measures it past the noise: at least twice
        the BDP at the estimate and `exposed_s` (or busy_factor x the noise, if more) of its
        bandwidth. None without an estimate."""
        bw, rtt = self.bandwidth_bps, self.rtt_s or 0.0
        if bw is None:
            return None
        return int(max(2 * bw * rtt, bw * max(exposed_s, self.busy_factor * self.noise_s)) / 8)

    def snapshot(self) -> dict[str, Any]:
        """The estimate for the round's metrics (Mbit/s, ms; None where unknown): what the policy is given."""
        bw, rtt = self.bandwidth_bps, self.rtt_s
        return {"bandwidth_mbps": None if bw is None else bw / 1e6, "rtt_ms": None if rtt is None else rtt * 1e3,
                "srtt_ms": None if self.srtt_s is None else self.srtt_s * 1e3, "transfers": self.transfers,
                "cold_transfers": self.cold_transfers, "spread_transfers": self.spread_transfers,
                "concurrent": self.concurrent, "age_s": None if self.age_s is None else round(self.age_s, 2),
                "confidence": round(self.confidence, 3), "busy_transfers": self.busy_transfers,
                "under_bdp_transfers": self.under_bdp_transfers, "noise_ms": round(self.noise_s * 1e3, 2)}

    def state_dict(self) -> dict[str, Any]:
        """The samples and counters, for a checkpoint (`load_state_dict` restores them)."""
        return {"rates": list(self._rates), "rtts": list(self._rtts), "srtt_s": self.srtt_s,
                "transfers": self.transfers, "cold_transfers": self.cold_transfers,
                "spread_transfers": self.spread_transfers, "concurrent": self.concurrent,
                "age_s": self.age_s, "busy_based": self._busy_based, "doubts": self.doubts,
                "pings": list(self._pings), "busy_transfers": self.busy_transfers,
                "under_bdp_transfers": self.under_bdp_transfers}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore `state_dict()`'s samples; the window sizes stay this estimator's own."""
        self._rates = deque(d["rates"], maxlen=self.window)
        self._rtts = deque(d["rtts"], maxlen=self.rtt_window)
        self.srtt_s, self.concurrent = d.get("srtt_s"), d.get("concurrent")
        self.transfers, self.cold_transfers = int(d.get("transfers", 0)), int(d.get("cold_transfers", 0))
        self.spread_transfers = int(d.get("spread_transfers", 0))
        # Ages travel, not clock readings: a restored region's monotonic clock starts elsewhere.
        age = d.get("age_s")
        self._sample_t = None if age is None else self._clock() - float(age)
        self._busy_based, self.doubts = bool(d.get("busy_based", False)), int(d.get("doubts", 0))
        self._pings = deque(d.get("pings", []), maxlen=NOISE_PINGS)
        self.busy_transfers, self.under_bdp_transfers = int(d.get("busy_transfers", 0)), int(d.get("under_bdp_transfers", 0))
