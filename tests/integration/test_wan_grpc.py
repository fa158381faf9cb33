"""grpcio through the shaping proxy: a client stream of 1 MiB chunks, as the gossip transport sends."""

from __future__ import annotations

import statistics
import time
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")

from geofed.p2p.wan import EmulationConfig, LinkSpec, ScheduleEvent, WanEmulator

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
OPTS = [("grpc.max_send_message_length", 64 * MIB), ("grpc.max_receive_message_length", 64 * MIB),
        # Reconnect quickly after an emulated outage; the default backoff starts at 1 s. Not
        # grpc.min_reconnect_backoff_ms: it is also the connect timeout (up to the server's
        # SETTINGS), and at 100 ms every connect over an 80 ms RTT failed once the proxy delayed
        # the TCP handshake (2 RTT to the SETTINGS), as it would over a real link.
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]


def _start_server():
    def push(chunks, ctx):
        return sum(len(c) for c in chunks).to_bytes(8, "big")

    handler = grpc.method_handlers_generic_handler("wan.Test", {
        "Push": grpc.stream_unary_rpc_method_handler(push),
        "Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=OPTS)
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    return srv, f"127.0.0.1:{port}"


@pytest.fixture
def server():
    srv, address = _start_server()
    yield address
    srv.stop(0)


def _chunks(n_mib: int):
    chunk = b"\x5a" * MIB
    for _ in range(n_mib):
        yield chunk


def test_grpc_client_stream_reaches_the_configured_rate(server):
    mbps, latency_ms, n_mib = 50.0, 20.0, 8
    cfg = EmulationConfig(preset=None, default=LinkSpec(latency_ms=latency_ms, bandwidth_mbps=mbps))
    with WanEmulator(cfg, ["a", "b"]) as emu:
        channel = grpc.insecure_channel(emu.route("a", "b", server), options=OPTS)
        try:
            push = channel.stream_unary("/wan.Test/Push")
            ping = channel.unary_unary("/wan.Test/Ping")
            ping(b"x", timeout=10)   # connect: the transport keeps one warm channel per peer
            push(_chunks(2), timeout=60)   # and leave slow start (1.1x the ideal for 8 MiB otherwise)
            rtts = []
            for _ in range(5):
                t = time.monotonic()
                ping(b"x", timeout=10)
                rtts.append((time.monotonic() - t) * 1e3)
            ideal = n_mib * MIB * 8 / (mbps * 1e6) + 2 * latency_ms / 1e3
            times = []
            for _ in range(2):   # the link's best of two (see test_wan_proxy.best_goodput_ratio)
                t = time.monotonic()
                got = int.from_bytes(push(_chunks(n_mib), timeout=60), "big")
                times.append(time.monotonic() - t)
                assert got == n_mib * MIB
                assert ideal / times[-1] <= 1.05, f"faster than the link: {times} s, ideal {ideal:.3f} s"
                if ideal / times[-1] >= 0.95:
                    break
        finally:
            channel.close()
        st = emu.link_stats()["a->b"]
    assert ideal / min(times) >= 0.95, f"{times} s for {n_mib} MiB, ideal {ideal:.3f} s"
    # gRPC's own threads add to the RTT on a loaded machine; the emulated part is a floor.
    assert 2 * latency_ms <= statistics.median(rtts) <= 2 * latency_ms + 25
    assert st["measured_goodput_mbps"] == pytest.approx(mbps, rel=0.05)
    assert st["bytes"] > n_mib * MIB   # payload plus HTTP/2 framing


def test_grpc_fails_during_a_reset_outage_and_recovers_after(server):
    start, length = 0.8, 1.0
    cfg = EmulationConfig(preset=None, default=LinkSpec(latency_ms=5, bandwidth_mbps=50), schedule=(
        ScheduleEvent(link="a->b", at_s=start, outage_s=length, outage_mode="reset"),))
    with WanEmulator(cfg, ["a", "b"]) as emu:
        channel = grpc.insecure_channel(emu.route("a", "b", server), options=OPTS)
        try:
            ping = channel.unary_unary("/wan.Test/Ping")
            assert ping(b"x", timeout=5) == b"x"
            time.sleep(max(0.0, emu.start_time + start + 0.2 - time.monotonic()))
            with pytest.raises(grpc.RpcError) as err:
                ping(b"x", timeout=0.5)
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            time.sleep(max(0.0, emu.start_time + start + length - time.monotonic()))
            assert ping(b"x", timeout=5, wait_for_ready=True) == b"x"
        finally:
            channel.close()
        st = emu.link_stats()["a->b"]
    assert st["resets"] >= 1 and st["connections"] >= 2


def main(argv=None) -> int:
    """`python tests/integration/test_wan_grpc.py`: the gRPC table of docs/wan.md."""
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--mbps", type=float, nargs="+", default=[10, 50, 100, 1000])
    p.add_argument("--latency-ms", type=float, default=40.0)
    p.add_argument("--seconds", type=float, default=2.5, help="size each transfer to about this long")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    srv, address = _start_server()
    print("| Mbit/s | MiB | goodput / configured | time / (bytes/rate + RTT) | ping RTT median | proxy measured Mbit/s |")
    print("|---|---|---|---|---|---|")
    try:
        for mbps in args.mbps:
            n_mib = max(1, min(64, round(mbps * 1e6 / 8 * args.seconds / MIB)))
            print(_grpc_row(address, mbps, args.latency_ms, n_mib, args.repeats), flush=True)
    finally:
        srv.stop(0)
    return 0


def _grpc_row(address: str, mbps: float, latency_ms: float, n_mib: int, repeats: int) -> str:
    cfg = EmulationConfig(preset=None, default=LinkSpec(latency_ms=latency_ms, bandwidth_mbps=mbps))
    with WanEmulator(cfg, ["a", "b"]) as emu:
        channel = grpc.insecure_channel(emu.route("a", "b", address), options=OPTS)
        try:
            push, ping = channel.stream_unary("/wan.Test/Push"), channel.unary_unary("/wan.Test/Ping")
            push(_chunks(n_mib), timeout=120)   # connect and grow the HTTP/2 windows, unmeasured
            rtts = []
            for _ in range(10):
                t = time.monotonic()
                ping(b"x", timeout=10)
                rtts.append((time.monotonic() - t) * 1e3)
            runs = []
            for _ in range(repeats):
                t = time.monotonic()
                push(_chunks(n_mib), timeout=120)
                runs.append(time.monotonic() - t)
        finally:
            channel.close()
        measured = emu.link_stats()["a->b"]["measured_goodput_mbps"]
    bits, rtt_s = n_mib * MIB * 8, 2 * latency_ms / 1e3
    good = " ".join(f"{bits / (s - rtt_s) / 1e6 / mbps:.3f}" for s in runs)
    ratio = " ".join(f"{s / (bits / (mbps * 1e6) + rtt_s):.3f}" for s in runs)
    return f"| {mbps:g} | {n_mib} | {good} | {ratio} | {statistics.median(rtts):.1f} | {measured} |"


if __name__ == "__main__":
    raise SystemExit(main())
