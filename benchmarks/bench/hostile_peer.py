"""A compromised peer, for the adversarial tests and ``geofed bench soak``: it holds one region's
genuine certificate (from a run's ``tls/`` folder) and calls another region's gossip server the way
an attacker would, not the way GrpcTransport does.

Every call returns what the server answered: ``"accepted"`` or the refusal reason (the prefix of
the status details, a name from ``geofed.p2p.transport.REASONS``), or for statuses geofed did not
write, the gRPC code's name in lower case (``resource_exhausted`` for gRPC core's "Concurrent RPC
limit exceeded", ``deadline_exceeded``, ``unavailable``). ``outcomes`` counts them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc
import torch

from geofed.compression import encode_update

from geofed.p2p.proto import gossip_pb2, gossip_pb2_grpc
from geofed.p2p.service import MAX_CHUNK_BYTES
from geofed.p2p.tls import load_tls
from geofed.p2p.transport import REASONS

__all__ = ["HostilePeer", "huge_update", "outcome_of"]


def outcome_of(exc: grpc.RpcError) -> str:
    """The refusal reason of a failed call (from its status details), or the gRPC code in lower case."""
    details = exc.details() or ""
    prefix = details.split(":", 1)[0]
    return prefix if prefix in REASONS else exc.code().name.lower()


def huge_update(shapes: Sequence[tuple[int, ...]], value: float = 3e38, codec: str = "identity") -> bytes:
    """A well-formed update (valid checksum; `codec` "bf16" halves it and still holds 3e38) of values +-`value` in turn: finite,
    so the NaN/Inf check lets it through, and the first forward pass it reaches sums +inf and
    -inf into NaN (one sign everywhere can hide behind a ReLU)."""
    out = []
    for s in shapes:
        t = torch.full(tuple(s), value)
        t.view(-1)[1::2] = -value
        out.append(t)
    return encode_update(codec, out)


def _header(sender: str, round_: int, total: int) -> gossip_pb2.PushMessage:
    return gossip_pb2.PushMessage(header=gossip_pb2.PushHeader(sender=sender, round=round_, total_bytes=total))


def _chunks(payload: bytes) -> Iterable[gossip_pb2.PushMessage]:
    for off in range(0, len(payload), MAX_CHUNK_BYTES):
        yield gossip_pb2.PushMessage(chunk=payload[off:off + MAX_CHUNK_BYTES])


class HostilePeer:
    """`address`: the target's gRPC server; `tls_dir`: the run's tls/ folder; `as_region`: whose
    certificate it holds (and whose name it claims); `target`: the region it calls."""

    def __init__(self, address: str, *, tls_dir: str | Path, as_region: str, target: str):
        m = load_tls(Path(tls_dir), as_region)
        creds = grpc.ssl_channel_credentials(root_certificates=m.ca_pem, private_key=m.key_pem,
                                             certificate_chain=m.cert_pem)
        self.address, self.as_region, self.target = address, as_region, target
        self._creds = creds
        self.channel = self._channel()
        self.stub = gossip_pb2_grpc.GossipStub(self.channel)
        self.outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _channel(self) -> grpc.Channel:
        # Without BDP probing the receive window stays at its initial 64 KiB: a stream nobody reads
        # holds its sender sooner (an attacker's choice, as the server cannot tell).
        return grpc.secure_channel(self.address, self._creds, options=[
            ("grpc.ssl_target_name_override", self.target), ("grpc.max_send_message_length", 8 << 20),
            ("grpc.max_receive_message_length", 8 << 20), ("grpc.use_local_subchannel_pool", 1),
            ("grpc.http2.bdp_probe", 0)])

    def _note(self, outcome: str) -> str:
        with self._lock:
            self.outcomes[outcome] += 1
        return outcome

    def close(self) -> None:
        self.channel.close()

    # -- pushes --------------------------------------------------------------------------
    def push_messages(self, messages: Iterable[gossip_pb2.PushMessage], *, timeout_s: float = 10.0) -> str:
        try:
            self.stub.Push(iter(messages), timeout=timeout_s)
        except grpc.RpcError as exc:
            return self._note(outcome_of(exc))
        return self._note("accepted")

    def push(self, round_: int, payload: bytes, *, timeout_s: float = 10.0) -> str:
        """A whole push of `payload` for `round_`, claiming to be `as_region`."""
        return self.push_messages([_header(self.as_region, round_, len(payload)), *_chunks(payload)], timeout_s=timeout_s)

    def push_huge(self, round_: int, shapes: Sequence[tuple[int, ...]], value: float = 3e38, codec: str = "identity") -> str:
        return self.push(round_, huge_update(shapes, value, codec))

    def push_garbage(self, round_: int, nbytes: int = 4096) -> str:
        return self.push(round_, os.urandom(nbytes))

    def push_stalled(self, round_: int, declared: int, *, send_bytes: int, hold_s: float,
                     release: threading.Event | None = None) -> str:
        """A header declaring `declared` bytes, `send_bytes` of them, then nothing for `hold_s`
        (or until `release`), then the stream is ended: a slow-loris push of a big size."""
        release = release or threading.Event()

        def messages():
            yield _header(self.as_region, round_, declared)
            sent = 0
            while sent < send_bytes:
                n = min(MAX_CHUNK_BYTES, send_bytes - sent)
                yield gossip_pb2.PushMessage(chunk=bytes(n))
                sent += n
            release.wait(hold_s)

        return self.push_messages(messages(), timeout_s=hold_s + 30)

    # -- FetchState, Ping ----------------------------------------------------------------
    def fetch_flood(self, n: int, *, hold_s: float, timeout_s: float | None = None) -> list[str]:
        """`n` FetchState streams opened at once and never read past their first message; held
        for `hold_s`, then cancelled. Returns each one's outcome ("held": the server started
        streaming its state, and now waits on a reader that never reads)."""
        held, out = [], []
        for _ in range(n):
            stream = self.stub.FetchState(
                gossip_pb2.FetchStateRequest(sender=self.as_region), timeout=timeout_s or hold_s + 30)
            try:
                next(stream)
            except grpc.RpcError as exc:
                out.append(self._note(outcome_of(exc)))
                continue
            except StopIteration:
                out.append(self._note("empty"))
                continue
            held.append(stream)
            out.append(self._note("held"))
        time.sleep(hold_s)
        for stream in held:
            stream.cancel()
        return out

    def fetch_without_deadline(self) -> str:
        try:
            next(self.stub.FetchState(gossip_pb2.FetchStateRequest(sender=self.as_region)))
        except grpc.RpcError as exc:
            return self._note(outcome_of(exc))
        return self._note("held")

    def ping(self, *, timeout_s: float | None = 5.0) -> str:
        try:
            self.stub.Ping(gossip_pb2.PingRequest(sender=self.as_region, nonce=1), timeout=timeout_s)
        except grpc.RpcError as exc:
            return self._note(outcome_of(exc))
        return self._note("accepted")
