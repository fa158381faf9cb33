"""A rejoining region pulls the current parameters from a peer, spreading the load.

hivemind's joiners all pulled state from the same donor (its issues #169, #445). Here each
joiner ranks the candidate donors by rendezvous hashing of (salt, joiner, donor): different
joiners start at different donors, the order is stable for a joiner, and a donor that fails or
times out is skipped for the next one.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from .transport import Transport, TransportError

log = logging.getLogger("geofed.p2p")


def donor_order(joiner: str, donors: Sequence[str], *, salt: str = "") -> list[str]:
    """The donors (without the joiner) in the order `joiner` tries them: rendezvous hashing of (salt, joiner, donor)."""
    def score(d: str) -> bytes:
        return hashlib.sha256(f"{salt}\0{joiner}\0{d}".encode()).digest()

    return sorted((d for d in donors if d != joiner), key=score)


def fetch_state_from_any(transport: Transport, donors: Sequence[str], *, timeout_s: float,
                         salt: str = "") -> tuple[str, bytes]:
    """(donor, state bytes) from the first donor in this joiner's order that answers."""
    order = donor_order(transport.region, donors, salt=salt)
    if not order:
        raise ValueError("donors: no peer to fetch the state from")
    failures = []
    for donor in order:
        try:
            return donor, transport.fetch_state(donor, timeout_s=timeout_s)
        except TransportError as exc:
            log.warning("%s: state fetch from %s failed (%s); trying the next donor", transport.region, donor, exc)
            failures.append(f"{donor}: {exc.reason}")
    raise TransportError(f"{transport.region}: no donor gave its state ({'; '.join(failures)})", reason="unavailable")
