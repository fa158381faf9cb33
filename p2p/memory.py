"""In-memory transport: regions of one process exchange updates through a hub.

A real implementation (the receive side is the same ``Mailbox`` the gRPC transport uses:
sender/round/size checks, the validator, deadlines, counters), so algorithm tests run without
sockets. The hub can delay or cut a directed link to exercise deadlines. Identities cannot be
forged here: a transport always sends as its own region.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any

from .mailbox import Mailbox, Refusal, stream_tag
from .spread import SpreadClock, SpreadPushes
from .transport import PING, PROBE, UPDATE, Inbox, TransferStats, Transport, TransportError

__all__ = ["InMemoryHub", "InMemoryTransport"]

_HEADER_BYTES = 32  # about what the gRPC header message costs, so byte counters compare


class InMemoryHub:
    """The switchboard of in-memory transports in one process, with per-link delay and cuts
    (`set_link`) for testing deadlines.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, InMemoryTransport] = {}
        self._links: dict[tuple[str, str], tuple[float, bool]] = {}

    def register(self, t: InMemoryTransport) -> None:
        with self._lock:
            if t.region in self._members and self._members[t.region] is not t:
                raise ValueError(f"region: {t.region!r} is already registered on this hub")
            self._members[t.region] = t

    def unregister(self, t: InMemoryTransport) -> None:
        with self._lock:
            if self._members.get(t.region) is t:
                del self._members[t.region]

    def lookup(self, region: str) -> InMemoryTransport | None:
        with self._lock:
            return self._members.get(region)

    def set_link(self, src: str, dst: str, *, delay_s: float = 0.0, down: bool = False) -> None:
        """Delay every message src -> dst by delay_s, or cut the link (sends time out)."""
        if delay_s < 0:
            raise ValueError(f"delay_s: must be >= 0, got {delay_s}")
        with self._lock:
            self._links[(src, dst)] = (delay_s, down)

    def link(self, src: str, dst: str) -> tuple[float, bool]:
        with self._lock:
            return self._links.get((src, dst), (0.0, False))


class InMemoryTransport(Transport):
    """A Transport whose sends go straight into the peer's Mailbox through the hub: the receive rules
    of GrpcTransport without sockets, for algorithm tests. Probes and pings only reflect the hub's delays.
    """

    def __init__(self, region: str, hub: InMemoryHub, *, max_message_bytes: int = 1 << 30,
                 round_window: int = 2, chunk_bytes: int = 1 << 20, max_inflight_per_sender: int = 4,
                 peer_budget_bytes: int | None = None):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: must be >= 1, got {chunk_bytes}")
        self.region = region
        self.hub = hub
        self.chunk_bytes = chunk_bytes
        self.spreading = SpreadPushes()
        self.mailbox = Mailbox(region, round_window=round_window, max_message_bytes=max_message_bytes,
                               max_inflight_per_sender=max_inflight_per_sender, peer_budget_bytes=peer_budget_bytes)
        self._peers: dict[str, str] = {}
        self.state_provider: Callable[[], bytes] | None = None
        self._lock = threading.Lock()
        self._sent_bytes: Counter[str] = Counter()
        self._sent_messages: Counter[str] = Counter()
        self._send_failures: Counter[str] = Counter()
        self._closed = False

    def start(self) -> str:
        self.hub.register(self)
        return f"inmem:{self.region}"

    def connect(self, peers: Mapping[str, str]) -> None:
        self._peers.update({p: a for p, a in peers.items() if p != self.region})
        self.mailbox.add_known(self._peers)

    def _target(self, peer: str, timeout_s: float) -> InMemoryTransport:
        if self._closed:
            raise TransportError("transport is closed", peer=peer, reason="closed")
        if peer not in self._peers:
            raise ValueError(f"peer: {peer!r} is not connected (connect() it first)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        delay, down = self.hub.link(self.region, peer)
        target = self.hub.lookup(peer)
        if down or target is None or delay >= timeout_s:
            time.sleep(timeout_s if (down or delay >= timeout_s) else 0)
            reason = "timeout" if down or delay >= timeout_s else "unavailable"
            self._note_failure(peer)
            raise TransportError(f"{self.region} -> {peer}: {reason}", peer=peer, reason=reason)
        time.sleep(delay)
        return target

    def _note_failure(self, peer: str) -> None:
        with self._lock:
            self._send_failures[peer] += 1

    def send(self, peer: str, round: int, payload: bytes, *, timeout_s: float, spread_s: float = 0.0,
             stream: str = UPDATE) -> TransferStats:
        if stream == PING:
            return self._ping(peer, timeout_s)
        if stream == PROBE:
            return self._probe(peer, len(payload), timeout_s)
        round |= stream_tag(stream)
        if len(payload) > self.mailbox.max_message_bytes:
            raise ValueError(f"payload: {len(payload)} bytes exceeds max_message_bytes {self.mailbox.max_message_bytes}")
        start = time.monotonic()
        if spread_s > 0:
            # No wire to pace: the payload arrives whole when its spread is over (or is hurried), as
            # the last chunk would.
            with self.spreading.track(SpreadClock(min(spread_s, timeout_s), 2)) as clock:
                clock.wait(0)
                clock.wait(1)
        target = self._target(peer, timeout_s)
        chunks = max(1, math.ceil(len(payload) / self.chunk_bytes))
        wire = _HEADER_BYTES + len(payload) + 5 * chunks
        target.mailbox.note_bytes(self.region, wire)
        t0 = time.monotonic()
        try:
            ticket = target.mailbox.admit(self.region, round, len(payload), identity=self.region)
            target.mailbox.deliver(ticket, memoryview(bytes(payload)), wire_bytes=wire, seconds=time.monotonic() - t0)
        except Refusal as r:
            self._note_failure(peer)
            raise TransportError(f"{peer} refused round {round}: {r}", peer=peer, reason=r.reason) from None
        with self._lock:
            self._sent_bytes[peer] += wire
            self._sent_messages[peer] += 1
        seconds = time.monotonic() - start
        return TransferStats(peer=peer, round=round, payload_bytes=len(payload), wire_bytes=wire,
                             seconds=seconds, receiver_seconds=time.monotonic() - t0, chunks=chunks,
                             spread_s=max(0.0, spread_s))

    def receive(self, round: int, deadline_s: float, *, quorum: int | None = None, grace_s: float = 0.0,
                optional: Collection[str] = (), until: Collection[str] | None = None,
                stream: str = UPDATE) -> Inbox:
        return self.mailbox.stream(stream).receive(round, deadline_s, quorum=quorum, grace_s=grace_s,
                                                   optional=optional, until=until)

    def _ping(self, peer: str, timeout_s: float) -> TransferStats:
        # No link to measure in one process: a round trip is the hub's delays both ways.
        start = time.monotonic()
        self._target(peer, timeout_s)
        seconds = time.monotonic() - start + self.hub.link(peer, self.region)[0]
        return TransferStats(peer=peer, round=-1, payload_bytes=0, wire_bytes=0, seconds=seconds,
                             receiver_seconds=0.0, chunks=0)

    def _probe(self, peer: str, nbytes: int, timeout_s: float) -> TransferStats:
        # The probe is one message's worth of the hub's delay.
        stats = self._ping(peer, timeout_s)
        return TransferStats(peer=peer, round=-1, payload_bytes=nbytes, wire_bytes=_HEADER_BYTES + nbytes,
                             seconds=max(stats.seconds, 1e-6), receiver_seconds=0.0, chunks=1)

    def fetch_state(self, peer: str, *, timeout_s: float) -> bytes:
        target = self._target(peer, timeout_s)
        provider = target.state_provider
        if provider is None:
            raise TransportError(f"{peer} has no state to give", peer=peer, reason="no_state")
        return bytes(provider())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            own = {"region": self.region, "bytes_sent": dict(self._sent_bytes),
                   "messages_sent": dict(self._sent_messages), "send_failures": dict(self._send_failures)}
        return own | self.mailbox.counters()

    def close(self) -> None:
        self._closed = True
        self.hub.unregister(self)
