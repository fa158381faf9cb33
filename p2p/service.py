"""The server side of the gossip service: every incoming RPC is checked, refusals are statuses.

A refusal aborts the RPC with a gRPC status whose details read ``"<reason>: <detail>"`` (reason
from ``geofed.p2p.transport.REASONS``); it is counted in the mailbox and logged; the server
keeps serving. Who is calling comes from the client certificate (mutual TLS) and must equal the
``sender`` the message claims. Without TLS (``security.tls: false``) the claim is trusted.

Resource bounds, so a hostile or broken peer cannot pin the server (docs/p2p.md, "Memory and
thread budget"):

- every call (Push, Ping, FetchState) must carry a client deadline of at most ``max_rpc_s``
  (``no_deadline`` otherwise), so no call holds a thread longer than that;
- each caller may run at most ``CALLER_LIMITS[method]`` calls of a method at once (Push:
  ``max_inflight_per_sender``), checked on the certificate's identity before anything is read
  (``busy``); the transport sizes its thread pool to the sum of these over its peers, so one
  peer's flood is refused by geofed, counted, long before gRPC core's own limit could turn an
  honest peer away;
- a push's declared size is charged to the sender's memory budget (the mailbox) before any byte
  is read, and its buffer grows with the bytes that actually arrive: a stalled push that
  declared a large size holds only what it sent; chunks are at most ``MAX_CHUNK_BYTES``;
- FetchState serialises the state once per call, one call per caller at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import grpc

from .handshakes import HandshakeLedger
from .mailbox import Mailbox, Refusal
from .proto import gossip_pb2, gossip_pb2_grpc

log = logging.getLogger("geofed.p2p")

MAX_CHUNK_BYTES = 1 << 20
MAX_PROBE_BYTES = 16 << 20  # a probe needs a few hundred ms of the link, not more
# Concurrent calls one caller may hold per method (Push: the transport's max_inflight_per_sender).
# A ping answers at once; a state is big and fetched rarely (a rejoin or a resync).
CALLER_LIMITS = {"Ping": 2, "FetchState": 1, "Probe": 1}
SERVICE = "geofed.p2p.Gossip"
PUSH_METHOD = f"/{SERVICE}/Push"
PROBE_METHOD = f"/{SERVICE}/Probe"
_HEADER_TAG, _CHUNK_TAG = 0x0A, 0x12  # PushMessage fields 1 and 2, wire type 2 (length-delimited)

_CODES = {
    "unknown_sender": grpc.StatusCode.PERMISSION_DENIED,
    "not_neighbour": grpc.StatusCode.PERMISSION_DENIED,
    "identity_mismatch": grpc.StatusCode.UNAUTHENTICATED,
    "late": grpc.StatusCode.FAILED_PRECONDITION,
    "replayed": grpc.StatusCode.ALREADY_EXISTS,
    "future_round": grpc.StatusCode.OUT_OF_RANGE,
    "oversize": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "chunk_too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "overrun": grpc.StatusCode.INVALID_ARGUMENT,
    "truncated": grpc.StatusCode.INVALID_ARGUMENT,
    "aborted": grpc.StatusCode.ABORTED,
    "bad_header": grpc.StatusCode.INVALID_ARGUMENT,
    "invalid_payload": grpc.StatusCode.INVALID_ARGUMENT,
    "equivocation": grpc.StatusCode.ALREADY_EXISTS,
    "out_of_bounds": grpc.StatusCode.INVALID_ARGUMENT,
    "outlier": grpc.StatusCode.INVALID_ARGUMENT,
    "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "over_budget": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "no_deadline": grpc.StatusCode.INVALID_ARGUMENT,
    "no_state": grpc.StatusCode.UNAVAILABLE,
}


def _abort(context: grpc.ServicerContext, refusal: Refusal) -> NoReturn:
    context.abort(_CODES.get(refusal.reason, grpc.StatusCode.INTERNAL), str(refusal))
    raise AssertionError("context.abort returned")  # it raises; said so that the type checker knows


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode_chunk(data: memoryview) -> bytes:
    """A serialized ``PushMessage(chunk=data)`` with one copy of the data.

    Building a protobuf message per 1 MiB chunk and serializing it costs two more copies and
    capped a push at ~0.6-0.8 GB/s of CPU; this is byte-for-byte what protobuf would emit.
    """
    return b"".join((bytes((_CHUNK_TAG,)), _varint(len(data)), data))


def parse_push_message(raw: bytes) -> tuple[str, Any]:
    """("header", PushHeader) | ("chunk", memoryview) | ("malformed", why). Never raises: a
    deserializer that raises would end the RPC with an uncounted INTERNAL error."""
    mv = memoryview(raw)
    n = pos = shift = 0
    for pos in range(1, min(len(mv), 11)):
        n |= (mv[pos] & 0x7F) << shift
        shift += 7
        if not mv[pos] & 0x80:
            break
    else:
        return "malformed", "message without a complete field header"
    pos += 1
    if pos + n != len(mv):
        return "malformed", f"field length {n} does not match the message ({len(mv) - pos} bytes)"
    if mv[0] == _CHUNK_TAG:
        return "chunk", mv[pos:]
    if mv[0] == _HEADER_TAG:
        try:
            return "header", gossip_pb2.PushHeader.FromString(bytes(mv[pos:]))
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends: refuse, never crash
            return "malformed", f"undecodable header: {exc}"
    return "malformed", f"unexpected field tag {mv[0]:#x}"


def add_to_server(servicer: "GossipServicer", server: grpc.Server) -> None:
    """Like the generated ``add_GossipServicer_to_server``, but Push takes raw messages (parsed
    by ``parse_push_message``: one copy of each chunk instead of three)."""
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=parse_push_message,
            response_serializer=gossip_pb2.PushAck.SerializeToString),
        "Ping": grpc.unary_unary_rpc_method_handler(
            servicer.Ping, request_deserializer=gossip_pb2.PingRequest.FromString,
            response_serializer=gossip_pb2.PingReply.SerializeToString),
        "Probe": grpc.stream_unary_rpc_method_handler(
            servicer.Probe, request_deserializer=parse_push_message,
            response_serializer=gossip_pb2.PushAck.SerializeToString),
        "FetchState": grpc.unary_stream_rpc_method_handler(
            servicer.FetchState, request_deserializer=gossip_pb2.FetchStateRequest.FromString,
            response_serializer=gossip_pb2.StateMessage.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


class GossipServicer(gossip_pb2_grpc.GossipServicer):
    """The gRPC servicer of one region: checks every call (identity, deadline, per-caller limits,
    see the module docstring) and hands pushes to the mailbox; a refusal aborts the call with a status.
    """

    def __init__(self, region: str, mailbox: Mailbox, *, tls: bool, max_rpc_s: float,
                 state_provider: Callable[[], Callable[[], bytes] | None]):
        self.region = region
        self.mailbox = mailbox
        self.tls = tls
        self.max_rpc_s = max_rpc_s
        self._state_provider = state_provider
        self._lock = threading.Lock()
        self._open: Counter[tuple[str, str]] = Counter()  # (caller, method) -> calls running
        self.probe_bytes: Counter[str] = Counter()  # probe payload received, by sender
        self.handshakes = HandshakeLedger(region)

    def limit(self, method: str) -> int:
        """How many calls of `method` one caller may run at once (Push: the mailbox's max_inflight_per_sender)."""
        return self.mailbox.max_inflight_per_sender if method == "Push" else CALLER_LIMITS[method]

    # -- helpers -------------------------------------------------------------------------
    def _identity(self, context: grpc.ServicerContext) -> str | None:
        if not self.tls:
            return None
        names = context.auth_context().get("x509_common_name") or []
        if len(names) != 1:  # mutual TLS is required at the handshake, so this is our bug
            raise AssertionError(f"TLS peer without exactly one common name: {names!r}")
        self.handshakes.authenticated(context.peer())
        return names[0].decode()

    def _refuse(self, context: grpc.ServicerContext, reason: str, detail: str, sender: str,
                round: int = -1) -> NoReturn:
        refusal = Refusal(reason, detail)
        self.mailbox.count_refusal(refusal, sender, round)
        _abort(context, refusal)

    def _check_caller(self, context: grpc.ServicerContext, identity: str | None, claimed: str, what: str) -> None:
        if identity is not None and identity != claimed:
            self._refuse(context, "identity_mismatch", f"certificate of {identity!r} claims to be {claimed!r} ({what})", claimed)
        if not self.mailbox.is_known(claimed):
            self._refuse(context, "unknown_sender", f"{claimed!r} is not a region of this run ({what})", claimed)

    def _check_deadline(self, context: grpc.ServicerContext, caller: str, what: str) -> None:
        remaining = context.time_remaining()
        if remaining is None or remaining > self.max_rpc_s:
            self._refuse(context, "no_deadline", f"{what} deadline must be set and at most {self.max_rpc_s:.0f} s", caller)

    @contextmanager
    def _slot(self, context: grpc.ServicerContext, caller: str, method: str) -> Iterator[None]:
        """One of `caller`'s concurrent calls of `method`, or refused as busy."""
        key, limit = (caller, method), self.limit(method)
        with self._lock:
            busy = self._open[key] >= limit
            if not busy:
                self._open[key] += 1
        if busy:
            self._refuse(context, "busy", f"{caller} already has {limit} {method} call(s) open", caller)
        try:
            yield
        finally:
            with self._lock:
                self._open[key] -= 1
                if not self._open[key]:
                    del self._open[key]  # plaintext callers are keyed by connection: do not pile up

    def open_calls(self) -> dict[str, int]:
        """Calls running now, by method (for tests and stats)."""
        with self._lock:
            out: Counter[str] = Counter()
            for (_, method), n in self._open.items():
                out[method] += n
            return dict(out)

    # -- Push ----------------------------------------------------------------------------
    def Push(self, request_iterator: Iterator[tuple[str, Any]], context: grpc.ServicerContext) -> Any:
        identity = self._identity(context)
        caller = identity if identity is not None else context.peer()
        with self._slot(context, caller, "Push"):
            self._check_deadline(context, caller, "push")
            return self._push(request_iterator, context, identity, caller)

    def _push(self, request_iterator: Iterator[tuple[str, Any]], context: grpc.ServicerContext,
              identity: str | None, caller: str) -> Any:
        try:
            kind, h = next(request_iterator)
        except StopIteration:
            self._refuse(context, "bad_header", "empty stream", caller)
        except grpc.RpcError:
            self._refuse(context, "aborted", "stream ended before the header", caller)
        if kind != "header" or not h.sender:
            self._refuse(context, "bad_header", f"the first message must be a header naming the sender (got {kind} {h if kind == 'malformed' else ''})", caller)
        header_bytes = h.ByteSize() + 2 + 5
        self.mailbox.note_bytes(h.sender if identity is None else identity, header_bytes)
        try:
            ticket = self.mailbox.admit(h.sender, h.round, h.total_bytes, identity=identity)
        except Refusal as r:
            _abort(context, r)
        t0 = time.monotonic()
        try:
            buf, wire, t_last = self._read_body(request_iterator, h.total_bytes, h.sender)
        except Refusal as r:
            self.mailbox.release(ticket, r)
            _abort(context, r)
        try:
            self.mailbox.deliver(ticket, memoryview(buf), wire_bytes=wire + header_bytes, seconds=t_last - t0)
        except Refusal as r:
            _abort(context, r)
        return gossip_pb2.PushAck(received_bytes=len(buf), receiver_seconds=t_last - t0)

    def _read_body(self, request_iterator: Iterator[tuple[str, Any]], total: int, sender: str) -> tuple[bytearray, int, float]:
        # Grown as bytes arrive, never allocated at the declared size: a push that declares a
        # large size and stalls holds what it sent (appending 1 MiB chunks costs what writing
        # into a preallocated buffer does: 256 MiB in 0.17 s either way, measured here).
        # Bytes are counted as they arrive, not when the stream ends: a stalled push's bytes show
        # in the counters while it stalls.
        buf = bytearray()
        wire = 0
        t_last = time.monotonic()
        try:
            for kind, chunk in request_iterator:
                if kind != "chunk":
                    raise Refusal("bad_header", f"expected a chunk, got {kind}: {chunk if kind == 'malformed' else ''}")
                n = len(chunk)
                self.mailbox.note_bytes(sender, n + 5 + 1 + len(_varint(n)))
                wire += n + 5 + 1 + len(_varint(n))
                if n > MAX_CHUNK_BYTES:
                    raise Refusal("chunk_too_large", f"chunk of {n} bytes, limit {MAX_CHUNK_BYTES}")
                if len(buf) + n > total:
                    raise Refusal("overrun", f"more than the declared {total} bytes")
                buf += chunk
                t_last = time.monotonic()
        except grpc.RpcError:
            raise Refusal("aborted", f"stream cancelled or timed out after {len(buf)} of {total} bytes") from None
        if len(buf) != total:
            raise Refusal("truncated", f"stream ended after {len(buf)} of {total} declared bytes")
        return buf, wire, t_last

    # -- Ping, FetchState ----------------------------------------------------------------
    def Ping(self, request: Any, context: grpc.ServicerContext) -> Any:
        identity = self._identity(context)
        self._check_caller(context, identity, request.sender, "ping")
        caller = identity if identity is not None else context.peer()
        with self._slot(context, caller, "Ping"):
            self._check_deadline(context, caller, "ping")
            return gossip_pb2.PingReply(nonce=request.nonce, region=self.region)

    def FetchState(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        identity = self._identity(context)
        self._check_caller(context, identity, request.sender, "fetch_state")
        caller = identity if identity is not None else context.peer()
        # A generator: the slot is held while the stream runs (to its end, its deadline or the
        # client's cancel, when gRPC closes the generator).
        with self._slot(context, caller, "FetchState"):
            self._check_deadline(context, caller, "fetch_state")
            provider = self._state_provider()
            if provider is None:
                self._refuse(context, "no_state", f"{self.region} has no state provider", request.sender)
            state = memoryview(provider())
            log.info("%s gives its state (%d bytes) to %s", self.region, len(state), request.sender)
            yield gossip_pb2.StateMessage(total_bytes=len(state))
            for off in range(0, len(state), MAX_CHUNK_BYTES):
                yield gossip_pb2.StateMessage(chunk=bytes(state[off:off + MAX_CHUNK_BYTES]))

    # -- Probe ---------------------------------------------------------------------------
    def Probe(self, request_iterator: Iterator[tuple[str, Any]], context: grpc.ServicerContext) -> Any:
        """Count and drop a probe's bytes; ack with how many came and how long they took."""
        identity = self._identity(context)
        caller = identity if identity is not None else context.peer()
        with self._slot(context, caller, "Probe"):
            self._check_deadline(context, caller, "probe")
            first: tuple[str, Any] = next(request_iterator, ("malformed", "empty stream"))
            kind, h = first
            if kind != "header" or not h.sender:
                self._refuse(context, "bad_header", "a probe starts with a header naming the sender", caller)
            self._check_caller(context, identity, h.sender, "probe")
            if h.total_bytes > MAX_PROBE_BYTES:
                self._refuse(context, "oversize", f"probe of {h.total_bytes} bytes, limit {MAX_PROBE_BYTES}", h.sender)
            n, t0 = 0, time.monotonic()
            t_last = t0
            try:
                for kind, chunk in request_iterator:
                    if kind != "chunk" or len(chunk) > MAX_CHUNK_BYTES or n + len(chunk) > h.total_bytes:
                        self._refuse(context, "overrun", f"probe past its declared {h.total_bytes} bytes or malformed", h.sender)
                    n += len(chunk)
                    t_last = time.monotonic()
            except grpc.RpcError:
                self._refuse(context, "aborted", f"probe cancelled after {n} bytes", h.sender)
            with self._lock:
                self.probe_bytes[h.sender] += n
            return gossip_pb2.PushAck(received_bytes=n, receiver_seconds=t_last - t0)
