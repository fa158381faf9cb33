"""Issue 22, secure aggregation's pieces below the round (regions/secagg/keys.py, masks.py,
wire.py): the masks cancel exactly, a masked update looks uniform, a dropped
region's pair masks are removed with the survivors' own pair seeds, and an advert signed by the
wrong identity, a replayed key or a malformed message are refused with a reason. The round that
drives them is tests/unit/test_secagg_exchange.py's. (Issue 40 deleted the per-round Shamir
protocol these tests used to go through; what they check of the live code is kept here.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from geofed.regions.secagg import SecAggError
from geofed.regions.secagg import masks as secmask
from geofed.regions.secagg import wire
from geofed.regions.secagg.keys import KeyBook, RunKeys, sign_advert, verify_run_advert
from geofed.regions.secagg.masks import unmask_total
from geofed.p2p.tls import load_tls, make_pki

REGIONS = ("ap-northeast-1", "eu-central-1", "eu-west-1", "us-east-1")
RUN = "run-a"


def _keys(round=0, regions=REGIONS, pki=None):
    tls = pki or {}
    return {r: RunKeys.generate(run_id=RUN, region=r, round=round, tls_key_pem=tls.get(r)) for r in regions}


def _publics(keys, me, among=None):
    return {p: k.advert.public_key for p, k in keys.items() if p != me and (among is None or p in among)}


def _masked(keys, x, round=0, bits=32):
    return {r: keys[r].mask(x[r], _publics(keys, r), round=round, bits=bits) for r in x}


def _updates(n, size=1000, levels=127, seed=0):
    rng = np.random.default_rng(seed)
    return {r: rng.integers(-levels, levels + 1, size=size) for r in REGIONS[:n]}


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_the_masks_cancel_exactly_in_the_sum(bits):
    keys = _keys()
    levels = secmask.levels_for(len(REGIONS), bits)
    x = _updates(4, levels=levels)
    masked = _masked(keys, x, bits=bits)
    self_keys = {r: keys[r].self_key(0) for r in REGIONS}
    total = unmask_total(masked, self_keys=self_keys, dropped_seeds={}, bits=bits)
    assert np.array_equal(total, sum(x.values()))
    # The pairwise masks alone cancel: the raw ring sum is the plain sum plus the self masks only.
    raw = secmask.ring_sum(masked.values(), bits)
    for r in REGIONS:
        raw = raw - secmask.keystream(self_keys[r], raw.size, bits)
    assert np.array_equal(secmask.from_ring(raw, bits), sum(x.values()))


def test_a_masked_update_looks_uniform_and_unlike_the_plain_one():
    keys = _keys()
    plain = np.zeros(200_000, dtype=np.int64)  # the most structured input there is
    a, b = REGIONS[0], REGIONS[1]
    y = keys[a].mask(plain, _publics(keys, a), round=0, bits=32)
    assert y.dtype == np.uint32 and np.count_nonzero(y == 0) <= 2
    # Byte histogram of a uniform stream: chi-square with 255 dof stays far below 400.
    counts = np.bincount(y.view(np.uint8), minlength=256)
    expected = y.nbytes / 256
    assert ((counts - expected) ** 2 / expected).sum() < 400
    assert abs(float(y.mean()) / 2**32 - 0.5) < 0.01
    # Two regions masking the same values send unrelated vectors, and so does one region in two rounds.
    z = keys[b].mask(plain, _publics(keys, b), round=0, bits=32)
    assert np.count_nonzero(y == z) < 5
    assert np.count_nonzero(y == keys[a].mask(plain, _publics(keys, a), round=1, bits=32)) < 5


def test_a_peer_that_strips_its_own_pair_masks_still_sees_noise():
    """What one curious receiver can do with one peer's masked update: remove the masks it shares
    with that peer. The masks the peer shares with the others (and its self mask) remain."""
    keys = _keys()
    a, b = REGIONS[0], REGIONS[1]
    plain = np.full(50_000, 7, dtype=np.int64)
    y = keys[a].mask(plain, _publics(keys, a), round=0, bits=32)
    seed = keys[b].pair_seed(a, keys[a].advert.public_key, 0)
    assert seed == keys[a].pair_seed(b, keys[b].advert.public_key, 0)
    stripped = y - secmask.pair_sign(a, b) * secmask.keystream(seed, y.size, 32).astype(np.int64)
    stripped = secmask.from_ring(stripped.astype(np.uint32), 32)
    assert np.count_nonzero(stripped == 7) < 5


@pytest.mark.parametrize("dropped", [{"eu-west-1"}, {"ap-northeast-1"}])
def test_a_dropped_regions_masks_are_removed_with_the_survivors_pair_seeds(dropped):
    """A region that masked for everyone but never delivered: each survivor reveals its own pair
    seed with it (never the dropped region's key), and the survivors' sum is exact."""
    regions = REGIONS + ("sa-east-1",)
    keys = _keys(regions=regions, round=3)
    x = {r: np.random.default_rng(i).integers(-127, 128, 3000) for i, r in enumerate(regions)}
    survivors = set(regions) - dropped
    masked = {r: keys[r].mask(x[r], _publics(keys, r), round=5, bits=32) for r in survivors}
    seeds = {(s, d): keys[s].pair_seed(d, keys[d].advert.public_key, 5) for s in survivors for d in dropped}
    self_keys = {s: keys[s].self_key(5) for s in survivors}
    total = unmask_total(masked, self_keys=self_keys, dropped_seeds=seeds, bits=32)
    assert np.array_equal(total, sum(x[r] for r in survivors))
    # Without removing the dropped region's pair masks the sum is garbage.
    assert not np.array_equal(unmask_total(masked, self_keys=self_keys, dropped_seeds={}, bits=32), total)
    # A pair seed offered for a survivor as if it had dropped is refused, not summed.
    s, d = sorted(survivors)[:2]
    with pytest.raises(SecAggError) as exc:
        unmask_total(masked, self_keys=self_keys, dropped_seeds={(s, d): bytes(32)}, bits=32)
    assert exc.value.reason == "reveal_conflict"
    with pytest.raises(SecAggError) as exc:
        unmask_total(masked, self_keys={s: self_keys[s]}, dropped_seeds=seeds, bits=32)
    assert exc.value.reason == "too_few_shares"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    make_pki(d, REGIONS + ("mallory",))
    return {r: load_tls(d, r) for r in REGIONS + ("mallory",)}


def _verify(advert, pki, book, *, sender=None, cert_of=None, run_id=RUN):
    sender = sender or advert.region
    return verify_run_advert(advert, sender=sender, run_id=run_id, regions=REGIONS, book=book,
                             cert_pem=pki[cert_of or sender].cert_pem, ca_pem=pki[sender].ca_pem)


def test_signed_adverts_verify_against_the_regions_certificates(pki):
    keys = _keys(pki={r: pki[r].key_pem for r in REGIONS})
    book = KeyBook()
    for r in REGIONS:
        _verify(keys[r].advert, pki, book)
    a = REGIONS[0]
    cases = {
        "unsigned": dataclasses.replace(keys[a].advert, signature=b""),
        "key swapped": dataclasses.replace(keys[a].advert, public_key=keys[REGIONS[1]].advert.public_key),
    }
    for name, advert in cases.items():
        with pytest.raises(SecAggError) as exc:
            _verify(advert, pki, KeyBook())
        assert exc.value.reason == "bad_signature", name
    # Another identity of the same CA signing for region a: the certificate names someone else.
    forged = RunKeys.generate(run_id=RUN, region=a, round=0, tls_key_pem=pki["mallory"].key_pem).advert
    with pytest.raises(SecAggError, match="mallory"):
        _verify(forged, pki, KeyBook(), cert_of="mallory")


def test_a_replayed_or_foreign_advert_is_refused(pki):
    tls_keys = {r: pki[r].key_pem for r in REGIONS}
    a = REGIONS[0]
    old, new = _keys(round=3, pki=tls_keys)[a].advert, _keys(round=4, pki=tls_keys)[a].advert
    book = KeyBook()
    _verify(old, pki, book)
    _verify(old, pki, book)  # the same advert delivered twice: fine
    _verify(new, pki, book)  # a restarted region's new key
    with pytest.raises(SecAggError) as exc:  # the old key replayed after the new one
        _verify(old, pki, book)
    assert exc.value.reason == "replayed_key"
    # A region re-signing an old key for a later round is a replay too.
    with pytest.raises(SecAggError) as exc:
        _verify(sign_advert(dataclasses.replace(old, round=5), tls_keys[a]), pki, book)
    assert exc.value.reason == "replayed_key"
    refusals = {
        "wrong_run": dict(run_id="other"),
        "unknown_region": dict(sender=REGIONS[1]),  # a's advert pushed by another region
    }
    for reason, kw in refusals.items():
        with pytest.raises(SecAggError) as exc:
            _verify(old, pki, KeyBook(), **kw)
        assert exc.value.reason == reason
    with pytest.raises(SecAggError) as exc:  # the per-round protocol's share commitments: not this protocol's
        _verify(dataclasses.replace(old, commitments=((bytes(32),), ())), pki, KeyBook())
    assert exc.value.reason == "malformed"


def test_seeds_are_bound_to_run_round_and_pair():
    k1, k2 = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    pub = lambda k: k.public_key().public_bytes_raw()
    base = dict(run_id="r", round=1, me="a", peer="b")
    s = secmask.pair_seed(k1, pub(k2), **base)
    assert s == secmask.pair_seed(k2, pub(k1), run_id="r", round=1, me="b", peer="a")
    for change in ({"run_id": "q"}, {"round": 2}, {"peer": "c"}):
        assert secmask.pair_seed(k1, pub(k2), **{**base, **change}) != s
    with pytest.raises(ValueError, match="no shared secret"):
        secmask.pair_seed(k1, bytes(32), **base)  # a low-order point


def test_quantiser_with_shared_scales_sums_like_the_floats():
    rng = np.random.default_rng(1)
    chunk, levels = 256, secmask.levels_for(4, 32)
    xs = [rng.normal(size=1000).astype(np.float32) * (i + 1) for i in range(4)]
    scales = secmask.shared_scales([secmask.chunk_absmax(x, chunk) for x in xs], levels)
    q = [secmask.quantize(x, scales, chunk=chunk, levels=levels) for x in xs]
    assert max(int(np.abs(v).max()) for v in q) <= levels
    got = secmask.dequantize(sum(q), scales, chunk=chunk)
    per_value = np.repeat(scales, chunk)[:1000]
    assert np.all(np.abs(got - sum(xs)) <= 4 * per_value / 2 + 1e-6)  # 4 roundings of half a step at most
    assert secmask.levels_for(4, 8) == 31 and secmask.levels_for(300, 16) == 109


def test_the_ring_is_one_geofed_uses():
    for bits in (8, 16, 32):
        assert secmask.ring_dtype(bits).itemsize * 8 == bits
    with pytest.raises(ValueError, match="bits"):
        secmask.ring_dtype(12)


def test_the_key_book_stays_bounded():
    small = KeyBook()
    small.MAX_KEYS = 3
    for r in range(5):
        small.accept(_keys(round=r, regions=REGIONS[:1])[REGIONS[0]].advert)
    assert len(small.keys[REGIONS[0]]) == 3 and small.newest[REGIONS[0]][0] == 4


def test_malformed_messages_are_refused_as_malformed():
    """Moved from tests/unit/test_secagg_round.py (deleted with the per-round protocol): the live
    decoders of adverts and masked updates refuse bad bytes as SecAggError("malformed")."""
    keys = _keys()
    good = wire.encode_advert(keys[REGIONS[0]].advert)
    assert wire.decode_advert(good) == (keys[REGIONS[0]].advert, b"")
    for bad in (b"", b"GSA1", b"GSA1\x01" + b"\xff" * 8, b"XXXX\x01", wire.MAGIC + b"\x02" + (5).to_bytes(4, "big"),
                good[:-1], good[:4] + b"\x05" + good[5:]):
        with pytest.raises(SecAggError) as exc:
            wire.decode_advert(bad)
        assert exc.value.reason == "malformed"
    with pytest.raises(SecAggError, match="malformed"):
        wire.decode_masked(b"\0" * 7, numel=2, bits=32)
