"""The side-message plumbing that every phase of secure aggregation in the round shares
(regions/secagg_round.py): the side channel and its worker pool, a phase's push-and-wait, the
pushes still in flight and their counting once they end, and `Fallback`, which any phase raises
when this region cannot unmask the round."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from geofed.p2p.secagg_slot import MASKED, SideChannel
from geofed.p2p.transport import Transport, TransportError


class Fallback(Exception):
    """This region cannot unmask the round (why): it applies its own update alone."""


class SecAggIO:
    """The pushes and receives of one region's secure-aggregation rounds. `deadline` is the
    region's AdaptiveDeadline (every wait), `regions` the run's regions."""

    def __init__(self, *, regions: Sequence[str], transport: Transport, deadline, send_timeout_s: float,
                 max_message_bytes: int):
        self.regions = sorted(regions)
        self.deadline, self.send_timeout_s = deadline, send_timeout_s
        self.side = SideChannel(transport, max_message_bytes=max_message_bytes)
        self.side.set_validator(lambda sender, r, phase, payload: bytes(payload))  # checked in the round's thread
        self.pending: list[tuple[int, str, int, Future]] = []  # pushes not yet acknowledged when a round ended
        self.refused: Counter[str] = Counter()
        # A KEY task waits in a worker for its MASKED push's ack: room for both, per peer, and a stalled one.
        self._pool = ThreadPoolExecutor(max_workers=max(6, 3 * len(regions)), thread_name_prefix="geofed-secagg")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _harvest(self, m: dict) -> None:
        """Count the pushes of `pending` that ended; the others stay pending, counted by a later
        round. The common round waits for no self-key ack: those pushes end while the next round's
        inner steps run (the last round's few hundred bytes are not counted)."""
        still = []
        for round_, peer, phase, fut in self.pending:
            if not fut.done():
                still.append((round_, peer, phase, fut))
                continue
            try:
                stats = fut.result()
            except TransportError as exc:
                m["send_failures"][peer] = f"secagg round {round_} phase {phase}: {exc}"
                continue
            if stats is None:  # a self key not sent: the masked update was not acknowledged
                continue
            m["bytes_sent"] += stats.bytes
            if phase == MASKED:
                m["transfers"].append({"peer": peer, "direction": "send", "bytes": stats.bytes,
                                       "seconds": round(stats.seconds, 6), "concurrent": len(self.regions) - 1})
        self.pending = still

    @staticmethod
    def _count_received(inbox, phase: int, m: dict) -> None:
        for sender, (nbytes, seconds) in inbox.timings.items():
            m["bytes_received"] += nbytes
            if phase == MASKED:
                m["transfers"].append({"peer": sender, "direction": "recv", "bytes": nbytes, "seconds": round(seconds, 6)})

    def _round_trip(self, round_: int, phase: int, payloads: dict[str, bytes], m: dict, *, receive: bool = True,
                    until=None, wait_s: float | None = None):
        """Push each peer its payload and wait (the deadline) for the peers' of this phase; returns
        (the inbox, {peer: its push's future}). No ack is waited for: the pushes are counted when
        they end (`_harvest`), and only the masked update's acks decide anything."""
        futures = {p: self._pool.submit(self.side.send, p, round_, phase, b, timeout_s=self.send_timeout_s)
                   for p, b in payloads.items()}
        self.pending += [(round_, p, phase, f) for p, f in futures.items()]
        wait_s = self.deadline.current() if wait_s is None else wait_s
        inbox = self.side.receive(round_, phase, wait_s, until=until) if receive else None
        if inbox is not None:
            self._count_received(inbox, phase, m)
        return inbox, futures
