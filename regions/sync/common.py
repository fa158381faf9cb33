"""Shared pieces of the sync algorithms."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from geofed.p2p.gossip import mix  # re-exported: weights of missing peers fold into self

from ..exchange import ExchangeResult


class _Background:
    """`fn()` in a thread of its own from now on (the rollback copy of a round's state, taken while the
    exchange waits on the WAN: `before_outer_step_during`). `join` waits for it and raises what it
    raised; `wait` only waits (an exception of the caller's own is on its way)."""

    def __init__(self, fn: Callable[[], None], *, name: str):
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to join's caller
                self.error = exc

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def before_outer_step_during(before_outer_step: Callable[[], None], work: Callable[[], Any]) -> Any:
    """`work()` (a round's exchange) while `before_outer_step()` runs in a thread; its result once both
    are done. The rollback copy (regions/rollback.py; 8 B/param written to disk by default) then costs
    the round nothing where the exchange waits on the network: an algorithm's state changes only at its
    outer step, after this returns, so the copy taken meanwhile is the round's start as before."""
    copier = _Background(before_outer_step, name="rollback-copy")
    try:
        out = work()
    except BaseException:
        copier.wait()
        raise
    copier.join()
    return out


def exchange_metrics(res: ExchangeResult) -> dict[str, Any]:
    """The exchange keys of a round's metrics record, from one exchange's result."""
    return {"bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received,
            "transfers": res.transfers, "peers_missing": res.missing, "wait_s": round(res.wait_s, 6),
            "send_failures": res.send_failures}


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


__all__ = ["before_outer_step_during", "exchange_metrics", "merge_exchange_metrics", "mix", "no_exchange_metrics"]
