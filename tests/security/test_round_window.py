"""Issue 15, finding 2 (round window): one entry per (sender, round), judged on the bytes, on the
order they arrived in and on who sent them. The shared receive side (Mailbox) is the same for the
in-memory and the gRPC transport, so these run without sockets; identity is what mutual TLS
binds (the gRPC server passes the certificate's name, tests/integration/test_p2p_hostile.py).

Who can do what:
- a compromised peer with its OWN certificate reaches only its own slots (identity_mismatch);
- a thief of a peer's key that pushes the peer's future round first used to have its update
  used and the real one refused as `replayed`; now the real one is read and compared: different
  bytes void the slot (`equivocation`), so the thief's update is never used in its place;
- a push still in flight for a slot (a stalled stream) blocks nobody;
- rounds past the window are refused before a byte is read, and what a peer may park for
  future rounds is bounded by its memory budget (`over_budget`).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from geofed.p2p.mailbox import Mailbox, Refusal
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.p2p.transport import TransportError


def _floats(sender, round_, payload):
    return np.frombuffer(payload, dtype=np.float64).copy()


def _box(**kw) -> Mailbox:
    mb = Mailbox("a", round_window=kw.pop("round_window", 2), max_message_bytes=kw.pop("max_message_bytes", 1 << 16), **kw)
    mb.add_known(["b", "c"])
    mb.set_validator(_floats)
    return mb


def _push(mb: Mailbox, sender: str, round_: int, value: float, *, identity: str | None = None) -> None:
    payload = memoryview(struct.pack("d", value))
    ticket = mb.admit(sender, round_, len(payload), identity=identity if identity is not None else sender)
    mb.deliver(ticket, payload, wire_bytes=len(payload), seconds=0.0)


def test_a_compromised_peer_with_its_own_certificate_cannot_touch_another_senders_slot():
    mb = _box()
    mb.expect(0, ["b", "c"])
    with pytest.raises(Refusal) as ei:
        _push(mb, "b", 1, 666.0, identity="c")  # c's certificate, b's name, b's future round
    assert ei.value.reason == "identity_mismatch"
    _push(mb, "b", 0, 1.0)
    _push(mb, "c", 0, 2.0)
    inbox = mb.receive(0, 1.0)
    assert inbox["b"][0] == 1.0 and inbox["c"][0] == 2.0
    mb.expect(1, ["b"])
    _push(mb, "b", 1, 3.0)  # b's next round is b's own
    assert mb.receive(1, 1.0)["b"][0] == 3.0


def test_a_stolen_key_pushing_a_future_round_first_cannot_have_its_update_used():
    """On main: the thief's early copy was filed and used; the real sender's push was refused
    as `replayed`."""
    mb = _box()
    mb.expect(0, ["b"])
    _push(mb, "b", 1, 666.0)  # the thief, holding b's certificate, first
    mb.receive(0, 0.0)
    mb.expect(1, ["b"])
    with pytest.raises(Refusal) as ei:
        _push(mb, "b", 1, 1.0)  # the real b
    assert ei.value.reason == "equivocation"
    with pytest.raises(Refusal) as ei:  # the slot stays void: no third copy either
        _push(mb, "b", 1, 666.0)
    assert ei.value.reason == "equivocation"
    inbox = mb.receive(1, 0.2)
    assert "b" not in inbox and inbox.missing == {"b"}  # the round goes on without b (weight folded)
    assert inbox.waited_s < 0.1  # and does not wait for a void slot
    assert mb.counters()["refused"] == {"equivocation": 2}
    assert mb.held("b") == 0
    mb.expect(2, ["b"])
    _push(mb, "b", 2, 2.0)  # the next round is b's again
    assert mb.receive(2, 0.2)["b"][0] == 2.0


def test_the_same_bytes_twice_are_a_replay_and_the_first_copy_stays():
    mb = _box()
    mb.expect(0, ["b"])
    _push(mb, "b", 0, 1.0)
    with pytest.raises(Refusal) as ei:
        _push(mb, "b", 0, 1.0)
    assert ei.value.reason == "replayed"
    assert mb.receive(0, 0.2)["b"][0] == 1.0


def test_a_stalled_push_in_flight_does_not_block_the_real_senders_round():
    """On main a second push for a slot with one in flight was refused as `replayed` at its header:
    a thief's stalled stream held the real sender's round for as long as its deadline."""
    mb = _box()
    mb.expect(0, ["b"])
    stalled = mb.admit("b", 0, 8, identity="b")  # header read, body never comes
    _push(mb, "b", 0, 1.0)
    mb.release(stalled, Refusal("truncated", "stream ended"))
    assert mb.receive(0, 0.2)["b"][0] == 1.0
    assert mb.inflight() == 0 and mb.held("b") == 0


def test_far_future_rounds_are_refused_before_their_body_and_hold_nothing():
    mb = _box(max_message_bytes=1 << 20, peer_budget_bytes=3 << 20)
    mb.expect(0, ["b"])
    for r in (3, 100, 10**9):
        with pytest.raises(Refusal) as ei:
            mb.admit("b", r, 1 << 20, identity="b")
        assert ei.value.reason == "future_round"
    assert mb.held("b") == 0 and mb.inflight() == 0
    # Inside the window: what b parks is charged to its budget, and the budget holds.
    tickets = [mb.admit("b", r, 1 << 20, identity="b") for r in (0, 1, 2)]
    with pytest.raises(Refusal) as ei:
        mb.admit("b", 2, 1, identity="b")
    assert ei.value.reason in ("over_budget", "busy")
    assert mb.held("b") == 3 << 20
    _push(mb, "c", 1, 5.0)  # c's budget is c's own
    for t in tickets:
        mb.release(t, Refusal("aborted", "gone"))
    assert mb.held("b") == 0
    assert mb.counters()["refused"]["future_round"] == 3


def test_budget_counts_filed_updates_until_their_round_is_received_or_closed():
    mb = _box(max_message_bytes=64, peer_budget_bytes=64)
    mb.expect(0, ["b"])
    _push(mb, "b", 1, 1.0)  # early: 8 bytes held until round 1 is received
    assert mb.held("b") == 8
    mb.receive(0, 0.0)
    mb.expect(1, ["c"])  # b is not an in-neighbour of round 1 after all: dropped, refunded
    assert mb.held("b") == 0 and mb.counters()["refused"] == {"not_neighbour": 1}
    _push(mb, "c", 1, 2.0)
    assert mb.held("c") == 8
    mb.receive(1, 0.1)
    assert mb.held("c") == 0


def test_the_in_memory_transport_enforces_the_same_rules():
    hub = InMemoryHub()
    a, b = (InMemoryTransport(r, hub, max_message_bytes=64, peer_budget_bytes=64) for r in ("a", "b"))
    for t in (a, b):
        t.start()
        t.connect({"a": "x", "b": "x"})
        t.mailbox.set_validator(_floats)
    a.mailbox.expect(0, ["b"])
    b.send("a", 1, struct.pack("d", 9.0), timeout_s=1)
    a.receive(0, 0.0)
    a.mailbox.expect(1, ["b"])
    with pytest.raises(TransportError) as ei:
        b.send("a", 1, struct.pack("d", 1.0), timeout_s=1)
    assert ei.value.reason == "equivocation"
    assert "b" not in a.receive(1, 0.1)
