"""The asyncio shaping TCP proxy: one listener per (src, dst, target) route, two Pipes per connection.

Everything here runs on the emulator's event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .links import LinkTable, Pair
from .shaper import LinkRuntime, Pipe, wait_outage
from .window import CongestionWindow

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
STREAM_LIMIT = 256 * 1024   # asyncio's read buffer; pipes read at most 64 KiB at a time


@dataclass(eq=False)
class Route:
    """One listener of the proxy: connections to it go src -> dst and are forwarded to the target."""

    src: str
    dst: str
    target_host: str
    target_port: int
    sock: socket.socket                  # the bound, listening socket (made on the caller's thread)
    server: asyncio.base_events.Server | None = None
    address: str = ""
    upstream: tuple[str, int] | None = None   # kernel mode: where the socket in src's namespace dials

    @property
    def pair(self) -> Pair:
        """The directed link its connections' client-to-server bytes cross."""
        return (self.src, self.dst)


OpenUpstream = Callable[[Route], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def open_tcp(route: Route) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The default upstream: a plain TCP connection to the route's target."""
    return await asyncio.open_connection(route.target_host, route.target_port, limit=STREAM_LIMIT)


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a cut link or a refused connection looks to the peer."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


@dataclass(eq=False)
class _Conn:
    route: Route
    client_w: asyncio.StreamWriter
    upstream_w: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    was_reset: bool = False

    def reset(self) -> None:
        self.was_reset = True
        _rst(self.client_w)
        _rst(self.upstream_w)
        for t in self.tasks:
            t.cancel()


class Proxy:
    """The shaping TCP proxy: every route's connections are forwarded through two Pipes that apply the
    link table's shape and outages. Runs on the emulator's event loop; not thread-safe.
    """

    def __init__(self, *, table: LinkTable, clock: Callable[[], float], seed: int, cap_bytes: int,
                 open_upstream: OpenUpstream = open_tcp, shape_bandwidth: bool = True,
                 slow_start_after_idle: bool = False):
        self.table = table
        self.clock = clock
        self.seed = seed
        self.cap_bytes = cap_bytes
        self.open_upstream = open_upstream
        self.shape_bandwidth = shape_bandwidth
        self.slow_start_after_idle = slow_start_after_idle
        self.links = {p: LinkRuntime(p) for p in table.pairs}
        self.routes: list[Route] = []
        self._conns: set[_Conn] = set()
        self._n = 0

    async def serve(self, route: Route) -> None:
        """Start accepting connections on `route`'s listening socket."""
        route.server = await asyncio.start_server(lambda r, w: self._handle(route, r, w), sock=route.sock,
                                                  limit=STREAM_LIMIT)
        self.routes.append(route)

    def _resetting(self, route: Route) -> bool:
        now = self.clock()
        return any((o := self.table.outage(*p, now)) is not None and o.mode == "reset"
                   for p in (route.pair, route.pair[::-1]))

    async def _handle(self, route: Route, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        fwd, rev = self.links[route.pair], self.links[route.pair[::-1]]
        if self._resetting(route):
            fwd.refused += 1
            _rst(client_w)
            return
        conn = _Conn(route=route, client_w=client_w)
        self._conns.add(conn)
        fwd.connections += 1
        try:
            await self._run(conn, client_r, fwd, rev)
        finally:
            self._conns.discard(conn)

    async def _run(self, conn: _Conn, client_r, fwd: LinkRuntime, rev: LinkRuntime) -> None:
        route = conn.route
        self._n += 1
        # One RNG per connection, derived from the seed, so a run's jitter/loss draws do not depend on thread timing.
        rng = random.Random(zlib.crc32(f"{self.seed}:{fwd.name}:{self._n}".encode()))
        await wait_outage(self.table, fwd.pair, self.clock)   # a stalled link: the client's connect succeeded, its bytes wait
        # The TCP handshake: the client's connect() returned at once (loopback), but its first byte
        # may leave only once SYN and SYN-ACK have crossed; the server accepts when the ACK lands.
        syn, syn_ack = (self._one_way(p, rng) for p in (fwd.pair, rev.pair))
        t_connected = self.clock() + syn + syn_ack
        await asyncio.sleep(syn + syn_ack)
        if conn.was_reset:
            return
        try:
            up_r, up_w = await asyncio.wait_for(self.open_upstream(route), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            log.info("wan: %s: upstream %s:%s unreachable (%s); resetting the client", fwd.name,
                     route.target_host, route.target_port, exc)
            _rst(conn.client_w)
            return
        conn.upstream_w = up_w
        common = dict(table=self.table, clock=self.clock, rng=rng, cap_bytes=self.cap_bytes, shape_bandwidth=self.shape_bandwidth)
        first = Pipe(link=fwd, reader=client_r, writer=up_w, window=self._window(), **common)
        back = Pipe(link=rev, reader=up_r, writer=conn.client_w, window=self._window(),
                    start_at=t_connected + syn, **common)
        fwd.active += 1
        conn.tasks = [asyncio.ensure_future(c) for c in (first.pump_in(), first.pump_out(), back.pump_in(), back.pump_out())]
        try:
            await self._supervise(conn, fwd)
        finally:
            fwd.active -= 1

    def _one_way(self, pair: Pair, rng: random.Random) -> float:
        shape = self.table.shape(*pair)
        return max(0.0, shape.latency_s + rng.uniform(-shape.jitter_s, shape.jitter_s)) if shape.jitter_s else shape.latency_s

    def _window(self) -> CongestionWindow:
        return CongestionWindow(restart_after_idle=self.slow_start_after_idle)

    async def _supervise(self, conn: _Conn, fwd: LinkRuntime) -> None:
        pending = set(conn.tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed or any(t.cancelled() for t in done):
                # One side was reset or cut: the other side sees a reset too, as across a real path.
                if not conn.was_reset:   # else reset_links() already counted it
                    fwd.resets += 1
                    conn.reset()
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return
        for w in (conn.client_w, conn.upstream_w):
            assert w is not None
            w.close()
        for w in (conn.client_w, conn.upstream_w):
            try:
                await asyncio.wait_for(w.wait_closed(), CLOSE_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                pass

    def reset_links(self, pairs: list[Pair]) -> int:
        """Reset every open connection that crosses one of `pairs` (either direction); returns how many."""
        hit = [c for c in self._conns if not c.was_reset and (c.route.pair in pairs or c.route.pair[::-1] in pairs)]
        for c in hit:
            self.links[c.route.pair].resets += 1
            c.reset()
        return len(hit)

    async def close(self) -> None:
        for r in self.routes:
            if r.server is not None:
                r.server.close()
        for c in list(self._conns):
            c.reset()
        tasks = [t for c in self._conns for t in c.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
        for r in self.routes:
            if r.server is not None:
                try:
                    await asyncio.wait_for(r.server.wait_closed(), CLOSE_TIMEOUT_S)
                except asyncio.TimeoutError:
                    pass

    def peak_buffered(self) -> int:
        return max((lr.peak_buffered for lr in self.links.values()), default=0)
