"""Issue 22, secure aggregation (p2p/secagg.py, secmask.py, shamir.py): the masks cancel exactly,
a masked update looks uniform, a dropped region's masks are recovered from Shamir shares, and a
wrong share, a replayed key or an advert signed by the wrong identity are refused with a reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from geofed.p2p import secmask, shamir
from geofed.p2p.secagg import (
    KeyBook, RoundContext, RoundSecrets, SecAggError, ShareHolder, default_threshold, mask_update,
    recover_secret, sign_advert, unmask_sum, verify_advert,
)
from geofed.p2p.tls import load_tls, make_pki

REGIONS = ("ap-northeast-1", "eu-central-1", "eu-west-1", "us-east-1")


def _round(round=0, bits=32, regions=REGIONS, pki=None):
    ctx = RoundContext(run_id="run-a", round=round, regions=regions, threshold=default_threshold(len(regions)),
                       bits=bits)
    keys = pki or {}
    mine = {r: RoundSecrets.generate(ctx, r, tls_key_pem=keys.get(r)) for r in ctx.regions}
    adverts = {r: s.advert for r, s in mine.items()}
    return ctx, mine, adverts


def _updates(n, size=1000, levels=127, seed=0):
    rng = np.random.default_rng(seed)
    return {r: rng.integers(-levels, levels + 1, size=size) for r in REGIONS[:n]}


def _holders(ctx, mine, adverts):
    holders = {r: ShareHolder(ctx, r, adverts) for r in ctx.regions}
    for dealer in ctx.regions:
        for holder, bundle in mine[dealer].bundles.items():
            holders[holder].receive(bundle)
    return holders


def _recover(ctx, adverts, holders, survivors, dropped):
    """Every survivor reveals; each secret is rebuilt from the revealed shares."""
    revealed = {h: holders[h].reveal(survivors=survivors, dropped=dropped) for h in survivors}
    out = {"seed": {}, "key": {}}
    for (kind, dealers) in (("seed", survivors), ("key", dropped)):
        for d in dealers:
            shares = {h: r[(d, kind)] for h, r in revealed.items() if (d, kind) in r}
            out[kind][d] = recover_secret(ctx, adverts[d], kind, shares)
    return out["seed"], out["key"]


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_the_masks_cancel_exactly_in_the_sum(bits):
    ctx, mine, adverts = _round(bits=bits)
    levels = secmask.levels_for(len(REGIONS), bits)
    x = _updates(4, levels=levels)
    masked = {r: mask_update(mine[r], adverts, x[r]) for r in REGIONS}
    seeds = {r: mine[r].self_seed for r in REGIONS}
    total = unmask_sum(ctx, masked, adverts, self_seeds=seeds, dropped_keys={})
    assert np.array_equal(total, sum(x.values()))
    # The pairwise masks alone cancel: the raw ring sum is the plain sum plus the self masks only.
    raw = secmask.ring_sum(masked.values(), bits)
    for r in REGIONS:
        key = secmask.self_seed_key(seeds[r], run_id="run-a", round=0, region=r)
        raw = raw - secmask.keystream(key, raw.size, bits)
    assert np.array_equal(secmask.from_ring(raw, bits), sum(x.values()))


def test_a_masked_update_looks_uniform_and_unlike_the_plain_one():
    ctx, mine, adverts = _round()
    plain = np.zeros(200_000, dtype=np.int64)  # the most structured input there is
    y = mask_update(mine[REGIONS[0]], adverts, plain)
    assert y.dtype == np.uint32 and np.count_nonzero(y == 0) <= 2
    # Byte histogram of a uniform stream: chi-square with 255 dof stays far below 400.
    counts = np.bincount(y.view(np.uint8), minlength=256)
    expected = y.nbytes / 256
    assert ((counts - expected) ** 2 / expected).sum() < 400
    assert abs(float(y.mean()) / 2**32 - 0.5) < 0.01
    # Two regions masking the same values send unrelated vectors.
    z = mask_update(mine[REGIONS[1]], adverts, plain)
    assert np.count_nonzero(y == z) < 5


def test_a_peer_that_strips_its_own_pair_masks_still_sees_noise():
    """What one curious receiver can do with one peer's masked update: remove the masks it shares
    with that peer. The masks the peer shares with the others (and its self mask) remain."""
    ctx, mine, adverts = _round()
    a, b = REGIONS[0], REGIONS[1]
    plain = np.full(50_000, 7, dtype=np.int64)
    y = mask_update(mine[a], adverts, plain)
    seed = secmask.pair_seed(mine[b].mask_key, adverts[a].public_key, run_id="run-a", round=0, me=b, peer=a)
    stripped = y - secmask.pair_sign(a, b) * secmask.keystream(seed, y.size, 32).astype(np.int64)
    stripped = secmask.from_ring(stripped.astype(np.uint32), 32)
    assert np.count_nonzero(stripped == 7) < 5


@pytest.mark.parametrize("dropped", [{"eu-west-1"}, {"ap-northeast-1"}])
def test_a_dropped_regions_masks_are_recovered_and_the_survivors_sum_is_exact(dropped):
    ctx, mine, adverts = _round(regions=REGIONS + ("sa-east-1",))
    x = {r: np.random.default_rng(i).integers(-127, 128, 3000) for i, r in enumerate(ctx.regions)}
    survivors = set(ctx.regions) - dropped
    masked = {r: mask_update(mine[r], adverts, x[r]) for r in survivors}  # the dropped never sent
    holders = _holders(ctx, mine, adverts)
    seeds, keys = _recover(ctx, adverts, holders, survivors, dropped)
    assert seeds == {r: mine[r].self_seed for r in survivors}
    total = unmask_sum(ctx, masked, adverts, self_seeds=seeds, dropped_keys=keys)
    assert np.array_equal(total, sum(x[r] for r in survivors))
    # Without removing the dropped region's pair masks the sum is garbage.
    wrong = unmask_sum(ctx, {**masked}, adverts, self_seeds=seeds, dropped_keys={d: bytes(32) for d in dropped})
    assert not np.array_equal(wrong, total)


def test_a_wrong_share_is_refused_naming_its_holder():
    ctx, mine, adverts = _round()
    dealer = REGIONS[2]
    shares = {h: b.shares[0] for h, b in mine[dealer].bundles.items()}
    assert recover_secret(ctx, adverts[dealer], "key", shares) == mine[dealer].mask_key.private_bytes_raw()
    liar = REGIONS[0]
    shares[liar] = shamir.Share(x=shares[liar].x, y=(shares[liar].y + 1) % shamir.PRIME)
    with pytest.raises(SecAggError) as exc:
        recover_secret(ctx, adverts[dealer], "key", shares)
    assert exc.value.reason == "wrong_share" and liar in str(exc.value)
    # A share for the wrong index, and a bundle tampered on its way, are refused the same way.
    holder = ShareHolder(ctx, liar, adverts)
    bundle = mine[dealer].bundles[liar]
    bad = dataclasses.replace(bundle, shares=(bundle.shares[0], mine[dealer].bundles[REGIONS[1]].shares[1]))
    with pytest.raises(SecAggError, match="wrong_share"):
        holder.receive(bad)


def test_too_few_shares_are_refused():
    ctx, mine, adverts = _round()
    dealer = REGIONS[0]
    shares = dict(list({h: b.shares[1] for h, b in mine[dealer].bundles.items()}.items())[: ctx.threshold - 1])
    with pytest.raises(SecAggError) as exc:
        recover_secret(ctx, adverts[dealer], "seed", shares)
    assert exc.value.reason == "too_few_shares"


def test_a_holder_never_reveals_both_secrets_of_one_region():
    """Double masking's rule: a region revealed as a survivor (seed) is never revealed as dropped
    (key), or its late update could be unmasked."""
    ctx, mine, adverts = _round()
    holders = _holders(ctx, mine, adverts)
    h = holders[REGIONS[0]]
    h.reveal(survivors=set(REGIONS[:3]), dropped={REGIONS[3]})
    with pytest.raises(SecAggError) as exc:
        h.reveal(survivors={REGIONS[0], REGIONS[2], REGIONS[3]}, dropped={REGIONS[1]})
    assert exc.value.reason == "reveal_conflict"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    make_pki(d, REGIONS + ("mallory",))
    return {r: load_tls(d, r) for r in REGIONS + ("mallory",)}


def test_signed_adverts_verify_against_the_regions_certificates(pki):
    ctx, mine, adverts = _round(pki={r: pki[r].key_pem for r in REGIONS})
    book = KeyBook()
    for r in REGIONS:
        verify_advert(adverts[r], ctx, book=book, cert_pem=pki[r].cert_pem, ca_pem=pki[r].ca_pem)
    a = REGIONS[0]
    cases = {
        "unsigned": dataclasses.replace(adverts[a], signature=b""),
        "key swapped": dataclasses.replace(adverts[a], public_key=adverts[REGIONS[1]].public_key),
    }
    for name, advert in cases.items():
        with pytest.raises(SecAggError) as exc:
            verify_advert(advert, ctx, book=KeyBook(), cert_pem=pki[a].cert_pem, ca_pem=pki[a].ca_pem)
        assert exc.value.reason == "bad_signature", name
    # Another identity of the same CA signing for region a: the certificate names someone else.
    forged = RoundSecrets.generate(ctx, a, tls_key_pem=pki["mallory"].key_pem).advert
    with pytest.raises(SecAggError, match="mallory"):
        verify_advert(forged, ctx, book=KeyBook(), cert_pem=pki["mallory"].cert_pem, ca_pem=pki[a].ca_pem)


def test_a_replayed_key_is_refused(pki):
    keys = {r: pki[r].key_pem for r in REGIONS}
    ctx0, _, adverts0 = _round(round=3, pki=keys)
    ctx1, _, adverts1 = _round(round=4, pki=keys)
    a = REGIONS[0]
    book = KeyBook()
    tls = dict(cert_pem=pki[a].cert_pem, ca_pem=pki[a].ca_pem)
    verify_advert(adverts0[a], ctx0, book=book, **tls)
    verify_advert(adverts0[a], ctx0, book=book, **tls)  # the same advert delivered twice: fine
    verify_advert(adverts1[a], ctx1, book=book, **tls)
    with pytest.raises(SecAggError) as exc:  # round 3's advert replayed in round 4
        verify_advert(adverts0[a], ctx1, book=book, **tls)
    assert exc.value.reason == "replayed_key"
    # A region re-signing an old key for a new round is a replay too.
    ctx2 = dataclasses.replace(ctx1, round=5)
    reused = dataclasses.replace(adverts0[a], round=5)

    with pytest.raises(SecAggError) as exc:
        verify_advert(sign_advert(reused, keys[a]), ctx2, book=book, **tls)
    assert exc.value.reason == "replayed_key"
    with pytest.raises(SecAggError) as exc:
        verify_advert(dataclasses.replace(adverts0[a], run_id="other"), ctx0, book=KeyBook())
    assert exc.value.reason == "wrong_run"


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


def test_shamir_reconstructs_from_any_threshold_subset():
    secret = bytes(range(32))
    shares = shamir.split(secret, threshold=3, holders=5)
    for subset in ([0, 1, 2], [4, 2, 0], [1, 3, 4, 0]):
        assert shamir.combine([shares[i] for i in subset], threshold=3, secret_bytes=32) == secret
    assert shamir.Share.from_bytes(shares[0].to_bytes()) == shares[0]
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(secret, threshold=1, holders=5)


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


def test_context_refuses_too_few_regions_and_bad_thresholds():
    with pytest.raises(ValueError, match=">= 3"):
        RoundContext(run_id="r", round=0, regions=("a", "b"), threshold=2)
    with pytest.raises(ValueError, match="threshold"):
        RoundContext(run_id="r", round=0, regions=("a", "b", "c"), threshold=3)
    with pytest.raises(ValueError, match="bits"):
        RoundContext(run_id="r", round=0, regions=("a", "b", "c"), threshold=2, bits=12)


def test_the_key_book_survives_a_checkpoint_and_stays_bounded():
    ctx, _, adverts = _round(round=2)
    book = KeyBook()
    for a in adverts.values():
        book.accept(a)
    again = KeyBook.from_state(book.state())
    with pytest.raises(SecAggError, match="replayed_key"):
        again.accept(dataclasses.replace(adverts[REGIONS[0]], round=3))  # an old key in a later round
    small = KeyBook()
    small.MAX_KEYS = 3
    for r in range(5):
        small.accept(_round(round=r)[2][REGIONS[0]])
    assert len(small.keys[REGIONS[0]]) == 3 and small.newest[REGIONS[0]][0] == 4
