"""Issue 15, findings 3 and 4, against a real mutual-TLS gossip server: every RPC is bounded.

A compromised peer holds one region's genuine certificate. Seventy unread FetchState streams used
to pin every server thread (honest pushes and pings then failed with gRPC core's uncounted
"Concurrent RPC limit exceeded"), and each serialized its own copy of the state; a push that
declared a large size allocated all of it before the first byte, and could stay open for an hour.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
import torch

from geofed.compression import encode_update
from geofed.bench.hostile_peer import HostilePeer
from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.proto import gossip_pb2, gossip_pb2_grpc
from geofed.p2p.tls import load_tls, make_pki
from geofed.p2p.validate import update_validator
from geofed.p2p.prober import LinkProber

pytestmark = pytest.mark.timeout(120)

REGIONS = ["r0", "r1", "r2", "r3"]
SHAPE = (6,)
STATE_MB = 4


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("run") / "tls", REGIONS)


def _mesh(pki, max_message_bytes=1 << 20, **server_kw):
    """r0 serves a fresh 4 MiB state per call (as Region.state_bytes serializes one per
    call); r1..r3 are honest transports."""
    ts = {r: GrpcTransport(r, tls=load_tls(pki.directory, r), max_message_bytes=max_message_bytes,
                           **(server_kw if r == "r0" else {"max_state_bytes": 16 << 20})) for r in REGIONS}
    ts["r0"].mailbox.set_validator(update_validator(max_bytes=1 << 20, expected_shapes=[SHAPE]))
    ts["r0"].state_provider = lambda: os.urandom(16) * (STATE_MB << 16)
    addrs = {r: t.start() for r, t in ts.items()}
    for t in ts.values():
        t.connect(addrs)
    return ts, addrs["r0"]


@pytest.fixture
def mesh(pki):
    ts, address = _mesh(pki)
    yield ts, address
    for t in ts.values():
        t.close()


def _update(value=1.0) -> bytes:
    return encode_update("identity", [torch.full(SHAPE, value)])


def _honest_round(ts, round_):
    """r1 pushes to r0 and both ping each other: what a round needs of r0's server."""
    r0 = ts["r0"]
    r0.mailbox.expect(round_, ["r1"])
    ts["r1"].send("r0", round_, _update(float(round_)), timeout_s=5)
    assert LinkProber(ts["r1"]).ping("r0", timeout_s=5) < 2
    assert set(r0.receive(round_, 2.0)) == {"r1"}


def test_a_fetch_state_flood_from_one_certificate_pins_one_thread_and_nobody_is_starved(pki, mesh):
    ts, address = mesh
    r0 = ts["r0"]
    atk = HostilePeer(address, tls_dir=pki.directory, as_region="r2", target="r0")
    rss_before = _rss_mb()
    outcomes: list[str] = []
    flood = threading.Thread(target=lambda: outcomes.extend(atk.fetch_flood(70, hold_s=8.0)))
    flood.start()
    # `outcomes` is a Counter: its total, not its len (the distinct outcomes), counts the streams
    # (the len never reached 70, so this waited its full 30 s and the rounds below ran after the hold).
    deadline = time.monotonic() + 30
    while sum(atk.outcomes.values()) < 70 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(atk.outcomes.values()) == 70 and flood.is_alive(), atk.outcomes  # every stream open or refused, still held
    # While the flood holds its streams, honest rounds run (on main: "Concurrent RPC limit exceeded").
    for r in range(3):
        _honest_round(ts, r)
    assert r0.stats()["open_calls"].get("FetchState", 0) <= 1
    assert flood.is_alive(), "the honest rounds must run while the flood holds its stream"
    rss_flood = _rss_mb() - rss_before
    flood.join(60)
    atk.close()
    assert sorted(set(outcomes)) == ["busy", "held"] and outcomes.count("held") == 1, outcomes
    assert r0.stats()["refused"].get("busy") == 69  # counted under a geofed reason
    assert rss_flood < 8 * STATE_MB, rss_flood  # one state in flight, not seventy
    deadline = time.monotonic() + 10
    while r0.stats()["open_calls"].get("FetchState", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r0.stats()["open_calls"].get("FetchState", 0) == 0  # the held stream ended with the cancel
    assert len(ts["r1"].fetch_state("r0", timeout_s=10)) == STATE_MB << 20


def test_every_method_needs_a_deadline_within_the_limit(pki):
    ts, address = _mesh(pki, max_rpc_s=60)
    try:
        atk = HostilePeer(address, tls_dir=pki.directory, as_region="r2", target="r0")
        assert atk.ping(timeout_s=None) == "no_deadline"
        assert atk.ping(timeout_s=3600) == "no_deadline"
        assert atk.fetch_without_deadline() == "no_deadline"
        assert atk.push_messages([gossip_pb2.PushMessage(header=gossip_pb2.PushHeader(sender="r2", round=0, total_bytes=5))],
                                 timeout_s=3600) == "no_deadline"  # an hour-long stream: refused
        assert atk.ping(timeout_s=5) == "accepted"
        atk.close()
        assert ts["r0"].stats()["refused"] == {"no_deadline": 4}
    finally:
        for t in ts.values():
            t.close()


def test_an_unread_fetch_state_stream_ends_at_its_deadline(pki, mesh):
    ts, address = mesh
    ch = grpc.secure_channel(address, load_tls(pki.directory, "r2").channel_credentials(),
                             options=[("grpc.ssl_target_name_override", "r0")])
    stream = gossip_pb2_grpc.GossipStub(ch).FetchState(gossip_pb2.FetchStateRequest(sender="r2"), timeout=2.0)
    assert next(stream).total_bytes == STATE_MB << 20  # then never read again
    assert ts["r0"].stats()["open_calls"] == {"FetchState": 1}
    deadline = time.monotonic() + 10
    while ts["r0"].stats()["open_calls"].get("FetchState") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ts["r0"].stats()["open_calls"].get("FetchState", 0) == 0
    assert len(ts["r2"].fetch_state("r0", timeout_s=10)) == STATE_MB << 20  # its slot is free again
    ch.close()


def test_stalled_pushes_of_the_largest_size_hold_only_what_they_sent(pki):
    """Finding 4: two stalled pushes declaring the cap each allocated all of it at once."""
    cap = 64 << 20
    ts, address = _mesh(pki, max_message_bytes=cap)
    release = threading.Event()
    try:
        atk = HostilePeer(address, tls_dir=pki.directory, as_region="r2", target="r0")
        rss_before = _rss_mb()
        holders = [threading.Thread(target=atk.push_stalled, args=(r, cap),
                                    kwargs={"send_bytes": 1 << 20, "hold_s": 30, "release": release}) for r in (0, 1)]
        for th in holders:
            th.start()
        deadline = time.monotonic() + 20
        while ts["r0"].stats()["bytes_received"].get("r2", 0) < 2 << 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ts["r0"].mailbox.inflight() == 2
        grown = _rss_mb() - rss_before
        _honest_round(ts, 0)
        release.set()
        for th in holders:
            th.join(30)
        atk.close()
        assert grown < 24, f"two stalled {cap >> 20} MiB pushes grew the server by {grown:.0f} MB"
        assert atk.outcomes == {"truncated": 2}
        assert ts["r0"].mailbox.held("r2") == 0
    finally:
        release.set()
        for t in ts.values():
            t.close()


def test_a_peer_past_its_memory_budget_is_refused_before_its_body_is_read(pki):
    cap = 8 << 20
    ts, address = _mesh(pki, max_message_bytes=cap, peer_budget_bytes=2 * cap)
    release = threading.Event()
    try:
        atk = HostilePeer(address, tls_dir=pki.directory, as_region="r2", target="r0")
        holders = [threading.Thread(target=atk.push_stalled, args=(r, cap),
                                    kwargs={"send_bytes": 0, "hold_s": 30, "release": release}) for r in (0, 1)]
        for th in holders:
            th.start()
        deadline = time.monotonic() + 20
        while ts["r0"].mailbox.held("r2") < 2 * cap and time.monotonic() < deadline:
            time.sleep(0.05)
        assert atk.push(2, bytes(16)) == "over_budget"
        _honest_round(ts, 0)  # another peer's budget is its own
        release.set()
        for th in holders:
            th.join(30)
        atk.close()
        assert ts["r0"].stats()["refused"] == {"over_budget": 1, "truncated": 2}
        assert ts["r0"].mailbox.held("r2") == 0
    finally:
        release.set()
        for t in ts.values():
            t.close()


def test_peers_at_their_limits_never_reach_grpc_cores_limit(pki):
    """Two hostile peers hold every call their limits allow and flood more; the pool is sized to
    the peers' limits, so the honest third peer is never turned away by gRPC core."""
    server = GrpcTransport("r0", tls=load_tls(pki.directory, "r0"), max_message_bytes=1 << 20, max_peers=3)
    per_peer = 4 + 2 + 1 + 1  # pushes, pings, a state fetch, a probe
    assert server.max_workers >= 3 * per_peer
    with pytest.raises(ValueError, match=f"max_workers: need >= {3 * per_peer + 8}"):
        GrpcTransport("r0", tls=None, max_message_bytes=1 << 20, max_peers=3, max_workers=3 * per_peer + 7)
    server.close()
    ts, address = _mesh(pki, max_peers=3, max_workers=3 * per_peer + 8, round_window=4)  # the peers' limits + 8 spare
    release = threading.Event()
    threads, atks = [], []
    try:
        for name in ("r2", "r3"):
            atk = HostilePeer(address, tls_dir=pki.directory, as_region=name, target="r0")
            atks.append(atk)
            threads += [threading.Thread(target=atk.push_stalled, args=(r, 1 << 20),
                                         kwargs={"send_bytes": 0, "hold_s": 30, "release": release}) for r in range(4)]
            threads.append(threading.Thread(target=atk.fetch_flood, args=(5,), kwargs={"hold_s": 4.0}))
        for th in threads:
            th.start()
        deadline = time.monotonic() + 20
        while ts["r0"].mailbox.inflight() < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ts["r0"].mailbox.inflight() == 8
        for atk in atks:
            for _ in range(10):
                assert atk.push(0, _update()) == "busy"
                atk.ping()
        for r in range(3):
            _honest_round(ts, r)
        release.set()
        for th in threads:
            th.join(30)
        for atk in atks:
            assert "resource_exhausted" not in atk.outcomes, atk.outcomes  # gRPC core's own refusal
            atk.close()
    finally:
        release.set()
        for t in ts.values():
            t.close()
