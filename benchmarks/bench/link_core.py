"""The measuring core of ``geofed bench link`` (its driver: benchmarks/bench/link.py): gRPC push rate on loopback, and sync time over an emulated WAN link.

Loopback: pushes of each size with and without mutual TLS between two real GrpcTransports
(payload MB/s, send -> ack, median of --repeats after unmeasured warm-up pushes; 1 MB = 10^6
bytes; the receiver's validator only counts bytes, so the number is the transport's, not a
codec's). On a shared 2-core machine single runs vary 2-3x: read the medians.

Emulated: the same push through geofed.p2p.wan's shaping proxy (latency + bandwidth), with
mutual TLS. ``limit_s = bytes * 8 / bandwidth + RTT`` is what an ideal link needs;
``sync_s / limit_s`` should stay <= 1.15. ``estimated_mbps`` is the LinkEstimator's bandwidth
after the transfers of that row (fed with pings and the sender-timed transfers).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from pathlib import Path

from geofed.p2p.estimator import LinkEstimator
from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.prober import LinkProber
from geofed.p2p.tls import load_tls

MB = 1_000_000


class _Pair:
    """Two transports a -> b (b validates by counting bytes), optionally through a route."""

    def __init__(self, pki_dir: Path | None, max_bytes: int, route=None):
        quiet = logging.getLogger("geofed.p2p")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # the plaintext warning: plaintext is what is measured here
        try:
            self.a, self.b = (GrpcTransport(r, tls=load_tls(pki_dir, r) if pki_dir else None,
                                            max_message_bytes=max_bytes) for r in ("a", "b"))
        finally:
            quiet.setLevel(level)
        self.b.mailbox.set_validator(lambda sender, round, payload: len(payload))
        addr_a, addr_b = self.a.start(), self.b.start()
        self.a.connect({"b": route(addr_b) if route else addr_b})
        self.b.connect({"a": addr_a})
        self.round = 0

    def push(self, payload: bytes, timeout_s: float):
        self.b.mailbox.expect(self.round, ["a"])
        stats = self.a.send("b", self.round, payload, timeout_s=timeout_s)
        inbox = self.b.receive(self.round, 5.0)
        if inbox.get("a") != len(payload):
            raise RuntimeError(f"bench: round {self.round} did not arrive intact")
        self.round += 1
        return stats

    def close(self) -> None:
        self.a.close()
        self.b.close()


def loopback(sizes_mb: Sequence[float], repeats: int, pki_dir: Path) -> list[dict]:
    """Push rate (MB/s, median of `repeats`) of each size between two GrpcTransports on loopback,
    with and without mutual TLS."""
    rows = []
    for tls in (False, True):
        pair = _Pair(pki_dir if tls else None, int(max(sizes_mb) * MB) + 1)
        try:
            for _ in range(3):
                pair.push(bytes(MB), 30)  # warm the channel (connect, slow start) and thread pools
            for size in sizes_mb:
                payload = bytes(int(size * MB))
                pair.push(payload, 120)  # unmeasured: first buffers of this size
                runs = [len(payload) / pair.push(payload, 120).seconds / MB for _ in range(repeats)]
                rows.append({"size_mb": size, "tls": tls, "mb_s": round(statistics.median(runs), 1),
                             "mb_s_runs": [round(r, 1) for r in runs]})
        finally:
            pair.close()
    return rows


def emulated(mbps_list: Sequence[float], latency_ms: float, sizes_mb: Sequence[float], repeats: int,
             pki_dir: Path, max_transfer_s: float) -> list[dict]:
    """Push time of each size through the emulator's shaping proxy, per bandwidth in `mbps_list`,
    against the ideal ``bytes * 8 / bandwidth + RTT`` (mutual TLS).
    """
    from geofed.p2p.wan.config import EmulationConfig, LinkSpec
    from geofed.p2p.wan.emulator import WanEmulator

    rows = []
    for mbps in mbps_list:
        cfg = EmulationConfig(mode="proxy", preset=None,
                              default=LinkSpec(latency_ms=latency_ms, bandwidth_mbps=mbps, jitter_ms=0.0, loss=0.0))
        with WanEmulator(cfg, ["a", "b"]) as emu:
            # At least 1 MB: the warm-up push of _emulated_link is 1 MB whatever the sizes measured.
            pair = _Pair(pki_dir, int(max(*sizes_mb, 1) * MB) + 1, route=lambda addr: emu.route("a", "b", addr))
            try:
                rows += _emulated_link(pair, mbps, latency_ms, sizes_mb, repeats, max_transfer_s)
            finally:
                pair.close()
    return rows


def _emulated_link(pair: _Pair, mbps: float, latency_ms: float, sizes_mb: Sequence[float], repeats: int,
                   max_transfer_s: float) -> list[dict]:
    rtt_s = 2 * latency_ms / 1e3
    pair.push(bytes(MB), 60)  # connect and leave slow start, as a run's first round would
    rows = []
    for size in sizes_mb:
        nbytes = int(size * MB)
        limit_s = nbytes * 8 / (mbps * 1e6) + rtt_s
        if limit_s > max_transfer_s:
            continue
        est = LinkEstimator()
        for _ in range(5):
            est.observe_rtt(LinkProber(pair.a).ping("b", timeout_s=10))
        syncs = []
        for _ in range(repeats):
            stats = pair.push(bytes(nbytes), 10 * limit_s + 10)
            est.observe_transfer(stats.bytes, stats.seconds)
            syncs.append(stats.seconds)
        sync_s = statistics.median(syncs)
        goodput = nbytes * 8 / max(1e-6, sync_s - rtt_s) / 1e6
        rows.append({
            "configured_mbps": mbps, "rtt_ms": round(est.rtt_s * 1e3, 1), "size_mb": size,
            "goodput_mbps": round(goodput, 2), "goodput_ratio": round(goodput / mbps, 3),
            "sync_s": round(sync_s, 3), "limit_s": round(limit_s, 3),
            # None: every transfer of the row was latency-bound (under the estimator's exposure floor)
            # and so not a bandwidth sample (p2p/estimator.py), as in a run.
            "estimated_mbps": None if est.bandwidth_bps is None else round(est.bandwidth_bps / 1e6, 2),
            "ratio": round(sync_s / limit_s, 3),
            "sync_runs": [round(x, 3) for x in syncs],
        })
    return rows
