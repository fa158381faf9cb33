"""A plain TCP forwarder for kernel mode with endpoints in the host namespace.

Path of one connection, src -> dst: client (host) -> shaping proxy (host; latency, jitter, loss,
outages) -> a socket in src's namespace -> veth with tbf (bandwidth) -> this relay, listening in
dst's namespace -> a socket in the host namespace -> the real server. The relay adds nothing but
a copy; it exists so that processes need not run inside the namespaces.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from .proxy import CLOSE_TIMEOUT_S, CONNECT_TIMEOUT_S, STREAM_LIMIT, _rst

log = logging.getLogger(__name__)
COPY_BYTES = 256 * 1024


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(COPY_BYTES):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


class Relay:
    def __init__(self, sock: socket.socket, target_host: str, target_port: int):
        self.sock = sock          # bound and listening, in the destination's namespace
        self.target = (target_host, target_port)
        self.server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, sock=self.sock, limit=STREAM_LIMIT)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(*self.target, limit=STREAM_LIMIT), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            log.info("wan relay: %s:%s unreachable (%s)", *self.target, exc)
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
