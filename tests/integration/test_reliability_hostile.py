"""Issue 9, point 4: hostile input against a RUNNING region's gRPC service, during a real
`geofed` run (Runner on Ray, mutual TLS). Every kind of the issue is refused with a reason
(the gRPC status the attacker sees), counted (the region's counters and summary.json
`refusals`), logged (the region's own log and events.jsonl); the region keeps training and its
resident memory stays bounded.

The attacker holds the run's real certificate of a region that is not the target's neighbour
(a compromised peer; ring topology), plus forged or foreign certificates. Refusals at the TLS
handshake (no certificate, another CA) happen inside gRPC core, before any geofed code runs:
the attacker gets UNAVAILABLE and nothing is delivered; the region counts them as
`tls_handshake` (accepted connections that never carried an authenticated call,
p2p/handshakes.py), as it does the flood's raw TCP connections.
"""

from __future__ import annotations

import glob
import os
import socket
import struct
import threading
import time

import grpc
import pytest
import ray
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from geofed.compression import encode_update
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.p2p.handshakes import GRACE_S
from geofed.p2p.proto import gossip_pb2, gossip_pb2_grpc
from geofed.p2p.service import MAX_CHUNK_BYTES
from geofed.p2p.tls import issue, load_tls, make_pki
from reliability_harness import BackgroundRun, events, rss_mb, small_config, wait_for
from test_p2p_hostile import _chunk, _header, _with_crc

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(420)]

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"]
TARGET, INSIDER = "us-east-1", "ap-northeast-1"  # ring: ap-northeast-1 never sends to us-east-1
WINDOW = 8  # security.round_window
MAX_MB = 4  # network.max_message_mb
SHAPES = [(32, 64), (32,), (10, 32), (10,)]  # the digits MLP with 32 hidden units
RSS_BOUND_MB = 64
# The attacks end within ~20 rounds of the run's start (13 rounds at load 38 on 2 cores); the run
# must outlive them by the handshake grace and a few rounds, and train on long enough to halve
# its loss. 300 rounds left ~280 idle rounds after the attacks (20 s of CI's 47).
ROUNDS = 120


class Attacker:
    def __init__(self, address: str, tls_dir, region: str = INSIDER, *, cert=None, key=None, ca=None):
        m = load_tls(tls_dir, region) if cert is None else None
        creds = grpc.ssl_channel_credentials(root_certificates=ca or m.ca_pem, private_key=key or (m and m.key_pem),
                                             certificate_chain=cert or (m and m.cert_pem))
        self.channel = grpc.secure_channel(address, creds, options=[
            ("grpc.ssl_target_name_override", TARGET), ("grpc.max_send_message_length", 8 << 20),
            ("grpc.use_local_subchannel_pool", 1)])
        self.stub = gossip_pb2_grpc.GossipStub(self.channel)

    def push(self, messages, timeout=10.0) -> grpc.RpcError | None:
        try:
            self.stub.Push(iter(messages), timeout=timeout)
        except grpc.RpcError as exc:
            return exc
        return None

    def close(self):
        self.channel.close()


def _update(value: float = 0.5) -> bytes:
    return encode_update("identity", [torch.full(s, value) for s in SHAPES])


def _poisoned(value: float) -> bytes:
    payload = bytearray(_update(1.2345))
    at = payload.find(struct.pack("<f", 1.2345))
    payload[at:at + 4] = struct.pack("<f", value)
    return _with_crc(payload)  # a valid checksum: refused for the value, not the CRC


def _wrong_dtype() -> bytes:
    payload = bytearray(_update())
    spec_len = struct.unpack_from("<I", payload, 20)[0]
    payload[36 + spec_len] = 7  # tensor 0's dtype code: no such dtype
    return _with_crc(payload)


def _push_of(sender: str, round_: int, payload: bytes) -> list:
    return [_header(sender, round_, len(payload)), _chunk(payload)]


def _foreign_identity(run_dir, name: str) -> tuple[bytes, bytes]:
    """A certificate the run's own CA signed for a name that is not a region of the run."""
    tls = run_dir / "tls"
    ca_key = serialization.load_pem_private_key((tls / "ca.key").read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate((tls / "ca.pem").read_bytes())
    key, cert = issue(ca_key, ca_cert, name)
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _closed_upto(run) -> int:
    return ray.get(run.runner.actors.handles[TARGET].transport_stats.remote(), timeout=60)["closed_upto"]


def _expect(err, code, reason, text=""):
    assert err is not None, f"{reason}: the push was accepted"
    assert err.code() == code, (reason, err.code(), err.details())
    assert err.details().startswith(f"{reason}: ") and text in err.details(), err.details()


def _payload_attacks(run, atk: Attacker) -> dict[str, int]:
    c = _closed_upto(run)
    ahead = c + WINDOW  # within the window, not yet expected: the payload itself is judged
    big_ok = (MAX_MB << 20)
    cases = [
        ("truncated", [_header(INSIDER, ahead, 1000), _chunk(b"x" * 100)], grpc.StatusCode.INVALID_ARGUMENT, "after 100 of 1000"),
        ("oversize", [_header(INSIDER, ahead, 1 << 62)], grpc.StatusCode.RESOURCE_EXHAUSTED, f"limit {big_ok}"),
        ("oversize", [_header(INSIDER, ahead, big_ok + 1)], grpc.StatusCode.RESOURCE_EXHAUSTED, f"limit {big_ok}"),
        ("chunk_too_large", [_header(INSIDER, ahead, big_ok), _chunk(b"x" * (MAX_CHUNK_BYTES + 1))],
         grpc.StatusCode.RESOURCE_EXHAUSTED, "chunk of"),
        ("invalid_payload", _push_of(INSIDER, ahead, encode_update("identity", [torch.ones(7)])),
         grpc.StatusCode.INVALID_ARGUMENT, "1 tensors, expected 4"),
        ("invalid_payload", _push_of(INSIDER, ahead, encode_update("identity", [torch.ones(32, 65), *map(torch.ones, SHAPES[1:])])),
         grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        ("invalid_payload", _push_of(INSIDER, ahead, _wrong_dtype()), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
        ("invalid_payload", _push_of(INSIDER, ahead, _poisoned(float("nan"))), grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
        ("invalid_payload", _push_of(INSIDER, ahead, _poisoned(float("inf"))), grpc.StatusCode.INVALID_ARGUMENT, "Inf"),
        ("future_round", _push_of(INSIDER, c + 10_000, _update()), grpc.StatusCode.OUT_OF_RANGE, "beyond"),
        ("late", _push_of(INSIDER, 0, _update()), grpc.StatusCode.FAILED_PRECONDITION, "after the round closed"),
        ("identity_mismatch", _push_of("eu-west-1", ahead, _update()), grpc.StatusCode.UNAUTHENTICATED,
         f"certificate of {INSIDER!r} claims to be 'eu-west-1'"),
    ]
    counts: dict[str, int] = {}
    for reason, messages, code, text in cases:
        _expect(atk.push(messages), code, reason, text)
        counts[reason] = counts.get(reason, 0) + 1
    # A replay: the same well-formed update twice (the first is filed early, then dropped when
    # the round opens, since its sender is not an in-neighbour; the copy is refused at once).
    assert atk.push(_push_of(INSIDER, ahead, _update())) is None
    _expect(atk.push(_push_of(INSIDER, ahead, _update())), grpc.StatusCode.ALREADY_EXISTS, "replayed")
    counts["replayed"] = 1
    counts["not_neighbour"] = 1  # the original, dropped when its round opens
    # Wait for that: later attacks then cannot collide with the filed copy's round.
    wait_for(lambda: _closed_upto(run) >= ahead, 120, f"{TARGET} to open round {ahead}", 0.2)
    return counts


def _identity_attacks(run, address: str, tmp_path) -> dict[str, int]:
    cert, key = _foreign_identity(run.run_dir, "zz-intruder")
    ca = (run.run_dir / "tls" / "ca.pem").read_bytes()
    stranger = Attacker(address, None, cert=cert, key=key, ca=ca)
    _expect(stranger.push(_push_of("zz-intruder", _closed_upto(run) + 2, _update())),
            grpc.StatusCode.PERMISSION_DENIED, "unknown_sender", "'zz-intruder' is not a region of this run")
    with pytest.raises(grpc.RpcError) as ei:
        stranger.stub.FetchState(gossip_pb2.FetchStateRequest(sender="zz-intruder"), timeout=5).next()
    assert ei.value.details().startswith("unknown_sender: ")
    stranger.close()
    # No certificate, or one from another CA: refused in the TLS handshake (UNAVAILABLE).
    other = make_pki(tmp_path / "other-ca", [INSIDER]).material(INSIDER)
    for name, creds in [("no certificate", grpc.ssl_channel_credentials(root_certificates=ca)),
                        ("another CA", grpc.ssl_channel_credentials(root_certificates=ca, private_key=other.key_pem,
                                                                    certificate_chain=other.cert_pem))]:
        ch = grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", TARGET)])
        with pytest.raises(grpc.RpcError) as ei:
            gossip_pb2_grpc.GossipStub(ch).Ping(gossip_pb2.PingRequest(sender=INSIDER, nonce=1), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, (name, ei.value.details())
        ch.close()
    return {"unknown_sender": 2, "tls_handshake": 2}


def _flood(run, address: str) -> dict[str, int]:
    """Streams that send a header and then nothing hold the insider's 4 slots; 20 more pushes are
    refused as busy; 300 raw TCP connections (no TLS, some sending junk) sit on the port."""
    base = _closed_upto(run) + 2
    release = threading.Event()
    ended: list[str] = []

    def hold(round_):
        atk = Attacker(address, run.run_dir / "tls")

        def messages():
            yield _header(INSIDER, round_, 1 << 20)
            release.wait(30)
        err = atk.push(messages(), timeout=40)
        ended.append(err.details().split(":")[0] if err else "accepted")
        atk.close()

    def header_bytes() -> int:
        stats = ray.get(run.runner.actors.handles[TARGET].transport_stats.remote(), timeout=60)
        return stats["bytes_received"].get(INSIDER, 0)

    before = header_bytes()
    holders = [threading.Thread(target=hold, args=(base + i,)) for i in range(4)]
    for th in holders:
        th.start()
    one = _header(INSIDER, base, 1 << 20).header.ByteSize() + 7  # what the server counts per header
    wait_for(lambda: header_bytes() - before >= 4 * one, 30, "the four held streams to reach the server", 0.2)
    busy = Attacker(address, run.run_dir / "tls")
    for i in range(20):
        assert not ended, (i, ended)
        _expect(busy.push(_push_of(INSIDER, base + 4 + (i % 2), _update())), grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    busy.close()
    host, port = address.rsplit(":", 1)
    socks = []
    for i in range(300):
        s = socket.create_connection((host, int(port)), timeout=5)
        if i % 3 == 0:
            s.sendall(os.urandom(512))
        socks.append(s)
    rounds_before = run.rounds_done()
    run.wait_rounds(rounds_before + 3, timeout_s=60)  # it trains on, under the flood
    for s in socks:
        s.close()
    release.set()
    for th in holders:
        th.join(60)
    assert sorted(ended) == ["truncated"] * 4, ended  # each held stream ended, refused, freed
    return {"busy": 20, "truncated": 4, "tls_handshake": 300}  # raw connections never carry a call


def _target_log(pid: int) -> str:
    session = ray._private.worker._global_node.get_session_dir_path()
    texts = []
    for path in glob.glob(os.path.join(session, "logs", f"worker-*-{pid}.*")):
        with open(path, errors="replace") as f:
            texts.append(f.read())
    return "\n".join(texts)


def test_hostile_input_against_a_running_region(tmp_path):
    cfg = small_config(regions=REGIONS, rounds=ROUNDS, H=10,
                       network={"emulation": {"mode": "proxy", "preset": None,
                                              "default": {"latency_ms": 20, "bandwidth_mbps": 100, "jitter_ms": 0,
                                                          "loss": 0}},
                                "max_message_mb": MAX_MB},
                       # The outer step is plain averaging (SGD, lr 1, no momentum): with DiLoCo's Nesterov
                       # 0.7/0.9 the ring's loss fell to 0.5 by round 6, then swung to 16-24 and back (to 650
                       # once), so whether it had halved by the last round was chance (1.06 against a bound of
                       # 1.14 after 300 rounds, 2.27 at round 119); momentum 0.5 (with or without cosine decay)
                       # still rose to 1-2 after round 70. What is under test here is the service, not the
                       # outer optimiser.
                       sync={"topology": "ring", "policy": {"kind": "fixed", "H": 10}, "inner": {"lr": 0.003},
                             "outer": {"kind": "sgd", "lr": 1.0, "momentum": 0.0},
                             "deadline": {"initial_s": 3.0, "min_s": 1.0, "max_s": 4.0}},
                       security={"round_window": WINDOW})
    run = BackgroundRun(cfg, tmp_path).start()
    run.wait_rounds(5, timeout_s=240)
    address = run.runner.addresses[TARGET]  # the server itself, not the emulator's proxy
    pid = run.runner.actors.info[TARGET]["pid"]
    rss_before = rss_mb(pid)
    start_round = run.rounds_done()

    atk = Attacker(address, tmp_path / "tls")
    expected = _payload_attacks(run, atk)
    atk.close()
    for reason, n in _identity_attacks(run, address, tmp_path).items():
        expected[reason] = expected.get(reason, 0) + n
    for reason, n in _flood(run, address).items():
        expected[reason] = expected.get(reason, 0) + n
    rss_after = rss_mb(pid)
    attack_end = run.rounds_done()
    assert attack_end > start_round, "the region stopped training under attack"
    assert rss_after - rss_before < RSS_BOUND_MB, (rss_before, rss_after)

    time.sleep(GRACE_S + 0.2)  # a connection counts as a refused handshake once older than this
    live_stats = ray.get(run.runner.actors.handles[TARGET].transport_stats.remote(), timeout=60)
    live = live_stats["refused"] | {"connections": live_stats.get("connections")}
    summary = run.join(timeout_s=300)
    assert run.error is None, run.error
    # Counted: by the region, in summary.json, round by round in events.jsonl.
    for reason, n in expected.items():
        # Honest traffic on a loaded machine can add a late or cut-short push, never the others;
        # a refused client may retry its handshake, and the flood's raw connections count too.
        exact = reason not in ("late", "truncated", "tls_handshake")
        assert (live.get(reason, 0) == n) if exact else (live.get(reason, 0) >= n), (reason, str(live))
        assert (summary["refusals"]["by_reason"].get(reason, 0) >= n), (reason, summary["refusals"])
    assert summary["refusals"]["by_region"][TARGET] >= sum(expected.values())
    logged = {}
    for e in events(tmp_path, "refused"):
        if e["region"] == TARGET:
            for reason, n in e["by_reason"].items():
                logged[reason] = logged.get(reason, 0) + n
    for reason in ("identity_mismatch", "unknown_sender", "future_round", "invalid_payload", "busy", "oversize"):
        assert logged.get(reason, 0) >= expected[reason] or summary["refusals"]["by_reason"][reason] >= expected[reason]
    # Logged by the region itself, with the reason.
    text = _target_log(pid)
    for reason in expected:
        assert "refused a message from" in text and f"{reason}:" in text, reason
    # It kept training: every round has the target's metrics, and its loss fell.
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["region"] == TARGET]
    assert [m["round"] for m in metrics] == list(range(ROUNDS))
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"] * 0.5
    # ...as well as the regions nobody attacked.
    evals = {r: v["value"] for r, v in summary["eval_per_region"].items()}
    assert evals[TARGET] >= min(v for r, v in evals.items() if r != TARGET) - 0.03, evals
