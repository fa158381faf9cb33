"""A transfer whose time the sender's own CPU set (p2p/estimator.py, `stall_s` and StallMeter).

Issue 37 item 1: on the default run under load, the region that also evaluates (us-east-1) read
0.3-0.6 of its out-links in probes whose pings stayed within 50 ms of the path; such readings were
clean samples, and the estimates ended on them.
"""

from __future__ import annotations

import threading
import time

import pytest

from geofed.p2p.estimator import STALL_SHARE, LinkEstimator, StallMeter

RTT = 0.04


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _seconds(nbytes: int, bps: float) -> float:
    return RTT + nbytes * 8.0 / bps


def test_readings_the_senders_cpu_stalled_never_replace_a_good_estimate():
    """Four 1 MB probes at 0.4 of a 40 Mbit/s link, each with the sender's threads waiting to run for
    most of it. Before (59d752a: no `stall_s`): TypeError; without the argument they were samples,
    and once the window held only them the estimate was 16 Mbit/s."""
    est = LinkEstimator()
    est.observe_rtt(RTT)
    assert est.observe_transfer(1 << 20, _seconds(1 << 20, 40e6)) == "sample"
    slow = _seconds(1 << 20, 16e6)
    verdicts = [est.observe_transfer(1 << 20, slow, stall_s=0.9 * (slow - RTT)) for _ in range(4)]
    assert verdicts == ["busy-ignored"] * 4
    assert est.bandwidth_bps == pytest.approx(40e6, rel=1e-6) and est.busy_transfers == 4
    # A reading with less of its time stalled is the link's: a fall of 2.5x shows once the window holds it.
    for _ in range(3):
        assert est.observe_transfer(1 << 20, slow, stall_s=0.5 * STALL_SHARE * (slow - RTT)) == "sample"
    assert est.bandwidth_bps == pytest.approx(16e6, rel=1e-3)


def test_a_first_reading_the_senders_cpu_stalled_is_a_lower_bound_at_low_confidence():
    """Before: the set-up probe of a busy region was a clean sample (confidence 1, no re-probe for
    STALE_S): the default run's us-east-1 started at 4 Mbit/s on links of 26-52."""
    clock = _Clock()
    est = LinkEstimator(clock=clock)
    est.observe_rtt(RTT)
    slow = _seconds(1 << 20, 4e6)
    assert est.observe_transfer(1 << 20, slow, stall_s=0.8 * (slow - RTT)) == "busy"
    assert est.bandwidth_bps == pytest.approx(4e6, rel=1e-3)
    clock.t += 0.1
    assert est.confidence <= 0.5 and est.needs_probe()
    # A calm reading of the link raises it at once, and the estimate is sure of itself again.
    assert est.observe_transfer(1 << 20, _seconds(1 << 20, 40e6), stall_s=0.001) == "sample"
    assert est.bandwidth_bps == pytest.approx(40e6, rel=1e-3) and not est.needs_probe()


def test_a_bad_stall_is_refused_naming_it():
    est = LinkEstimator()
    est.observe_rtt(RTT)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stall_s"):
            est.observe_transfer(1 << 20, 0.5, stall_s=bad)
    with pytest.raises(ValueError, match="tick_s"):
        StallMeter(tick_s=0)


def test_the_stall_meter_reads_threads_that_hold_the_gil():
    """Two pure-Python threads that never sleep (what an evaluation beside a region's sends is to
    its other threads): the meter's thread waits to run for most of the time. Measured: 0.9 of it
    beside a probe, against 0.04-0.25 for quiet probes on the shared host."""
    stop = threading.Event()

    def hog() -> None:
        x = 0
        while not stop.is_set():
            for i in range(10_000):
                x += i

    hogs = [threading.Thread(target=hog, daemon=True) for _ in range(2)]
    for h in hogs:
        h.start()
    try:
        with StallMeter() as m:
            time.sleep(0.3)
    finally:
        stop.set()
        for h in hogs:
            h.join()
    assert m.elapsed_s >= 0.3 and m.share > STALL_SHARE, (m.stall_s, m.elapsed_s)
