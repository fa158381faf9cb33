"""Counting the connections refused in the TLS handshake (no certificate, another CA).

gRPC core refuses them before any Python runs, and it surfaces no failed handshake to Python.
What it does surface: a server built with ``grpc.dynamic_ssl_server_credentials`` calls its
certificate fetcher once for every connection it accepts, before the handshake. Every connection
whose handshake succeeds then carries an authenticated call (our clients connect to call), seen
by the servicer with the connection's ``context.peer()``. So

    refused = accepted connections - connections that carried an authenticated call

Each new authenticated connection takes back one accepted connection younger than ``grace_s``
(its own handshake was milliseconds before its first call; which young one it takes does not
change the count), and an accepted connection is counted as refused once it is older than the
grace without having been taken. So a good connection is never counted, and a burst of good ones
does not hide refusals (subtracting totals did: 300 young connections of a flood hid two older
refusals). The count includes any connection dropped before its first call (a client that gave
up mid-handshake); the name says what is counted, not why.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("geofed.p2p")

GRACE_S = 2.0
_MAX_PEERS = 65536       # authenticated connections remembered (a few per peer and reconnect)
_MAX_PENDING = 100_000   # accepted connections younger than the grace (a flood is bounded too)


class HandshakeLedger:
    """Counts the connections of one server that never carried an authenticated call (refused in the
    TLS handshake, or dropped before a call); see the module docstring. Thread-safe.
    """

    def __init__(self, region: str, *, grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic):
        self.region = region
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: collections.deque[float] = collections.deque(maxlen=_MAX_PENDING)
        self._accepted = 0
        self._aged = 0                    # accepted, older than the grace, not taken back: refused
        self._peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._authenticated = 0
        self._logged = 0

    def accepted(self) -> None:
        """One accepted connection, before its handshake (the certificate fetcher's call)."""
        with self._lock:
            self._accepted += 1
            self._pending.append(self._clock())

    def authenticated(self, peer: str) -> None:
        """A call arrived over an authenticated connection (``context.peer()``: one per connection)."""
        with self._lock:
            if peer in self._peers:
                self._peers.move_to_end(peer)
                return
            self._peers[peer] = None
            self._authenticated += 1
            if len(self._peers) > _MAX_PEERS:
                self._peers.popitem(last=False)
            if self._pending:
                self._pending.pop()
            elif self._aged:   # its first call came later than the grace: not refused after all
                self._aged -= 1

    def counts(self) -> dict[str, int]:
        """Accepted connections (all) and connections that carried an authenticated call."""
        with self._lock:
            return {"accepted": self._accepted, "authenticated": self._authenticated}

    def refused(self) -> int:
        """Connections accepted at least ``grace_s`` ago that never carried an authenticated call."""
        with self._lock:
            horizon = self._clock() - self.grace_s
            while self._pending and self._pending[0] <= horizon:
                self._pending.popleft()
                self._aged += 1
            n = self._aged
            new, self._logged = n - self._logged, max(self._logged, n)
        if new > 0:
            log.warning("%s refused %d connection(s): tls_handshake: no client certificate, one from "
                        "another CA, or dropped before its first call", self.region, new)
        return n
