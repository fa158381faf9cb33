"""Issue 22: SecAggSession, one region's secure-aggregation round over bytes, as the DiLoCo
exchange would drive it: bundles that race ahead of adverts, a region dropping after its shares,
float updates through the shared-scale quantiser, and the refusals a hostile peer meets."""

from __future__ import annotations

import numpy as np
import pytest

from geofed.p2p import secmask
from geofed.p2p.secagg import KeyBook, RoundContext, SecAggError
from geofed.p2p.secagg_session import SecAggSession
from geofed.p2p.tls import load_tls, make_pki

REGIONS = ("ap-northeast-1", "eu-central-1", "eu-west-1", "sa-east-1", "us-east-1")
NUMEL, CHUNK = 2000, 128


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    make_pki(d, REGIONS)
    return {r: load_tls(d, r) for r in REGIONS}


def _sessions(tls, round=0, books=None):
    ctx = RoundContext(run_id="run-s", round=round, regions=REGIONS, threshold=3)
    books = books or {r: KeyBook() for r in REGIONS}
    return {r: SecAggSession(ctx, r, book=books[r], numel=NUMEL, tls_key_pem=tls[r].key_pem,
                             cert_pem=tls[r].cert_pem, ca_pem=tls[r].ca_pem) for r in REGIONS}, books


def _keys_and_shares(s):
    for a in s.values():  # bundles first: they may overtake the adverts on the wire
        for b in s.values():
            if a is not b:
                b.on_bundle(a.me, a.bundle_bytes(b.me))
    for a in s.values():
        for b in s.values():
            if a is not b:
                b.on_advert(a.me, a.advert_bytes())


@pytest.mark.parametrize("dropped", [(), ("eu-west-1",), ("ap-northeast-1", "us-east-1")])
def test_sessions_sum_float_updates_through_the_shared_grid(tls, dropped):
    s, _ = _sessions(tls)
    _keys_and_shares(s)
    rng = np.random.default_rng(2)
    floats = {r: rng.normal(size=NUMEL).astype(np.float32) for r in REGIONS}
    levels = secmask.levels_for(len(REGIONS), 32)
    scales = secmask.shared_scales([secmask.chunk_absmax(x, CHUNK) for x in floats.values()], levels)
    q = {r: secmask.quantize(x, scales, chunk=CHUNK, levels=levels) for r, x in floats.items()}
    survivors = [r for r in REGIONS if r not in dropped]
    for a in survivors:
        payload = s[a].masked_bytes(q[a])
        for b in survivors:
            if b != a:
                s[b].on_masked(a, payload)
    reveals = {a: s[a].reveal_bytes(survivors) for a in survivors}
    for a in survivors:
        for b in survivors:
            if b != a:
                s[b].on_reveal(a, reveals[a])
    for b in survivors:
        total = s[b].total()
        assert np.array_equal(total, sum(q[r] for r in survivors))
        mean = secmask.dequantize(total, scales, chunk=CHUNK) / len(survivors)
        exact = sum(floats[r] for r in survivors) / len(survivors)
        assert float(np.abs(mean - exact).max()) <= float(scales.max()) / 2 + 1e-6


def test_a_second_different_advert_and_a_foreign_one_are_refused(tls):
    s, books = _sessions(tls)
    a, b, c = REGIONS[:3]
    s[b].on_advert(a, s[a].advert_bytes())
    s[b].on_advert(a, s[a].advert_bytes())  # retried push: fine
    other, _ = _sessions(tls, books={r: KeyBook() for r in REGIONS})
    with pytest.raises(SecAggError) as exc:
        s[b].on_advert(a, other[a].advert_bytes())
    assert exc.value.reason == "replayed_key"
    with pytest.raises(SecAggError) as exc:  # c forwarding a's advert as its own
        s[b].on_advert(c, s[a].advert_bytes())
    assert exc.value.reason == "unknown_region"


def test_next_rounds_session_refuses_the_last_rounds_advert(tls):
    s0, books = _sessions(tls, round=4)
    _keys_and_shares(s0)
    s1, _ = _sessions(tls, round=5, books=books)
    a, b = REGIONS[:2]
    with pytest.raises(SecAggError) as exc:
        s1[b].on_advert(a, s0[a].advert_bytes())
    assert exc.value.reason == "replayed_key"
    s1[b].on_advert(a, s1[a].advert_bytes())


def test_masking_needs_every_key_and_late_updates_are_refused(tls):
    s, _ = _sessions(tls)
    a, b = REGIONS[:2]
    with pytest.raises(SecAggError, match="too_few_shares"):
        s[a].masked_bytes(np.zeros(NUMEL, np.int64))
    _keys_and_shares(s)
    payload = s[a].masked_bytes(np.zeros(NUMEL, np.int64))
    s[b].reveal_bytes([r for r in REGIONS if r != a])
    with pytest.raises(SecAggError) as exc:  # a declared dropped: its update is not taken any more
        s[b].on_masked(a, payload)
    assert exc.value.reason == "wrong_round"
