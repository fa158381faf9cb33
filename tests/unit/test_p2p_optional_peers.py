"""Issue 36, N2 (bench attack's withhold arms at 2.44x and 1.64x the undisturbed time): what a
receive waits for when an in-neighbour is silent.

- An *optional* in-peer (a member on probation after withholding) is taken if it comes with the
  required ones, and nobody waits past a short grace for it.
- A "senders done" notice (the driver saw the sender report the round; its push here was
  delivered or never made) ends the wait for a sender still absent after a short grace, but never
  cuts a push that is still streaming in.

Real in-memory transports and mailboxes (the receive rules the gRPC transport shares), no mocks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from geofed.compression import CodecSpec
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.mailbox import DONE_GRACE_S, OPTIONAL_GRACE_S, Mailbox
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions.exchange import Exchanger


@pytest.fixture
def trio():
    hub = InMemoryHub()
    ts = {r: InMemoryTransport(r, hub) for r in ("a", "b", "x")}
    for t in ts.values():
        t.start()
        t.connect({r: f"inmem:{r}" for r in ts})
    yield hub, ts
    for t in ts.values():
        t.close()


def test_an_optional_in_peer_that_never_pushes_costs_only_a_short_grace(trio):
    """Before: TypeError (receive() took no `optional`); the silent member on probation cost every
    honest region its whole deadline (>= min_s, 1 s in bench attack)."""
    _, ts = trio
    ts["a"].mailbox.expect(0, ["b", "x"])
    ts["b"].send("a", 0, b"from-b", timeout_s=1.0)
    t0 = time.monotonic()
    inbox = ts["a"].receive(0, 3.0, optional=["x"])
    waited = time.monotonic() - t0
    assert set(inbox.received) == {"b"} and inbox.missing == {"x"}  # still a miss for the driver's watch
    assert waited < OPTIONAL_GRACE_S + 0.3, waited


def test_an_optional_in_peer_that_comes_with_the_others_is_taken(trio):
    """Before: TypeError (no `optional`)."""
    _, ts = trio
    ts["a"].mailbox.expect(0, ["b", "x"])
    threading.Timer(0.3, ts["b"].send, ("a", 0, b"from-b"), {"timeout_s": 1.0}).start()
    threading.Timer(0.1, ts["x"].send, ("a", 0, b"from-x"), {"timeout_s": 1.0}).start()
    inbox = ts["a"].receive(0, 3.0, optional=["x"])
    assert set(inbox.received) == {"b", "x"} and not inbox.missing
    # Within the grace after the required ones: still taken.
    ts["a"].mailbox.expect(1, ["b", "x"])
    ts["b"].send("a", 1, b"from-b", timeout_s=1.0)
    threading.Timer(OPTIONAL_GRACE_S / 3, ts["x"].send, ("a", 1, b"from-x"), {"timeout_s": 1.0}).start()
    inbox = ts["a"].receive(1, 3.0, optional=["x"])
    assert set(inbox.received) == {"b", "x"}


def test_a_senders_done_notice_ends_the_wait_for_a_silent_sender(trio):
    """Round 0 of a withholding member: b's update is in, x reported the round without pushing to a.
    Before: AttributeError (no senders_done); a waited its whole deadline (5 s in bench attack, 30 s
    with the product default)."""
    _, ts = trio
    ts["a"].mailbox.expect(0, ["b", "x"])
    ts["b"].send("a", 0, b"from-b", timeout_s=1.0)
    threading.Timer(0.3, ts["a"].mailbox.senders_done, (0, ["x"])).start()
    t0 = time.monotonic()
    inbox = ts["a"].receive(0, 5.0)
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 0.3 + DONE_GRACE_S + 0.3, waited
    assert inbox.missing == {"x"} and inbox.cut == {"x"} and set(inbox.received) == {"b"}
    # A notice before the round opens is kept for it (a fast region reports before a slow one receives).
    ts["a"].mailbox.senders_done(1, ["x"])
    ts["a"].mailbox.expect(1, ["b", "x"])
    ts["b"].send("a", 1, b"from-b", timeout_s=1.0)
    t0 = time.monotonic()
    inbox = ts["a"].receive(1, 5.0)
    assert time.monotonic() - t0 < DONE_GRACE_S + 0.3 and inbox.cut == {"x"}


def test_a_notice_does_not_cut_an_update_that_is_already_in_or_streaming_in():
    """A push admitted (its header in) and still streaming when the notice comes is waited for, and
    kept. Before: AttributeError (no senders_done)."""
    box = Mailbox("a", round_window=2, max_message_bytes=1 << 20)
    box.add_known(["b", "x"])
    box.expect(0, ["b", "x"])
    ticket = box.admit("x", 0, 6, identity="x")  # x's push is arriving
    box.senders_done(0, ["x", "b"])
    threading.Timer(0.6, box.deliver, (ticket, memoryview(b"from-x")), {"wire_bytes": 40, "seconds": 0.6}).start()
    threading.Timer(0.05, lambda: box.deliver(box.admit("b", 0, 6, identity="b"), memoryview(b"from-b"),
                                              wire_bytes=40, seconds=0.0)).start()
    t0 = time.monotonic()
    inbox = box.receive(0, 5.0)
    assert set(inbox.received) == {"b", "x"} and not inbox.cut
    assert 0.55 < time.monotonic() - t0 < 2.0


def test_a_cut_or_optional_sender_does_not_widen_the_deadline(trio):
    """Through the real exchanger: a silent optional in-peer, then a silent sender cut by a notice.
    Neither is lateness: the deadline keeps its value (before: TypeError, exchange() took no
    `optional`)."""
    _, ts = trio
    deadline = AdaptiveDeadline(2.0, 0.1, 8.0, 3.0)
    ex = Exchanger(ts["a"], error_feedback=False, deadline=deadline, send_timeout_s=2.0)
    spec = CodecSpec.parse("identity")
    try:
        for round_ in range(2):
            ts["b"].send("a", round_, _payload(), timeout_s=1.0)
        res = ex.exchange(0, [torch.ones(2)], out_peers=[], in_peers=["b", "x"], codecs={}, default_codec=spec,
                          optional=["x"])
        assert res.missing == ["x"] and res.wait_s < 1.0
        assert deadline.current() == 2.0
        threading.Timer(0.2, ts["a"].mailbox.senders_done, (1, ["x"])).start()
        res = ex.exchange(1, [torch.ones(2)], out_peers=[], in_peers=["b", "x"], codecs={}, default_codec=spec)
        assert res.missing == ["x"] and res.wait_s < 1.0
        assert deadline.current() == 2.0
    finally:
        ex.close()


def _payload() -> bytes:
    return b"u" * 16


def test_only_delivered_or_never_made_pushes_are_reported_finished():
    """What a region reports for the driver's notices (regions/region.py, `pushes_done`), from a real
    exchange: a push delivered (b) and one never made (d, not an out-peer this round) are finished;
    one that failed (c is gone) and one still in flight past the sender's wait (a, its link 1.6 s
    slow) are not, so the driver never tells a or c to stop waiting for this sender. Written with
    ExchangeResult.finished_pushes (before: no such method, AttributeError)."""
    hub = InMemoryHub()
    ts = {r: InMemoryTransport(r, hub) for r in ("x", "a", "b", "c", "d")}
    for t in ts.values():
        t.start()
        t.connect({r: f"inmem:{r}" for r in ts})
    hub.set_link("x", "a", delay_s=1.6)
    ex = Exchanger(ts["x"], error_feedback=False, deadline=AdaptiveDeadline(0.2, 0.1, 1.0, 3.0), send_timeout_s=4.0)
    try:
        for r in ("a", "b"):
            ts[r].mailbox.expect(0, ["x"])
        ts["c"].close()  # its push fails at once: unavailable
        res = ex.exchange(0, [torch.ones(2)], out_peers=["a", "b", "c"], in_peers=[], codecs={},
                          default_codec=CodecSpec.parse("identity"))
        assert "a" in res.send_failures and "in flight" in res.send_failures["a"]
        assert "c" in res.send_failures
        assert res.finished_pushes(["a", "b", "c", "d"]) == ["b", "d"]
    finally:
        ex.close()
        for t in ts.values():
            t.close()
