"""What the coordinator tells the policy about each link: the regions' own p2p estimates.

Each region keeps one ``geofed.p2p.estimator.LinkEstimator`` per out-link (it sees every push,
probe and ping on it) and reports its snapshot with each round's metrics. This view keeps the
latest value of each field per link, so a region that restarts (and has not measured yet) or a
round in which a link carried nothing leaves the last known figures in place rather than none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .types import LinkEstimate


class LinkView:
    """The coordinator's view of every link: the latest value of each field the regions' estimators
    reported, so a link that did not report this round keeps its last known figures.
    """

    def __init__(self) -> None:
        self._links: dict[str, dict[str, Any]] = {}

    def observe(self, link: str, snapshot: Mapping[str, Any]) -> None:
        """One link's snapshot (``LinkEstimator.snapshot()``: bandwidth_mbps, rtt_ms, concurrent)."""
        entry = self._links.setdefault(link, {"bandwidth_bps": None, "rtt_s": None, "concurrent": None})
        bw, rtt = snapshot.get("bandwidth_mbps"), snapshot.get("rtt_ms")
        if bw is not None and bw > 0:
            entry["bandwidth_bps"], entry["concurrent"] = bw * 1e6, snapshot.get("concurrent")
        if rtt is not None and rtt > 0:
            entry["rtt_s"] = rtt / 1e3

    def observe_round(self, results: Mapping[str, Mapping[str, Any]]) -> None:
        """Every region's round metrics (their ``links`` snapshots)."""
        for m in results.values():
            for link, snapshot in (m.get("links") or {}).items():
                self.observe(link, snapshot)

    def estimate(self, link: str) -> LinkEstimate:
        """The policy's LinkEstimate of `link`; all None before any report."""
        e = self._links.get(link)
        if e is None:
            return LinkEstimate()
        return LinkEstimate(bandwidth_bps=e["bandwidth_bps"], rtt_s=e["rtt_s"], concurrent=e["concurrent"])

    def links(self) -> list[str]:
        """Every link reported so far, sorted."""
        return sorted(self._links)

    def state_dict(self) -> dict[str, Any]:
        """The latest figures per link, for the driver's checkpoint."""
        return {"links": {k: dict(v) for k, v in self._links.items()}}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore `state_dict()`, replacing what is known."""
        self._links = {k: dict(v) for k, v in d.get("links", {}).items()}
