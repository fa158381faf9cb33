"""What the links of a RegionNet really give: RTT, cold and warm pushes, the egress share of bulk flows.

Plain TCP between the namespaces (wan_measure.SinkServer in each, clients made in the sender's
namespace), every region pushing to every other at once as geofed's full-topology rounds do:

* ``rtt_ms``: median of 1-byte round trips on a warm connection;
* ``connect_ms``: the TCP handshake (one RTT through the router);
* ``cold_push_s``: connect + ``payload_bytes`` on a fresh connection (round 0 of a run without
  warm-up: handshake and slow start);
* ``warm_push_s``: ``payload_bytes`` on the same connections after an idle gap, the median of
  ``rounds`` rounds (what a later round's push costs with this host's congestion control);
* ``bulk_mbps``: goodput of ``bulk_bytes`` per flow with every flow running: each region's
  egress shared by its concurrent flows.

Timings are sender-side, send to the sink's receipt: one RTT more than the bytes' own time, as
geofed's sender-timed transfers.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from geofed.p2p.wan.kernel import socket_in_namespace
from .wan_measure import SinkServer, bulk, ping

Pair = tuple[str, str]


def _connect(net, src: str, dst: str, port: int) -> socket.socket:
    sock = socket_in_namespace(net.namespace(src))
    sock.settimeout(60)
    sock.connect((net.address(dst), port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _all_at_once(pairs: list[Pair], work: Callable[[Pair], Any]) -> dict[Pair, Any]:
    out: dict[Pair, Any] = {}
    errors: list[BaseException] = []

    def run(pair: Pair) -> None:
        try:
            out[pair] = work(pair)
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def probe(net, *, payload_bytes: int, rounds: int = 3, gap_s: float = 0.5, bulk_bytes: int = 2_000_000) -> dict:
    """Measure every directed pair of `net` (a started hub.RegionNet); times in seconds, rates in Mbit/s."""
    pairs = [(a, b) for a in net.regions for b in net.regions if a != b]
    sinks = {r: SinkServer("0.0.0.0", sock=socket_in_namespace(net.namespace(r))) for r in net.regions}
    socks: dict[Pair, socket.socket] = {}
    try:
        def cold(pair: Pair) -> tuple[float, float]:
            t0 = time.monotonic()
            sock = socks[pair] = _connect(net, pair[0], pair[1], sinks[pair[1]].port)
            connected = time.monotonic() - t0
            bulk(sock, payload_bytes)
            return connected, time.monotonic() - t0

        first = _all_at_once(pairs, cold)
        rtt = {p: statistics.median(ping(socks[p], 5)) for p in pairs}
        warm: dict[Pair, list[float]] = {p: [] for p in pairs}
        for _ in range(rounds):
            time.sleep(gap_s)
            for p, s in _all_at_once(pairs, lambda p: bulk(socks[p], payload_bytes)).items():
                warm[p].append(s)
        flows = _all_at_once(pairs, lambda p: bulk(socks[p], bulk_bytes))
        return {
            "payload_bytes": payload_bytes, "bulk_bytes": bulk_bytes, "rounds": rounds, "gap_s": gap_s,
            "rtt_ms": {_k(p): round(v, 3) for p, v in rtt.items()},
            "connect_ms": {_k(p): round(first[p][0] * 1e3, 3) for p in pairs},
            "cold_push_s": {_k(p): round(first[p][1], 5) for p in pairs},
            "warm_push_s": {_k(p): round(statistics.median(v), 5) for p, v in warm.items()},
            # one RTT (the last byte's trip and the receipt) is not the link's time
            "bulk_mbps": {_k(p): round(bulk_bytes * 8 / max(1e-6, s - rtt[p] / 1e3) / 1e6, 3) for p, s in flows.items()},
        }
    finally:
        for s in socks.values():
            s.close()
        for sink in sinks.values():
            sink.close()


def _k(pair: Pair) -> str:
    return f"{pair[0]}->{pair[1]}"
