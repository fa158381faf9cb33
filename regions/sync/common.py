"""Shared pieces of the sync algorithms."""

from __future__ import annotations

from typing import Any

from geofed.p2p.gossip import mix  # re-exported: weights of missing peers fold into self

from ..exchange import ExchangeResult


def exchange_metrics(res: ExchangeResult) -> dict[str, Any]:
    return {"bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received,
            "transfers": res.transfers, "peers_missing": res.missing, "wait_s": round(res.wait_s, 6),
            "send_failures": res.send_failures}

__all__ = ["exchange_metrics", "mix"]
