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
    cfg = EmulationConfig(mode="proxy", preset=None,
                          default=LinkSpec(latency_ms=5.0, bandwidth_mbps=40.0, jitter_ms=0.0, loss=0.0),
                          schedule=(ScheduleEvent(link="a->b", at_round=1, set=LinkSpec(bandwidth_mbps=16.0)),))
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
            assert est.bandwidth_bps / 1e6 == pytest.approx(40.0, rel=0.10)
            emu.set_round(1)
            assert emu.configured("a", "b").bandwidth_mbps == 16.0
            for _ in range(3):
                transfer()
            assert est.bandwidth_bps / 1e6 == pytest.approx(16.0, rel=0.10)
        finally:
            a.close()
            b.close()
