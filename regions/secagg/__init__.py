"""Secure aggregation (``security.secure_aggregation``; docs/privacy.md): no region sees
another's update, only the sum of the round's. One subpackage, on top of the transport's
``secagg`` side stream (p2p/mailbox.py):

- ``round.py``: the round itself (SecAggRound, one `exchange` per DiLoCo round) and its phases;
- ``keys.py``: the run's keys, their signed adverts and the book that refuses replays;
- ``masks.py``: the arithmetic (seeds, keystreams, masks over Z_2^b, the shared-scale grid);
- ``relay.py``: XOR shares of a round's self key, relayed so a complete round needs no KEY phase;
- ``wire.py``: the bytes of every message (strict, bounded decoding);
- ``codecs.py``: which codecs it can carry (the config loader asks, without the cryptography).

This module holds only the refusal they all raise, so that importing ``codecs`` stays cheap.
"""

from __future__ import annotations

REASONS = ("wrong_run", "wrong_round", "replayed_key", "bad_signature", "unknown_region", "malformed",
           "wrong_share", "too_few_shares", "reveal_conflict", "wrong_grid")


class SecAggError(ValueError):
    """A refused secure-aggregation input; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason
