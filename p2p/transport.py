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
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .spread import SpreadPushes

if TYPE_CHECKING:
    from .mailbox import Mailbox  # which imports this module

UPDATE = "update"  # the round's update: the default stream (p2p/mailbox.py, UPDATE)

__all__ = [
    "Transport", "TransportError", "TransferStats", "Arrival", "Inbox", "REASONS", "UPDATE", "PROBE", "PING",
]

# Why an incoming message (or request) was refused; the keys of stats()["refused"].
REASONS = (
    "unknown_sender",     # not a region of this run
    "not_neighbour",      # a region of the run, but not an in-neighbour for that round
    "identity_mismatch",  # the header names another region than the TLS certificate
    "late",               # the round was already closed (its deadline passed): dropped
    "replayed",           # this sender's update for this round was already accepted (the same bytes)
    "equivocation",       # a second, different update from the same sender for one round: both are
                          # dropped and the round's slot stays void (the sender's key is used twice)
    "future_round",       # beyond the current round + security.round_window
    "oversize",           # declared size above network.max_message_mb
    "chunk_too_large",    # one chunk above the chunk limit
    "overrun",            # more bytes than declared
    "truncated",          # fewer bytes than declared when the stream ended
    "aborted",            # the stream was cancelled or timed out mid-transfer
    "bad_header",         # first message is not a well-formed header
    "invalid_payload",    # the validator refused it (CodecError, wrong shape, NaN, ...)
    "out_of_bounds",      # a value above security.max_update_value (finite but absurd: 3e38)
    "outlier",            # norm above security.norm_multiple x the recent median norm (robust modes)
    "busy",               # too many concurrent calls of one method from this caller (flood)
    "over_budget",        # this sender's pushes in flight and waiting would exceed its memory budget
    "no_deadline",        # the client set no deadline, or one above the server's limit
    "no_state",           # FetchState before a state provider was set
    "bad_state",          # a donor's FetchState state refused by its receiver (p2p/rejoin.py, check_state)
    "tls_handshake",      # a connection that never carried an authenticated call: no client
                          # certificate or one from another CA (refused by gRPC core; p2p/handshakes.py)
)


class TransportError(RuntimeError):
    """A send, ping or fetch that failed: refused by the peer (``reason`` in REASONS), timed
    out (``reason == "timeout"``), unreachable (``"unavailable"``) or closed (``"closed"``)."""

    def __init__(self, message: str, *, peer: str | None = None, reason: str = "error"):
        super().__init__(message)
        self.peer = peer
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class TransferStats:
    """One acknowledged push, as the sender saw it."""

    peer: str
    round: int
    payload_bytes: int
    wire_bytes: int          # gRPC messages (header + chunks, protobuf + 5-byte prefix)
    seconds: float           # send start -> ack received (includes one RTT)
    receiver_seconds: float  # header -> last chunk, measured by the receiver (no RTT)
    chunks: int
    cold: bool = False       # the first on a fresh connection: it paid handshakes and slow start
    spread_s: float = 0.0    # paced over this many seconds (sync.spread_sends): its duration is the pace's

    @property
    def bytes(self) -> int:
        """What crossed the link (wire bytes, headers included)."""
        return self.wire_bytes


@dataclass(frozen=True, kw_only=True)
class Arrival:
    """One accepted update, as the receiver saw it."""

    sender: str
    round: int
    payload_bytes: int
    wire_bytes: int
    seconds: float     # header -> last chunk
    arrived_at: float  # time.monotonic() when it was accepted


@dataclass(frozen=True)
class Inbox(Mapping[str, Any]):
    """What arrived for one round: a mapping ``{sender: validated object}`` (also ``.received``)
    plus ``missing``, the expected senders that did not arrive by the deadline.

    ``waits[sender]`` is how long receive() waited for that sender (0 if it was already there):
    the sample an adaptive deadline learns from.
    """

    round: int
    received: dict[str, Any]
    missing: frozenset[str]
    arrivals: dict[str, Arrival] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)
    waited_s: float = 0.0
    # Expected senders whose update was refused for its content (or equivocated): missing, but not
    # a miss of the network (no deadline waits for or widens on them; issue 36, N2).
    refused: frozenset[str] = frozenset()
    # Expected senders done with the round (Mailbox.senders_done) whose update never came: missing,
    # and no miss of the network either (their push here was delivered elsewhere or never made).
    cut: frozenset[str] = frozenset()

    def __getitem__(self, sender: str) -> Any:
        return self.received[sender]

    def __iter__(self) -> Iterator[str]:
        return iter(self.received)

    def __len__(self) -> int:
        return len(self.received)

    @property
    def timings(self) -> dict[str, tuple[int, float]]:
        """sender -> (payload bytes, seconds header -> last chunk)."""
        return {s: (a.payload_bytes, a.seconds) for s, a in self.arrivals.items()}


Validator = Callable[[str, int, memoryview], Any]

# What send() and receive() carry besides the round's update (``stream=``): a side stream of the
# mailbox (p2p/mailbox.py, SIDE_STREAMS: secure aggregation's messages), or, send only, a probe
# (filler the peer counts and drops, timed like a push) or a ping (a round trip; the payload is
# ignored and the stats' `seconds` is the RTT). geofed.p2p.prober.LinkProber sends the last two.
PROBE = "probe"
PING = "ping"


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
