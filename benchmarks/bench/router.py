"""A user-space IP router between TUN devices: per-pair latency, and a byte count of every flow.

The hub of `hub.RegionNet`: every region namespace has one TUN device, and every packet a
region sends to another region leaves through it (after the kernel's tbf on that device, the
region's shared egress) into this router, which writes it into the destination region's TUN
after the pair's one-way latency. Unlike the TCP proxy it delays every packet, handshakes and
ACKs included, so TCP sees the real RTT (slow start, window limits and TLS round trips are
real), and unlike the per-pair delay line (delayline.py) one region's flows to all its peers
share one device, hence one egress, as on a cloud VM.

It sees every packet between regions, so it counts them per flow (addresses, protocol, ports):
the cheapest exact answer to "which bytes crossed which link, for whom". One thread, epoll and
a FIFO per (source, destination) pair (a pair's latency is constant, so arrival order is send
order); Python handles each packet, which holds a few hundred Mbit/s in all (FIELD-NOTES).
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_PACKET = 65536
READS_PER_WAKE = 256      # packets read from one device per wake-up before looking at the others
EARLY_S = 0.0002          # deliver packets due within this much of now together
TCP, UDP = 6, 17

FlowKey = tuple[str, str, int, int, int]   # (src ip, dst ip, protocol, src port, dst port)


@dataclass(frozen=True)
class Flow:
    """What one IPv4 packet is: addresses, protocol, ports (0 when not TCP/UDP), transport payload."""

    src: str
    dst: str
    proto: int
    sport: int
    dport: int
    ip_bytes: int        # the whole IP packet: what the device (and tbf) carries
    payload: int         # TCP/UDP payload bytes (IP bytes minus IP and transport headers)

    @property
    def key(self) -> FlowKey:
        return (self.src, self.dst, self.proto, self.sport, self.dport)


def parse(packet: bytes) -> Flow | None:
    """The flow of an IPv4 packet, or None for anything else (IPv6, a runt)."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return None
    ihl = (packet[0] & 0x0F) * 4
    total = struct.unpack_from("!H", packet, 2)[0]
    proto = packet[9]
    src, dst = socket.inet_ntoa(packet[12:16]), socket.inet_ntoa(packet[16:20])
    sport = dport = 0
    header = ihl
    fragment_offset = struct.unpack_from("!H", packet, 6)[0] & 0x1FFF
    if proto in (TCP, UDP) and fragment_offset == 0 and len(packet) >= ihl + 4:
        sport, dport = struct.unpack_from("!HH", packet, ihl)
        if proto == TCP and len(packet) >= ihl + 13:
            header += (packet[ihl + 12] >> 4) * 4
        elif proto == UDP:
            header += 8
    return Flow(src=src, dst=dst, proto=proto, sport=sport, dport=dport, ip_bytes=total,
                payload=max(0, total - header))


class FlowCounters:
    """Packets, IP bytes and payload bytes per flow; snapshot() is a copy safe to keep."""

    def __init__(self):
        self._lock = threading.Lock()
        self._flows: dict[FlowKey, list[int]] = {}
        self.unparsed = 0

    def add(self, packet: bytes) -> Flow | None:
        flow = parse(packet)
        with self._lock:
            if flow is None:
                self.unparsed += 1
                return None
            c = self._flows.get(flow.key)
            if c is None:
                c = self._flows[flow.key] = [0, 0, 0]
            c[0] += 1
            c[1] += flow.ip_bytes
            c[2] += flow.payload
        return flow

    def snapshot(self) -> dict[FlowKey, tuple[int, int, int]]:
        with self._lock:
            return {k: (v[0], v[1], v[2]) for k, v in self._flows.items()}


def _raise_priority() -> None:
    """Run this thread (the whole WAN between the regions) at nice -20 where allowed (root).

    The router stands for the network, which a real cluster's compute cannot slow down; with
    regions, Ray and other work on 2 cores, links read 0.57-0.60 of their shaped rate (pings up
    to 125 ms on an 81 ms path) at the default priority. A thread's
    nice value is its own on Linux (setpriority on its thread id). Not real-time scheduling:
    a routing bug then cannot lock the machine."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -20)
    except (OSError, AttributeError) as exc:  # not root: the default priority, as before
        log.info("wan router: runs at the default priority (%s); a busy host can slow the links", exc)


class PacketRouter:
    """Routes IPv4 packets between TUN devices by destination address.

    ``devices``: address -> file descriptor of the (non-blocking) TUN device behind which that
    address lives. ``latency_s(src_address, dst_address)``: one-way delay of the pair. A packet
    for an address no device has is dropped (counted in ``no_route``), as by a router without a
    route; a destination device whose queue is full drops it too (``dropped``).
    """

    def __init__(self, devices: Mapping[str, int], latency_s: Callable[[str, str], float], *,
                 clock: Callable[[], float] = time.monotonic):
        self.devices = dict(devices)
        self._by_fd = {fd: addr for addr, fd in self.devices.items()}
        self.latency = {(a, b): float(latency_s(a, b)) for a in self.devices for b in self.devices if a != b}
        for pair, s in self.latency.items():
            if not 0 <= s < 10:
                raise ValueError(f"latency_s: one-way latency of {pair[0]}->{pair[1]} must be in [0, 10) s, got {s}")
        self.clock = clock
        self.counters = FlowCounters()
        self.no_route = 0
        self.dropped = 0
        self.delivered = 0
        self._queues: dict[tuple[str, str], collections.deque[tuple[float, bytes]]] = {
            pair: collections.deque() for pair in self.latency}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="wan-router", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    def _run(self) -> None:
        _raise_priority()
        ep = select.epoll()
        try:
            for fd in self._by_fd:
                ep.register(fd, select.EPOLLIN)
            ep.register(self._wake_r, select.EPOLLIN)
            while not self._stop.is_set():
                for fd, _ in ep.poll(self._timeout()):
                    if fd != self._wake_r:
                        self._read(fd)
                self._flush()
        except BaseException as exc:  # kept for the owner: a dead router is a dead network
            self.error = exc
            log.exception("wan router stopped")
        finally:
            ep.close()

    def _timeout(self) -> float:
        heads = [q[0][0] for q in self._queues.values() if q]
        if not heads:
            return 0.5
        return max(0.0, min(heads) - self.clock())

    def _read(self, fd: int) -> None:
        src = self._by_fd[fd]
        now = self.clock()
        for _ in range(READS_PER_WAKE):
            try:
                packet = os.read(fd, MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                return
            flow = self.counters.add(packet)
            dst = flow.dst if flow is not None else None
            queue = self._queues.get((src, dst)) if dst is not None else None
            if queue is None:
                self.no_route += 1
                continue
            queue.append((now + self.latency[(src, dst)], packet))

    def _flush(self) -> None:
        now = self.clock() + EARLY_S
        for (_, dst), queue in self._queues.items():
            fd = self.devices[dst]
            while queue and queue[0][0] <= now:
                _, packet = queue.popleft()
                try:
                    os.write(fd, packet)
                    self.delivered += 1
                except (BlockingIOError, InterruptedError):
                    self.dropped += 1   # the receiving device's queue is full: a router drop
