"""What a terminating proxy hides from TCP, put back as a model: the handshake and the congestion window.

The proxy ends the client's TCP connection on loopback and opens its own to the server, so
neither kernel sees the emulated RTT: connect() returns at once and the sender's congestion
window is never the limit. On a real path (and through kernel mode's packet delay line) a new
connection pays the SYN / SYN-ACK round trip before its first byte, then TCP slow start: an
initial window of 10 segments (Linux, RFC 6928) that grows by the bytes acknowledged, so it
doubles every RTT until the link's rate, not the window, is the limit. Measured on shaped
namespaces (FIELD-NOTES, issue 14): a fresh mTLS channel paid 2 RTT to connect plus slow start,
1 MiB at 50 Mbit/s / 80 ms took 2.4x the ideal.

The model, per direction of each connection: bytes enter the link (the token bucket) only while
`in flight < cwnd`; a byte counts as in flight from the moment it enters until its ack would be
back, one RTT (this link's latency plus the reverse link's) after the bucket let it depart;
each acked byte adds a byte to cwnd. There is no loss-driven back-off (loss is a stall, see
shaper.py): cwnd grows until it no longer limits (it stops at 2 BDP, shaper.window_cap).
"""

from __future__ import annotations

import collections

MSS = 1448                   # bytes of payload per TCP segment
INITIAL_WINDOW = 10 * MSS    # Linux's initial congestion window (IW10, RFC 6928)
MIN_RTO_S = 0.2              # Linux's minimum retransmission timeout (TCP_RTO_MIN)


def idle_rto_s(rtt_s: float, jitter_s: float) -> float:
    """Linux's RTO on a path with a steady RTT: srtt + max(4 rttvar, rto_min)."""
    return rtt_s + max(MIN_RTO_S, 4 * jitter_s)


class CongestionWindow:
    """One sender's congestion window (bytes) and the acks it waits for; times are emulator seconds.

    `restart_after_idle` is Linux's `net.ipv4.tcp_slow_start_after_idle` for a congestion control
    that honours it (reno, cubic): a sender that has nothing in flight and sent nothing for more
    than an RTO halves cwnd once per RTO of that gap, down to the initial window
    (tcp_cwnd_restart). BBR skips that check (it has its own `cong_control`), as does the sysctl at 0.
    """

    def __init__(self, *, restart_after_idle: bool, initial: int = INITIAL_WINDOW):
        self.initial = initial
        self.cwnd = float(initial)
        self.inflight = 0
        self.restart_after_idle = restart_after_idle
        self.restarts = 0
        self._acks: collections.deque[tuple[float, int]] = collections.deque()
        self._last_send: float | None = None

    def room(self, now: float, *, rto_s: float, cap: float) -> int:
        """Bytes that may enter the link now (acks due by `now` counted, idle restart applied)."""
        while self._acks and self._acks[0][0] <= now:
            _, n = self._acks.popleft()
            self.inflight -= n
            self.cwnd = min(max(cap, self.cwnd), self.cwnd + n)   # slow start: +1 byte per byte acked
        if self.restart_after_idle and self.inflight == 0 and self._last_send is not None:
            self._restart(now - self._last_send, rto_s)
        return max(0, int(min(self.cwnd, max(cap, self.initial))) - self.inflight)

    def _restart(self, idle_s: float, rto_s: float) -> None:
        cwnd = self.cwnd
        while (idle_s := idle_s - rto_s) > 0 and cwnd > self.initial:
            cwnd /= 2
        if cwnd < self.cwnd:
            self.restarts += 1
            self.cwnd = max(cwnd, float(self.initial))

    def next_ack(self) -> float | None:
        """When the oldest byte in flight is acked (None: nothing in flight)."""
        return self._acks[0][0] if self._acks else None

    def sent(self, n: int, now: float, ack_at: float) -> None:
        """`n` bytes left the sender at `now`; their ack will be back at `ack_at`."""
        self.inflight += n
        self._last_send = now
        self._acks.append((ack_at, n))


def transfer_s(nbytes: int, rate_bps: float, rtt_s: float, *, cwnd: float = INITIAL_WINDOW, cap: float = float("inf")) -> float:
    """Seconds from the first byte sent to the last byte's ack for a sender starting at `cwnd`.

    The model above in closed steps, one segment at a time: a segment enters the link when the
    window has room, leaves it after the link has serialised it (`rate_bps`, bytes per second)
    and is acked `rtt_s` later, adding itself to cwnd (up to `cap`). A cold connection starts at
    the initial window; a warm one (cwnd >= the bandwidth-delay product) takes
    `nbytes / rate + rtt`. What a transfer over a real path costs after its handshake, and a
    floor for anything sent through the proxy.
    """
    acks: collections.deque[tuple[float, int]] = collections.deque()
    t = link_free = last_ack = 0.0
    inflight = sent = 0
    while sent < nbytes:
        n = min(MSS, nbytes - sent)
        while inflight + n > cwnd:
            at, acked = acks.popleft()
            t, inflight = max(t, at), inflight - acked
            cwnd = min(max(cap, cwnd), cwnd + acked)
        link_free = max(t, link_free) + n / rate_bps
        last_ack = link_free + rtt_s
        acks.append((last_ack, n))
        inflight += n
        sent += n
    return last_ack
