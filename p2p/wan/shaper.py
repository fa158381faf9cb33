"""One direction of one proxied connection: read, wait for the window and the link, delay, deliver in order.

The model: a chunk read from the sender enters the link while the connection's congestion
window has room (window.py: slow start on a fresh or idle connection), *departs* once the link has
serialised it (at the configured rate, after the bytes queued before it) and *arrives*
`latency +- jitter` later, but never before the previous chunk of the same stream (so jitter
never reorders). A loss is a stall of one RTO before departure: the stream stops and the link
goes idle meanwhile, so loss costs goodput as it does for TCP. Bytes held between
read and delivery are bounded (about two bandwidth-delay products): when full, the proxy stops
reading and the sender's kernel buffers fill, which is the backpressure a real link applies.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
from collections.abc import Callable

from .links import LinkTable, Pair, Shape, link_name
from .window import MIN_RTO_S, MSS, CongestionWindow, idle_rto_s

MIN_READ, MAX_READ = 4096, 65536
READ_TIME_S = 0.005         # read about 5 ms worth of bytes at a time: fine enough steps for the bucket
MIN_BUFFER = 256 * 1024
OUTAGE_POLL_S = 0.05
SAMPLE_MIN_BYTES = 1024
# Deliveries further apart than this (as done and as scheduled) end a goodput sample. Under one
# RTT of the presets, so a request/response turn between two transfers is idle time, not the link's.
BUSY_GAP_S = 0.05
# The link has no burst: a real bottleneck serialises every byte, so B bytes take at least
# B / rate from the first. A token bucket's burst of 10 ms of line time let 1 MB at 200 Mbit/s
# and 80 ms arrive, acked, in 0.966 of bytes/rate + RTT (issue 14); a 16 KiB floor before it let
# whole compressed updates through unshaped at 0.05 Mbit/s. The proxy's own hiccups within a busy
# period (the time between serving one chunk and reading the next, a late wake-up) are bridged
# instead (LinkRuntime.reserve), when the next bytes were already waiting for the proxy.
SLACK_S = 0.002
READ_WAIT_S = 0.001     # a read that waited longer than this found no bytes waiting: the sender was the limit


def read_size(shape: Shape) -> int:
    """Bytes to read at a time on a link of this shape: about 5 ms of its rate, within [4 KiB, 64 KiB]."""
    return int(min(MAX_READ, max(MIN_READ, shape.rate_bps * READ_TIME_S)))


def buffer_limit(shape: Shape, cap_bytes: int) -> int:
    """Bytes one direction may hold in flight: 2 BDP (so the delay line never starves the link), capped."""
    bdp = shape.rate_bps * (shape.latency_s + shape.jitter_s + MIN_RTO_S * (shape.loss > 0))
    return int(min(cap_bytes, max(MIN_BUFFER, 2 * bdp + 2 * read_size(shape))))


def window_cap(shape: Shape, rtt_s: float) -> float:
    """Where slow start stops: 2 BDP (BBR's cwnd gain; a cubic window fills the bottleneck's queue
    on top of the BDP), so a warm window never limits the link, plus two reads of slack for the
    proxy's chunks."""
    return 2 * shape.rate_bps * rtt_s + 2 * read_size(shape)


def rto_s(shape: Shape) -> float:
    """The retransmission timeout a loss costs on this link: 2 x one-way latency + 4 x jitter, at least MIN_RTO_S."""
    return max(MIN_RTO_S, 2 * shape.latency_s + 4 * shape.jitter_s)


class LinkRuntime:
    """Loop-side state of one directed link: its serialisation clock (shared by its connections) and counters."""

    def __init__(self, pair: Pair):
        self.pair = pair
        self.name = link_name(pair)
        self._free_at: float | None = None   # when the link has serialised every byte given to it
        self.bytes = 0                  # delivered to the receiving side
        self.bytes_in = 0               # read from the sending side
        self.connections = 0
        self.active = 0
        self.resets = 0
        self.refused = 0
        self.loss_stalls = 0
        self.peak_buffered = 0
        self._busy_bytes = 0
        self._busy_s = 0.0
        self._last_delivery: float | None = None
        self._last_due = 0.0
        self._lat_sum = 0.0
        self._lat_n = 0

    def reserve(self, n: int, shape: Shape, now: float, credit_s: float = 0.0, since: float = float("-inf")) -> float:
        """Serialise n bytes on the link; seconds to wait until the last of them has left.

        The link is busy until `_free_at`; n bytes go after whatever is queued (another
        connection's bytes too), or from `now` if the link has gone idle, and never before
        `since` (when the bytes reached the proxy, if it had to wait for them). So B bytes never
        leave sooner than B / rate after the first of them arrived: there is no burst, an idle
        link banks nothing. A gap since the link went free of at most SLACK_S + `credit_s` (how
        late the caller's last sleep for the link woke) with the bytes already waiting is the
        proxy's own lateness, not idle time: the link carries on from where it was, so a loaded
        event loop does not lose bandwidth.
        """
        start = self._free_at
        if start is None or (start < now and now - start > SLACK_S + credit_s):
            start = now
        self._free_at = max(start, since) + n / shape.rate_bps
        return max(0.0, self._free_at - now)

    def delivered(self, n: int, now: float, one_way_s: float, shape: Shape, due: float | None = None,
                  fresh: bool = False) -> None:
        """Count n bytes handed to the receiver at `now` (they were due at `due`), and sample goodput.

        A sample is a run of deliveries no more than 50 ms apart, either as they happened or as
        they were scheduled (a CPU-starved event loop delivers late, but the link was busy and its
        catch-up follows); longer gaps (idle time, outages, loss stalls) are not the link's. Small
        writes (replies, acks, pings: under 1 KiB) neither start nor extend a run, so the receipt
        that follows a transfer by one latency does not stretch it. `fresh` bytes (sent after a
        wait for the congestion window: slow start, where the window and not the link paced the
        sender) start a new run, as after an idle gap.
        """
        self.bytes += n
        self._lat_sum += one_way_s
        self._lat_n += 1
        if n < SAMPLE_MIN_BYTES:
            return
        due = now if due is None else due
        busy_gap = max(BUSY_GAP_S, 3 * read_size(shape) / shape.rate_bps)
        if self._last_delivery is not None and not fresh and (now - self._last_delivery <= busy_gap or due - self._last_due <= busy_gap):
            self._busy_bytes += n
            self._busy_s += now - self._last_delivery
        self._last_delivery = now
        self._last_due = due

    def measured_goodput_mbps(self) -> float | None:
        if self._busy_s < 0.05:
            return None
        return self._busy_bytes * 8 / self._busy_s / 1e6

    def measured_latency_ms(self) -> float | None:
        return self._lat_sum / self._lat_n * 1e3 if self._lat_n else None


_EOF = b""


async def wait_outage(table: LinkTable, pair: Pair, clock: Callable[[], float]) -> None:
    """Block while an outage holds `pair`; a reset outage also has its connections reset by the proxy."""
    # Polled, not an asyncio.Event: an outage ends by the clock or by a table edit (end_outage), and
    # neither wakes a waiter.
    while (o := table.outage(*pair, clock())) is not None:  # noqa: ASYNC110 - see above
        # Re-check at least every 50 ms: an end_outage event may cut the window short.
        await asyncio.sleep(min(OUTAGE_POLL_S, max(0.001, o.end_s - clock())))


class Pipe:
    """src -> dst bytes of one connection through `link`."""

    def __init__(self, *, link: LinkRuntime, table: LinkTable, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, clock: Callable[[], float], rng: random.Random, cap_bytes: int,
                 shape_bandwidth: bool = True, window: CongestionWindow | None = None, start_at: float = 0.0):
        self.link, self.table, self.reader, self.writer = link, table, reader, writer
        self.clock, self.rng, self.cap = clock, rng, cap_bytes
        self.shape_bandwidth = shape_bandwidth   # False in kernel mode: tbf does it
        self.window = window                     # None: no slow start (bytes enter the link as read)
        self.start_at = start_at                 # no byte departs before the emulated handshake let it
        self.queue: collections.deque[tuple[float, float, bytes, bool]] = collections.deque()   # arrival, depart, data, fresh
        self.buffered = 0
        self.peak = 0
        self._has_data = asyncio.Event()
        self._has_space = asyncio.Event()
        self._last_arrival = float("-inf")
        self._late = 0.0   # how late the last sleep for the link woke

    def _shape(self) -> Shape:
        return self.table.shape(*self.link.pair)

    async def wait_outage(self) -> None:
        await wait_outage(self.table, self.link.pair, self.clock)

    async def pump_in(self) -> None:
        if (wait := self.start_at - self.clock()) > 0:
            await asyncio.sleep(wait)
        while True:
            shape = self._shape()
            while self.buffered >= buffer_limit(shape, self.cap):
                self._has_space.clear()
                await self._has_space.wait()
                shape = self._shape()
            asked = self.clock()
            data = await self.reader.read(read_size(shape) if self.shape_bandwidth else MAX_READ)
            got = self.clock()
            if not data:
                self._push(got, got, _EOF, False)
                return
            self.link.bytes_in += len(data)
            await self._pace(data, since=got if got - asked > READ_WAIT_S else float("-inf"))

    async def _pace(self, data: bytes, since: float) -> None:
        """Send one chunk, read at `since` (-inf: it was waiting), in pieces as large as the congestion window lets through."""
        off = 0
        while off < len(data):
            n, waited = (len(data) - off, False) if self.window is None else await self._window_room(len(data) - off)
            # After a wait for the window the piece is sent only now: the link idled before it.
            await self._send(data[off:off + n], since=self.clock() if waited else since, fresh=waited)
            off += n

    async def _window_room(self, want: int) -> tuple[int, bool]:
        """Wait until the window has room for a segment (or for all of `want`): how much may go, and whether it waited."""
        assert self.window is not None
        waited = False
        while True:
            now = self.clock()
            shape, back = self._shape(), self.table.shape(*self.link.pair[::-1])
            rtt = shape.latency_s + back.latency_s
            room = self.window.room(now, rto_s=idle_rto_s(rtt, shape.jitter_s + back.jitter_s), cap=window_cap(shape, rtt))
            if room >= min(want, MSS):
                return min(room, want), waited
            next_ack = self.window.next_ack()
            assert next_ack is not None, "a window with nothing in flight has room"
            await asyncio.sleep(max(0.0, next_ack - now))
            waited = True

    async def _send(self, data: bytes, since: float, fresh: bool) -> None:
        """Wait out outages, the link and loss stalls for one piece, then put it on the delay line."""
        await self.wait_outage()
        shape = self._shape()
        wait = self.link.reserve(len(data), shape, self.clock(), credit_s=self._late, since=since) if self.shape_bandwidth else 0.0
        if wait > 0:
            due = self.clock() + wait
            await asyncio.sleep(wait)
            # Credited to the next reservations, until the link has caught up and is waited for again.
            self._late = max(0.0, self.clock() - due)
        if shape.loss > 0 and self.rng.random() < 1 - (1 - shape.loss) ** math.ceil(len(data) / MSS):
            self.link.loss_stalls += 1
            await asyncio.sleep(rto_s(shape))
        depart = self.clock()
        delay = max(0.0, shape.latency_s + self.rng.uniform(-shape.jitter_s, shape.jitter_s)) if shape.jitter_s else shape.latency_s
        arrival = max(self._last_arrival, depart + delay)
        self._last_arrival = arrival
        if self.window is not None:   # its ack is back one reverse latency after it arrived
            self.window.sent(len(data), depart, arrival + self.table.shape(*self.link.pair[::-1]).latency_s)
        self._push(arrival, depart, data, fresh)

    def _push(self, arrival: float, depart: float, data: bytes, fresh: bool) -> None:
        self.queue.append((arrival, depart, data, fresh))
        self.buffered += len(data)
        self.peak = max(self.peak, self.buffered)
        self.link.peak_buffered = max(self.link.peak_buffered, self.buffered)
        self._has_data.set()

    async def pump_out(self) -> None:
        while True:
            while not self.queue:
                self._has_data.clear()
                await self._has_data.wait()
            arrival, depart, data, fresh = self.queue[0]
            if arrival > self.clock():
                await asyncio.sleep(arrival - self.clock())
            await self.wait_outage()   # bytes in flight when a link goes down arrive after it is back
            self.queue.popleft()
            if not data:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            self.writer.write(data)
            # Counted once handed to the socket: a reader may see the bytes before drain() returns.
            now = self.clock()
            self.link.delivered(len(data), now, now - depart, self._shape(), due=arrival, fresh=fresh)
            await self.writer.drain()
            self.buffered -= len(data)
            self._has_space.set()
