"""A plain TCP forwarder for kernel mode with endpoints in the host namespace.

Path of one connection, src -> dst, kernel_latency proxy: client (host) -> shaping proxy (host;
latency, jitter, loss, outages) -> a socket in src's namespace -> veth with tbf (bandwidth) ->
a relay listening in dst's namespace -> a socket in the host namespace -> the real server.
kernel_latency packet: client (host) -> a relay in the host whose next hop is a socket in src's
namespace -> TUN, tbf, packet delay line -> a relay in dst's namespace -> the real server. A
relay adds nothing but a copy; it exists so that processes need not run inside the namespaces.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from .proxy import CLOSE_TIMEOUT_S, CONNECT_TIMEOUT_S, STREAM_LIMIT, _rst

log = logging.getLogger(__name__)
COPY_BYTES = 256 * 1024

Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


def tcp_opener(host: str, port: int) -> Opener:
    """An Opener dialling host:port (the next hop of a relay)."""
    return lambda: asyncio.open_connection(host, port, limit=STREAM_LIMIT)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(COPY_BYTES):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


class Relay:
    """A forwarder listening on `sock`: each connection is copied both ways to a fresh one from `opener`."""

    def __init__(self, sock: socket.socket, opener: Opener, name: str = ""):
        self.sock = sock          # bound and listening (in whichever namespace it was made)
        self.opener = opener      # dials the next hop
        self.name = name
        self.server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        """Start accepting on the listening socket."""
        self.server = await asyncio.start_server(self._handle, sock=self.sock, limit=STREAM_LIMIT)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.wait_for(self.opener(), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            log.info("wan relay %s: next hop unreachable (%s)", self.name, exc)
            _rst(writer)
            return
        self._writers.update((writer, up_w))
        try:
            await asyncio.gather(_copy(reader, up_w), _copy(up_r, writer))
        except (OSError, asyncio.IncompleteReadError):
            _rst(writer)
            _rst(up_w)
        finally:
            self._writers.difference_update((writer, up_w))
            for w in (writer, up_w):
                w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self._writers):
            _rst(w)
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
