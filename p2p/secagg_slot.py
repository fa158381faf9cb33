"""Secure aggregation's own message slots next to the update's (docs/privacy.md, "In the round").

The mailbox keeps one message per (sender, round): the update. A secure-aggregation round needs
up to six per link (scales and keys when no scales were agreed ahead, the masked update, the
relayed self-key shares, the self key, the reveal and a recovery answer after a drop:
regions/secagg_round.py), so they travel
in a side mailbox: a push whose header round has the SIDE bit set is filed there, under the
"side round" ``round * PHASES + phase`` (monotonic, so the side mailbox closes its rounds the way
the main one does). The wire format is unchanged (the round is a uint64 in the push header), and
every rule of the main mailbox (identity = certificate, replay, equivocation, size, budget,
windows, late drops, counters) applies to the side messages too.

``SlotMailbox`` is the mailbox both transports build (a plain Mailbox for every untagged push);
``SideChannel`` is what a region uses to send and receive side messages of one phase.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from .mailbox import stream_tag
from .transport import Inbox, TransferStats, Transport

STREAM = "secagg"       # the transport's side stream (p2p/mailbox.py, SIDE_STREAMS)
SIDE = stream_tag(STREAM)  # the header round's tag bit of a side message
PHASES = 6              # side messages per round: scales (+ keys), masked update, relay, self key, reveal, recovery
# In this order: receiving a phase closes the earlier ones (the mailbox closes every round <= it).
# RELAY before KEY: a round whose relays rebuilt every self key never receives KEY (the keys it
# did not need are dropped as late), one that lacks some still can.
SETUP, MASKED, RELAY, KEY, REVEAL, RECOVER = range(PHASES)


def side_round(round: int, phase: int) -> int:
    """The side mailbox's round of (round, phase)."""
    assert 0 <= phase < PHASES and round >= 0, (round, phase)
    return round * PHASES + phase


class SideChannel:
    """One region's side messages over its transport: send/expect/receive by (round, phase).
    `validator(sender, round, phase, payload)` checks and files what arrives (a ValueError or a
    Refusal refuses it, counted like any refusal)."""

    def __init__(self, transport: Transport, *, max_message_bytes: int):
        self.transport = transport
        self.mailbox = transport.mailbox.open_stream(STREAM, max_message_bytes=max_message_bytes,
                                                     rounds_per_round=PHASES)

    def set_validator(self, fn: Callable[[str, int, int, memoryview], Any]) -> None:
        self.mailbox.set_validator(lambda sender, r, payload: fn(sender, r // PHASES, r % PHASES, payload))

    def send(self, peer: str, round: int, phase: int, payload: bytes, *, timeout_s: float) -> TransferStats:
        return self.transport.send(peer, side_round(round, phase), payload, timeout_s=timeout_s, stream=STREAM)

    def expect(self, round: int, phase: int, senders: Collection[str]) -> None:
        self.mailbox.expect(side_round(round, phase), senders)

    def receive(self, round: int, phase: int, deadline_s: float, *, until: Collection[str] | None = None) -> Inbox:
        return self.transport.receive(side_round(round, phase), deadline_s, until=until, stream=STREAM)
