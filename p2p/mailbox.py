"""The receive side both transports share: who may send what for which round, and waiting.

Admission (identity, sender, round, size, concurrency), the (sender, round) slots with their
replay and equivocation rules, and the per-sender memory budgets are p2p/admission.py's; this
module adds the rounds and the owner's side.

Rounds: ``expect(r, senders)`` opens round r; pushes for rounds up to the newest expected round
+ ``round_window`` are accepted early (a fast peer may push round r+1 before this region has
opened it; the sender check then runs when it is opened). ``receive(r, deadline_s)`` closes
every round <= r: anything arriving for them later is dropped as late.

Two kinds of in-neighbour need not be waited for to the deadline (issue 36, N2):

- *optional* ones (``receive(..., optional=)``: a member back on probation after withholding):
  their update is taken if it is in by the time the required ones are, or within
  ``OPTIONAL_GRACE_S`` after them; nobody waits longer for it.
- senders *done* with the round (``senders_done``: the driver saw the sender report the round, and
  the sender says its push here was delivered or never made): a push is acknowledged only after it
  is filed here, so one still absent ``DONE_GRACE_S`` after the notice is not coming. A push of
  theirs that is still being received is never cut.

Streams (side channels): the update is one message per (sender, round). A feature that needs
more messages per link and round (secure aggregation: scales, masked update, relays, keys, ...)
opens a named side stream (``open_stream``): a mailbox of its own, with its own rounds, whose
pushes carry the stream's tag in the top bits of the header's round (a uint64, so the wire format
is unchanged). Every rule of the update's mailbox (identity = certificate, replay, equivocation,
size, budget, windows, late drops, counters) applies to a stream's messages too. A push tagged for
a stream this region has not opened is refused ``bad_header``.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .admission import Admission, Refusal, Ticket, held_bytes
from .messages import Inbox, Validator

__all__ = ["DONE_GRACE_S", "OPTIONAL_GRACE_S", "SIDE_STREAMS", "UPDATE", "Mailbox", "Refusal", "Ticket",
           "held_bytes", "stream_tag"]

# How long past the required in-neighbours a receive waits for an optional one. Its update, when it
# comes, comes with theirs (it trained the same H steps): this is scheduling slack, not a deadline.
OPTIONAL_GRACE_S = 0.25
# How long a "senders done" notice waits for an update its sender claims it delivered. An
# acknowledged push is filed before its ack leaves (tests/integration/test_p2p_optional_grpc.py
# measures the order over real gRPC): the grace only covers the notice overtaking a filing thread.
DONE_GRACE_S = 0.1
# Rounds of notices kept ahead of the newest expected round (a notice for a round this region has not
# opened yet is kept for it; a run far ahead of it is no notice of anything).
_DONE_ROUNDS_AHEAD = 8

UPDATE = "update"  # the stream of the round's update: the mailbox itself
# The side streams, in the order of their wire tags (1, 2, 3 in the round's top two bits): fixed, so
# that both ends of a link agree. secagg's tag, 1 << 62, is the one its side mailbox always had.
SIDE_STREAMS = ("secagg",)
_TAG_SHIFT = 62
_ROUND_MASK = (1 << _TAG_SHIFT) - 1


def stream_tag(stream: str) -> int:
    """What a push of `stream` adds to its header's round (0 for the update)."""
    if stream == UPDATE:
        return 0
    if stream not in SIDE_STREAMS:
        raise ValueError(f"stream: {stream!r} is not one of {(UPDATE, *SIDE_STREAMS)}")
    return (SIDE_STREAMS.index(stream) + 1) << _TAG_SHIFT


@dataclass(frozen=True)
class _StreamTicket(Ticket):
    """A push admitted into a side stream's mailbox (deliver/release go back there)."""

    stream: str = UPDATE

    def inner(self) -> Ticket:
        """The ticket as the stream's own mailbox issued it."""
        return Ticket(self.sender, self.round, self.declared_bytes)


class Mailbox(Admission):
    """The receive side of one region (see the module docstring): admits, validates and files pushes
    by (sender, round) and hands a round's updates to receive(). Thread-safe.
    """

    def __init__(self, region: str, **kwargs: Any):
        super().__init__(region, **kwargs)
        self._done: dict[int, dict[str, float]] = {}  # round -> sender -> when it was said to be done
        self._streams: dict[str, Mailbox] = {}  # side streams opened (open_stream)

    # -- side streams ----------------------------------------------------------------------
    def open_stream(self, stream: str, *, max_message_bytes: int, rounds_per_round: int = 1) -> Mailbox:
        """The side stream's mailbox (made on the first call). `rounds_per_round`: how many of its
        rounds the owner uses per round of the update (its window and memory budget scale with it)."""
        stream_tag(stream)
        if stream == UPDATE:
            return self
        with self._cond:
            box = self._streams.get(stream)
            if box is None:
                box = self._streams[stream] = Mailbox(
                    self.region, round_window=(self.round_window + 1) * rounds_per_round,
                    max_message_bytes=max_message_bytes, max_inflight_per_sender=self.max_inflight_per_sender,
                    peer_budget_bytes=(self.round_window + 2) * rounds_per_round * max_message_bytes)
                box.add_known(self._known)
        return box

    def stream(self, stream: str) -> Mailbox:
        """The mailbox of `stream` (this one for the update); ValueError if it was never opened."""
        if stream == UPDATE:
            return self
        box = self._streams.get(stream)
        if box is None:
            stream_tag(stream)
            raise ValueError(f"stream: {stream!r} was not opened on {self.region} (open_stream)")
        return box

    def admit(self, sender: str, round: int, declared_bytes: int, *, identity: str | None) -> Ticket:
        tag = round >> _TAG_SHIFT
        if not tag:
            return super().admit(sender, round, declared_bytes, identity=identity)
        stream = SIDE_STREAMS[tag - 1] if tag <= len(SIDE_STREAMS) else f"#{tag}"
        box = self._streams.get(stream)
        if box is None:
            refusal = Refusal("bad_header", f"{sender} pushed on stream {stream!r}, which this region has not opened")
            self.count_refusal(refusal, sender, round)
            raise refusal
        t = box.admit(sender, round & _ROUND_MASK, declared_bytes, identity=identity)
        return _StreamTicket(t.sender, t.round, t.declared_bytes, stream)

    def deliver(self, ticket: Ticket, payload: memoryview, *, wire_bytes: int, seconds: float) -> None:
        if isinstance(ticket, _StreamTicket):
            return self._streams[ticket.stream].deliver(ticket.inner(), payload, wire_bytes=wire_bytes, seconds=seconds)
        return super().deliver(ticket, payload, wire_bytes=wire_bytes, seconds=seconds)

    def release(self, ticket: Ticket, refusal: Refusal) -> None:
        if isinstance(ticket, _StreamTicket):
            return self._streams[ticket.stream].release(ticket.inner(), refusal)
        return super().release(ticket, refusal)

    def senders_done(self, round: int, senders: Collection[str]) -> None:
        """`senders` have finished `round` and will push nothing more for it here (see the module
        docstring): a receive of it stops waiting for them DONE_GRACE_S after this call."""
        now = time.monotonic()
        with self._cond:
            if round <= self._closed_upto or round > max(self._newest, self._closed_upto) + _DONE_ROUNDS_AHEAD:
                return  # closed already, or no round of this region's near future
            marks = self._done.setdefault(round, {})
            for s in senders:
                marks.setdefault(s, now)
            self._cond.notify_all()

    # -- configuration -------------------------------------------------------------------
    def add_known(self, senders: Collection[str]) -> None:
        with self._cond:
            self._known.update(s for s in senders if s != self.region)
            streams = list(self._streams.values())
        for box in streams:
            box.add_known(senders)

    def set_validator(self, fn: Validator) -> None:
        self._validator = fn

    def expect(self, round: int, senders: Collection[str]) -> None:
        senders = frozenset(senders)
        with self._cond:
            if round <= self._closed_upto:
                raise ValueError(f"round: {round} is already closed (received up to {self._closed_upto})")
            strangers = senders - self._known
            if strangers:
                raise ValueError(f"senders: not connected regions: {sorted(strangers)}")
            self._expected[round] = senders
            self._newest = max(self._newest, round)
            early = self._arrived.get(round, {})
            for sender in [s for s in early if s not in senders]:
                self._refund(sender, early.pop(sender).held)
                self.count_refusal(Refusal("not_neighbour", f"{sender} pushed round {round} early but is not an in-neighbour"), sender, round)
            self._cond.notify_all()

    def look_ahead(self, round: int) -> None:
        """Accept pushes for `round` (and the window past it) before expect(round). A region that
        takes the model from a peer before it runs `round` (a late quorum region catching up) is
        rounds behind: its peers push `round` while the fetch is still running, and without this
        those pushes were refused as future rounds and the region waited out its deadline (30 s)."""
        with self._cond:
            self._newest = max(self._newest, round - 1)

    def accept_stale(self, window: int) -> None:
        """Keep late updates of expected senders that missed a round, up to `window` rounds back (0: drop them)."""
        with self._cond:
            self.stale_window = max(0, int(window))

    def take_stale(self) -> list[tuple[str, int, Any]]:
        """The late updates filed since the last call, as (sender, round, value), oldest first."""
        with self._cond:
            out, self._stale = self._stale, []
            for sender, _, entry in out:
                self._refund(sender, entry.held)
        return [(sender, r, entry.value) for sender, r, entry in out]


    # -- the owner's side ----------------------------------------------------------------
    def receive(self, round: int, deadline_s: float, *, quorum: int | None = None, grace_s: float = 0.0,
                until: Collection[str] | None = None, optional: Collection[str] = ()) -> Inbox:
        """Wait for the expected senders of `round` (all, or with `quorum` that many and then at
        most `grace_s` for the rest; or only those of them in `until`, the others taken if they
        are in by then) for at most `deadline_s`, then close every round <= it. `optional` senders
        are taken if they come by OPTIONAL_GRACE_S after the others; senders done with the round
        (senders_done) are waited for DONE_GRACE_S after the notice, unless their push is arriving."""
        if not deadline_s >= 0:
            raise ValueError(f"deadline_s: must be >= 0, got {deadline_s}")
        start = time.monotonic()
        end = start + deadline_s
        with self._cond:
            if round not in self._expected:
                raise ValueError(f"round: expect({round}, ...) was not called (or the round is closed)")
            expected = self._expected[round]
            optional = expected & frozenset(optional)
            wanted = (expected if until is None else expected & frozenset(until)) - optional
            self._receive_started[round] = start
            cut: frozenset[str] = frozenset()
            while True:
                now = time.monotonic()
                settled = self._arrived.get(round, {}).keys() | self._void.get(round, set()) | self._refused_in.get(round, set())
                cut, next_cut = self._cut(round, expected - settled, now)
                if wanted <= settled | cut:
                    if not optional or optional <= settled | cut:
                        break
                    end = min(end, now + OPTIONAL_GRACE_S)  # the required ones are in: a short grace for the rest
                    wanted = wanted | optional
                if quorum is not None and len(expected & self._arrived.get(round, {}).keys()) >= quorum:
                    end = min(end, now + grace_s)  # the quorum is in: a grace for the rest
                    quorum = None
                remaining = min(end, next_cut) - now
                if end - now <= 0:
                    break
                self._cond.wait(max(remaining, 0.001))
            got = self._arrived.pop(round, {})
            refused = frozenset((self._void.get(round, set()) | self._refused_in.get(round, set())) & (expected - got.keys()))
            cut = cut - got.keys()
            for sender, entry in got.items():
                self._refund(sender, entry.held)
            if self.stale_window:
                self._missed[round] = set(expected - got.keys())
                for r in [r for r in self._missed if r <= round - self.stale_window]:
                    del self._missed[r]
            self._close_upto(round)
        waited = time.monotonic() - start
        return Inbox(
            round=round,
            received={s: e.value for s, e in got.items()},
            missing=frozenset(expected - got.keys()),
            arrivals={s: e.arrival for s, e in got.items()},
            waits={s: max(0.0, e.arrival.arrived_at - start) for s, e in got.items()},
            waited_s=waited,
            refused=refused,
            cut=cut,
        )

    def _cut(self, round: int, absent: frozenset[str], now: float) -> tuple[frozenset[str], float]:
        """Of `absent`, the senders done with `round` whose grace is over and whose push is not being
        received now; and when the next grace of the others ends (inf: none pending)."""
        cut, next_cut = set(), float("inf")
        for sender, at in self._done.get(round, {}).items():
            if sender not in absent:
                continue
            if self._inflight[(sender, round)]:
                # Arriving: a push that is streaming in is never cut. A push that aborts is released
                # without a notify, so look again soon.
                next_cut = min(next_cut, now + 0.05)
                continue
            if now >= at + DONE_GRACE_S:
                cut.add(sender)
            else:
                next_cut = min(next_cut, at + DONE_GRACE_S)
        return frozenset(cut), next_cut

    def _close_upto(self, round: int) -> None:
        self._closed_upto = round
        for r in [r for r in self._arrived if r <= round]:
            # Accepted for a round the owner never received: it can no longer be used.
            dropped = self._arrived.pop(r)
            self.late_dropped += len(dropped)
            for sender, entry in dropped.items():
                self._refund(sender, entry.held)
        for r in [r for r in self._void if r <= round]:
            del self._void[r]
        for r in [r for r in self._refused_in if r <= round]:
            del self._refused_in[r]
        for r in [r for r in self._done if r <= round]:
            del self._done[r]
        for r in [r for r in self._expected if r <= round]:
            del self._expected[r]
        for r in [r for r in self._receive_started if r < round - 8]:
            del self._receive_started[r]  # late stragglers of older rounds are not timed

    def counters(self) -> dict:
        """The update's counters; a side stream's refusals added in, and kept apart under its name."""
        out = self.own_counters()
        for name, box in list(self._streams.items()):
            side = box.own_counters()
            refused = dict(out["refused"])
            for reason, n in side["refused"].items():
                refused[reason] = refused.get(reason, 0) + n
            out.update(refused=refused, refused_total=sum(refused.values()))
            out[name] = {"refused": side["refused"], "messages_received": side["messages_received"],
                         "late_dropped": side["late_dropped"]}
        return out

    def own_counters(self) -> dict:
        """This stream's counters alone (`counters` adds the side streams' in)."""
        with self._cond:
            return {
                "bytes_received": dict(self.bytes_received),
                "messages_received": dict(self.messages_received),
                "refused": dict(self.refused),
                "refused_total": sum(self.refused.values()),
                "late_dropped": self.late_dropped,
                "held_bytes": dict(self._held),
                "late_waits_s": [{"round": r, "sender": s, "seconds": w} for r, s, w in self.late_waits],
                "closed_upto": self._closed_upto,
            }
