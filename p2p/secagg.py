"""Secure aggregation for the full-topology exchange: per-round keys, their authentication by the
run's mTLS identities, Shamir shares for dropout recovery, and the masking/unmasking of a round
(docs/privacy.md has the protocol and the threat model; the arithmetic is p2p/secmask.py).

One round, per region i (pure functions here; the transport carries the messages):
  1. `RoundSecrets.generate`: a fresh X25519 key, a fresh self-mask seed, t-of-n Shamir shares of
     both for the peers, and a `KeyAdvert` (public key + a hash commitment to every share) signed
     with i's TLS key. Peers check it with `verify_advert` (CA, certificate name, signature, run,
     round, key never seen before) and their share with `ShareHolder.receive`.
  2. `mask_update`: i's quantised update plus pairwise and self masks, pushed to every peer.
  3. Once the round's survivors are fixed, every holder `reveal`s its shares: of each survivor's
     self seed, of each dropped region's key, never both for one region. `recover_secret`
     checks each share against its signed commitment and rebuilds the secrets; `unmask_sum` gives
     the exact integer sum of the survivors' updates.
Refusals are `SecAggError`s with a short `reason` (REASONS), to be counted like the transport's.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import secrets as _secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from . import secmask, shamir
from .tls import certificate_region

REASONS = ("wrong_run", "wrong_round", "replayed_key", "bad_signature", "unknown_region", "malformed",
           "wrong_share", "too_few_shares", "reveal_conflict", "wrong_grid")
KINDS = ("key", "seed")  # the two secrets a region shares: its X25519 key and its self-mask seed


class SecAggError(ValueError):
    """A refused secure-aggregation input; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class RoundContext:
    """What every region agrees on before a round: the run, the round, the regions (sorted: a
    region's share index is its position + 1), the recovery threshold and the mask ring."""

    run_id: str
    round: int
    regions: tuple[str, ...]
    threshold: int
    bits: int = 32

    def __post_init__(self):
        object.__setattr__(self, "regions", tuple(sorted(self.regions)))
        n = len(self.regions)
        if len(set(self.regions)) != n or n < 3:
            # With two regions the sum and one's own update give the other's: nothing to hide.
            raise ValueError(f"regions: secure aggregation needs >= 3 distinct regions, got {n}")
        if not 2 <= self.threshold <= n - 1:
            raise ValueError(f"threshold: must be in [2, {n - 1}] for {n} regions, got {self.threshold}")
        if self.round < 0:
            raise ValueError(f"round: must be >= 0, got {self.round}")
        secmask.ring_dtype(self.bits)

    def index(self, region: str) -> int:
        if region not in self.regions:
            raise SecAggError("unknown_region", f"{region!r} is not a region of this run")
        return self.regions.index(region) + 1


def default_threshold(regions: int) -> int:
    """A majority of the regions (at least 2, at most n - 1): fewer colluders than this learn
    nothing of an honest region's secrets; up to n - threshold regions may drop per round."""
    return min(regions - 1, max(2, regions // 2 + 1))


def _commitment(ctx: RoundContext, dealer: str, holder: str, kind: str, share: shamir.Share) -> bytes:
    data = b"|".join([b"geofed-secagg-share-v1", ctx.run_id.encode(), str(ctx.round).encode(),
                      dealer.encode(), holder.encode(), kind.encode(), share.to_bytes()])
    return hashlib.sha256(data).digest()


@dataclass(frozen=True, kw_only=True)
class KeyAdvert:
    """A region's public key for one round and the commitments to the shares it dealt (per kind,
    one per region in `RoundContext.regions` order, its own included), signed with its TLS key."""

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


@dataclass(frozen=True, kw_only=True)
class ShareBundle:
    """What a dealer sends one holder (over the mTLS channel): its shares of both secrets."""

    run_id: str
    round: int
    dealer: str
    holder: str
    shares: tuple[shamir.Share, shamir.Share]  # (key, seed)


@dataclass(frozen=True, kw_only=True, repr=False)
class RoundSecrets:
    """One region's secrets for one round; never leaves the region (the bundles go to holders)."""

    ctx: RoundContext
    region: str
    mask_key: X25519PrivateKey
    self_seed: bytes
    bundles: Mapping[str, ShareBundle]
    advert: KeyAdvert

    def __repr__(self) -> str:  # never print a secret
        return f"RoundSecrets(region={self.region!r}, round={self.ctx.round})"

    @classmethod
    def generate(cls, ctx: RoundContext, region: str, *, tls_key_pem: bytes | None = None) -> RoundSecrets:
        """Fresh secrets for `region` this round, dealt to its peers; the advert signed when a TLS key is given."""
        ctx.index(region)
        key, seed = X25519PrivateKey.generate(), _secrets.token_bytes(32)
        raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
        n = len(ctx.regions)
        dealt = [shamir.split(raw, threshold=ctx.threshold, holders=n),
                 shamir.split(seed, threshold=ctx.threshold, holders=n)]
        bundles, commitments = {}, ([], [])
        for pos, holder in enumerate(ctx.regions):
            pair = (dealt[0][pos], dealt[1][pos])
            for k, kind in enumerate(KINDS):
                commitments[k].append(_commitment(ctx, region, holder, kind, pair[k]))
            # The dealer holds a point of its own too: a survivor's seed is then rebuilt from the
            # survivors' shares alone (its own among them) while up to n - t regions are missing.
            bundles[holder] = ShareBundle(run_id=ctx.run_id, round=ctx.round, dealer=region, holder=holder,
                                          shares=pair)
        public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        advert = KeyAdvert(run_id=ctx.run_id, round=ctx.round, region=region, public_key=public,
                           commitments=(tuple(commitments[0]), tuple(commitments[1])))
        if tls_key_pem is not None:
            advert = sign_advert(advert, tls_key_pem)
        return cls(ctx=ctx, region=region, mask_key=key, self_seed=seed, bundles=bundles, advert=advert)


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


def verify_advert(advert: KeyAdvert, ctx: RoundContext, *, book: KeyBook, cert_pem: bytes | None = None,
                  ca_pem: bytes | None = None, now: dt.datetime | None = None) -> None:
    """Refuse (SecAggError) an advert that is not this run's and this round's, is malformed, is not
    signed by its region's certificate (when `cert_pem`/`ca_pem` are given: TLS runs), or replays a key."""
    if advert.run_id != ctx.run_id:
        raise SecAggError("wrong_run", f"{advert.region}'s advert is for run {advert.run_id!r}")
    if advert.round < ctx.round:
        raise SecAggError("replayed_key", f"{advert.region}'s advert is for round {advert.round}, an earlier "
                                          f"round than {ctx.round}")
    if advert.round != ctx.round:
        raise SecAggError("wrong_round", f"{advert.region}'s advert is for round {advert.round}, not {ctx.round}")
    ctx.index(advert.region)
    n = len(ctx.regions)
    if len(advert.public_key) != 32 or any(len(c) != n or any(len(h) != 32 for h in c) for c in advert.commitments):
        raise SecAggError("malformed", f"{advert.region}'s advert holds a {len(advert.public_key)}-byte key "
                                       f"or commitments for other than {n} regions")
    if (cert_pem is None) != (ca_pem is None):
        raise ValueError("cert_pem and ca_pem: give both (TLS runs) or neither")
    if cert_pem is not None:
        _check_identity(advert, cert_pem, ca_pem, now)
    book.accept(advert)


# ---- shares --------------------------------------------------------------------------------

def _check_share(ctx: RoundContext, advert: KeyAdvert, holder: str, kind: str, share: shamir.Share) -> None:
    want = advert.commitments[KINDS.index(kind)][ctx.index(holder) - 1]
    if share.x != ctx.index(holder) or _commitment(ctx, advert.region, holder, kind, share) != want:
        raise SecAggError("wrong_share", f"{holder}'s share of {advert.region}'s {kind} does not match the "
                                         "commitment its dealer signed")


class ShareHolder:
    """One region's view of the shares it holds this round; reveals each dealer's shares of at
    most one kind (a region revealed as a survivor is never also revealed as dropped)."""

    def __init__(self, ctx: RoundContext, me: str, adverts: Mapping[str, KeyAdvert]):
        self.ctx, self.me, self.adverts = ctx, me, dict(adverts)
        self.held: dict[str, ShareBundle] = {}
        self.revealed: dict[str, str] = {}  # dealer -> the kind revealed

    def receive(self, bundle: ShareBundle) -> None:
        if (bundle.run_id, bundle.round) != (self.ctx.run_id, self.ctx.round):
            raise SecAggError("wrong_round", f"{bundle.dealer}'s shares are for round {bundle.round}")
        if bundle.holder != self.me or bundle.dealer not in self.adverts:
            raise SecAggError("unknown_region", f"shares from {bundle.dealer!r} for {bundle.holder!r}")
        for kind, share in zip(KINDS, bundle.shares):
            _check_share(self.ctx, self.adverts[bundle.dealer], self.me, kind, share)
        self.held[bundle.dealer] = bundle

    def reveal(self, *, survivors: set[str], dropped: set[str]) -> dict[tuple[str, str], shamir.Share]:
        """(dealer, kind) -> share: seed shares of survivors, key shares of the dropped."""
        if survivors & dropped:
            raise SecAggError("reveal_conflict", f"{sorted(survivors & dropped)} both survived and dropped")
        out = {}
        for dealers, kind in ((survivors, "seed"), (dropped, "key")):
            for dealer in sorted(dealers):
                if self.revealed.setdefault(dealer, kind) != kind:
                    raise SecAggError("reveal_conflict", f"{dealer}'s {self.revealed[dealer]} share was already "
                                                         f"revealed this round; its {kind} share never will be")
                if dealer in self.held:
                    out[(dealer, kind)] = self.held[dealer].shares[KINDS.index(kind)]
        return out


def recover_secret(ctx: RoundContext, advert: KeyAdvert, kind: str, shares: Mapping[str, shamir.Share]) -> bytes:
    """A dealer's secret (its X25519 private key, or its self seed) from holder -> share; every
    share is checked against the dealer's signed commitment, a key against its public key."""
    for holder, share in shares.items():
        _check_share(ctx, advert, holder, kind, share)
    if len(shares) < ctx.threshold:
        raise SecAggError("too_few_shares", f"{len(shares)} shares of {advert.region}'s {kind}, "
                                            f"{ctx.threshold} needed")
    try:
        secret = shamir.combine(list(shares.values()), threshold=ctx.threshold, secret_bytes=32)
    except ValueError as exc:
        raise SecAggError("wrong_share", f"{advert.region}'s {kind}: {exc}") from None
    if kind == "key" and _public(X25519PrivateKey.from_private_bytes(secret)) != advert.public_key:
        raise SecAggError("wrong_share", f"the key rebuilt for {advert.region} is not its advertised key")
    return secret


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# ---- masking and unmasking -----------------------------------------------------------------

def mask_update(mine: RoundSecrets, adverts: Mapping[str, KeyAdvert], values: np.ndarray) -> np.ndarray:
    """This region's integer update masked for the round (every peer's verified advert needed)."""
    ctx = mine.ctx
    seeds = {peer: secmask.pair_seed(mine.mask_key, adverts[peer].public_key, run_id=ctx.run_id, round=ctx.round,
                                     me=mine.region, peer=peer)
             for peer in ctx.regions if peer != mine.region}
    self_key = secmask.self_seed_key(mine.self_seed, run_id=ctx.run_id, round=ctx.round, region=mine.region)
    return secmask.mask(values, me=mine.region, pair_seeds=seeds, self_key=self_key, bits=ctx.bits)


def unmask_sum(ctx: RoundContext, masked: Mapping[str, np.ndarray], adverts: Mapping[str, KeyAdvert], *,
               self_seeds: Mapping[str, bytes], dropped_keys: Mapping[str, bytes]) -> np.ndarray:
    """The exact int64 sum of the survivors' updates (the regions in `masked`): their self masks
    removed with their seeds, and the masks each survivor shared with a dropped region removed
    with that region's recovered private key."""
    survivors, dropped = set(masked), set(dropped_keys)
    if survivors & dropped or survivors | dropped != set(ctx.regions):
        raise SecAggError("reveal_conflict", f"survivors {sorted(survivors)} and dropped {sorted(dropped)} "
                                             f"must split the regions {list(ctx.regions)}")
    if set(self_seeds) != survivors:
        raise SecAggError("too_few_shares", f"self seeds for {sorted(self_seeds)}, survivors are {sorted(survivors)}")
    total = secmask.ring_sum(masked.values(), ctx.bits)
    n = total.size
    for s in sorted(survivors):
        key = secmask.self_seed_key(self_seeds[s], run_id=ctx.run_id, round=ctx.round, region=s)
        np.subtract(total, secmask.keystream(key, n, ctx.bits), out=total)
    for d in sorted(dropped):
        private = X25519PrivateKey.from_private_bytes(dropped_keys[d])
        for s in sorted(survivors):
            seed = secmask.pair_seed(private, adverts[s].public_key, run_id=ctx.run_id, round=ctx.round, me=d, peer=s)
            stream = secmask.keystream(seed, n, ctx.bits)
            # s added its mask for (s, d) with sign(s, d); take exactly that back out.
            (np.subtract if secmask.pair_sign(s, d) > 0 else np.add)(total, stream, out=total)
    return secmask.from_ring(total, ctx.bits)
