"""Kernel mode with `kernel_latency: packet`: a user-space delay line for IP packets between TUN devices.

Each region pair is joined by two TUN devices, one in each namespace; the kernel shapes what a
namespace sends with tbf on its TUN's egress, and this delay line carries each packet from one
TUN's file descriptor to the other's after `latency +- jitter` (never reordering), drops it with
probability `loss`, and drops everything during an outage (a black hole: TCP retransmits and
backs off, as over a cut WAN path). Unlike the TCP proxy it delays the handshake and every ACK,
so TCP sees the emulated RTT: slow start and window limits are real. Python handles each packet,
so keep such links to a few hundred Mbit/s (larger `kernel_mtu` means fewer packets).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
from collections.abc import Callable

from .links import LinkTable, Pair
from .shaper import LinkRuntime

MAX_PACKET = 65536
READS_PER_WAKE = 512    # packets read per readable event before yielding to the loop
EARLY_S = 0.0002        # deliver packets due within this much of now together


class PacketPath:
    """Packets src -> dst: read from src's end of the link, written into dst's end when due."""

    def __init__(self, *, pair: Pair, read_fd: int, write_fd: int, table: LinkTable, link: LinkRuntime,
                 clock: Callable[[], float], rng: random.Random, cap_bytes: int):
        self.pair, self.read_fd, self.write_fd = pair, read_fd, write_fd
        self.table, self.link, self.clock, self.rng, self.cap = table, link, clock, rng, cap_bytes
        self.queue: collections.deque[tuple[float, float, bytes]] = collections.deque()
        self.buffered = 0
        self.dropped = 0
        self._last_arrival = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.read_fd, self._on_readable)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.read_fd)
        if self._timer is not None:
            self._timer.cancel()

    def _on_readable(self) -> None:
        for _ in range(READS_PER_WAKE):
            try:
                packet = os.read(self.read_fd, MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:   # the device went away (stop() is on its way)
                self.stop()
                return
            self._admit(packet)
        self._schedule()

    def _admit(self, packet: bytes) -> None:
        now = self.clock()
        shape = self.table.shape(*self.pair)
        self.link.bytes_in += len(packet)
        if self.table.outage(*self.pair, now) is not None or self.buffered + len(packet) > self.cap:
            self.dropped += 1
            return
        if shape.loss and self.rng.random() < shape.loss:
            self.link.loss_stalls += 1   # here a real drop: TCP recovers it
            return
        delay = shape.latency_s + (self.rng.uniform(-shape.jitter_s, shape.jitter_s) if shape.jitter_s else 0.0)
        arrival = max(self._last_arrival, now + max(0.0, delay))
        self._last_arrival = arrival
        self.queue.append((arrival, now, packet))
        self.buffered += len(packet)
        self.link.peak_buffered = max(self.link.peak_buffered, self.buffered)

    def _schedule(self) -> None:
        if self._timer is None and self.queue and self._loop is not None:
            self._timer = self._loop.call_later(max(0.0, self.queue[0][0] - self.clock()), self._flush)

    def _flush(self) -> None:
        self._timer = None
        now = self.clock()
        shape = self.table.shape(*self.pair)
        while self.queue and self.queue[0][0] <= now + EARLY_S:
            due, sent, packet = self.queue.popleft()
            self.buffered -= len(packet)
            if self.table.outage(*self.pair, now) is not None:
                self.dropped += 1   # in flight when the link went down
                continue
            try:
                os.write(self.write_fd, packet)
            except (BlockingIOError, InterruptedError):
                self.dropped += 1   # the receiving device's queue is full: a router drop
                continue
            except OSError:
                self.stop()
                return
            self.link.delivered(len(packet), now, now - sent, shape, due=due)
        self._schedule()
