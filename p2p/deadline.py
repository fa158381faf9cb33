"""Adaptive receive deadline: how long a region waits for its in-neighbours in a round.

``current() = clamp(median + k * MAD, min_s, max_s)`` over the recent wait samples (hivemind
users asked for exactly this instead of hand-set timeouts, its issue #676). Before
``min_samples`` samples it is ``initial_s``. Two guards:

- MAD is floored at 10% of the median: equal samples give MAD 0, which would leave no slack
  at all for the next round's ordinary jitter.
- ``observe_miss()`` (a round ended with someone missing) multiplies the deadline by ``growth``
  for the next rounds, up to ``max_s``; the next complete round resets it. So a link that slowed
  down stretches the deadline within a few rounds, while a dead peer costs at most ``max_s``
  per round and never enters the samples.
- The deadline widens on evidence of lateness, not on silence (issue 36, N2): a round whose only
  absentees never arrived while every other in-neighbour came within ``SILENT_FRACTION`` of the
  deadline does not widen it and samples the last arrival (``observe_incomplete``); an update that then arrives after its
  round closed (the mailbox refuses it as ``late`` and times it) widens it to cover that arrival
  and enters the samples (``observe_late``). Without another in-neighbour to compare with there
  is no evidence either way, and a miss widens as before. A peer whose update was refused (its content, not the
  network: regions/exchange.py) is no miss, and a member that never pushes is muted by the driver
  (orchestrator/driver/recovery.py, WithholdWatch): neither stretches the deadline (issue 36, N2).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

# Arrivals within this share of the deadline are "well inside" it (observe_incomplete): a peer
# missing beside them is silent, not slow.
SILENT_FRACTION = 0.5


class AdaptiveDeadline:
    """The receive deadline of one region, learnt from how long complete rounds waited (see the
    module docstring); `current()` is the deadline for the next round.
    """

    def __init__(self, initial_s: float, min_s: float, max_s: float, k: float, *,
                 window: int = 32, min_samples: int = 3, growth: float = 1.5):
        if not 0 < min_s <= initial_s <= max_s:
            raise ValueError(f"initial_s: need 0 < min_s <= initial_s <= max_s, got {min_s}, {initial_s}, {max_s}")
        if k < 0:
            raise ValueError(f"k: must be >= 0, got {k}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"window: need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        if growth < 1:
            raise ValueError(f"growth: must be >= 1, got {growth}")
        self.initial_s, self.min_s, self.max_s, self.k = initial_s, min_s, max_s, k
        self.min_samples, self.growth = min_samples, growth
        self._samples: deque[float] = deque(maxlen=window)
        self._boost = 1.0

    def observe(self, seconds: float) -> None:
        """A wait that ended because everyone arrived (seconds from the start of receive)."""
        if not seconds >= 0:
            raise ValueError(f"seconds: must be >= 0, got {seconds}")
        self._samples.append(float(seconds))
        self._boost = 1.0

    def observe_miss(self) -> None:
        """A round's deadline passed with a peer missing."""
        self._boost = min(self._boost * self.growth, self.max_s / self.min_s)

    def observe_incomplete(self, others_s: Sequence[float], *, deadline_s: float) -> None:
        """A round's deadline `deadline_s` passed with a peer missing; `others_s`: how long the
        in-neighbours that did arrive took. All of them well inside the deadline is silence of the
        absent peer, not a slow network: no widening (observe_late() widens if it was only late)."""
        if others_s and max(others_s) <= SILENT_FRACTION * deadline_s:
            # The last of those who came is what the round had to wait for: a sample like a
            # complete round's (a silent member's first rounds then teach the deadline instead of
            # leaving it at initial_s), the boost of an earlier miss kept.
            self._samples.append(float(max(others_s)))
            return
        self.observe_miss()

    def observe_late(self, seconds: float) -> None:
        """An update that arrived `seconds` after its round's receive began, after that round closed."""
        if not seconds >= 0:
            raise ValueError(f"seconds: must be >= 0, got {seconds}")
        self._samples.append(float(seconds))
        # Cover that arrival next round with the growth factor's margin (a late peer is seldom
        # exactly as late twice); a complete round then resets the boost as after any miss.
        base = max(self.base(), 1e-9)
        need = seconds * self.growth / base
        self._boost = min(max(self._boost * self.growth, need), max(self.max_s / self.min_s, self.max_s / base))

    def base(self) -> float:
        """median + k * MAD of the samples (MAD floored at 10% of the median); initial_s before min_samples."""
        if len(self._samples) < self.min_samples:
            return self.initial_s
        med = statistics.median(self._samples)
        mad = statistics.median(abs(s - med) for s in self._samples)
        return med + self.k * max(mad, 0.1 * med)

    def current(self) -> float:
        """The deadline for the next round: base() stretched by the misses since the last complete round, clamped."""
        return min(self.max_s, max(self.min_s, self.base() * self._boost))

    def state_dict(self) -> dict:
        """Samples and miss factor, for a checkpoint."""
        return {"samples": list(self._samples), "boost": self._boost}

    def load_state_dict(self, d: dict) -> None:
        """Restore `state_dict()`; the bounds and k stay this instance's (the config's)."""
        self._samples.clear()
        self._samples.extend(float(s) for s in d.get("samples", []))
        self._boost = float(d.get("boost", 1.0))
