"""The link estimator against a real emulated WAN link (geofed.p2p.wan proxy) carrying real mTLS gRPC."""

import pytest

from geofed.p2p.estimator import LinkEstimator
from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.tls import load_tls, make_pki
from geofed.p2p.wan.config import EmulationConfig, LinkSpec, ScheduleEvent
from geofed.p2p.wan.emulator import WanEmulator
from geofed.p2p.prober import LinkProber

pytestmark = pytest.mark.timeout(120)


def test_estimate_within_10_percent_after_3_transfers_and_follows_a_step(tmp_path):
    pki = make_pki(tmp_path / "tls", ["a", "b"])
    # 20 then 8 Mbit/s (were 40 and 16): the sender, the receiver and the user-space proxy share this
    # process, and their per-chunk CPU is a larger share of a faster link's transfer; a fresh-clone CI run
    # on a slow spell of this host read 34.9 Mbit/s of 40 (-13%); the estimator is what is tested, not the proxy.
    cfg = EmulationConfig(mode="proxy", preset=None,
                          default=LinkSpec(latency_ms=5.0, bandwidth_mbps=20.0, jitter_ms=0.0, loss=0.0),
                          schedule=(ScheduleEvent(link="a->b", at_round=1, set=LinkSpec(bandwidth_mbps=8.0)),))
    a, b = (GrpcTransport(r, tls=load_tls(pki.directory, r), max_message_bytes=4 << 20) for r in ("a", "b"))
    b.mailbox.set_validator(lambda sender, round, payload: len(payload))
    with WanEmulator(cfg, ["a", "b"]) as emu:
        try:
            addr_a, addr_b = a.start(), b.start()
            a.connect({"b": emu.route("a", "b", addr_b)})
            b.connect({"a": addr_a})
            est = LinkEstimator()
            for _ in range(3):
                est.observe_rtt(LinkProber(a).ping("b", timeout_s=5))
            assert 0.009 < est.rtt_s < 0.05
            r = 0

            def transfer(observe=True):
                nonlocal r
                b.mailbox.expect(r, ["a"])
                stats = a.send("b", r, bytes(1 << 20), timeout_s=30)
                assert b.receive(r, 5)["a"] == 1 << 20
                if observe:
                    est.observe_transfer(stats.bytes, stats.seconds)
                r += 1

            transfer(observe=False)  # warm-up: connection and slow start (a run's first round pays it)
            assert est.bandwidth_bps is None
            for _ in range(3):
                transfer()
            assert est.bandwidth_bps / 1e6 == pytest.approx(20.0, rel=0.10)
            emu.set_round(1)
            assert emu.configured("a", "b").bandwidth_mbps == 8.0
            for _ in range(3):
                transfer()
            assert est.bandwidth_bps / 1e6 == pytest.approx(8.0, rel=0.10)
        finally:
            a.close()
            b.close()


def test_a_probe_reads_the_shaped_link_and_counts_its_wire_bytes(tmp_path):
    """What a set-up probe teaches the estimator (issue 40: the probe became a push on the Probe
    method through send's streaming code): its bytes are the wire's (header, chunks, framing),
    counted once as probe bytes and never as update bytes; its seconds run from the first byte to
    the ack, so bytes over (seconds - RTT) is the link's rate; only a channel's first is cold."""
    pki = make_pki(tmp_path / "tls", ["a", "b"])
    cfg = EmulationConfig(mode="proxy", preset=None,
                          default=LinkSpec(latency_ms=20.0, bandwidth_mbps=16.0, jitter_ms=0.0, loss=0.0))
    a, b = (GrpcTransport(r, tls=load_tls(pki.directory, r), max_message_bytes=4 << 20) for r in ("a", "b"))
    with WanEmulator(cfg, ["a", "b"]) as emu:
        try:
            addr_a, addr_b = a.start(), b.start()
            a.connect({"b": emu.route("a", "b", addr_b)})
            b.connect({"a": addr_a})
            prober = LinkProber(a)
            prober.measure_rtt("b", warm_up=True)
            est = prober.estimator("b")
            assert 0.035 < est.rtt_s < 0.1
            warm = prober.probe("b", 256 << 10, timeout_s=30)
            assert warm.cold and warm.round == -1
            nbytes = 600_000
            for _ in range(3):
                stats = prober.probe("b", nbytes, timeout_s=30)
                assert not stats.cold and stats.payload_bytes == nbytes and stats.chunks == 1
                assert nbytes < stats.bytes == stats.wire_bytes < nbytes + 64
                assert stats.seconds > est.rtt_s + nbytes * 8 / 16e6 * 0.9  # at most the link's rate
                prober.observe("b", stats, concurrent=1)
            sent = a.stats()
            assert sent["probe_bytes_sent"]["b"] == warm.bytes + 3 * stats.bytes
            assert b.stats()["probe_bytes_received"]["a"] == warm.payload_bytes + 3 * nbytes
            assert "b" not in sent["bytes_sent"]
            assert est.bandwidth_bps / 1e6 == pytest.approx(16.0, rel=0.10)
        finally:
            a.close()
            b.close()
