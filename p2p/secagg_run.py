"""Secure aggregation with keys per run, for geofed's peer-to-peer round (docs/privacy.md,
"In the round"). A per-round protocol (fresh keys and Shamir shares every round, deleted in issue
40) cost ~1.9 KB per link and round with its certificate; here the key material crosses each link
once per run, and a round costs two small messages per link besides the masked update.

* **Keys, once**: each region's X25519 key and a 32-byte self secret, its `KeyAdvert` (no share
  commitments) signed with its TLS key and checked against the run's CA (`verify_run_advert`).
  A region that restarts makes new keys; the `KeyBook` refuses older adverts and reused keys.
* **Masks, per round**: the pair seed of i and j is HKDF of their X25519 secret bound to the run
  and the round (p2p/secmask.py), so every round's masks are fresh; the self mask's key is HKDF
  of the self secret bound to the round (revealing it reveals no other round).
* **Unmasking** (`unmask_total`): region i's round self key reaches a peer only if that peer
  acknowledged its masked update (KEY), or rebuilt from XOR shares that only the peers that counted
  its masked update relay (p2p/secagg_relay.py: possible only when every peer counted it); the dropped regions' pairwise masks are removed with the pair
  seeds that the survivors hold themselves (each survivor is one end of each of its pairs), which
  a survivor reveals only to a region that asks for them and only for a region whose masked
  update it did not get either. Shamir's t-of-n is not needed for that: the seed a survivor
  reveals is its own, round-bound one; the dropped region's key stays secret and it keeps its
  keys for later rounds.
"""

from __future__ import annotations

import hashlib
import secrets as _secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from . import secmask
from .secagg import KeyAdvert, KeyBook, SecAggError, _check_identity, sign_advert
from .secagg_wire import _int, _pack, _text, _unpack

RUN_REVEAL, RUN_RECOVER = 5, 6  # message types next to secagg_wire's


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
        return cls(run_id=run_id, region=region, mask_key=key, self_secret=_secrets.token_bytes(32), advert=advert)

    def pair_seed(self, peer: str, peer_public: bytes, round: int) -> bytes:
        return secmask.pair_seed(self.mask_key, peer_public, run_id=self.run_id, round=round, me=self.region, peer=peer)

    def self_key(self, round: int) -> bytes:
        return secmask.self_seed_key(self.self_secret, run_id=self.run_id, round=round, region=self.region)


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


def mask_values(keys: RunKeys, publics: Mapping[str, bytes], values: np.ndarray, *, round: int,
                bits: int) -> np.ndarray:
    """`values` plus the pairwise masks with every region in `publics` (the round's other regions)
    and the round's self mask, in Z_2^bits."""
    seeds = {peer: keys.pair_seed(peer, pub, round) for peer, pub in publics.items()}
    return secmask.mask(values, me=keys.region, pair_seeds=seeds, self_key=keys.self_key(round), bits=bits)


def unmask_total(masked: Mapping[str, np.ndarray], *, self_keys: Mapping[str, bytes],
                 dropped_seeds: Mapping[tuple[str, str], bytes], bits: int) -> np.ndarray:
    """The int64 sum of the survivors' (`masked`'s) values: their self masks removed with their
    round's self keys, and the mask each survivor s shared with each dropped d removed with the
    pair seed `dropped_seeds[(s, d)]` (s added it with pair_sign(s, d))."""
    if set(self_keys) != set(masked):
        raise SecAggError("too_few_shares", f"self keys of {sorted(self_keys)}, survivors {sorted(masked)}")
    total = secmask.ring_sum(masked.values(), bits)
    n = total.size
    for s in sorted(masked):
        np.subtract(total, secmask.keystream(self_keys[s], n, bits), out=total)
    for (s, d), seed in sorted(dropped_seeds.items()):
        if s not in masked or d in masked:
            raise SecAggError("reveal_conflict", f"a pair seed of {s} and {d}: {s} must survive, {d} be dropped")
        stream = secmask.keystream(seed, n, bits)
        (np.subtract if secmask.pair_sign(s, d) > 0 else np.add)(total, stream, out=total)
    return secmask.from_ring(total, bits)


def digest(*arrays: np.ndarray) -> bytes:
    """What two regions compare to know they used one grid (the shared scales)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()[:16]


# ---- the two per-round messages ------------------------------------------------------------

def encode_reveal(run_id: str, round: int, region: str, *, self_key: bytes, survivors: Iterable[str],
                  grid: bytes) -> bytes:
    """A region's reveal to one peer: its round's self key (empty for a peer that did not
    acknowledge its masked update), the survivors it saw and the digest of its grid."""
    return _pack(RUN_REVEAL, [run_id.encode(), round.to_bytes(8, "big"), region.encode(), self_key, grid,
                              *(s.encode() for s in sorted(survivors))])


def decode_reveal(data: bytes | memoryview) -> tuple[str, int, str, bytes, frozenset[str], bytes]:
    """(run id, round, region, self key or b"", survivors, grid digest)."""
    f = _unpack(data, RUN_REVEAL)
    if len(f) < 5 or len(f[3]) not in (0, 32) or len(f[4]) != 16:
        raise SecAggError("malformed", "a reveal is run, round, region, a 32-byte key or none, a grid digest, survivors")
    return _text(f[0]), _int(f[1]), _text(f[2]), f[3], frozenset(_text(s) for s in f[5:]), f[4]


def encode_recover(run_id: str, round: int, region: str, seeds: Mapping[str, bytes]) -> bytes:
    """A survivor's answer to a region that lost some masked updates: its pair seed with each
    dropped region it also lost (regions it did get are left out: it will not help unmask them)."""
    fields = [run_id.encode(), round.to_bytes(8, "big"), region.encode()]
    for d, seed in sorted(seeds.items()):
        fields += [d.encode(), seed]
    return _pack(RUN_RECOVER, fields)


def decode_recover(data: bytes | memoryview) -> tuple[str, int, str, dict[str, bytes]]:
    """(run id, round, region, {dropped region: the pair seed})."""
    f = _unpack(data, RUN_RECOVER)
    if len(f) < 3 or (len(f) - 3) % 2 or any(len(f[i]) != 32 for i in range(4, len(f), 2)):
        raise SecAggError("malformed", "a recovery answer is run, round, region, then (dropped, 32-byte seed) pairs")
    return _text(f[0]), _int(f[1]), _text(f[2]), {_text(f[i]): f[i + 1] for i in range(3, len(f), 2)}
