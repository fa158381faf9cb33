"""The ledger of accepted vs authenticated connections, on a hand-driven clock."""

import logging

from geofed.p2p.handshakes import HandshakeLedger


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_connection_counts_as_refused_only_after_the_grace_without_a_call(caplog):
    clock = Clock()
    ledger = HandshakeLedger("r0", grace_s=2.0, clock=clock)
    ledger.accepted()                      # good: its first call comes at once
    ledger.authenticated("ipv4:127.0.0.1:5001")
    ledger.accepted()                      # refused in the handshake: no call ever
    clock.t = 1.0
    assert ledger.refused() == 0           # still within the grace
    with caplog.at_level(logging.WARNING, logger="geofed.p2p"):
        clock.t = 2.5
        assert ledger.refused() == 1
        assert ledger.refused() == 1       # logged once per new refusal, not per read
    assert sum("refused 1 connection(s): tls_handshake:" in r.getMessage() for r in caplog.records) == 1


def test_many_calls_over_one_connection_are_one_connection_and_a_fresh_good_one_never_overcounts():
    clock = Clock()
    ledger = HandshakeLedger("r0", grace_s=2.0, clock=clock)
    ledger.accepted()
    for _ in range(5):
        ledger.authenticated("ipv4:127.0.0.1:5001")
    clock.t = 3.0
    assert ledger.refused() == 0
    ledger.accepted()                      # a new good connection, its call within the grace
    clock.t = 3.001
    ledger.authenticated("ipv4:127.0.0.1:5002")
    assert ledger.refused() == 0
    clock.t = 10.0
    assert ledger.refused() == 0


def test_a_burst_of_good_connections_does_not_hide_an_older_refusal():
    clock = Clock()
    ledger = HandshakeLedger("r0", grace_s=2.0, clock=clock)
    ledger.accepted()                      # refused at t=0
    clock.t = 1.5
    for i in range(300):                   # a burst of good connections just before the read
        ledger.accepted()
        ledger.authenticated(f"ipv4:127.0.0.1:{6000 + i}")
    clock.t = 2.1
    assert ledger.refused() == 1
    assert ledger.counts() == {"accepted": 301, "authenticated": 300}
