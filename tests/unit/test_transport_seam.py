"""The narrow transport seam (issue 40, item 5): seven methods, side channels by `stream=`, pings
and probes through the link prober, no transport method beyond the seam's.

Before: Transport had 16 methods (expect, hurry, senders_done, accept_stale, take_stale, ping,
probe, set_state_provider, set_validator besides these seven), and a secure-aggregation message
reached its mailbox only through secure aggregation's own SlotMailbox, which both transports built.
"""

from __future__ import annotations

import inspect

import pytest

from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.mailbox import SIDE_STREAMS, stream_tag
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.p2p.prober import LinkProber
from geofed.p2p.transport import Transport, TransportError

SEAM = {"start", "connect", "send", "receive", "fetch_state", "stats", "close"}


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_the_transport_has_seven_methods_and_both_transports_no_more():
    assert Transport.__abstractmethods__ == SEAM
    assert _public_methods(Transport) == SEAM
    for cls in (GrpcTransport, InMemoryTransport):
        assert _public_methods(cls) == SEAM, cls.__name__


@pytest.fixture
def pair():
    hub = InMemoryHub()
    a, b = (InMemoryTransport(r, hub, max_message_bytes=1 << 10) for r in ("a", "b"))
    for t in (a, b):
        t.start()
        t.connect({"a": "x", "b": "x"})
        t.mailbox.set_validator(lambda sender, r, payload: bytes(payload))
    yield hub, a, b
    a.close()
    b.close()


def test_a_side_stream_has_rounds_of_its_own_and_the_update_never_sees_them(pair):
    _, a, b = pair
    side = b.mailbox.open_stream("secagg", max_message_bytes=1 << 10)
    side.set_validator(lambda sender, r, payload: ("side", bytes(payload)))
    b.mailbox.expect(0, ["a"])
    side.expect(0, ["a"])
    a.send("b", 0, b"update", timeout_s=1.0)
    a.send("b", 0, b"side", timeout_s=1.0, stream="secagg")  # the same round number: another mailbox
    assert b.receive(0, 0.5, stream="secagg").received == {"a": ("side", b"side")}
    assert b.receive(0, 0.5).received == {"a": b"update"}
    assert stream_tag("update") == 0 and stream_tag("secagg") == 1 << 62 and SIDE_STREAMS == ("secagg",)
    with pytest.raises(ValueError, match="stream"):
        stream_tag("nonsense")


def test_a_push_on_a_stream_the_receiver_never_opened_is_refused_and_counted(pair):
    _, a, b = pair
    with pytest.raises(TransportError) as exc:
        a.send("b", 0, b"x", timeout_s=1.0, stream="secagg")
    assert exc.value.reason == "bad_header"
    assert b.stats()["refused"]["bad_header"] == 1
    with pytest.raises(ValueError, match="not opened"):
        b.receive(0, 0.1, stream="secagg")


def test_the_link_prober_pings_and_probes_through_send(pair):
    hub, a, _ = pair
    hub.set_link("a", "b", delay_s=0.05)
    hub.set_link("b", "a", delay_s=0.03)
    prober = LinkProber(a, ping_timeout_s=1.0)
    assert 0.08 <= prober.ping("b", timeout_s=1.0) < 0.5  # both directions' delays
    stats = prober.probe("b", 4096, timeout_s=1.0)
    assert stats.payload_bytes == 4096 and stats.round == -1 and stats.seconds >= 0.08
    prober.measure_rtt("b")
    assert not prober.is_cold("b") and prober.estimator("b").rtt_s >= 0.08
    assert set(prober.link_estimates("a")) == {"a->b"}
