"""Shared pieces of the sync algorithms."""

from __future__ import annotations

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
    """The compute an overlapped exchange hides behind: the shortest compute of the region's last few
    rounds (the next round's compute is what the exchange overlaps; on 2 shared cores a round's compute
    moves +-25%, and sized on the last round alone a spread made peers wait 0.1-0.4 s in most rounds).
    0 for the final round: its exchange is waited for at once, with no compute to hide behind.

    Two uses: the receive deadline is at least the window (a peer that arrives within it costs this
    region nothing: waiting for it is free, refusing it as late loses its update and costs the run a
    resync), and sync.spread_sends paces each push over its share of the window."""

    def __init__(self, spread_fraction: float, window: int = 5):
        self.fraction = float(spread_fraction or 0.0)
        self._compute: deque[float] = deque(maxlen=window)

    def note(self, plan, metrics: Mapping[str, Any]) -> tuple[float, float]:
        """(window, spread) seconds for the exchange of the round `metrics` reports."""
        self._compute.append(float(metrics.get("compute_s") or 0.0))
        window = 0.0 if plan.final else min(self._compute)
        return window, self.fraction * window


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
