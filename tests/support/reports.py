"""Round reports (regions/messages.py: RoundReport, ExchangeStats) made by hand, for tests of the
driver's parts that read them (the coordinator, resync, the withhold watch, the DP budget): only
the keys a test cares about are given, the rest take a quiet round's values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from geofed.regions.messages import ExchangeStats, RoundReport

_ROUND: dict[str, Any] = {
    "round": 0, "region": "a", "H": 1, "codecs": {}, "wall_s": 0.1, "utilization": 1.0, "rss_mb": 0.0, "links": {},
    "train_loss": 1.0, "steps": 1, "compute_s": 0.1, "step_time_s": 0.1,
    "bytes_sent": 0, "bytes_received": 0, "transfers": [], "peers_missing": [], "send_failures": {}, "wait_s": 0.0,
    "refused": 0, "refusals": {}, "harmful": {}, "quarantined": {}, "clipped": {},
}


def report(**keys: Any) -> RoundReport:
    """A region's report of one round: `keys` are metrics.jsonl keys over a quiet round's."""
    return RoundReport.from_metrics({**_ROUND, **keys})


def exchange(*, missing: Iterable[str] = (), heard: Iterable[str] = (), **keys: Any) -> ExchangeStats:
    """A round's exchange that missed `missing` and received from `heard` (one recv transfer each)."""
    transfers = [{"peer": p, "direction": "recv"} for p in heard] + [{"peer": "x", "direction": "send"}]
    return report(peers_missing=list(missing), transfers=transfers, **keys).exchange
