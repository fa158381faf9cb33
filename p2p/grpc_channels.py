"""The client half of the gRPC transport: one long-lived channel per peer, and whether it is warm.

Why a module of its own: a channel's life (opened at the first call to its peer after ``connect()``,
replaced when a peer's address changes, closed in parallel at the end) and its connection epochs (which send paid for a
fresh connection) change on gRPC's connectivity thread, apart from any call; the calls in
``grpc_transport.py`` only look a peer up here and report when a send finished.

Measured on these machines (FIELD-NOTES): a new mTLS channel costs ~7 ms plus slow start, and
``channel.close()`` blocks ~200 ms, so channels are kept for the run and closed in parallel.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc

from .proto import gossip_pb2, gossip_pb2_grpc
from .service import MAX_CHUNK_BYTES, PROBE_METHOD, PUSH_METHOD
from .tls import TlsMaterial
from .transport import TransportError

__all__ = ["CORE_MESSAGE_LIMIT", "PeerChannel", "PeerChannels", "close_all"]

# Core gRPC limit on one message, on both ends: above our own chunk check, so an oversized chunk
# reaches the handler (which counts it) unless it is absurd.
CORE_MESSAGE_LIMIT = 4 * MAX_CHUNK_BYTES


@dataclass(frozen=True, kw_only=True)
class PeerChannel:
    """One peer's channel and the calls bound to it (Push and Probe send pre-serialized messages)."""

    address: str
    channel: grpc.Channel
    stub: gossip_pb2_grpc.GossipStub
    push: Callable
    probe: Callable


class PeerChannels:
    """The channels of one region to its peers. Thread-safe.

    A connection's epoch counts how often its channel became READY; a send finishing in an epoch
    no earlier send finished in ran on a fresh connection (handshakes, slow start):
    TransferStats.cold, which the link estimator does not take as a bandwidth sample.
    """

    def __init__(self, region: str, tls: TlsMaterial | None):
        self.region, self.tls = region, tls
        self._lock = threading.Lock()
        self._addresses: dict[str, str] = {}  # every connected peer's, opened or not
        self._channels: dict[str, PeerChannel] = {}  # the ones opened: a first get() opens one
        self._epochs: Counter[str] = Counter()
        self._warm_epoch: dict[str, int] = {}
        self._closed = False

    def connect(self, peers: Mapping[str, str]) -> list[grpc.Channel]:
        """Know every peer but this region at its address; a channel opens at the first call to a peer
        (`get`). Each open channel has a gRPC connectivity thread waking every 0.2 s (its READY
        epochs), so a channel to every region would cost N-1 threads a region: 1,008 in a process of
        16 regions of 64 (regions.per_process), whose wake-ups starved the process (4 processes,
        load 230 on 2 cores, no region connected within 60 s), where a region talks to its
        topology's neighbours (11 of 63, exponential). A peer whose address changed loses its open
        channel, returned for the caller to close_all()."""
        stale = []
        with self._lock:
            for peer, address in peers.items():
                if peer == self.region or self._addresses.get(peer) == address:
                    continue
                self._addresses[peer] = address
                current = self._channels.pop(peer, None)
                if current is not None:
                    stale.append(current.channel)
                    self._warm_epoch.pop(peer, None)
        return stale

    def _open(self, peer: str, address: str) -> PeerChannel:
        options: list[tuple[str, int | str]] = [("grpc.max_send_message_length", CORE_MESSAGE_LIMIT),
                   ("grpc.max_receive_message_length", CORE_MESSAGE_LIMIT),
                   # one connection per peer, never shared with another channel
                   ("grpc.use_local_subchannel_pool", 1),
                   # grpcio's default 1 s first backoff would turn a short outage into a lost round
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        if self.tls is not None:
            # The dialled address may be an emulator proxy: check the certificate names `peer`.
            options.append(("grpc.ssl_target_name_override", peer))
            channel = grpc.secure_channel(address, self.tls.channel_credentials(), options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        # Push sends pre-serialized messages (see service.encode_chunk).
        push = channel.stream_unary(PUSH_METHOD, request_serializer=None,
                                    response_deserializer=gossip_pb2.PushAck.FromString)
        probe = channel.stream_unary(PROBE_METHOD, request_serializer=None,
                                     response_deserializer=gossip_pb2.PushAck.FromString)
        channel.subscribe(lambda state, p=peer, c=channel: self._on_state(p, c, state), try_to_connect=False)
        return PeerChannel(address=address, channel=channel, stub=gossip_pb2_grpc.GossipStub(channel), push=push, probe=probe)

    def _on_state(self, peer: str, channel: grpc.Channel, state: grpc.ChannelConnectivity) -> None:
        # gRPC's connectivity thread; a replaced channel's late callbacks are ignored.
        if state is grpc.ChannelConnectivity.READY:
            with self._lock:
                entry = self._channels.get(peer)
                if entry is not None and entry.channel is channel:
                    self._epochs[peer] += 1

    def get(self, peer: str, timeout_s: float) -> PeerChannel:
        """`peer`'s channel for a call with deadline `timeout_s`: ValueError for a timeout <= 0 or a
        peer never connected (our bug), TransportError(reason="closed") after seal()."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.region}: transport is closed", peer=peer, reason="closed")
            entry = self._channels.get(peer)
            if entry is None:
                address = self._addresses.get(peer)
                if address is None:
                    raise ValueError(f"peer: {peer!r} is not connected (connect() it first)")
                entry = self._channels[peer] = self._open(peer, address)  # under the lock: one channel a peer
        return entry

    def note_warm(self, peer: str) -> bool:
        """Whether the send that just finished on `peer`'s connection was its first (cold)."""
        with self._lock:
            epoch = self._epochs[peer]
            cold = self._warm_epoch.get(peer) != epoch
            self._warm_epoch[peer] = epoch
        return cold

    def seal(self) -> list[grpc.Channel] | None:
        """Refuse every later get() (reason ``closed``); returns the channels for the caller to
        close_all() (after stopping its server), or None when already sealed."""
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            return [entry.channel for entry in self._channels.values()]


def close_all(channels: list[grpc.Channel]) -> None:
    """Close `channels`, waiting at most 5 s for each."""
    # channel.close() blocks ~200 ms each: close them in parallel.
    threads = [threading.Thread(target=c.close, daemon=True) for c in channels]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
