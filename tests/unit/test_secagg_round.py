"""Issue 22: one secure-aggregation round of four regions over the in-memory transport (the
mailbox, validators and refusal counters of the gRPC transport), every message in its wire bytes:
what arrives at a region never shows a peer's update, the survivors' sum is exact when a region
drops after dealing its shares, and a tampered share is refused and counted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from geofed.p2p import secagg_wire as wire
from geofed.p2p import secmask
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.p2p.secagg import (
    KeyBook, RoundContext, RoundSecrets, ShareHolder, default_threshold, mask_update, recover_secret, unmask_sum,
    verify_advert,
)
from geofed.p2p.tls import load_tls, make_pki
from geofed.p2p.transport import TransportError

REGIONS = ("ap-northeast-1", "eu-central-1", "eu-west-1", "us-east-1")
PHASES = ("advert", "bundle", "masked", "reveal")
CHUNK, NUMEL, ROUND = 64, 1000, 7


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    make_pki(d, REGIONS)
    return {r: load_tls(d, r) for r in REGIONS}


class Region:
    """One region's side of the round: a transport per phase, and what its validators saw."""

    def __init__(self, name, hubs, ctx, tls):
        self.name, self.ctx, self.tls = name, ctx, tls
        self.secrets = RoundSecrets.generate(ctx, name, tls_key_pem=tls[name].key_pem)
        self.book, self.captured = KeyBook(), {}
        self.t = {p: InMemoryTransport(name, hubs[p]) for p in PHASES}
        peers = {p: f"inmem:{p}" for p in REGIONS if p != name}
        for t in self.t.values():
            t.start()
            t.connect(peers)
            t.expect(ctx.round, set(peers))
        self.t["advert"].set_validator(self._advert)
        self.t["masked"].set_validator(self._masked)
        self.holder = None

    def _advert(self, sender, round, payload):
        advert, cert = wire.decode_advert(payload)
        if advert.region != sender:
            raise ValueError(f"an advert for {advert.region} from {sender}")
        verify_advert(advert, self.ctx, book=self.book, cert_pem=cert, ca_pem=self.tls[self.name].ca_pem)
        return advert

    def _bundle(self, sender, round, payload):
        bundle = wire.decode_bundle(payload)
        if bundle.dealer != sender:
            raise ValueError(f"shares dealt by {bundle.dealer} from {sender}")
        self.holder.receive(bundle)
        return bundle

    def _masked(self, sender, round, payload):
        self.captured[sender] = bytes(payload)  # everything a curious region keeps
        return wire.decode_masked(payload, numel=NUMEL, bits=self.ctx.bits)

    def adverts(self):
        got = dict(self.t["advert"].receive(ROUND, 0.0))
        self.adverts_in = {**got, self.name: self.secrets.advert}
        self.holder = ShareHolder(self.ctx, self.name, self.adverts_in)
        self.holder.receive(self.secrets.bundles[self.name])
        self.t["bundle"].set_validator(self._bundle)


def _send_all(regions, phase, payload_for, skip=()):
    for r in regions.values():
        for peer in REGIONS:
            if peer != r.name and r.name not in skip:
                r.t[phase].send(peer, ROUND, payload_for(r, peer), timeout_s=1.0)


def _run(tls, dropped=frozenset(), tamper=None):
    hubs = {p: InMemoryHub() for p in PHASES}
    ctx = RoundContext(run_id="run-x", round=ROUND, regions=REGIONS, threshold=default_threshold(4))
    regions = {r: Region(r, hubs, ctx, tls) for r in REGIONS}
    _send_all(regions, "advert", lambda r, peer: wire.encode_advert(r.secrets.advert, tls[r.name].cert_pem))
    for r in regions.values():
        r.adverts()
    refused = None
    if tamper is not None:  # one dealer's bundle altered on its way to one holder
        dealer, holder = tamper
        b = regions[dealer].secrets.bundles[holder]
        bad = dataclasses.replace(b, shares=(b.shares[0], dataclasses.replace(b.shares[1], y=b.shares[1].y ^ 1)))
        with pytest.raises(TransportError) as exc:
            regions[dealer].t["bundle"].send(holder, ROUND, wire.encode_bundle(bad), timeout_s=1.0)
        refused = exc.value
    _send_all(regions, "bundle", lambda r, peer: wire.encode_bundle(r.secrets.bundles[peer]),
              skip={tamper[0]} if tamper else ())
    rng = np.random.default_rng(0)
    floats = {r: rng.normal(size=NUMEL).astype(np.float32) for r in REGIONS}
    levels = secmask.levels_for(4, ctx.bits)
    scales = secmask.shared_scales([secmask.chunk_absmax(x, CHUNK) for x in floats.values()], levels)
    plain = {r: secmask.quantize(x, scales, chunk=CHUNK, levels=levels) for r, x in floats.items()}
    masked = {r: mask_update(regions[r].secrets, regions[r].adverts_in, plain[r]) for r in REGIONS}
    _send_all(regions, "masked", lambda r, peer: wire.encode_masked(masked[r.name]), skip=dropped)
    return ctx, regions, plain, masked, refused


def _finish(ctx, me, regions):
    """Region `me` after the deadline: survivors are who arrived (and itself); every survivor reveals."""
    inbox = me.t["masked"].receive(ROUND, 0.0)
    arrived = {**dict(inbox), me.name: secmask.to_ring(np.zeros(0, np.int64), ctx.bits)}
    survivors, dropped = set(arrived), set(REGIONS) - set(arrived)
    reveals = {h: wire.decode_reveal(wire.encode_reveal("run-x", ROUND, h, regions[h].holder.reveal(
        survivors=survivors, dropped=dropped)))[3] for h in survivors}
    secret = {}
    for kind, dealers in (("seed", survivors), ("key", dropped)):
        for d in dealers:
            shares = {h: rv[(d, kind)] for h, rv in reveals.items() if (d, kind) in rv}
            secret[d] = recover_secret(ctx, me.adverts_in[d], kind, shares)
    own = dict(inbox) | {me.name: mask_update(me.secrets, me.adverts_in, np.zeros(NUMEL, np.int64))}
    return inbox, unmask_sum(ctx, own, me.adverts_in, self_seeds={s: secret[s] for s in survivors},
                             dropped_keys={d: secret[d] for d in dropped})


def test_what_arrives_at_a_region_never_shows_a_peers_update(tls):
    ctx, regions, plain, masked, _ = _run(tls)
    me = regions[REGIONS[0]]
    inbox, total = _finish(ctx, me, regions)
    # me's own contribution was masked zeros, so the result is the others' sum, exactly.
    assert np.array_equal(total, sum(plain[r] for r in REGIONS[1:]))
    assert set(me.captured) == set(REGIONS[1:])
    for sender, raw in me.captured.items():
        seen = np.frombuffer(raw, dtype=np.uint32)
        as_plain = secmask.to_ring(plain[sender], 32)
        assert np.count_nonzero(seen == as_plain) < 5, sender  # 1000 values, chance is 1000 / 2^32
        assert abs(float(np.corrcoef(secmask.from_ring(seen, 32), plain[sender])[0, 1])) < 0.15
        assert raw not in (plain[sender].tobytes(), plain[sender].astype(np.int8).tobytes())


def test_a_region_that_drops_after_dealing_is_recovered_exactly(tls):
    gone = REGIONS[2]
    ctx, regions, plain, masked, _ = _run(tls, dropped={gone})
    for name in set(REGIONS) - {gone}:
        inbox, total = _finish(ctx, regions[name], regions)
        assert inbox.missing == {gone}
        assert np.array_equal(total, sum(plain[r] for r in REGIONS if r not in (gone, name)))


def test_a_tampered_share_is_refused_by_the_holder_and_counted(tls):
    dealer, holder = REGIONS[1], REGIONS[3]
    _, regions, *_, refused = _run(tls, tamper=(dealer, holder))
    assert refused.reason == "invalid_payload" and "wrong_share" in str(refused)
    counters = regions[holder].t["bundle"].stats()
    assert counters["refused"] == {"invalid_payload": 1}


def test_a_replayed_advert_is_refused_and_counted(tls):
    ctx, regions, *_ = _run(tls)
    old = regions[REGIONS[0]].secrets.advert
    hubs = {p: InMemoryHub() for p in PHASES}
    later = dataclasses.replace(ctx, round=ROUND + 1)
    fresh = {r: Region(r, hubs, later, tls) for r in REGIONS}
    target = fresh[REGIONS[1]]
    target.book = regions[REGIONS[1]].book  # the receiver remembers what it accepted before
    with pytest.raises(TransportError) as exc:  # round 7's signed advert pushed again in round 8
        fresh[REGIONS[0]].t["advert"].send(REGIONS[1], ROUND + 1, wire.encode_advert(old, tls[REGIONS[0]].cert_pem), timeout_s=1.0)
    assert "replayed_key" in str(exc.value)
    assert target.t["advert"].stats()["refused"] == {"invalid_payload": 1}


def test_malformed_messages_are_refused_as_malformed():
    from geofed.p2p.secagg import SecAggError

    for bad in (b"", b"GSA1", b"GSA1\x01" + b"\xff" * 8, b"XXXX\x01", wire.MAGIC + b"\x02" + (5).to_bytes(4, "big")):
        for decode in (wire.decode_advert, wire.decode_bundle, wire.decode_reveal):
            with pytest.raises(SecAggError) as exc:
                decode(bad)
            assert exc.value.reason == "malformed"
    with pytest.raises(SecAggError, match="malformed"):
        wire.decode_masked(b"\0" * 7, numel=2, bits=32)
