"""Spread sends: a push paced over a time span instead of sent at line rate (``sync.spread_sends``).

Streaming DiLoCo (arXiv 2501.18512) lowers a link's peak bandwidth by keeping one small exchange
in flight while the model computes. With overlap, that exchange has a whole round of compute to
finish in, yet a push at line rate still goes out in one burst and leaves the link idle for the
rest of the round: bursty for a WAN that others share, and a peak that the contracted rate must
cover. A spread push cuts the payload into chunks and releases them evenly over ``spread_s``, so
the link carries the round's bytes at about ``bytes / spread_s`` all round long.

A chunk goes out every ``TICK_S`` at most, and no chunk is smaller than ``MIN_CHUNK_BYTES``
(each chunk costs ~8 bytes of framing: at 512 B, 1.6%). The first chunk leaves at once and the
last at the end of the spread, so the push spans it whole. A link slower than the pace
is not paced at all in effect: the chunks queue and the push ends when the link has carried
them, so its duration still measures the link (``p2p/estimator.py`` uses it only then).

The spread is a plan made from the last round's compute. When the round it hides behind ends
sooner (a faster round, the final flush), the region calls ``transport.spreading.hurry()`` and what is
left goes out at once: peers never wait on a pace that no longer has compute to hide behind.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

TICK_S = 0.05
MIN_CHUNK_BYTES = 512


def spread_chunk_bytes(nbytes: int, chunk_bytes: int, spread_s: float) -> int:
    """The chunk size of a push of `nbytes` spread over `spread_s` (0: `chunk_bytes`, line rate)."""
    if spread_s <= 0 or nbytes <= MIN_CHUNK_BYTES:
        return chunk_bytes
    chunks = max(1, min(nbytes // MIN_CHUNK_BYTES, math.ceil(spread_s / TICK_S)))
    return max(1, min(chunk_bytes, math.ceil(nbytes / chunks)))


class SpreadClock:
    """Releases chunk i of n at start + spread_s * i / (n - 1): the first at once, the last at the
    end; every chunk at once after hurry()."""

    def __init__(self, spread_s: float, chunks: int):
        self.spread_s, self.chunks = max(0.0, spread_s), max(1, chunks)
        self.start: float | None = None
        self._hurry = threading.Event()

    def hurry(self) -> None:
        """Release the remaining chunks now."""
        self._hurry.set()

    def wait(self, i: int) -> None:
        """Block until chunk `i` may go; the clock starts at chunk 0."""
        if self.start is None:
            self.start = time.monotonic()
        if self.spread_s <= 0 or i <= 0 or self.chunks < 2:
            return
        delay = self.start + self.spread_s * min(1.0, i / (self.chunks - 1)) - time.monotonic()
        if delay > 0:
            self._hurry.wait(delay)


class SpreadPushes:
    """A transport's spread pushes in flight, so that hurry() reaches all of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clocks: set[SpreadClock] = set()

    @contextmanager
    def track(self, clock: SpreadClock) -> Iterator[SpreadClock]:
        with self._lock:
            self._clocks.add(clock)
        try:
            yield clock
        finally:
            with self._lock:
                self._clocks.discard(clock)

    def hurry(self) -> int:
        """Release every tracked push's remaining chunks; returns how many pushes were paced."""
        with self._lock:
            clocks = list(self._clocks)
        for c in clocks:
            c.hurry()
        return len(clocks)
