"""Secure aggregation's identities: a region's X25519 key advert, signed with its TLS key and
checked against the run's CA (`sign_advert`, `_check_identity`), the `KeyBook` that refuses a
replayed or older key, and `SecAggError`, the refusal every secure-aggregation check raises
(docs/privacy.md has the protocol and the threat model). The protocol with keys per run is
p2p/secagg_run.py; the masks' arithmetic is p2p/secmask.py.

Refusals are `SecAggError`s with a short `reason` (REASONS), to be counted like the transport's.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from .tls import certificate_region

REASONS = ("wrong_run", "wrong_round", "replayed_key", "bad_signature", "unknown_region", "malformed",
           "wrong_share", "too_few_shares", "reveal_conflict", "wrong_grid")


class SecAggError(ValueError):
    """A refused secure-aggregation input; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class KeyAdvert:
    """A region's public key for the run (`round`: the round it was issued in), signed with its
    TLS key. `commitments` is always empty (p2p/secagg_run.py refuses any other): the per-round
    protocol that committed to Shamir shares there is gone, and the field stays so that the
    signed bytes and the advert's wire layout are unchanged."""

    run_id: str
    round: int
    region: str
    public_key: bytes
    commitments: tuple[tuple[bytes, ...], tuple[bytes, ...]]  # (key shares, seed shares)
    signature: bytes = b""

    def payload(self) -> bytes:
        """The signed bytes: every field but the signature, length-prefixed."""
        parts = [b"geofed-secagg-advert-v1", self.run_id.encode(), self.round.to_bytes(8, "big"),
                 self.region.encode(), self.public_key]
        parts += [c for per_kind in self.commitments for c in per_kind]
        return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


# ---- authentication ------------------------------------------------------------------------

def sign_advert(advert: KeyAdvert, tls_key_pem: bytes) -> KeyAdvert:
    """The advert signed (ECDSA P-256, SHA-256) with the region's TLS private key (p2p/tls.py)."""
    key = serialization.load_pem_private_key(tls_key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("tls_key_pem: expected the region's EC private key")
    sig = key.sign(advert.payload(), ec.ECDSA(hashes.SHA256()))
    return dataclasses.replace(advert, signature=sig)


def _check_identity(advert: KeyAdvert, cert_pem: bytes, ca_pem: bytes, now: dt.datetime | None) -> None:
    """The advert's signature verifies under a certificate the run's CA issued to its region."""
    try:
        cert, ca = x509.load_pem_x509_certificate(cert_pem), x509.load_pem_x509_certificate(ca_pem)
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise SecAggError("bad_signature", f"{advert.region}'s certificate is not issued by the run's CA ({exc})") from None
    named = certificate_region(cert_pem)
    if named != advert.region:
        raise SecAggError("bad_signature", f"an advert for {advert.region!r} comes with {named!r}'s certificate")
    now = now or dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise SecAggError("bad_signature", f"{advert.region}'s certificate is not valid now")
    try:
        cert.public_key().verify(advert.signature, advert.payload(), ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError, TypeError):
        raise SecAggError("bad_signature", f"{advert.region}'s key advert is not signed by its TLS key") from None


@dataclass
class KeyBook:
    """The public keys a region has accepted, per peer: a key seen in an earlier round is a
    replay (every round's key is fresh), as is an advert for a round before the newest accepted.
    The last MAX_KEYS keys per peer are kept (older rounds are refused by their round anyway)."""

    MAX_KEYS = 4096
    keys: dict[str, dict[bytes, None]] = field(default_factory=dict)  # an insertion-ordered set
    newest: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # region -> (round, its key)

    def accept(self, advert: KeyAdvert) -> None:
        if self.newest.get(advert.region) == (advert.round, advert.public_key):
            return  # the same advert delivered twice (a retried push)
        seen = self.keys.setdefault(advert.region, {})
        if advert.public_key in seen:
            raise SecAggError("replayed_key", f"{advert.region}'s public key for round {advert.round} "
                                              "was already used in an earlier round")
        last = self.newest.get(advert.region, (-1, b""))[0]
        if advert.round <= last:
            raise SecAggError("replayed_key", f"{advert.region} already advertised a key for round {last}; "
                                              f"got another for round {advert.round}")
        seen[advert.public_key] = None
        if len(seen) > self.MAX_KEYS:
            del seen[next(iter(seen))]
        self.newest[advert.region] = (advert.round, advert.public_key)

    def state(self) -> dict:
        """For a region's checkpoint: the keys (hex) and the newest round per peer."""
        return {r: {"keys": [k.hex() for k in ks], "newest": self.newest.get(r, (-1, b""))[0]}
                for r, ks in self.keys.items()}

    @classmethod
    def from_state(cls, state: dict) -> KeyBook:
        book = cls()
        for region, d in state.items():
            keys = [bytes.fromhex(k) for k in d["keys"]]
            book.keys[region] = dict.fromkeys(keys)
            if keys:
                book.newest[region] = (int(d["newest"]), keys[-1])
        return book
