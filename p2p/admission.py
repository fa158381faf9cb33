"""The bookkeeping half of the Mailbox (p2p/mailbox.py): admission, slots and budgets.

A push is checked twice: ``admit`` before any payload byte is read (identity, sender, round,
declared size, concurrency) and ``deliver`` once it is complete (the validator decodes it).
Every refusal raises ``Refusal(reason, detail)``, is counted by reason and logged; the caller
(a gRPC handler or the in-memory sender) turns it into a status for the sender.

One entry per (sender, round). A second push for a slot is read and compared with the first
(CRC-32 and length): the same bytes are a replay (``replayed``, the first stays); different bytes
mean two holders of the sender's key (a stolen certificate): ``equivocation``, both are dropped
and the slot stays void for that round. So whoever pushes first cannot make the real sender's
update look like a replay and have its own used in its place, and a push still in flight never
blocks another for the same slot. With mutual TLS the identity must equal the claimed sender, so
a compromised peer with its own certificate reaches only its own slots; rounds beyond the window
are refused before any byte is read.

Memory: each sender has a budget (``peer_budget_bytes``): the declared sizes of its pushes in
flight plus what its filed, not yet received updates hold (their decoded tensors). A push that
would exceed it is refused ``over_budget`` before its body is read.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from .messages import Arrival, Validator

log = logging.getLogger("geofed.p2p")


class Refusal(Exception):
    """A refused push or call; `reason` is one of transport.REASONS (it leads the gRPC status details)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Ticket:
    """A push `admit` let in; its declared size stays charged to the sender until deliver() or release()."""

    sender: str
    round: int
    declared_bytes: int


@dataclass(frozen=True)
class _Entry:
    value: Any
    arrival: Arrival
    fingerprint: tuple[int, int]  # (CRC-32, length) of the payload: replay or equivocation?
    held: int                     # bytes charged to the sender's budget


def held_bytes(value: Any, payload_len: int) -> int:
    """What a filed value holds in memory: its tensors' bytes (a decoded update), else the payload's."""
    if isinstance(value, (list, tuple)) and value and all(hasattr(t, "nbytes") for t in value):
        return sum(int(t.nbytes) for t in value)
    return int(getattr(value, "nbytes", payload_len))


def _opaque(sender: str, round: int, payload: memoryview) -> bytes:
    return bytes(payload)



class Admission:
    """The state of one region's receive side and the push path into it (admit, deliver, release);
    the Mailbox adds the rounds and the waiting. Thread-safe (one RLock-backed Condition).
    """

    def __init__(self, region: str, *, round_window: int, max_message_bytes: int, max_inflight_per_sender: int = 4,
                 peer_budget_bytes: int | None = None):
        if round_window < 0:
            raise ValueError(f"round_window: must be >= 0, got {round_window}")
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes: must be >= 1, got {max_message_bytes}")
        if max_inflight_per_sender < 1:
            raise ValueError(f"max_inflight_per_sender: must be >= 1, got {max_inflight_per_sender}")
        if peer_budget_bytes is None:
            # The window's rounds filed plus two in flight, each at most one message.
            peer_budget_bytes = (round_window + 3) * max_message_bytes
        if peer_budget_bytes < max_message_bytes:
            raise ValueError(f"peer_budget_bytes: must be >= max_message_bytes ({max_message_bytes}), got {peer_budget_bytes}")
        self.region = region
        self.round_window = round_window
        self.max_message_bytes = max_message_bytes
        self.max_inflight_per_sender = max_inflight_per_sender
        self.peer_budget_bytes = peer_budget_bytes
        self._cond = threading.Condition()
        self._validator: Validator = _opaque
        self._known: set[str] = set()
        self._expected: dict[int, frozenset[str]] = {}
        self._newest = -1       # newest round passed to expect()
        self._closed_upto = -1  # every round <= this one is closed
        # After a restore (resume, rejoin) late pushes of the rounds around it are expected: logged
        # at INFO, not WARNING (still counted in `refused`).
        self.quiet_late_upto = -1
        self._inflight: Counter[tuple[str, int]] = Counter()
        self._inflight_per_sender: Counter[str] = Counter()
        self._held: Counter[str] = Counter()  # bytes charged to each sender's budget
        self._arrived: dict[int, dict[str, _Entry]] = {}
        self._void: dict[int, set[str]] = {}  # round -> senders whose slot saw two different updates
        self._refused_in: dict[int, set[str]] = {}  # round -> senders whose update the validator refused
        self.refused: Counter[str] = Counter()
        self.late_dropped = 0
        # (round, sender, seconds after receive() of that round began): how late late messages
        # were, so an owner can stretch its deadline for a slow peer (never for a dead one).
        self.late_waits: deque[tuple[int, str, float]] = deque(maxlen=32)
        self._receive_started: dict[int, float] = {}
        self.bytes_received: Counter[str] = Counter()
        self.messages_received: Counter[str] = Counter()
        # Quorum rounds (accept_stale): an expected sender that missed a closed round may still
        # deliver it within `stale_window` rounds; it is filed for take_stale(), once.
        self.stale_window = 0
        self.expect_late = False  # quorum rounds close without the slowest: its late pushes are no news
        self._missed: dict[int, set[str]] = {}
        self._stale: list[tuple[str, int, _Entry]] = []


    def inflight(self) -> int:
        """Pushes admitted and not yet delivered or released."""
        with self._cond:
            return sum(self._inflight.values())

    def held(self, sender: str) -> int:
        """Bytes charged to `sender`'s budget now (declared sizes in flight + filed updates)."""
        with self._cond:
            return self._held.get(sender, 0)

    def is_known(self, sender: str) -> bool:
        with self._cond:
            return sender in self._known

    # -- incoming ------------------------------------------------------------------------
    def note_bytes(self, sender: str, n: int) -> None:
        with self._cond:
            # Claimed names are untrusted (plaintext mode): unknown ones share one key, so a
            # stream of invented senders cannot grow this table.
            self.bytes_received[sender if sender in self._known else "<unknown>"] += n

    def admit(self, sender: str, round: int, declared_bytes: int, *, identity: str | None) -> Ticket:
        """Check a push header; charges its declared size to the sender's budget until
        deliver() or release()."""
        with self._cond:
            try:
                self._check_header(sender, round, declared_bytes, identity)
            except Refusal as r:
                self.count_refusal(r, sender, round)
                raise
            self._inflight[(sender, round)] += 1
            self._inflight_per_sender[sender] += 1
            self._held[sender] += declared_bytes
            return Ticket(sender, round, declared_bytes)

    def _check_header(self, sender: str, round: int, declared: int, identity: str | None) -> None:
        if identity is not None and identity != sender:
            raise Refusal("identity_mismatch", f"certificate of {identity!r} claims to be {sender!r}")
        if sender not in self._known:
            raise Refusal("unknown_sender", f"{sender!r} is not a region of this run")
        if round <= self._closed_upto and not self._stale_ok(sender, round):
            self._note_late(round, sender)
            raise Refusal("late", f"round {round} from {sender} arrived after the round closed")
        limit = max(self._newest, 0) + self.round_window
        if round > limit:
            raise Refusal("future_round", f"round {round} from {sender} is beyond {limit} (newest {self._newest} + window {self.round_window})")
        expected = self._expected.get(round)
        if expected is not None and sender not in expected:
            raise Refusal("not_neighbour", f"{sender} is not an in-neighbour in round {round}")
        if sender in self._void.get(round, ()):
            raise Refusal("equivocation", f"{sender}'s slot of round {round} is void: two different updates arrived for it")
        if not 0 <= declared <= self.max_message_bytes:
            raise Refusal("oversize", f"declared {declared} bytes, limit {self.max_message_bytes}")
        if self._inflight_per_sender[sender] >= self.max_inflight_per_sender:
            raise Refusal("busy", f"{sender} has {self.max_inflight_per_sender} pushes in flight")
        if self._held[sender] + declared > self.peer_budget_bytes:
            raise Refusal("over_budget", f"{sender} holds {self._held[sender]} bytes in flight and waiting; "
                                         f"{declared} more exceeds its budget of {self.peer_budget_bytes}")

    def release(self, ticket: Ticket, refusal: Refusal) -> None:
        """The push failed after admit(): count why and free its reservation."""
        with self._cond:
            self._unreserve(ticket)
            self.count_refusal(refusal, ticket.sender, ticket.round)

    def deliver(self, ticket: Ticket, payload: memoryview, *, wire_bytes: int, seconds: float) -> None:
        """Validate a complete payload and file it; raises Refusal (already counted)."""
        fingerprint = (zlib.crc32(payload), len(payload))
        with self._cond:
            self._check_slot(ticket, fingerprint)
        try:
            value = self._validator(ticket.sender, ticket.round, payload)
        except Refusal as r:  # the validator's own reason (out_of_bounds, outlier, ...)
            self.release(ticket, r)
            self._refused_content(ticket)
            raise
        except ValueError as exc:
            refusal = Refusal("invalid_payload", f"{type(exc).__name__}: {exc}")
            self.release(ticket, refusal)
            self._refused_content(ticket)
            raise refusal from None
        except Exception as exc:
            # A validator bug, not the sender's fault: say so loudly, but free the reservation so
            # the sender's next push is not refused as a replay forever.
            log.exception("%s: the validator crashed on %s's round %s", self.region, ticket.sender, ticket.round)
            refusal = Refusal("invalid_payload", f"validator raised {type(exc).__name__}: {exc}")
            self.release(ticket, refusal)
            raise refusal from None
        arrival = Arrival(sender=ticket.sender, round=ticket.round, payload_bytes=len(payload),
                          wire_bytes=wire_bytes, seconds=seconds, arrived_at=time.monotonic())
        with self._cond:
            self._unreserve(ticket)
            if ticket.round <= self._closed_upto and self._stale_ok(ticket.sender, ticket.round):
                entry = _Entry(value, arrival, fingerprint, held_bytes(value, len(payload)))
                self._missed[ticket.round].discard(ticket.sender)  # once: a second copy is late
                self._held[ticket.sender] += entry.held
                self._stale.append((ticket.sender, ticket.round, entry))
                self.messages_received[ticket.sender] += 1
                return
            if ticket.round <= self._closed_upto:
                self._note_late(ticket.round, ticket.sender)
                refusal = Refusal("late", f"round {ticket.round} from {ticket.sender} completed after the round closed")
                self.count_refusal(refusal, ticket.sender, ticket.round)
                raise refusal
            try:  # another copy may have been filed while this one was validated
                self._check_slot(ticket, fingerprint, reserved=False)
            except Refusal as r:
                self.count_refusal(r, ticket.sender, ticket.round)
                raise
            entry = _Entry(value, arrival, fingerprint, held_bytes(value, len(payload)))
            self._held[ticket.sender] += entry.held
            self._arrived.setdefault(ticket.round, {})[ticket.sender] = entry
            self.messages_received[ticket.sender] += 1
            self._cond.notify_all()

    def _refused_content(self, ticket: Ticket) -> None:
        """The sender's update of that round was refused for what it holds: the owner stops waiting
        for it (no honest sender pushes a round twice) and does not count it as a network miss."""
        with self._cond:
            self._refused_in.setdefault(ticket.round, set()).add(ticket.sender)
            self._cond.notify_all()

    def _check_slot(self, ticket: Ticket, fingerprint: tuple[int, int], *, reserved: bool = True) -> None:
        """One entry per (sender, round): a second copy is a replay (same bytes) or equivocation
        (different bytes: the filed one is dropped too and the slot stays void). With
        `reserved`, a refusal also frees the ticket's reservation and is counted."""
        sender, round = ticket.sender, ticket.round
        refusal = None
        if sender in self._void.get(round, ()):
            refusal = Refusal("equivocation", f"{sender}'s slot of round {round} is void: two different updates arrived for it")
        else:
            filed = self._arrived.get(round, {}).get(sender)
            if filed is not None and filed.fingerprint == fingerprint:
                refusal = Refusal("replayed", f"{sender} already pushed round {round}")
            elif filed is not None:
                del self._arrived[round][sender]
                self._refund(sender, filed.held)
                self._void.setdefault(round, set()).add(sender)
                log.error("%s: two different updates signed as %s for round %d: both dropped (is %s's key "
                          "in two hands?)", self.region, sender, round, sender)
                refusal = Refusal("equivocation", f"{sender} sent a different update for round {round} than the one filed; "
                                                  f"both are dropped")
        if refusal is not None and reserved:
            self.release(ticket, refusal)
        if refusal is not None:
            raise refusal

    def _stale_ok(self, sender: str, round: int) -> bool:
        return (self.stale_window > 0 and self._closed_upto - round < self.stale_window
                and sender in self._missed.get(round, ()))

    def _note_late(self, round: int, sender: str) -> None:
        self.late_dropped += 1
        started = self._receive_started.get(round)
        if started is not None:
            self.late_waits.append((round, sender, time.monotonic() - started))

    def _unreserve(self, ticket: Ticket) -> None:
        key = (ticket.sender, ticket.round)
        self._inflight[key] -= 1
        if self._inflight[key] <= 0:
            del self._inflight[key]
        self._inflight_per_sender[ticket.sender] -= 1
        if self._inflight_per_sender[ticket.sender] <= 0:
            del self._inflight_per_sender[ticket.sender]
        self._refund(ticket.sender, ticket.declared_bytes)

    def _refund(self, sender: str, nbytes: int) -> None:
        self._held[sender] -= nbytes
        if self._held[sender] <= 0:
            del self._held[sender]  # senders come and go (plaintext names): keep the table small

    def count_refusal(self, refusal: Refusal, sender: str, round: int) -> None:
        with self._cond:  # an RLock: also called with it held
            self.refused[refusal.reason] += 1
        expected = refusal.reason == "late" and (self.expect_late or isinstance(round, int) and round <= self.quiet_late_upto)
        log.log(logging.INFO if expected else logging.WARNING, "%s refused a message from %r for round %s: %s",
                self.region, sender, round, refusal)
