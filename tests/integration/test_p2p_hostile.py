"""Hostile input against a real mutual-TLS gossip server: each is refused with a gRPC status and
a reason, counted in stats(), logged, and the server keeps serving the honest peers."""

import logging
import struct
import threading
import time
import zlib

import grpc
import pytest
import torch

from geofed.compression import encode_update
from geofed.p2p.grpc_transport import GrpcTransport
from geofed.p2p.handshakes import GRACE_S
from geofed.p2p.proto import gossip_pb2, gossip_pb2_grpc
from geofed.p2p.tls import load_tls, make_pki
from geofed.p2p.transport import TransportError
from geofed.p2p.validate import update_validator
from geofed.p2p.prober import LinkProber

pytestmark = pytest.mark.timeout(60)

REGIONS = ["r0", "r1", "r2", "r3"]
SHAPE = (6,)
MAX = 1 << 20


@pytest.fixture(scope="module")
def pkis(tmp_path_factory):
    base = tmp_path_factory.mktemp("run")
    # "zz" holds a certificate from the run's own CA but is not a region of the run.
    return make_pki(base / "tls", REGIONS + ["zz"]), make_pki(base / "other-ca", REGIONS)


@pytest.fixture
def server(pkis):
    """r0 serves (expects r1 in round 0); r1 and r2 are honest senders."""
    pki = pkis[0]
    ts = {r: GrpcTransport(r, tls=load_tls(pki.directory, r), max_message_bytes=MAX, round_window=2,
                           max_inflight_per_sender=2) for r in ("r0", "r1", "r2")}
    ts["r0"].mailbox.set_validator(update_validator(max_bytes=MAX, expected_shapes=[SHAPE]))
    addrs = {r: t.start() for r, t in ts.items()}
    addrs["r3"] = "127.0.0.1:9"  # known to r0, never dialled
    for t in ts.values():
        t.connect(addrs)
    ts["r0"].mailbox.expect(0, ["r1"])
    yield ts, addrs["r0"]
    for t in ts.values():
        t.close()


def _good(value=1.0):
    return encode_update("identity", [torch.full(SHAPE, value)])


def _raw_stub(pki_dir, region, address, *, cert=True):
    m = load_tls(pki_dir, region)
    creds = grpc.ssl_channel_credentials(root_certificates=m.ca_pem, private_key=m.key_pem if cert else None,
                                         certificate_chain=m.cert_pem if cert else None)
    ch = grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "r0"),
                                                      ("grpc.max_send_message_length", 8 << 20),
                                                      ("grpc.use_local_subchannel_pool", 1)])
    return ch, gossip_pb2_grpc.GossipStub(ch)


def _header(sender, round, total):
    return gossip_pb2.PushMessage(header=gossip_pb2.PushHeader(sender=sender, round=round, total_bytes=total))


def _chunk(data):
    return gossip_pb2.PushMessage(chunk=data)


def _raw_push(stub, messages, timeout=5.0):
    with pytest.raises(grpc.RpcError) as ei:
        stub.Push(iter(messages), timeout=timeout)
    return ei.value


def _with_crc(payload):
    # The wire format carries a CRC-32 of bytes 12..end at offset 8: a forged payload must fix it,
    # or it is refused for the checksum instead of for what the test means to send.
    payload = bytearray(payload)
    payload[8:12] = struct.pack("<I", zlib.crc32(payload[12:]))
    return bytes(payload)


def _nan_payload():
    payload = bytearray(_good(1.2345))
    at = payload.find(struct.pack("<f", 1.2345))
    assert at > 0
    payload[at:at + 4] = struct.pack("<f", float("nan"))
    return _with_crc(payload)


def _wrong_dtype_payload():
    payload = bytearray(_good())
    spec_len = struct.unpack_from("<I", payload, 20)[0]
    assert payload[36 + spec_len] == 1  # tensor 0's dtype code: float32
    payload[36 + spec_len] = 7  # no such tensor dtype
    return _with_crc(payload)


def _push_of(sender, round, payload):
    return [_header(sender, round, len(payload)), _chunk(payload)]


# case -> (sender certificate, messages, expected code, reason, text the details must contain)
CASES = {
    "truncated": ("r1", lambda: [_header("r1", 0, 1000), _chunk(b"x" * 100)], grpc.StatusCode.INVALID_ARGUMENT,
                  "truncated", "after 100 of 1000"),
    "huge_declared_size": ("r1", lambda: [_header("r1", 0, 1 << 62)], grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "oversize", "limit 1048576"),
    "oversize_chunk": ("r1", lambda: [_header("r1", 0, MAX), _chunk(b"x" * (2 << 20))],
                       grpc.StatusCode.RESOURCE_EXHAUSTED, "chunk_too_large", "chunk of 2097152"),
    "overrun": ("r1", lambda: [_header("r1", 0, 10), _chunk(b"x" * 20)], grpc.StatusCode.INVALID_ARGUMENT,
                "overrun", "declared 10"),
    "no_header": ("r1", lambda: [_chunk(b"x" * 20)], grpc.StatusCode.INVALID_ARGUMENT, "bad_header", "header"),
    "wrong_shape": ("r1", lambda: _push_of("r1", 0, encode_update("identity", [torch.ones(7)])),
                    grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "expected (6,)"),
    "wrong_dtype": ("r1", lambda: _push_of("r1", 0, _wrong_dtype_payload()),
                    grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "dtype"),
    "not_a_codec_payload": ("r1", lambda: _push_of("r1", 0, torch.ones(6).numpy().tobytes()),
                            grpc.StatusCode.INVALID_ARGUMENT, "invalid_payload", "CodecError"),
    "nan": ("r1", lambda: _push_of("r1", 0, _nan_payload()), grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_payload", "NaN"),
    "future_round": ("r1", lambda: _push_of("r1", 3, b"x" * 5), grpc.StatusCode.OUT_OF_RANGE,
                     "future_round", "beyond 2"),
    "unknown_sender": ("zz", lambda: _push_of("zz", 0, b"x" * 5), grpc.StatusCode.PERMISSION_DENIED,
                       "unknown_sender", "'zz'"),
    "cert_of_a_claiming_b": ("r2", lambda: _push_of("r1", 0, b"x" * 5), grpc.StatusCode.UNAUTHENTICATED,
                             "identity_mismatch", "certificate of 'r2' claims to be 'r1'"),
    "not_neighbour": ("r2", lambda: _push_of("r2", 0, b"x" * 5), grpc.StatusCode.PERMISSION_DENIED,
                      "not_neighbour", "r2 is not an in-neighbour"),
}


def _honest_round_still_works(ts):
    stats = ts["r1"].send("r0", 0, _good(2.0), timeout_s=5)
    assert stats.payload_bytes == len(_good(2.0))
    inbox = ts["r0"].receive(0, 2.0)
    assert set(inbox) == {"r1"} and torch.equal(inbox["r1"][0], torch.full(SHAPE, 2.0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_push_is_refused_counted_logged_and_survived(pkis, server, case, caplog):
    ts, address = server
    cert, messages, code, reason, text = CASES[case]
    ch, stub = _raw_stub(pkis[0].directory, cert, address)
    with caplog.at_level(logging.WARNING, logger="geofed.p2p"):
        err = _raw_push(stub, messages())
    ch.close()
    assert err.code() == code, err.details()
    assert err.details().startswith(f"{reason}: ") and text in err.details(), err.details()
    assert ts["r0"].stats()["refused"] == {reason: 1}
    assert any(reason in rec.getMessage() and "refused" in rec.getMessage() for rec in caplog.records)
    _honest_round_still_works(ts)


def test_replayed_and_late_rounds_are_refused(server):
    ts, _ = server
    ts["r1"].send("r0", 0, _good(), timeout_s=5)
    with pytest.raises(TransportError) as ei:
        ts["r1"].send("r0", 0, _good(), timeout_s=5)
    assert ei.value.reason == "replayed"
    assert set(ts["r0"].receive(0, 1.0)) == {"r1"}
    with pytest.raises(TransportError) as ei:
        ts["r1"].send("r0", 0, _good(), timeout_s=5)
    assert ei.value.reason == "late"
    st = ts["r0"].stats()
    assert st["refused"] == {"replayed": 1, "late": 1} and st["late_dropped"] == 1
    assert st["late_waits_s"][0]["sender"] == "r1"
    ts["r0"].mailbox.expect(1, ["r1"])
    ts["r1"].send("r0", 1, _good(), timeout_s=5)
    assert set(ts["r0"].receive(1, 1.0)) == {"r1"}


def test_push_without_a_deadline_is_refused(pkis, server):
    ts, address = server
    ch, stub = _raw_stub(pkis[0].directory, "r1", address)
    err = _raw_push(stub, [_header("r1", 0, 5), _chunk(b"x" * 5)], timeout=None)
    ch.close()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("no_deadline: ")
    assert ts["r0"].stats()["refused"] == {"no_deadline": 1}
    _honest_round_still_works(ts)


@pytest.mark.parametrize("who", ["no_certificate", "other_ca"])
def test_handshake_without_a_run_certificate_is_refused(pkis, server, who):
    # Refused by gRPC core during the TLS handshake: the handler never runs; the caller sees
    # UNAVAILABLE, r0 counts the connection as `tls_handshake` (once it is older than the
    # ledger's grace: a good connection's first call comes within it) and keeps serving.
    ts, address = server
    before = ts["r0"].stats()["refused"].get("tls_handshake", 0)
    pki_dir = pkis[1].directory if who == "other_ca" else pkis[0].directory
    if who == "other_ca":
        # A client certificate from another CA, trusting r0's real CA (so only r0 can refuse).
        other, real = load_tls(pki_dir, "r1"), load_tls(pkis[0].directory, "r1")
        creds = grpc.ssl_channel_credentials(root_certificates=real.ca_pem, private_key=other.key_pem,
                                             certificate_chain=other.cert_pem)
        ch = grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "r0")])
        stub = gossip_pb2_grpc.GossipStub(ch)
    else:
        ch, stub = _raw_stub(pki_dir, "r1", address, cert=False)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Ping(gossip_pb2.PingRequest(sender="r1", nonce=1), timeout=3)
    ch.close()
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ts["r0"].stats()["messages_received"] == {}
    time.sleep(GRACE_S + 0.2)
    refused = ts["r0"].stats()["refused"].get("tls_handshake", 0) - before
    assert refused >= 1  # gRPC's client may retry the connection within its 3 s
    _honest_round_still_works(ts)
    time.sleep(GRACE_S + 0.2)  # the honest round's connections are not counted
    assert ts["r0"].stats()["refused"].get("tls_handshake", 0) - before == refused


def test_client_refuses_a_server_with_a_certificate_for_another_region(pkis, server):
    # r1 dials r0's address but expects r2 there: r0's certificate does not name r2.
    ts, address = server
    ts["r1"].connect({"r2": address})
    with pytest.raises(TransportError) as ei:
        LinkProber(ts["r1"]).ping("r2", timeout_s=3)
    assert ei.value.reason == "unavailable"


def test_connection_flood_is_refused_as_busy_while_honest_peers_are_served(pkis, server):
    ts, address = server
    r0 = ts["r0"]
    r0.mailbox.expect(1, ["r1", "r2"])
    release = threading.Event()
    results = []

    def hold(round):  # header, then nothing until released: holds one of r1's two slots
        ch, stub = _raw_stub(pkis[0].directory, "r1", address)

        def messages():
            yield _header("r1", round, 5)
            release.wait(10)
        try:
            stub.Push(messages(), timeout=15)
        except grpc.RpcError as e:
            results.append(e.details().split(":")[0])
        ch.close()

    holders = [threading.Thread(target=hold, args=(r,)) for r in (0, 1)]
    for th in holders:
        th.start()
    deadline = time.monotonic() + 10
    while r0.mailbox.inflight() < 2:
        assert time.monotonic() < deadline, "the holding streams never reached the server"
        time.sleep(0.01)
    flood = []
    for _ in range(12):  # each on its own new TLS connection
        ch, stub = _raw_stub(pkis[0].directory, "r1", address)
        flood.append(_raw_push(stub, [_header("r1", 2, 5), _chunk(b"x" * 5)]))
        ch.close()
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.details().startswith("busy: ") for e in flood)
    ts["r2"].send("r0", 1, _good(3.0), timeout_s=5)  # an honest peer is served meanwhile
    assert LinkProber(r0).ping("r2", timeout_s=2) < 1
    release.set()
    for th in holders:
        th.join(20)
    assert sorted(results) == ["truncated", "truncated"]
    assert r0.stats()["refused"] == {"busy": 12, "truncated": 2}
    assert r0.mailbox.inflight() == 0
