"""Real gRPC servers on 127.0.0.1:0 with real mutual TLS: rounds, dead peers, state fetch."""

import socket
import threading
import time

import numpy as np
import pytest
import torch

from geofed.compression import encode_update
from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.rejoin import donor_order, fetch_checked_states
from geofed.p2p.tls import load_tls, make_pki
from geofed.p2p.topology import make_topology, topology_names
from geofed.p2p.transport import TransportError
from geofed.p2p.validate import update_validator
from geofed.p2p.prober import LinkProber

pytestmark = pytest.mark.timeout(60)

REGIONS = ["r0", "r1", "r2", "r3"]
SHAPE = (6,)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("run") / "tls", REGIONS)


def _transport(pki, region, **kw):
    t = GrpcTransport(region, tls=load_tls(pki.directory, region), max_message_bytes=4 << 20, **kw)
    t.mailbox.set_validator(update_validator(max_bytes=1 << 20, expected_shapes=[SHAPE]))
    return t


@pytest.fixture
def mesh(pki):
    ts = [_transport(pki, r) for r in REGIONS]
    addrs = {t.region: t.start() for t in ts}
    for t in ts:
        t.connect(addrs)
    yield ts
    for t in ts:
        t.close()


def _push_all(ts, topo, r, values, alive):
    errors = []

    def push(i, j):
        try:
            ts[i].send(REGIONS[j], r, encode_update("identity", [values[i]]), timeout_s=2.0)
        except TransportError as e:
            errors.append((i, j, e.reason))

    threads = [threading.Thread(target=push, args=(i, j)) for i in alive for j in topo.out_neighbours(i, r)]
    for th in threads:
        th.start()
    return threads, errors


def _round(ts, topo, r, values, *, alive, deadline_s=3.0):
    for i in alive:
        ts[i].mailbox.expect(r, [REGIONS[j] for j in topo.in_weights(i, r)])
    threads, errors = _push_all(ts, topo, r, values, alive)
    inboxes = {i: ts[i].receive(r, deadline_s) for i in alive}
    for th in threads:
        th.join(10)
    mixed = {}
    for i, inbox in inboxes.items():
        acc = topo.self_weight(i, r) * values[i]
        for j, w in topo.in_weights(i, r).items():
            got = inbox.get(REGIONS[j])
            acc = acc + w * (got[0] if got is not None else values[i])
        mixed[i] = acc
    return inboxes, mixed, errors


@pytest.mark.parametrize("kind", topology_names())
def test_a_full_round_over_mutual_tls_for_every_topology(mesh, kind):
    topo = make_topology(kind, 4, seed=2)
    values = [torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for r in range(2):
        inboxes, mixed, errors = _round(mesh, topo, r, values, alive=range(4))
        assert errors == []
        assert all(not ib.missing for ib in inboxes.values())
        expected = topo.matrix(r) @ np.stack([v.numpy() for v in values])
        np.testing.assert_allclose(np.stack([mixed[i].numpy() for i in range(4)]), expected, rtol=1e-5, atol=1e-6)
        values = [mixed[i] for i in range(4)]
    st = mesh[0].stats()
    assert st["tls"] is True and st["refused"] == {}
    n_in = sum(len(topo.in_weights(0, r)) for r in range(2))
    assert sum(st["messages_received"].values()) == n_in
    if n_in:
        assert sum(st["bytes_received"].values()) > n_in * 24  # headers + 6 floats each


def test_a_region_that_stops_answering_is_left_out_and_the_others_finish(mesh):
    topo = make_topology("full", 4)
    values = [torch.full(SHAPE, float(i)) for i in range(4)]
    _round(mesh, topo, 0, values, alive=range(4))
    mesh[3].close()  # r3 dies between rounds
    t0 = time.monotonic()
    inboxes, mixed, errors = _round(mesh, topo, 1, values, alive=range(3), deadline_s=0.5)
    assert time.monotonic() - t0 < 5
    for i in range(3):
        assert inboxes[i].missing == {"r3"}
        assert set(inboxes[i]) == set(REGIONS[:3]) - {REGIONS[i]}
        assert 0.45 < inboxes[i].waited_s < 3
    assert {(j, reason) for _, j, reason in errors} == {(3, "unavailable")}
    # r0 folds r3's weight into its own: 0.5 * 0 + 0.25 * 1 + 0.25 * 2
    torch.testing.assert_close(mixed[0], torch.full(SHAPE, 0.75))


def test_a_peer_that_accepts_but_never_answers_times_out_without_hanging(pki):
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(8)  # TCP connects, TLS never completes
    t = _transport(pki, "r0")
    try:
        t.start()
        t.connect({"r1": f"127.0.0.1:{blackhole.getsockname()[1]}"})
        for call in (lambda: t.send("r1", 0, b"x", timeout_s=0.5), lambda: LinkProber(t).ping("r1", timeout_s=0.5),
                     lambda: t.fetch_state("r1", timeout_s=0.5)):
            t0 = time.monotonic()
            with pytest.raises(TransportError) as ei:
                call()
            assert ei.value.reason in ("timeout", "unavailable")
            assert time.monotonic() - t0 < 3
        assert t.stats()["send_failures"] == {"r1": 1}
    finally:
        t.close()
        blackhole.close()


def test_ping_and_state_fetch_spread_over_donors(mesh):
    rtt = LinkProber(mesh[0]).ping("r1", timeout_s=2)
    assert 0 < rtt < 1
    state = bytes(range(256)) * 12000  # 3 MB: several chunks
    for t in mesh[1:]:
        t.state_provider = lambda t=t: t.region.encode() + state
    [(donor, got)] = fetch_checked_states(mesh[0], REGIONS, timeout_s=5, check=lambda d, raw: raw)
    assert donor == donor_order("r0", REGIONS)[0] and got == donor.encode() + state
    # Joiners do not all pick the same first donor.
    firsts = {donor_order(f"joiner-{k}", REGIONS)[0] for k in range(16)}
    assert len(firsts) >= 3
    # A failing donor is skipped.
    mesh[REGIONS.index(donor)].close()
    [(donor2, got2)] = fetch_checked_states(mesh[0], REGIONS, timeout_s=2, check=lambda d, raw: raw)
    assert donor2 != donor and got2 == donor2.encode() + state
    with pytest.raises(TransportError) as ei:
        mesh[1].fetch_state("r0", timeout_s=2)  # r0 has no state provider
    assert ei.value.reason == "no_state" and mesh[0].stats()["refused"]["no_state"] == 1


def test_port_range_binds_the_first_free_port(pki):
    a = _transport(pki, "r0")
    addr = a.start()
    port = int(addr.rsplit(":", 1)[1])
    b = _transport(pki, "r1", port=(port, port + 20))
    try:
        got = int(b.start().rsplit(":", 1)[1])
        assert port < got <= port + 20
    finally:
        a.close()
        b.close()


def test_plaintext_works_only_when_asked_and_warns(caplog):
    with caplog.at_level("WARNING", logger="geofed.p2p"):
        a, b = (GrpcTransport(r, tls=None, max_message_bytes=1 << 20) for r in ("r0", "r1"))
    assert sum("security.tls is false" in rec.getMessage() for rec in caplog.records) == 2
    try:
        addrs = {"r0": a.start(), "r1": b.start()}
        a.connect(addrs)
        b.connect(addrs)
        b.mailbox.expect(0, ["r0"])
        a.send("r1", 0, b"plain bytes", timeout_s=2)
        assert b.receive(0, 1)["r0"] == b"plain bytes"  # default validator: the bytes themselves
        assert b.stats()["tls"] is False and b.stats()["bytes_received"]["r0"] > len(b"plain bytes")
    finally:
        a.close()
        b.close()


def test_a_spread_push_streams_its_chunks_over_the_spread_and_arrives_whole(pki):
    """sync.spread_sends over real TLS: the receiver sees the chunks come in over the spread (its
    own clock, header to last chunk), the update arrives intact, and the smaller chunks cost
    under 2% more on the wire than one burst."""
    big = (20_000,)
    ts = [GrpcTransport(r, tls=load_tls(pki.directory, r), max_message_bytes=4 << 20) for r in ("r0", "r1")]
    for t in ts:
        t.mailbox.set_validator(update_validator(max_bytes=1 << 20, expected_shapes=[big]))
    try:
        addrs = {t.region: t.start() for t in ts}
        for t in ts:
            t.connect(addrs)
        value = torch.randn(big, generator=torch.Generator().manual_seed(7))
        payload = encode_update("identity", [value])
        stats = {}
        for r, spread in enumerate((0.0, 0.6)):
            ts[1].mailbox.expect(r, ["r0"])
            stats[spread] = ts[0].send("r1", r, payload, timeout_s=10.0, spread_s=spread)
            inbox = ts[1].receive(r, 5.0)
            assert not inbox.missing
            torch.testing.assert_close(inbox.received["r0"][0], value, rtol=0, atol=0)
        paced, burst = stats[0.6], stats[0.0]
        assert paced.spread_s == 0.6 and burst.spread_s == 0.0
        assert paced.chunks >= 10 and burst.chunks == 1
        # chunk i of n leaves at i/(n-1) of the spread: the last one at its end
        assert paced.receiver_seconds >= 0.6 - 0.02
        assert paced.seconds >= paced.receiver_seconds
        assert burst.wire_bytes < paced.wire_bytes < 1.02 * burst.wire_bytes
    finally:
        for t in ts:
            t.close()
