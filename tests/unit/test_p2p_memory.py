import struct
import threading
import time

import numpy as np
import pytest

from geofed.p2p.mailbox import Mailbox, Refusal
from geofed.p2p.topology import make_topology, topology_names
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.p2p.transport import TransportError

REGIONS = ["r0", "r1", "r2", "r3"]


def _floats(sender, round, payload):
    if len(payload) % 8:
        raise ValueError("not a float64 array")
    arr = np.frombuffer(payload, dtype=np.float64).copy()
    if not np.isfinite(arr).all():
        raise ValueError("non-finite values")
    return arr


@pytest.fixture
def mesh():
    hub = InMemoryHub()
    ts = [InMemoryTransport(r, hub, max_message_bytes=1 << 16, round_window=2) for r in REGIONS]
    addrs = {t.region: t.start() for t in ts}
    for t in ts:
        t.connect(addrs)
        t.mailbox.set_validator(_floats)
    yield hub, ts
    for t in ts:
        t.close()


def _round(ts, topo, r, values, deadline_s=2.0):
    for i, t in enumerate(ts):
        t.mailbox.expect(r, [REGIONS[j] for j in topo.in_weights(i, r)])
    errors = []

    def push(i, j):
        try:
            ts[i].send(REGIONS[j], r, values[i].tobytes(), timeout_s=1.0)
        except TransportError as e:
            errors.append(e)

    # One thread per link: a slow link must not hold up the sender's other pushes.
    threads = [threading.Thread(target=push, args=(i, j)) for i in range(len(ts)) for j in topo.out_neighbours(i, r)]
    for th in threads:
        th.start()
    inboxes = [t.receive(r, deadline_s) for t in ts]
    for th in threads:
        th.join(5)
    mixed = []
    for i, inbox in enumerate(inboxes):
        w_self = topo.self_weight(i, r)
        acc = w_self * values[i]
        for j, w in topo.in_weights(i, r).items():
            if REGIONS[j] in inbox:
                acc = acc + w * inbox[REGIONS[j]]
            else:
                acc = acc + w * values[i]  # missing: fold into self
        mixed.append(acc)
    return inboxes, mixed, errors


@pytest.mark.parametrize("kind", topology_names())
def test_rounds_over_every_topology_match_the_mixing_matrix(mesh, kind):
    _, ts = mesh
    topo = make_topology(kind, 4, seed=5)
    values = [np.random.default_rng(i).normal(size=6) for i in range(4)]
    for r in range(3):
        inboxes, mixed, errors = _round(ts, topo, r, values)
        assert not errors
        assert all(not ib.missing for ib in inboxes)
        np.testing.assert_allclose(np.stack(mixed), topo.matrix(r) @ np.stack(values))
        values = mixed
    st = ts[0].stats()
    assert sum(st["messages_received"].values()) == sum(len(topo.in_weights(0, r)) for r in range(3))
    assert st["refused"] == {}


def test_a_cut_link_is_left_out_after_the_deadline_and_others_finish(mesh):
    hub, ts = mesh
    hub.set_link("r3", "r0", down=True)
    topo = make_topology("full", 4)
    values = [np.full(3, float(i)) for i in range(4)]
    t0 = time.monotonic()
    inboxes, mixed, errors = _round(ts, topo, 0, values, deadline_s=0.3)
    assert inboxes[0].missing == {"r3"} and set(inboxes[0]) == {"r1", "r2"}
    assert all(not ib.missing for ib in inboxes[1:])
    assert [e.reason for e in errors] == ["timeout"]
    assert 0.25 < inboxes[0].waited_s < 1.0
    assert time.monotonic() - t0 < 3
    # r0 folds r3's weight into its own: (0.25*0 + 0.25*0 [folded]) + 0.25*1 + 0.25*2
    np.testing.assert_allclose(mixed[0], np.full(3, 0.75))


def test_late_message_is_dropped_and_counted(mesh):
    hub, ts = mesh
    a, b = ts[0], ts[1]
    a.mailbox.expect(0, ["r1"])
    inbox = a.receive(0, 0.05)
    assert inbox.missing == {"r1"}
    with pytest.raises(TransportError) as ei:
        b.send("r0", 0, np.zeros(2).tobytes(), timeout_s=1)
    assert ei.value.reason == "late"
    assert a.stats()["late_dropped"] == 1 and a.stats()["refused"]["late"] == 1


@pytest.mark.parametrize("case,reason", [
    ("replayed", "replayed"), ("future", "future_round"), ("not_neighbour", "not_neighbour"),
    ("oversize", "oversize"), ("nan", "invalid_payload"), ("garbage", "invalid_payload"),
])
def test_each_refusal_is_reported_counted_and_the_receiver_keeps_working(mesh, case, reason):
    _, ts = mesh
    a, b, c = ts[0], ts[1], ts[2]
    a.mailbox.expect(0, ["r1"])
    ok = np.ones(2).tobytes()
    args = {
        "replayed": (0, ok), "future": (3, ok), "not_neighbour": (0, ok),
        "oversize": (0, bytes(1 << 17)), "nan": (0, np.array([1.0, np.nan]).tobytes()), "garbage": (0, b"abc"),
    }[case]
    sender = c if case == "not_neighbour" else b
    if case == "replayed":
        b.send("r0", 0, ok, timeout_s=1)
    if case == "oversize":
        sender.mailbox.max_message_bytes = 1 << 20  # the sender's own cap would stop it first
    with pytest.raises(TransportError) as ei:
        sender.send("r0", *args, timeout_s=1)
    assert ei.value.reason == reason
    assert a.stats()["refused"] == {reason: 1}
    if case != "replayed":
        b.send("r0", 0, ok, timeout_s=1)
    assert set(a.receive(0, 1.0)) == {"r1"}


def test_early_push_is_kept_and_a_non_neighbour_early_push_is_dropped(mesh):
    _, ts = mesh
    a = ts[0]
    a.mailbox.expect(0, ["r1"])
    ts[1].send("r0", 1, np.ones(1).tobytes(), timeout_s=1)
    ts[2].send("r0", 1, np.ones(1).tobytes(), timeout_s=1)
    a.receive(0, 0.01)
    a.mailbox.expect(1, ["r1"])
    inbox = a.receive(1, 0.5)
    assert set(inbox) == {"r1"} and not inbox.missing and inbox.waits["r1"] == 0.0
    assert a.stats()["refused"] == {"not_neighbour": 1}


def test_unknown_sender_and_identity_mismatch_are_refused():
    mb = Mailbox("a", round_window=1, max_message_bytes=100)
    mb.add_known(["b"])
    mb.expect(0, ["b"])
    for sender, identity, reason in [("z", "z", "unknown_sender"), ("b", "c", "identity_mismatch")]:
        with pytest.raises(Refusal) as ei:
            mb.admit(sender, 0, 10, identity=identity)
        assert ei.value.reason == reason
    assert mb.counters()["refused"] == {"unknown_sender": 1, "identity_mismatch": 1}
    with pytest.raises(ValueError, match="senders: not connected regions"):
        mb.expect(1, ["z"])


def test_too_many_concurrent_pushes_from_one_sender_are_refused_as_busy():
    mb = Mailbox("a", round_window=5, max_message_bytes=100, max_inflight_per_sender=2)
    mb.add_known(["b"])
    tickets = [mb.admit("b", r, 8, identity=None) for r in (0, 1)]
    with pytest.raises(Refusal, match="busy"):
        mb.admit("b", 2, 8, identity=None)
    mb.deliver(tickets[0], memoryview(struct.pack("d", 1.0)), wire_bytes=8, seconds=0.0)
    mb.admit("b", 2, 8, identity=None)  # a slot freed up
    assert mb.counters()["refused"] == {"busy": 1}


def test_receive_requires_expect_and_deadlines_are_checked(mesh):
    _, ts = mesh
    with pytest.raises(ValueError, match="round: expect"):
        ts[0].receive(7, 0.1)
    ts[0].mailbox.expect(0, [])
    assert ts[0].receive(0, 5.0).waited_s < 0.5  # nothing expected: returns at once
    with pytest.raises(ValueError, match="round: 0 is already closed"):
        ts[0].mailbox.expect(0, ["r1"])


def test_a_crashing_validator_refuses_the_push_and_frees_its_slot(mesh):
    _, ts = mesh
    calls = []

    def buggy(sender, round, payload):
        calls.append(round)
        if len(calls) == 1:
            raise TypeError("bug")
        return bytes(payload)

    ts[0].mailbox.set_validator(buggy)
    ts[0].mailbox.expect(0, ["r1"])
    with pytest.raises(TransportError) as ei:
        ts[1].send("r0", 0, b"x", timeout_s=1)
    assert ei.value.reason == "invalid_payload" and "validator raised TypeError" in str(ei.value)
    ts[1].send("r0", 0, b"x", timeout_s=1)  # not refused as a replay
    assert ts[0].receive(0, 1)["r1"] == b"x"
