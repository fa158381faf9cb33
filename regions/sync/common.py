"""Shared pieces of the sync algorithms."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from geofed.p2p.gossip import mix  # re-exported: weights of missing peers fold into self

from ..exchange import ExchangeResult


def exchange_metrics(res: ExchangeResult) -> dict[str, Any]:
    """The exchange keys of a round's metrics record, from one exchange's result."""
    return {"bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received,
            "transfers": res.transfers, "peers_missing": res.missing, "wait_s": round(res.wait_s, 6),
            "send_failures": res.send_failures}


class OverlapWindow:
    """How long an overlapped exchange has before the region needs its result, and the pace of its
    pushes (sync.spread_sends).

    The result is needed when the region's next round's compute ends: after the wait for the
    driver's barrier (the other regions finishing this round) and the next compute. A peer that
    arrives within that costs this region nothing to wait for; refused as late, its update is lost
    and the run pays a resync. So the receive deadline is at least the window: the median compute
    of the region's last few rounds plus the longest of its recent waits between rounds (on 2
    shared cores one region finished a round 1.7 s before the others, whose pushes then missed a
    window of its own compute alone). The spread is a share of the shortest recent compute, so a
    paced push ends before any next round does (a round's compute moves +-25% there; sized on the
    last round alone a spread made peers wait 0.1-0.4 s in most rounds). The final round has
    neither: its exchange is waited for at once."""

    def __init__(self, spread_fraction: float, rounds: int = 5):
        self.fraction = float(spread_fraction or 0.0)
        self._compute: deque[float] = deque(maxlen=rounds)
        self._gaps: deque[float] = deque(maxlen=rounds)
        self._ended: float | None = None

    def started(self) -> None:
        """A round starts: the wait since the last one ended is a gap between rounds."""
        if self._ended is not None:
            self._gaps.append(max(0.0, time.monotonic() - self._ended))
            self._ended = None

    def note(self, plan, metrics: Mapping[str, Any]) -> tuple[float, float]:
        """(window, spread) seconds for the exchange of the round `metrics` reports; the round ends."""
        self._compute.append(float(metrics.get("compute_s") or 0.0))
        self._ended = time.monotonic()
        if plan.final:
            return 0.0, 0.0
        window = statistics.median(self._compute) + max(self._gaps, default=0.0)
        return window, self.fraction * min(self._compute)


def no_exchange_metrics() -> dict[str, Any]:
    """The exchange keys of a round in which no exchange completed (overlap's first round):
    every round's record has them, so sums over rounds never miss a key."""
    return {"bytes_sent": 0, "bytes_received": 0, "transfers": [], "peers_missing": [], "wait_s": 0.0,
            "send_failures": {}}


def merge_exchange_metrics(into: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """Add a second exchange's metrics to a round's (overlap: a round that also flushes the
    exchange still in flight reports both); keys other than the exchange's are overwritten, except
    an evaluation: the round's own (of an earlier model) moves to `evals_earlier` with its age."""
    for key, value in more.items():
        if key == "eval" and "eval" in into:
            earlier = {**into["eval"], "age_s": into.get("eval_age_s", 0.0)}
            into["evals_earlier"] = [*into.get("evals_earlier", []), earlier]
            into[key] = value
        elif key in ("bytes_sent", "bytes_received", "wait_s") and key in into:
            into[key] = into[key] + value
        elif key in ("transfers", "peers_missing") and key in into:
            into[key] = list(into[key]) + [v for v in value if key == "transfers" or v not in into[key]]
        elif key == "send_failures" and key in into:
            into[key] = {**into[key], **value}
        else:
            into[key] = value
    return into


__all__ = ["exchange_metrics", "merge_exchange_metrics", "mix", "no_exchange_metrics"]
