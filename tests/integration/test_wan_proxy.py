"""The shaping proxy over real loopback sockets: the fidelity lines of issue 5's "Done when".

Bandwidths are small (10-100 Mbit/s, one at 400) and transfers last about a second, so the file
runs in well under a minute on 2 shared cores.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

import pytest

from geofed.p2p.wan import EmulationConfig, LinkSpec, ScheduleEvent, WanEmulator
from geofed.bench.wan_measure import (PATTERN, SinkServer, bulk, connect, goodput_mbps, pattern_digest, ping,
                                    rate_between)
from geofed.p2p.wan.shaper import MAX_READ, buffer_limit

pytestmark = pytest.mark.timeout(120)


def emulator(mbps=50.0, latency_ms=5.0, jitter_ms=0.0, loss=0.0, schedule=(), regions=("a", "b"), **kw) -> WanEmulator:
    cfg = EmulationConfig(preset=None, default=LinkSpec(latency_ms=latency_ms, bandwidth_mbps=mbps, jitter_ms=jitter_ms,
                                                        loss=loss), schedule=tuple(schedule), **kw)
    return WanEmulator(cfg, list(regions))


@pytest.fixture
def sink():
    s = SinkServer()
    yield s
    s.close()


class Sender(threading.Thread):
    """Streams the pattern into a bulk transfer of `total` bytes, logging (time, bytes handed to the kernel)."""

    def __init__(self, sock: socket.socket, total: int, piece: int = 65536):
        super().__init__(daemon=True)
        self.sock, self.total, self.piece = sock, total, piece
        self.progress: list[tuple[float, int]] = []
        self.done_at: float | None = None
        self.error: BaseException | None = None

    def run(self):
        view = memoryview(PATTERN)
        try:
            self.sock.sendall(b"b" + self.total.to_bytes(8, "big"))
            sent = 0
            while sent < self.total:
                k = min(self.piece, self.total - sent, len(view) - sent % len(view))
                off = sent % len(view)
                self.sock.sendall(view[off:off + k])
                sent += k
                self.progress.append((time.monotonic(), sent))
            assert self.sock.recv(1) == b"d"
            self.done_at = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc


def best_goodput_ratio(sock, nbytes: int, mbps: float, rtt_ms: float, tries: int = 2) -> list[float]:
    """goodput/configured of up to `tries` transfers, stopping at the first within 5%.

    The link's capacity is the best rate it delivers (BBR's max filter): on a 2-core machine
    shared with other jobs, a sender or sink thread starved of CPU makes one transfer slow
    without the link being wrong. Faster than configured is wrong at once, whatever the load.
    """
    ratios = []
    for _ in range(tries):
        ratios.append(goodput_mbps(nbytes, bulk(sock, nbytes), rtt_ms) / mbps)
        assert ratios[-1] <= 1.05, f"faster than configured: {ratios}"
        if ratios[-1] >= 0.95:
            break
    return ratios


@pytest.mark.parametrize("mbps", [10, 50, 100])
def test_goodput_within_5_percent(sink, mbps):
    nbytes = int(mbps * 1e6 / 8 * 1.2)   # about 1.2 s on the link
    with emulator(mbps=mbps, latency_ms=5) as emu:
        with connect(emu.route("a", "b", sink.address)) as sock:
            ratios = best_goodput_ratio(sock, nbytes, mbps, rtt_ms=10)
        assert 0.95 <= max(ratios) <= 1.05, f"goodput/configured {ratios}"
        assert sink.digests == [pattern_digest(nbytes)] * len(ratios)
        st = emu.link_stats()["a->b"]
        if len(ratios) == 1:   # a slow first try also slows the proxy's own sample
            assert st["measured_goodput_mbps"] == pytest.approx(mbps, rel=0.05)


def test_rtt_is_twice_the_one_way_latency(sink):
    with emulator(mbps=50, latency_ms=40) as emu:
        with connect(emu.route("a", "b", sink.address)) as sock:
            # Median of 10 pings; a second round only if the first is off (CPU starvation on a
            # shared machine only ever adds delay, so the better round is the link's).
            rounds = [ping(sock, 10)]
            if statistics.median(rounds[0]) > 88.0:
                rounds.append(ping(sock, 10))
        st = emu.link_stats()["a->b"]
    assert min(statistics.median(r) for r in rounds) == pytest.approx(80.0, rel=0.10)
    assert min(min(r) for r in rounds) >= 80.0   # latency is a floor: nothing arrives early
    # The proxy's own view: one way plus one way back as delivered (its loop's lateness on top).
    assert st["configured_rtt_ms"] == 80.0 and 80.0 <= st["measured_rtt_ms"] <= 80.0 * 1.25


def test_jitter_spreads_latency_but_never_reorders(sink):
    with emulator(mbps=50, latency_ms=20, jitter_ms=15, seed=7) as emu:
        with connect(emu.route("a", "b", sink.address)) as sock:
            rtts = ping(sock, 30)
            nbytes = 3_000_000
            bulk(sock, nbytes)
    assert max(rtts) - min(rtts) > 10, rtts      # jitter is there
    # Inside the configured band: never below it; the typical ping inside it (a loaded machine
    # can only add delay, so only the median is held to the top of the band).
    assert min(rtts) >= 2 * (20 - 15) - 0.5 and statistics.median(rtts) <= 2 * (20 + 15) + 5
    assert sink.digests == [pattern_digest(nbytes)]   # every byte, in order


def test_scheduled_step_50_to_5_mbps_shows_within_1s(sink):
    step_at = 1.0
    with emulator(mbps=50, latency_ms=5, schedule=[
            ScheduleEvent(link="a->b", at_s=step_at, set=LinkSpec(bandwidth_mbps=5))]) as emu:
        sock = connect(emu.route("a", "b", sink.address))
        sender = Sender(sock, total=1 << 30)
        sender.start()
        t_step = emu.start_time + step_at
        time.sleep(max(0.0, t_step + 1.5 - time.monotonic()))
        assert emu.configured("a", "b").bandwidth_mbps == 5
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        sender.join(10)
    log = sink.arrivals[0]
    before = rate_between(log, t_step - 0.6, t_step)
    after = rate_between(log, t_step + 0.5, t_step + 1.0)
    assert before == pytest.approx(50, rel=0.1)
    assert after == pytest.approx(5, rel=0.2), f"{after:.2f} Mbit/s in [0.5 s, 1 s] after the step"


def test_stall_outage_stops_the_sender_and_the_transfer_resumes(sink):
    start, length = 0.6, 1.0
    nbytes = 6_000_000   # 1.2 s at 40 Mbit/s
    with emulator(mbps=40, latency_ms=10, schedule=[
            ScheduleEvent(link="a->b", at_s=start, outage_s=length)]) as emu:
        sock = connect(emu.route("a", "b", sink.address))
        sender = Sender(sock, nbytes)
        sender.start()
        t0 = emu.start_time
        time.sleep(max(0.0, t0 + start + 0.2 - time.monotonic()))
        read_early = emu.link_stats()["a->b"]["bytes_in"]
        assert emu.link_stats()["a->b"]["in_outage"]
        time.sleep(max(0.0, t0 + start + length - 0.05 - time.monotonic()))
        read_late = emu.link_stats()["a->b"]["bytes_in"]
        sender.join(20)
        sock.close()
    assert sender.error is None and sender.done_at is not None
    assert read_late == read_early, "the proxy kept reading from the sender during the outage"
    log = sink.arrivals[0]
    assert rate_between(log, t0 + start + 0.05, t0 + start + length) == 0.0
    assert sender.done_at > t0 + start + length
    assert sink.digests == [pattern_digest(nbytes)]
    assert emu.link_stats()["a->b"]["outage_s"] == pytest.approx(length)


def test_reset_outage_resets_open_and_refuses_new_connections(sink):
    start, length = 0.5, 1.0
    with emulator(mbps=50, latency_ms=5, schedule=[
            ScheduleEvent(link="a<->b", at_s=start, outage_s=length, outage_mode="reset")]) as emu:
        addr = emu.route("a", "b", sink.address)
        t0 = emu.start_time
        old = connect(addr)
        assert len(ping(old, 2)) == 2
        time.sleep(max(0.0, t0 + start + 0.1 - time.monotonic()))
        with pytest.raises((ConnectionError, OSError)):
            ping(old, 1)
        old.close()
        # The listener is up: a new connection is reset at once, like a refused one (which may
        # already show while connect() sets its socket options).
        with pytest.raises((ConnectionError, OSError)):
            with connect(addr) as new:
                ping(new, 1)
        time.sleep(max(0.0, t0 + start + length + 0.05 - time.monotonic()))
        with connect(addr) as after:
            assert len(ping(after, 3)) == 3
        st = emu.link_stats()["a->b"]
    assert (st["resets"], st["refused"], st["connections"]) == (1, 1, 2)


def test_bounded_memory_under_a_64mb_transfer(sink):
    nbytes = 64 << 20
    mbps, latency_ms = 400, 10
    with emulator(mbps=mbps, latency_ms=latency_ms) as emu:
        hwm0 = _vm_hwm_kib()
        with connect(emu.route("a", "b", sink.address)) as sock:
            seconds = bulk(sock, nbytes)
        grown_mib = (_vm_hwm_kib() - hwm0) / 1024
        st = emu.link_stats()["a->b"]
        limit = buffer_limit(emu.table.shape("a", "b"), 32 << 20)
    assert sink.digests == [pattern_digest(nbytes)]
    # Never faster than the link (400 Mbit/s in one process may be CPU-bound on a loaded machine:
    # rate accuracy is test_goodput_within_5_percent's business, memory is this test's).
    assert goodput_mbps(nbytes, seconds, 2 * latency_ms) <= mbps * 1.05
    assert st["peak_buffered_bytes"] <= limit + MAX_READ and limit <= 2 << 20   # the bound, plus the read that crossed it
    assert grown_mib < 24, f"process peak memory grew {grown_mib:.1f} MiB for a 64 MiB transfer"


def test_a_receiver_that_stops_reading_does_not_grow_the_proxy():
    # A target that accepts and then reads nothing for a while: the proxy must stop reading too.
    srv = socket.create_server(("127.0.0.1", 0))
    conns = []
    threading.Thread(target=lambda: conns.append(srv.accept()[0]), daemon=True).start()
    try:
        with emulator(mbps=400, latency_ms=5, max_buffer_mb=1) as emu:
            sock = connect(emu.route("a", "b", f"127.0.0.1:{srv.getsockname()[1]}"))
            sock.setblocking(False)
            sent, deadline = 0, time.monotonic() + 1.5
            chunk = b"x" * 65536
            while time.monotonic() < deadline:
                try:
                    sent += sock.send(chunk)
                except BlockingIOError:
                    time.sleep(0.01)
            st = emu.link_stats()["a->b"]
            sock.close()
    finally:
        srv.close()
        for c in conns:
            c.close()
    assert st["peak_buffered_bytes"] <= (1 << 20) + MAX_READ
    assert st["bytes_in"] - st["bytes"] <= (1 << 20) + MAX_READ
    assert sent < 64 << 20, "the sender was never blocked"


def test_byte_counters_per_direction(sink):
    nbytes = 1_000_000
    with emulator(mbps=100, latency_ms=2) as emu:
        with connect(emu.route("a", "b", sink.address)) as sock:
            ping(sock, 3)
            bulk(sock, nbytes)
        deadline = time.monotonic() + 5
        while emu.link_stats()["b->a"]["bytes"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = emu.link_stats()
    assert st["a->b"]["bytes"] == 3 + 1 + 8 + nbytes   # pings, op, length, payload
    assert st["b->a"]["bytes"] == 3 + 1                # ping echoes, receipt
    assert st["a->b"]["connections"] == 1 and st["b->a"]["connections"] == 0


def test_loss_is_modelled_as_stalls(sink):
    nbytes = 1_000_000   # 0.16 s at 50 Mbit/s; ~690 packets at 1% loss -> several 200 ms stalls
    with emulator(mbps=50, latency_ms=5, loss=0.01, seed=3) as emu:
        with connect(emu.route("a", "b", sink.address)) as sock:
            seconds = bulk(sock, nbytes)
        stalls = emu.link_stats()["a->b"]["loss_stalls"]
    assert stalls >= 1
    assert seconds >= 0.16 + 0.2 * stalls * 0.9
    assert goodput_mbps(nbytes, seconds, 10) < 0.7 * 50
    assert sink.digests == [pattern_digest(nbytes)]


def test_connections_on_one_link_share_its_bandwidth(sink):
    nbytes = 3_000_000
    with emulator(mbps=40, latency_ms=5) as emu:
        addr = emu.route("a", "b", sink.address)
        socks = [connect(addr) for _ in range(2)]
        times: list[float] = []
        threads = [threading.Thread(target=lambda s=s: times.append(bulk(s, nbytes))) for s in socks]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        total = time.monotonic() - t0
        for s in socks:
            s.close()
    assert len(times) == 2
    assert goodput_mbps(2 * nbytes, total, 10) == pytest.approx(40, rel=0.05)


def test_reply_direction_uses_the_reverse_link(sink):
    # a->b fast, b->a 100 ms one way: RTT = 5 + 100.
    cfg = EmulationConfig(preset=None, default=LinkSpec(latency_ms=5, bandwidth_mbps=50),
                          links={"b->a": LinkSpec(latency_ms=100)})
    with WanEmulator(cfg, ["a", "b"]) as emu:
        with connect(emu.route("a", "b", sink.address)) as sock:
            rtt = statistics.median(ping(sock, 5))
    assert rtt == pytest.approx(105, rel=0.1)


def test_four_region_preset_links_measure_within_10_percent():
    regions = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"]
    cfg = EmulationConfig(preset="aws", bandwidth_scale=0.02)   # 7-23 Mbit/s
    sinks = {r: SinkServer() for r in regions}
    try:
        with WanEmulator(cfg, regions) as emu:
            jobs = []
            for a in regions:
                for b in regions:
                    if a != b:
                        mbps = emu.configured(a, b).bandwidth_mbps
                        sock = connect(emu.route(a, b, sinks[b].address))
                        jobs.append((a, b, sock, int(mbps * 1e6 / 8 * 0.8)))
            threads = [threading.Thread(target=bulk, args=(s, n)) for _, _, s, n in jobs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            for *_, s, _ in jobs:
                s.close()
            # The proxy thread counts a write just after the socket call that let the client see
            # it, so give it a moment to catch up (GIL hand-off) before reading the counters.
            expect = sum(1 + 8 + n + 1 for *_, n in jobs)
            deadline = time.monotonic() + 5
            while sum(v["bytes"] for v in emu.link_stats().values()) < expect and time.monotonic() < deadline:
                time.sleep(0.01)
            stats = emu.link_stats()
    finally:
        for s in sinks.values():
            s.close()
    assert len(stats) == 12
    for a, b, _, n in jobs:
        st = stats[f"{a}->{b}"]
        assert st["bytes"] == 1 + 8 + n + 1   # op, length, payload; and the receipt of b's transfer to a
        assert st["measured_goodput_mbps"] == pytest.approx(st["configured_bandwidth_mbps"], rel=0.10), f"{a}->{b}"
        # Latency is a floor; above it, only the event loop's lateness: a few ms on a loaded machine,
        # 15 ms once (48.4 for 33.5) with the twelve bulk flows on a slower 2-core host (2026-12-03).
        assert st["configured_latency_ms"] <= st["measured_latency_ms"] <= st["configured_latency_ms"] + 20


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def test_an_open_ended_outage_ends_at_a_round(sink):
    cfg = EmulationConfig(preset=None, default=LinkSpec(latency_ms=5, bandwidth_mbps=50), schedule=(
        ScheduleEvent(link="a->b", at_round=1, outage_s=1e9),
        ScheduleEvent(link="a->b", at_round=2, end_outage=True)))
    with WanEmulator(cfg, ["a", "b"]) as emu:
        with connect(emu.route("a", "b", sink.address)) as sock:
            ping(sock, 1)
            emu.set_round(1)
            sock.sendall(b"p")
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):   # stalled
                sock.recv(1)
            sock.settimeout(10)
            t = time.monotonic()
            emu.set_round(2)
            assert sock.recv(1) == b"p"
            assert time.monotonic() - t < 0.2


def test_link_stats_of_some_pairs_are_those_of_every_link(sink):
    """What a round's record asks for, one link at a time (driver/emulation.py: configured_link):
    the link's own entry as the every-link call gives it, without the N(N-1) others."""
    with emulator(mbps=50, latency_ms=5, regions=("a", "b", "c")) as emu:
        with connect(emu.route("a", "b", sink.address)) as sock:
            bulk(sock, 200_000)
        one = emu.link_stats([("a", "b"), ("x", "y")])
        every = emu.link_stats()
        assert list(one) == ["a->b"] and len(every) == 6
        assert one["a->b"]["bytes"] == every["a->b"]["bytes"] >= 200_000
        assert {k: v for k, v in one["a->b"].items() if k != "outage_s"} == \
            {k: v for k, v in every["a->b"].items() if k != "outage_s"}
