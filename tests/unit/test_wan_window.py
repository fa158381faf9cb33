"""The proxy's TCP model (no sockets): slow start, its cap, idle restart, and the transfer time it predicts."""

from __future__ import annotations

import pytest

from geofed.p2p.wan.window import INITIAL_WINDOW, MSS, CongestionWindow, idle_rto_s, transfer_s

RTT, RTO = 0.08, idle_rto_s(0.08, 0.0)
BIG = 1e12


def _flights(window: CongestionWindow, rounds: int, t0: float = 0.0) -> list[int]:
    """Bytes sent per RTT by a sender with endless data on an infinitely fast link."""
    sent, t = [], t0
    for _ in range(rounds):
        n = window.room(t, rto_s=RTO, cap=BIG)
        window.sent(n, t, t + RTT)
        sent.append(n)
        t += RTT
    return sent


def test_a_fresh_window_is_ten_segments_and_doubles_every_rtt():
    w = CongestionWindow(restart_after_idle=False)
    assert INITIAL_WINDOW == 10 * MSS
    assert _flights(w, 5) == [INITIAL_WINDOW * 2**k for k in range(5)]


def test_nothing_more_goes_until_an_ack_is_back():
    w = CongestionWindow(restart_after_idle=False)
    w.sent(INITIAL_WINDOW, 0.0, RTT)
    assert w.room(RTT - 1e-6, rto_s=RTO, cap=BIG) == 0
    assert w.next_ack() == RTT
    assert w.room(RTT, rto_s=RTO, cap=BIG) == 2 * INITIAL_WINDOW


def test_the_window_stops_growing_at_the_cap():
    w = CongestionWindow(restart_after_idle=False)
    cap = 5 * INITIAL_WINDOW
    t = 0.0
    for _ in range(6):
        n = w.room(t, rto_s=RTO, cap=cap)
        w.sent(n, t, t + RTT)
        t += RTT
    assert w.room(t, rto_s=RTO, cap=cap) == cap


@pytest.mark.parametrize("restart", [True, False])
def test_idle_restart_follows_the_sysctl(restart):
    # Linux (tcp_cwnd_restart): after an idle gap of more than one RTO with nothing in flight,
    # cwnd halves once per RTO of the gap, never below the initial window; BBR and
    # tcp_slow_start_after_idle=0 keep it.
    w = CongestionWindow(restart_after_idle=restart)
    _flights(w, 6)                       # cwnd 64 initial windows once all is acked, at 6 RTT
    open_cwnd = 64 * INITIAL_WINDOW
    t = 5 * RTT                          # the last send: idle time counts from it (tcp_sock.lsndtime)
    assert w.room(t + 0.9 * RTO, rto_s=RTO, cap=BIG) == open_cwnd   # a short pause: no restart
    assert w.room(t + 2.5 * RTO, rto_s=RTO, cap=BIG) == (open_cwnd // 4 if restart else open_cwnd)
    assert w.room(t + 100 * RTO, rto_s=RTO, cap=BIG) == (INITIAL_WINDOW if restart else open_cwnd)
    assert w.restarts == (2 if restart else 0)


def test_no_restart_while_bytes_are_in_flight():
    w = CongestionWindow(restart_after_idle=True)
    _flights(w, 3)
    w.sent(100, 3 * RTT, 10.0)           # an ack that takes long (a stalled receiver)
    assert w.room(5.0, rto_s=RTO, cap=BIG) == 8 * INITIAL_WINDOW - 100


def test_linux_rto_is_the_rtt_plus_200_ms():
    assert idle_rto_s(0.08, 0.0) == pytest.approx(0.28)
    assert idle_rto_s(0.08, 0.1) == pytest.approx(0.48)


def test_transfer_time_cold_and_warm():
    rate = 50e6 / 8
    # Warm (window open): exactly the physical limit, bytes / rate + RTT.
    for n in (64 << 10, 1 << 20, 8 << 20):
        assert transfer_s(n, rate, RTT, cwnd=BIG) == pytest.approx(n / rate + RTT)
    # Cold: what the packet delay line measured for a plain TCP socket (1 MiB at 50 Mbit/s and
    # 80 ms: 0.577-0.579 s, i.e. 2.3x), and never below the limit.
    assert transfer_s(1 << 20, rate, RTT) == pytest.approx(0.578, rel=0.02)
    for n in (1, 64 << 10, 1 << 20, 8 << 20, 64 << 20):
        assert transfer_s(n, rate, RTT) >= n / rate + RTT
    # Within the initial window a transfer is one round: the window costs nothing.
    assert transfer_s(INITIAL_WINDOW, rate, RTT) == pytest.approx(INITIAL_WINDOW / rate + RTT)
    # A cap below the BDP (500 kB here) limits the rate to cap / RTT.
    assert transfer_s(8 << 20, rate, RTT, cwnd=100_000, cap=100_000) == pytest.approx((8 << 20) / (100_000 / RTT), rel=0.02)
