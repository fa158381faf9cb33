"""The hub router (benchmarks/bench/router.py): packet parsing, per-pair latency, per-flow counts.

A TUN device hands out and takes whole IP packets on a file descriptor; a datagram socketpair
does the same without root, so the router runs here on real packets (built with struct) and
real descriptors.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import pytest

from geofed.bench.router import TCP, UDP, PacketRouter, parse


def _ip(src: str, dst: str, proto: int, body: bytes) -> bytes:
    total = 20 + len(body)
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, total, 0, 0, 64, proto, 0,
                       socket.inet_aton(src), socket.inet_aton(dst)) + body


def tcp(src: str, dst: str, sport: int, dport: int, payload: bytes = b"", *, options: int = 12) -> bytes:
    offset = (20 + options) // 4
    header = struct.pack("!HHIIBBHHH", sport, dport, 0, 0, offset << 4, 0x18, 65535, 0, 0) + b"\x01" * options
    return _ip(src, dst, TCP, header + payload)


def udp(src: str, dst: str, sport: int, dport: int, payload: bytes = b"") -> bytes:
    return _ip(src, dst, UDP, struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload)


def test_parse_reads_addresses_ports_and_payload_of_tcp_and_udp():
    f = parse(tcp("10.1.0.1", "10.1.0.2", 40000, 50051, b"x" * 1448))
    assert (f.src, f.dst, f.proto, f.sport, f.dport) == ("10.1.0.1", "10.1.0.2", TCP, 40000, 50051)
    assert f.ip_bytes == 20 + 32 + 1448 and f.payload == 1448   # timestamps: a 32-byte TCP header
    g = parse(udp("10.1.0.3", "10.1.0.1", 53, 5353, b"abc"))
    assert (g.proto, g.sport, g.dport, g.payload) == (UDP, 53, 5353, 3)


def test_parse_leaves_out_what_is_not_ipv4():
    assert parse(b"") is None
    assert parse(b"\x60" + b"\x00" * 39) is None      # IPv6
    icmp = parse(_ip("10.1.0.1", "10.1.0.2", 1, b"\x08\x00" + b"\x00" * 6))
    assert icmp.proto == 1 and icmp.sport == icmp.dport == 0


class Devices:
    """Datagram socketpairs standing in for TUN devices: the router holds one end of each."""

    def __init__(self, addresses):
        self.pairs = {a: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for a in addresses}
        for ours, theirs in self.pairs.values():
            ours.setblocking(False)
            theirs.settimeout(2.0)

    def fds(self):
        return {a: p[0].fileno() for a, p in self.pairs.items()}

    def send(self, addr: str, packet: bytes) -> None:
        self.pairs[addr][1].send(packet)

    def recv(self, addr: str) -> bytes:
        return self.pairs[addr][1].recv(65536)

    def close(self):
        for a, b in self.pairs.values():
            a.close()
            b.close()


@pytest.fixture
def devices():
    d = Devices(["10.9.0.1", "10.9.0.2", "10.9.0.3"])
    yield d
    d.close()


def test_router_delivers_by_destination_after_the_pairs_latency(devices):
    latency = {("10.9.0.1", "10.9.0.2"): 0.05, ("10.9.0.1", "10.9.0.3"): 0.15}
    router = PacketRouter(devices.fds(), lambda a, b: latency.get((a, b), 0.0))
    router.start()
    try:
        to_b = tcp("10.9.0.1", "10.9.0.2", 40000, 50051, b"b" * 100)
        to_c = tcp("10.9.0.1", "10.9.0.3", 40001, 50051, b"c" * 100)
        t0 = time.monotonic()
        devices.send("10.9.0.1", to_c)
        devices.send("10.9.0.1", to_b)
        assert devices.recv("10.9.0.2") == to_b
        t_b = time.monotonic() - t0
        assert devices.recv("10.9.0.3") == to_c
        t_c = time.monotonic() - t0
    finally:
        router.stop()
    assert 0.05 <= t_b < 0.05 + 0.04
    assert 0.15 <= t_c < 0.15 + 0.04
    assert router.delivered == 2 and router.no_route == 0 and router.error is None


def test_router_keeps_a_pairs_order_and_counts_every_flow(devices):
    router = PacketRouter(devices.fds(), lambda a, b: 0.01)
    router.start()
    try:
        sent = [tcp("10.9.0.2", "10.9.0.1", 40000, 50051, bytes([i]) * (100 + i)) for i in range(50)]
        for p in sent:
            devices.send("10.9.0.2", p)
        got = [devices.recv("10.9.0.1") for _ in sent]
        devices.send("10.9.0.3", udp("10.9.0.3", "10.9.0.2", 5000, 6000, b"hello"))
        devices.recv("10.9.0.2")
        # no device has 8.8.8.8: dropped and counted, as by a router without a route
        devices.send("10.9.0.1", udp("10.9.0.1", "8.8.8.8", 5000, 53, b"?"))
        deadline = time.monotonic() + 2
        while router.no_route == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        router.stop()
    assert got == sent
    flows = router.counters.snapshot()
    assert flows[("10.9.0.2", "10.9.0.1", TCP, 40000, 50051)] == (
        50, sum(len(p) for p in sent), sum(100 + i for i in range(50)))
    assert flows[("10.9.0.3", "10.9.0.2", UDP, 5000, 6000)] == (1, 20 + 8 + 5, 5)
    assert router.no_route == 1


def test_a_latency_out_of_range_is_refused_naming_the_pair(devices):
    with pytest.raises(ValueError, match=r"latency_s: one-way latency of 10\.9\.0\.1->10\.9\.0\.2"):
        PacketRouter(devices.fds(), lambda a, b: 20.0)


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a thread's nice value needs root (CAP_SYS_NICE)")
def test_the_router_thread_runs_at_nice_minus_20_and_the_caller_keeps_its_own(devices):
    # The router is the network between the regions: other work on the host must not starve it.
    own = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's (Linux: a thread's nice is its own)
    router = PacketRouter(devices.fds(), lambda a, b: 0.0)
    router.start()
    try:
        tid = router._thread.native_id
        deadline = time.monotonic() + 2
        nice = None
        while time.monotonic() < deadline and nice != -20:
            nice = int(Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])
            time.sleep(0.01)
    finally:
        router.stop()
    assert nice == -20
    assert os.getpriority(os.PRIO_PROCESS, 0) == own
