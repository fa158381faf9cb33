"""The transport seam: push an encoded update to a peer, receive a round's updates by a deadline.

Two implementations share the receive side (``geofed.p2p.mailbox.Mailbox``: sender, round and
size checks, the validator hook, deadlines, counters, side streams): ``GrpcTransport`` (real gRPC, mutual TLS)
and ``InMemoryTransport`` (the same rules inside one process, for unit tests of algorithms):
p2p/grpc_transport.py and p2p/memory.py.

Payloads are opaque bytes; the validator hook set by the owner decodes and checks them
(``geofed.p2p.validate.update_validator`` does it for geofed.compression updates).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from typing import Any

from .mailbox import Mailbox
from .messages import PING, PROBE, REASONS, UPDATE, Arrival, Inbox, TransferStats, TransportError, Validator
from .spread import SpreadPushes

__all__ = [
    "Transport", "TransportError", "TransferStats", "Arrival", "Inbox", "REASONS", "UPDATE", "PROBE", "PING",
    "Validator",
]


class Transport(ABC):
    """One region's endpoint. Thread-safe: sends to different peers may run in parallel.

    Besides its seven methods a transport hands out the objects that own the rest of its state:
    `mailbox` (the receive side, p2p/mailbox.py: expect() a round's senders, senders_done(),
    accept_stale()/take_stale(), look_ahead(), the validator, side streams), `spreading` (paced
    pushes in flight: spreading.hurry() sends what is left of them now) and `state_provider` (the
    function whose bytes a peer's fetch_state gets; None until set: such fetches are refused
    ``no_state``; called per fetch, so a rejoining region gets the parameters of that moment).
    """

    region: str
    mailbox: Mailbox
    spreading: SpreadPushes
    state_provider: Callable[[], bytes] | None

    @abstractmethod
    def start(self) -> str:
        """Start serving; returns the "host:port" peers dial."""

    @abstractmethod
    def connect(self, peers: Mapping[str, str]) -> None:
        """Region -> address to dial (may be an emulator proxy). Channels stay open for the run.
        These regions also become the known senders (anything else is ``unknown_sender``)."""

    @abstractmethod
    def send(self, peer: str, round: int, payload: bytes, *, timeout_s: float, spread_s: float = 0.0,
             stream: str = UPDATE) -> TransferStats:
        """Push `payload` to `peer` on `stream`; returns once the peer validated and acknowledged it.
        `spread_s` > 0: release the payload evenly over that many seconds rather than at line rate
        (p2p/spread.py). `stream` PROBE or PING: a probe or a ping instead (see PROBE; `round` is
        not used). Raises TransportError on refusal, failure or timeout."""

    @abstractmethod
    def receive(self, round: int, deadline_s: float, *, quorum: int | None = None, grace_s: float = 0.0,
                optional: Collection[str] = (), until: Collection[str] | None = None,
                stream: str = UPDATE) -> Inbox:
        """Wait at most `deadline_s` seconds for the expected senders of `round` on `stream` (with
        `quorum`: for that many, then at most `grace_s` for the rest; with `until`: only for those of
        them), then close the round: later messages for it are dropped and counted as late, unless
        mailbox.accept_stale() keeps them. `optional` senders are taken only if they come with the
        others (p2p/mailbox.py, OPTIONAL_GRACE_S), and senders said done with the round
        (mailbox.senders_done) are not waited for past DONE_GRACE_S."""

    @abstractmethod
    def fetch_state(self, peer: str, *, timeout_s: float) -> bytes:
        """The bytes `peer`'s state provider returns (a rejoining region's parameters)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: bytes and messages per peer both ways, refusals by reason, late drops."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and drop the connections; idempotent. Later sends raise TransportError(reason="closed")."""
