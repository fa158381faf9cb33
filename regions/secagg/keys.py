"""Secure aggregation's keys: a region's X25519 key for the run and its self secret (`RunKeys`),
its key advert signed with its TLS key and checked against the run's CA (`verify_run_advert`),
the `KeyBook` that refuses a replayed or older key, and `SecAggError`, the refusal every
secure-aggregation check raises (docs/privacy.md has the protocol and the threat model).

Keys cross each link once per run: each region's `KeyAdvert` (no share commitments) is checked
against the run's CA; a region that restarts makes new keys and the `KeyBook` refuses older
adverts and reused keys. Refusals are `SecAggError`s with a short `reason` (REASONS), counted
like the transport's.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from geofed.p2p.tls import certificate_region

from . import SecAggError, masks

@dataclass(frozen=True, kw_only=True)
class KeyAdvert:
    """A region's public key for the run (`round`: the round it was issued in), signed with its
    TLS key. `commitments` is always empty (verify_run_advert refuses any other): the per-round
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
    key = cert.public_key()
    try:
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise TypeError("not an EC key")  # make_pki issues P-256 keys only
        key.verify(advert.signature, advert.payload(), ec.ECDSA(hashes.SHA256()))
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


# ---- a region's keys for the run --------------------------------------------------------

@dataclass(frozen=True, kw_only=True, repr=False)
class RunKeys:
    """One region's secrets for the run (never leave the region) and its signed advert."""

    run_id: str
    region: str
    mask_key: X25519PrivateKey
    self_secret: bytes
    advert: KeyAdvert

    def __repr__(self) -> str:  # never print a secret
        return f"RunKeys(region={self.region!r}, issued={self.advert.round})"

    @classmethod
    def generate(cls, *, run_id: str, region: str, round: int, tls_key_pem: bytes | None = None) -> RunKeys:
        key = X25519PrivateKey.generate()
        public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        advert = KeyAdvert(run_id=run_id, round=round, region=region, public_key=public, commitments=((), ()))
        if tls_key_pem is not None:
            advert = sign_advert(advert, tls_key_pem)
        return cls(run_id=run_id, region=region, mask_key=key, self_secret=secrets.token_bytes(32), advert=advert)

    def pair_seed(self, peer: str, peer_public: bytes, round: int) -> bytes:
        return masks.pair_seed(self.mask_key, peer_public, run_id=self.run_id, round=round, me=self.region, peer=peer)

    def self_key(self, round: int) -> bytes:
        return masks.self_seed_key(self.self_secret, run_id=self.run_id, round=round, region=self.region)

    def mask(self, values: np.ndarray, publics: Mapping[str, bytes], *, round: int, bits: int) -> np.ndarray:
        """`values` plus the pairwise masks with every region in `publics` (the round's other regions)
        and the round's self mask, in Z_2^bits."""
        seeds = {peer: self.pair_seed(peer, pub, round) for peer, pub in publics.items()}
        return masks.mask(values, me=self.region, pair_seeds=seeds, self_key=self.self_key(round), bits=bits)


def verify_run_advert(advert: KeyAdvert, *, sender: str, run_id: str, regions: Iterable[str], book: KeyBook,
                      cert_pem: bytes | None, ca_pem: bytes | None) -> None:
    """Refuse (SecAggError) an advert of another run or region, a malformed one, one not signed by
    its region's certificate from the run's CA (TLS runs), or an older or reused key."""
    if advert.run_id != run_id:
        raise SecAggError("wrong_run", f"{sender}'s advert is for run {advert.run_id!r}")
    if advert.region != sender or sender not in set(regions):
        raise SecAggError("unknown_region", f"an advert for {advert.region!r} pushed by {sender!r}")
    if len(advert.public_key) != 32 or advert.commitments != ((), ()):
        raise SecAggError("malformed", f"{sender}'s advert holds a {len(advert.public_key)}-byte key or share commitments")
    if ca_pem is not None:
        _check_identity(advert, cert_pem or b"", ca_pem, None)
    book.accept(advert)
