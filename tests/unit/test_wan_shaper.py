"""The shaper's arithmetic: token bucket, buffer bound, read size, RTO (no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geofed.p2p.wan import LinkSpec
from geofed.p2p.wan.links import Shape
from geofed.p2p.wan.shaper import MAX_READ, MIN_BUFFER, LinkRuntime, buffer_limit, read_size, rto_s


def shape(mbps=50.0, latency_ms=40.0, jitter_ms=0.0, loss=0.0) -> Shape:
    return Shape.of(LinkSpec(latency_ms=latency_ms, bandwidth_mbps=mbps, jitter_ms=jitter_ms, loss=loss))


def test_link_starts_idle_then_serialises_at_the_rate():
    # No burst (issue 14): a real bottleneck serialises every byte, so even the first chunk after
    # idle waits for its own line time. A 10 ms burst let 1 MB at 200 Mbit/s beat bytes/rate + RTT.
    s = shape(mbps=8.0)   # 1e6 bytes/s
    lr = LinkRuntime(("a", "b"))
    assert lr.reserve(10_000, s, now=0.0) == pytest.approx(0.01)
    assert lr.reserve(10_000, s, now=0.0) == pytest.approx(0.02)
    # 5 ms later the link is still busy until 20 ms: the next 1000 bytes queue behind.
    assert lr.reserve(1000, s, now=0.005) == pytest.approx(0.016)


def test_an_idle_link_banks_nothing():
    for mbps in (8.0, 0.05):   # also a link scaled down by bandwidth_scale: 10 KiB still pays all its time
        s = shape(mbps=mbps)
        lr = LinkRuntime(("a", "b"))
        lr.reserve(1, s, now=0.0)
        assert lr.reserve(10_240, s, now=100.0) == pytest.approx(10_240 / s.rate_bps)


def test_a_hiccup_within_a_busy_period_is_bridged_an_idle_gap_is_not():
    s = shape(mbps=8.0)   # 1e6 bytes/s: 10 kB = 10 ms
    # (gap after the link went free, when the bytes reached the proxy, expected wait)
    for gap, since, wait in ((0.001, float("-inf"), 0.009),   # bytes were waiting: a 1 ms hiccup is bridged
                             (0.05, float("-inf"), 0.01),     # an idle gap is not
                             (0.001, 0.011, 0.01)):           # the sender was late: the link idled until its bytes came
        lr = LinkRuntime(("a", "b"))
        lr.reserve(10_000, s, now=0.0)            # through at 10 ms
        assert lr.reserve(10_000, s, now=0.01 + gap, since=since) == pytest.approx(wait), (gap, since)


@settings(max_examples=200, deadline=None)
@given(mbps=st.floats(1, 10_000), chunks=st.lists(st.integers(1, 65536), min_size=20, max_size=200),
       lateness=st.floats(0, 0.003))
def test_long_run_rate_is_exact_despite_late_wakeups(mbps, chunks, lateness):
    # A sender that sleeps as told, always waking `lateness` late, still gets exactly the rate
    # (the link carries on from where it was), and never more: no chunk is through before the
    # line time of all the bytes up to it.
    s = shape(mbps=mbps)
    lr = LinkRuntime(("a", "b"))
    now = late = paid = 0.0
    for n in chunks:
        wait = lr.reserve(n, s, now, credit_s=late)
        paid += n
        assert now + wait >= paid / s.rate_bps - 1e-9   # never before its line time
        if wait > 0:
            late = lateness
            now += wait + late
    ideal = sum(chunks) / s.rate_bps
    assert now <= ideal + lateness + 1e-9   # the lateness of all but the last sleep was made up


def test_read_size_and_buffer_limit_follow_the_rate():
    assert read_size(shape(mbps=1)) == 4096
    assert read_size(shape(mbps=50)) == int(50e6 / 8 * 0.005)
    assert read_size(shape(mbps=10_000)) == MAX_READ
    cap = 32 << 20
    assert buffer_limit(shape(mbps=1, latency_ms=1), cap) == MIN_BUFFER
    big = shape(mbps=1000, latency_ms=100)
    assert buffer_limit(big, cap) == int(2 * 125e6 * 0.1 + 2 * MAX_READ)
    assert buffer_limit(shape(mbps=10_000, latency_ms=500), cap) == cap


def test_rto_is_at_least_linux_minimum():
    assert rto_s(shape(latency_ms=10)) == 0.2
    assert rto_s(shape(latency_ms=150, jitter_ms=10)) == pytest.approx(0.34)


def test_goodput_counts_busy_time_only():
    s = shape(mbps=80.0)   # 10 MB/s, 50 KB reads
    lr = LinkRuntime(("a", "b"))
    t = 0.0
    for _ in range(20):         # 1 MB at 10 MB/s in 50 KB pieces
        lr.delivered(50_000, t, 0.04, s)
        t += 0.005
    t += 5.0                    # idle: not counted
    for _ in range(20):
        lr.delivered(50_000, t, 0.04, s)
        t += 0.005
    assert lr.bytes == 2_000_000
    assert lr.measured_goodput_mbps() == pytest.approx(80.0, rel=1e-6)
    assert lr.measured_latency_ms() == pytest.approx(40.0)


def test_small_writes_do_not_stretch_a_sample():
    # A 1-byte receipt 50 ms after a transfer must not stretch its busy time.
    s = shape(mbps=80.0)
    lr = LinkRuntime(("a", "b"))
    t = 0.0
    for _ in range(40):
        lr.delivered(50_000, t, 0.01, s)
        t += 0.005
    lr.delivered(1, t + 0.045, 0.01, s)
    assert lr.bytes == 40 * 50_000 + 1
    assert lr.measured_goodput_mbps() == pytest.approx(80.0, rel=1e-6)


def test_lateness_credit_keeps_the_rate_when_the_loop_is_starved():
    # Every sleep for the link wakes 50 ms late (a loaded machine). Without credit, all but the
    # 2 ms slack of that time is lost capacity; with credit, the sender catches up and gets the full rate.
    s = shape(mbps=20.0)   # 2.5e6 bytes/s
    for credit, expect_rate in ((False, False), (True, True)):
        lr = LinkRuntime(("a", "b"))
        now, late, sent = 0.0, 0.0, 0
        while now < 2.0:
            wait = lr.reserve(8192, s, now, credit_s=late if credit else 0.0)
            sent += 8192
            if wait > 0:   # as Pipe._send: the credit holds until the link is waited for again
                late = 0.05
                now += wait + late
        rate = sent / now
        assert (rate == pytest.approx(s.rate_bps, rel=0.05)) is expect_rate, rate


def test_a_late_delivery_is_busy_time_and_an_idle_gap_is_not():
    s = shape(mbps=80.0)   # 10 MB/s
    for starved in (True, False):
        lr = LinkRuntime(("a", "b"))
        lr.delivered(50_000, 0.000, 0.01, s, due=0.000)
        lr.delivered(50_000, 0.005, 0.01, s, due=0.005)
        # Delivered 300 ms later: due 5 ms later but the loop was starved, or sent only then.
        lr.delivered(50_000, 0.305, 0.01, s, due=0.010 if starved else 0.305)
        if starved:   # 100 kB sampled over 305 ms
            assert lr.measured_goodput_mbps() == pytest.approx(100_000 * 8 / 0.305 / 1e6)
        else:         # only the first 5 ms are a sample: too short to report
            assert lr.measured_goodput_mbps() is None


def test_bytes_sent_after_a_window_wait_start_a_new_sample():
    # Slow start: flights 30 ms apart (under the 50 ms busy gap) paced by acks, not by the link.
    # Each flight after a wait for the window starts a run, so the gaps are not the link's time.
    s = shape(mbps=80.0)   # 10 MB/s
    lr = LinkRuntime(("a", "b"))
    t = 0.0
    for flight in range(6):
        for i in range(2 ** flight):
            lr.delivered(50_000, t, 0.01, s, fresh=(i == 0))
            t += 0.005
        t += 0.030
    assert lr.measured_goodput_mbps() == pytest.approx(80.0, rel=1e-6)
