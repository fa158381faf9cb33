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

from .mailbox import Mailbox, Refusal, Ticket
from .transport import Inbox, TransferStats, Transport

SIDE = 1 << 62          # the header round's tag bit of a side message
PHASES = 6              # side messages per round: scales (+ keys), masked update, relay, self key, reveal, recovery
# In this order: receiving a phase closes the earlier ones (the mailbox closes every round <= it).
# RELAY before KEY: a round whose relays rebuilt every self key never receives KEY (the keys it
# did not need are dropped as late), one that lacks some still can.
SETUP, MASKED, RELAY, KEY, REVEAL, RECOVER = range(PHASES)


def side_round(round: int, phase: int) -> int:
    """The side mailbox's round of (round, phase)."""
    assert 0 <= phase < PHASES and round >= 0, (round, phase)
    return round * PHASES + phase


class SideTicket(Ticket):
    """A push admitted into the side mailbox (deliver/release go back there)."""


class SlotMailbox(Mailbox):
    """The main mailbox (untagged pushes) plus a side mailbox for SIDE-tagged ones, made by
    `open_side`; until then a tagged push is refused (``bad_header``)."""

    def __init__(self, region: str, **kwargs: Any):
        super().__init__(region, **kwargs)
        self.side: Mailbox | None = None

    def open_side(self, *, max_message_bytes: int) -> Mailbox:
        """The side mailbox (made once): its window covers the main one's rounds in side rounds."""
        if self.side is None:
            self.side = Mailbox(self.region, round_window=(self.round_window + 1) * PHASES,
                                max_message_bytes=max_message_bytes,
                                max_inflight_per_sender=self.max_inflight_per_sender,
                                peer_budget_bytes=(self.round_window + 2) * PHASES * max_message_bytes)
            with self._cond:
                self.side.add_known(self._known)
        return self.side

    def add_known(self, senders: Collection[str]) -> None:
        super().add_known(senders)
        if self.side is not None:
            self.side.add_known(senders)

    def admit(self, sender: str, round: int, declared_bytes: int, *, identity: str | None) -> Ticket:
        if not round & SIDE:
            return super().admit(sender, round, declared_bytes, identity=identity)
        if self.side is None:
            refusal = Refusal("bad_header", f"{sender} pushed a secure-aggregation message; this region runs none")
            self.count_refusal(refusal, sender, round)
            raise refusal
        t = self.side.admit(sender, round & ~SIDE, declared_bytes, identity=identity)
        return SideTicket(t.sender, t.round, t.declared_bytes)

    def deliver(self, ticket: Ticket, payload: memoryview, *, wire_bytes: int, seconds: float) -> None:
        if isinstance(ticket, SideTicket):
            return self.side.deliver(ticket, payload, wire_bytes=wire_bytes, seconds=seconds)
        return super().deliver(ticket, payload, wire_bytes=wire_bytes, seconds=seconds)

    def release(self, ticket: Ticket, refusal: Refusal) -> None:
        if isinstance(ticket, SideTicket):
            return self.side.release(ticket, refusal)
        return super().release(ticket, refusal)

    def counters(self) -> dict:
        """The main mailbox's counters; the side's refusals added in (and kept apart under `secagg`)."""
        out = super().counters()
        if self.side is not None:
            side = self.side.counters()
            refused = dict(out["refused"])
            for reason, n in side["refused"].items():
                refused[reason] = refused.get(reason, 0) + n
            out.update(refused=refused, refused_total=sum(refused.values()),
                       secagg={"refused": side["refused"], "messages_received": side["messages_received"],
                               "late_dropped": side["late_dropped"]})
        return out


class SideChannel:
    """One region's side messages over its transport: send/expect/receive by (round, phase).
    `validator(sender, round, phase, payload)` checks and files what arrives (a ValueError or a
    Refusal refuses it, counted like any refusal)."""

    def __init__(self, transport: Transport, *, max_message_bytes: int):
        mailbox = getattr(transport, "mailbox", None)
        if not isinstance(mailbox, SlotMailbox):
            raise TypeError(f"transport: {type(transport).__name__} has no SlotMailbox (secure aggregation's slots)")
        self.transport = transport
        self.mailbox = mailbox.open_side(max_message_bytes=max_message_bytes)

    def set_validator(self, fn: Callable[[str, int, int, memoryview], Any]) -> None:
        self.mailbox.set_validator(lambda sender, r, payload: fn(sender, r // PHASES, r % PHASES, payload))

    def send(self, peer: str, round: int, phase: int, payload: bytes, *, timeout_s: float) -> TransferStats:
        return self.transport.send(peer, SIDE | side_round(round, phase), payload, timeout_s=timeout_s)

    def expect(self, round: int, phase: int, senders: Collection[str]) -> None:
        self.mailbox.expect(side_round(round, phase), senders)

    def receive(self, round: int, phase: int, deadline_s: float, *, until: Collection[str] | None = None) -> Inbox:
        return self.mailbox.receive(side_round(round, phase), deadline_s, until=until)
