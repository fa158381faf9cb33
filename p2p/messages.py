"""What crosses the transport seam, besides the Transport itself (p2p/transport.py): the refusal
reasons, the error, a push's and an arrival's facts, a round's inbox, the validator hook's type and
the stream names. The mailbox and the admission checks build on these without importing the seam.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

UPDATE = "update"  # the round's update: the default stream (p2p/mailbox.py, UPDATE)


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
