"""Shamir t-of-n secret sharing over the prime field GF(2^521 - 1), for secure aggregation's
dropout recovery (p2p/secagg.py).

A secret of up to 64 bytes (an X25519 private key or a 32-byte seed) is the constant term of a
random polynomial of degree t - 1; holder k gets the point (k, f(k)), k = 1..n. Any t points give
the secret back (Lagrange at 0), fewer give no information about it. The field is a Mersenne
prime so that every 32- and 64-byte secret is an element without reduction.

Shamir alone cannot tell a wrong point from a right one: secagg.py checks every share against a
commitment its dealer signed, and the reconstructed key against its signed public key.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

PRIME = (1 << 521) - 1
SHARE_BYTES = 66  # ceil(521 / 8): one field element, big-endian
MAX_SECRET_BYTES = 64


@dataclass(frozen=True, kw_only=True)
class Share:
    """One point of a sharing: holder index x (1..n) and y = f(x) in GF(PRIME)."""

    x: int
    y: int

    def __post_init__(self):
        if not 1 <= self.x < 1 << 16:
            raise ValueError(f"x: a share index must be in [1, 65535], got {self.x}")
        if not 0 <= self.y < PRIME:
            raise ValueError("y: a share value must be a field element (0 <= y < 2^521 - 1)")

    def to_bytes(self) -> bytes:
        """x as 2 bytes then y as 66 bytes, big-endian: what a commitment hashes and the wire carries."""
        return self.x.to_bytes(2, "big") + self.y.to_bytes(SHARE_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        if len(data) != 2 + SHARE_BYTES:
            raise ValueError(f"share: expected {2 + SHARE_BYTES} bytes, got {len(data)}")
        return cls(x=int.from_bytes(data[:2], "big"), y=int.from_bytes(data[2:], "big"))


def split(secret: bytes, *, threshold: int, holders: int) -> list[Share]:
    """`holders` shares of `secret`, any `threshold` of which reconstruct it (share k has x = k)."""
    if not 1 <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"secret: must be 1..{MAX_SECRET_BYTES} bytes, got {len(secret)}")
    if not 2 <= threshold <= holders < 1 << 16:
        # t = 1 would hand the secret itself to every holder.
        raise ValueError(f"threshold: need 2 <= threshold <= holders < 65536, got {threshold} of {holders}")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return [Share(x=x, y=_evaluate(coeffs, x)) for x in range(1, holders + 1)]


def combine(shares: Sequence[Share], *, threshold: int, secret_bytes: int) -> bytes:
    """The secret from at least `threshold` shares with distinct x (the first `threshold` are used)."""
    if len(shares) < threshold:
        raise ValueError(f"shares: need {threshold} to reconstruct, got {len(shares)}")
    xs = [s.x for s in shares]
    if len(set(xs)) != len(xs):
        raise ValueError("shares: two shares have the same index")
    pts = list(shares)[:threshold]
    value = 0
    for i, si in enumerate(pts):
        num, den = 1, 1
        for j, sj in enumerate(pts):
            if i != j:
                num = num * (-sj.x) % PRIME
                den = den * (si.x - sj.x) % PRIME
        value = (value + si.y * num * pow(den, -1, PRIME)) % PRIME
    if value >= 1 << (8 * secret_bytes):
        # Points that lie on no polynomial with a secret of this size: some share is wrong.
        raise ValueError(f"shares: they reconstruct no {secret_bytes}-byte secret (a share is wrong)")
    return value.to_bytes(secret_bytes, "big")


def _evaluate(coeffs: Sequence[int], x: int) -> int:
    acc = 0
    for c in reversed(coeffs):  # Horner
        acc = (acc * x + c) % PRIME
    return acc
