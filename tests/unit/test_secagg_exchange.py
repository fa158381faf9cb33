"""Secure aggregation in the round (regions/secagg/round.py) over the in-memory transport: the
mean is the plain int8-grid mean up to quantisation, a region never holds a peer's unmasked
update, a region that leaves mid-round does not stall or corrupt the others' round, and
secure aggregation's side slots are separate from the update's."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions.secagg import relay
from geofed.p2p.transport import TransportError
from geofed.regions.secagg.masks import CHUNK
from geofed.regions.secagg.round import KEY, MASKED, PHASES, RECOVER, RELAY, SETUP, STREAM, SecAggRound, side_round
from geofed.regions.secagg.wire import unpack

REGIONS = ["a", "b", "c", "d"]


def _cluster(regions=REGIONS, *, bits=32, drop=frozenset(), deadline=2.0, error_feedback=False):
    hub = InMemoryHub()
    ts = {r: InMemoryTransport(r, hub) for r in regions}
    for t in ts.values():
        t.start()
    for t in ts.values():
        t.connect({p: f"inmem:{p}" for p in regions})
    rounds = {r: SecAggRound(region=r, regions=regions, transport=ts[r], run_id="test", bits=bits,
                             deadline=AdaptiveDeadline(deadline, 0.5, deadline, 3.0), send_timeout_s=5.0,
                             error_feedback=error_feedback,
                             max_message_bytes=1 << 24, drop_mid_round=lambda rnd, r=r: r in drop)
              for r in regions}
    return ts, rounds


def _updates(regions, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {r: [torch.randn(50, 100, generator=g) * (i + 1), torch.randn(7, generator=g)]
            for i, r in enumerate(regions)}


def _run(rounds, updates, round_=0, alive=None):
    out, errors = {}, []

    def one(r):
        try:
            out[r] = rounds[r].exchange(round_, updates[r], alive)
        except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in rounds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return out


def _grid_mean(updates, members, levels, scaled_by=None, scales_from=None):
    """The plain mean of `members` on the shared int8-style grid (scales from `scaled_by`'s
    updates in `scales_from`, default the members' in `updates`): what the secure sum is exact to."""
    out = []
    scales_from = scales_from or updates
    for k in range(len(next(iter(updates.values())))):
        xs = [updates[r][k].flatten().numpy() for r in members]
        pad = (-xs[0].size) % CHUNK
        amax = np.max([np.pad(np.abs(scales_from[r][k].flatten().numpy()), (0, pad)).reshape(-1, CHUNK).max(axis=1)
                       for r in (scaled_by or members)], axis=0)
        scale = np.repeat(amax / levels, CHUNK)[: xs[0].size]
        q = sum(np.clip(np.rint(x / scale), -levels, levels) for x in xs)
        out.append(torch.from_numpy((q * scale / len(members)).astype(np.float32)).reshape(updates[members[0]][k].shape))
    return out


def test_the_round_mean_is_the_plain_grid_mean_and_close_to_the_float_mean():
    ts, rounds = _cluster()
    updates = _updates(REGIONS)
    out = _run(rounds, updates)
    want = _grid_mean(updates, REGIONS, levels=127)
    for r in REGIONS:
        mean, m = out[r]
        assert m["secagg_survivors"] == 4 and m["secagg_dropped"] == [] and "secagg_failed" not in m
        for got, exp in zip(mean, want):
            torch.testing.assert_close(got, exp, rtol=0, atol=1e-5)
        # ... and within half a quantisation step of the float mean
        step = float(max(updates[x][0].abs().max() for x in REGIONS)) / 127
        assert float((mean[0] - sum(updates[x][0] for x in REGIONS) / 4).abs().max()) <= step / 2 + 1e-6
    for r in REGIONS:
        assert out[r][1]["bytes_sent"] > 0
    for t in ts.values():
        t.close()


def test_a_region_never_holds_a_peers_unmasked_update():
    """What arrives at a region in the MASKED slot is uniform-looking ring data, not the peer's
    quantised values (checked by capturing the side mailbox's filed payloads)."""
    ts, rounds = _cluster()
    captured: dict[tuple[str, int], bytes] = {}
    side = ts["a"].mailbox.stream(STREAM)
    inner = side._validator

    def capture(sender, r, payload):
        captured[(sender, r)] = bytes(payload)
        return inner(sender, r, payload)

    side.set_validator(capture)
    updates = _updates(REGIONS)
    _run(rounds, updates)
    for peer in ("b", "c", "d"):
        body = unpack(captured[(peer, side_round(0, MASKED))], 4)[0]
        raw = np.frombuffer(body, dtype="<u4").astype(np.int64)
        assert raw.size == 5007
        raw[raw >= 1 << 31] -= 1 << 32
        # quantised values lie in [-127, 127]; masked ones are spread over the whole ring
        assert np.mean(np.abs(raw) <= 127) < 0.01
        assert np.abs(raw).mean() > 1e8
    for t in ts.values():
        t.close()


def test_a_region_leaving_mid_round_leaves_the_others_the_exact_sum_of_the_survivors():
    ts, rounds = _cluster(drop={"c"}, deadline=1.0)
    updates = _updates(REGIONS)
    out = _run(rounds, updates)
    survivors = ["a", "b", "d"]
    # the scales were agreed over all four (c dealt its keys and absmax before leaving)
    want = _grid_mean(updates, survivors, levels=127, scaled_by=REGIONS)
    for r in survivors:
        mean, m = out[r]
        assert m["secagg_survivors"] == 3 and m["secagg_dropped"] == ["c"], m
        assert m["peers_missing"] == []
        for got, exp in zip(mean, want):
            torch.testing.assert_close(got, exp, rtol=0, atol=1e-5)
    assert out["c"][1]["peers_missing"] == ["a", "b", "d"] and out["c"][1]["secagg_dropped_self"]
    torch.testing.assert_close(out["c"][0][0], updates["c"][0])
    for t in ts.values():
        t.close()


def test_two_rounds_in_a_row_and_8_bit_rings_keep_the_sum():
    """Round 0 agrees its scales in SETUP; round 1 quantises with round 0's absmax (carried on the
    masked updates: scales agreed a round ahead), sends no SETUP, and is still the exact grid sum.
    Every self key is rebuilt from the relayed shares: no KEY message is sent at all."""
    ts, rounds = _cluster(bits=8)
    seen = []
    ts["a"].mailbox.stream(STREAM).set_validator(lambda s, rnd, p: seen.append(rnd) or bytes(p))
    previous = None
    for rnd in range(3):
        updates = _updates(REGIONS, seed=rnd)
        out = _run(rounds, updates, round_=rnd)
        # 127 // 4 levels: four sums cannot wrap 8 bits; the scales of the round before (round 0: its own)
        want = _grid_mean(updates, REGIONS, levels=31, scales_from=previous)
        for r in REGIONS:
            m = out[r][1]
            assert m["secagg_levels"] == 31 and m["secagg_scales_ahead"] == (rnd > 0), m
            assert set(m["secagg_phase_s"]) == ({"masked", "relay"} if rnd else {"setup", "masked", "relay"}), m
            torch.testing.assert_close(out[r][0][0], want[0], rtol=0, atol=1e-5)
        previous = updates
    # one message a peer per phase; SETUP only in round 0, no KEY, REVEAL or RECOVER in a complete round
    assert sorted(seen) == sorted(3 * [side_round(0, SETUP)] + [side_round(rnd, ph) for rnd in range(3)
                                                                 for ph in (MASKED, RELAY) for _ in range(3)])
    for t in ts.values():
        t.close()


def test_side_pushes_are_refused_by_a_region_without_secure_aggregation():
    hub = InMemoryHub()
    a, b = InMemoryTransport("a", hub), InMemoryTransport("b", hub)
    for t in (a, b):
        t.start()
    a.connect({"b": "inmem:b"})
    b.connect({"a": "inmem:a"})
    with pytest.raises(Exception, match="bad_header"):
        a.send("b", side_round(0, SETUP), b"x", timeout_s=1.0, stream=STREAM)
    assert b.stats()["refused"]["bad_header"] == 1


def test_a_restarted_region_rekeys_and_a_replayed_old_key_is_refused_and_counted():
    ts, rounds = _cluster(deadline=1.0)
    captured = {}
    side = ts["b"].mailbox.stream(STREAM)
    side.set_validator(lambda s, r, p: captured.setdefault((s, r), bytes(p)))
    _run(rounds, _updates(REGIONS), round_=0)
    # a restarts: new keys, no peer keys; it falls back once and the others drop it from round 1
    rounds["a"] = SecAggRound(region="a", regions=REGIONS, transport=ts["a"], run_id="test", bits=32,
                              deadline=AdaptiveDeadline(1.0, 0.5, 1.0, 3.0), send_timeout_s=5.0,
                              error_feedback=False, max_message_bytes=1 << 24)
    out = _run(rounds, _updates(REGIONS, seed=1), round_=1)
    assert out["a"][1].get("secagg_failed", "").startswith("no scales or key"), out["a"][1]
    assert out["b"][1]["secagg_dropped"] == ["a"] and out["b"][1]["secagg_survivors"] == 3
    # round 2: the others send a their keys again (it said it lacks them); all four sum
    out = _run(rounds, _updates(REGIONS, seed=2), round_=2)
    assert all(o[1].get("secagg_survivors") == 4 for o in out.values()), {r: o[1] for r, o in out.items()}
    # round 3: a sits out (the others agreed their scales ahead: no SETUP; they drop a)
    out = _run({r: rounds[r] for r in ("b", "c", "d")}, _updates(REGIONS, seed=3), round_=3, alive=REGIONS)
    assert out["b"][1]["secagg_scales_ahead"] and out["b"][1]["secagg_dropped"] == ["a"], out["b"][1]
    # round 4 (SETUP again after the drop): a's round-0 setup (its old key) replayed to b in a's slot
    ts["a"].send("b", side_round(4, SETUP), captured[("a", side_round(0, SETUP))], timeout_s=1.0, stream=STREAM)
    out = _run({r: rounds[r] for r in ("b", "c", "d")}, _updates(REGIONS, seed=4), round_=4, alive=REGIONS)
    m = out["b"][1]
    assert m["secagg_refused"].get("replayed_key", 0) == 1, m
    assert "secagg_failed" in m and m["peers_missing"] == ["a", "c", "d"]
    for t in ts.values():
        t.close()


def test_a_masked_update_that_reached_only_some_regions_is_never_unmasked():
    """d's masked update reaches a and c but not b. b never holds its share of d's self key and
    relays none, so nobody rebuilds d's key from relays; d's KEY goes only to the regions that
    acknowledged its update (a, c). b cannot unmask and applies its own update; a and c (d's key
    by KEY) and d (every other key rebuilt from relays: every peer got those updates) hold the
    exact sum of all four. No pair seed of d is revealed (the holders of d's update and key never
    answer a request for d's seeds), and b receives nothing from which d's key follows."""
    ts, rounds = _cluster(deadline=1.0)
    send = rounds["d"].side.send

    def lossy(peer, round_, phase, payload, **kw):
        if peer == "b" and phase == MASKED:
            raise TransportError("emulated loss of d's masked update to b", peer=peer, reason="unavailable")
        return send(peer, round_, phase, payload, **kw)

    rounds["d"].side.send = lossy
    seen, at_b = [], []
    for r in REGIONS:
        side = ts[r].mailbox.stream(STREAM)
        side.set_validator(lambda s, rnd, p, me=r: seen.append((me, s, rnd % PHASES)) or bytes(p))
    inner = ts["b"].mailbox.stream(STREAM)._validator
    ts["b"].mailbox.stream(STREAM).set_validator(lambda s, rnd, p: at_b.append((s, rnd % PHASES, bytes(p))) or inner(s, rnd, p))
    updates = _updates(REGIONS)
    out = _run(rounds, updates)
    d_key = rounds["d"].keys.self_key(0)
    assert not [x for x in at_b if d_key in x[2]]  # d's key never reached b, whole
    relayed = [relay.decode_relay(p, binding=relay.tag("test", 0, s, "b"), regions=REGIONS, relayer=s, me="b")[1]
               for s, ph, p in at_b if ph == RELAY]
    shares_of_d = [r["d"] for r in relayed if "d" in r]
    assert not [x for x in at_b if x[:2] == ("d", MASKED)]  # b's own share of d's key never came
    # at most a's and c's shares (the n - 2 relayed ones: uniform without b's)
    assert len(shares_of_d) <= 2 and relay.combine(shares_of_d) != d_key, [(s, ph, len(p)) for s, ph, p in at_b]  # a's and c's; b's own never came
    assert "secagg_failed" in out["b"][1] and len(out["b"][1]["peers_missing"]) == 3, out["b"][1]
    torch.testing.assert_close(out["b"][0][0], updates["b"][0])
    want = _grid_mean(updates, REGIONS, levels=127)
    for r in ("a", "c", "d"):
        assert out[r][1].get("secagg_survivors") == 4 and "secagg_failed" not in out[r][1], (r, out[r][1].get("secagg_failed"), out[r][1]["secagg_phase_s"], out[r][1]["secagg_refused"])
        torch.testing.assert_close(out[r][0][0], want[0], rtol=0, atol=1e-5)
    assert not [x for x in seen if x[2] == RECOVER]  # nobody answered with pair seeds
    assert ("b", "d", KEY) not in seen and ("d", "b", KEY) not in seen  # keys only where the masked went
    for t in ts.values():
        t.close()


def test_a_masked_update_on_another_grid_is_refused_counted_and_the_others_still_sum_exactly():
    """Round 1 quantises with scales agreed in round 0; d's are forged (its ahead absmax doubled).
    Its masked update carries its grid's digest: a, b and c refuse it (counted as wrong_grid) and
    treat d as dropped, recover d's masks among themselves and hold the exact sum of the three."""
    ts, rounds = _cluster(deadline=1.0)
    first = _updates(REGIONS, seed=0)
    _run(rounds, first, round_=0)
    r0, members, amax = rounds["d"].ahead
    rounds["d"].ahead = (r0, members, amax * 2)
    updates = _updates(REGIONS, seed=1)
    out = _run(rounds, updates, round_=1)
    want = _grid_mean(updates, ["a", "b", "c"], levels=127, scaled_by=REGIONS, scales_from=first)
    for r in ("a", "b", "c"):
        m = out[r][1]
        assert m["secagg_refused"].get("wrong_grid") == 1 and m["secagg_dropped"] == ["d"], m
        assert m["secagg_scales_ahead"] and "reveal" in m["secagg_phase_s"], m
        for got, exp in zip(out[r][0], want):
            torch.testing.assert_close(got, exp, rtol=0, atol=1e-5)
    assert out["d"][1]["secagg_refused"].get("wrong_grid") == 3 and "secagg_failed" in out["d"][1]
    for t in ts.values():
        t.close()


def test_two_survivors_never_unmask_their_sum():
    """c and d leave mid-round: the sum of a and b minus a's own update would be b's, so neither
    sends a self key or a pair seed, and both apply their own update alone."""
    ts, rounds = _cluster(drop={"c", "d"}, deadline=1.0)
    seen = []
    for r in REGIONS:
        ts[r].mailbox.stream(STREAM).set_validator(lambda s, rnd, p, me=r: seen.append((me, s, rnd % PHASES)) or bytes(p))
    updates = _updates(REGIONS)
    out = _run(rounds, updates)
    for r in ("a", "b"):
        assert out[r][1]["secagg_failed"].startswith("2 masked updates arrived"), out[r][1]
        torch.testing.assert_close(out[r][0][0], updates[r][0])
    assert not [x for x in seen if x[2] not in (SETUP, MASKED)], seen
    for t in ts.values():
        t.close()


def _capture(ts, region):
    got = []
    inner = ts[region].mailbox.stream(STREAM)._validator
    ts[region].mailbox.stream(STREAM).set_validator(lambda s, rnd, p: got.append((s, rnd // PHASES, rnd % PHASES, bytes(p)))
                                          or inner(s, rnd, p))
    return got


def test_relayed_shares_rebuild_each_self_key_and_fewer_do_not():
    """What reaches a in a complete round: its share of b's self key (with b's masked update) and
    c's and d's relayed shares; all three XOR to b's round key, any two do not."""
    ts, rounds = _cluster()
    got = _capture(ts, "a")
    _run(rounds, _updates(REGIONS))
    mine = {s: unpack(p, 4)[3][:relay.SHARE] for s, _, ph, p in got if ph == MASKED}
    relays = {s: relay.decode_relay(p, binding=relay.tag("test", 0, s, "a"), regions=REGIONS, relayer=s, me="a")
              for s, _, ph, p in got if ph == RELAY}
    assert all(flag for flag, _ in relays.values())  # every peer counted a's masked update
    for owner in ("b", "c", "d"):
        parts = [mine[owner]] + [relays[j][1][owner] for j in ("b", "c", "d") if j != owner]
        assert relay.combine(parts) == rounds[owner].keys.self_key(0)
        assert all(relay.combine(parts[:i] + parts[i + 1:]) != rounds[owner].keys.self_key(0) for i in range(3))
    for t in ts.values():
        t.close()


def test_a_replayed_relay_is_refused_and_counted_and_never_sums_wrong():
    """b's round-0 relay to a is pushed again into round 1's relay slot, where b's own relay to a
    is lost (with both, the mailbox voids the slot: equivocation). a refuses it (bound to round 0:
    wrong_round, counted), cannot rebuild c's and d's keys, gets no KEY (every peer counted
    theirs) and applies its own update; the others hold one and the same sum."""
    ts, rounds = _cluster(deadline=1.0)
    got = _capture(ts, "a")
    first = _run(rounds, _updates(REGIONS, seed=0), round_=0)
    assert all("secagg_failed" not in o[1] for o in first.values()), {r: o[1].get("secagg_failed") for r, o in first.items()}
    old = next(p for s, r, ph, p in got if (s, r, ph) == ("b", 0, RELAY))
    send = rounds["b"].side.send

    def lossy(peer, round_, phase, payload, **kw):
        if peer == "a" and phase == RELAY:
            raise TransportError("emulated loss of b's relay to a", peer=peer, reason="unavailable")
        return send(peer, round_, phase, payload, **kw)

    rounds["b"].side.send = lossy
    ts["b"].send("a", side_round(1, RELAY), old, timeout_s=1.0, stream=STREAM)
    updates = _updates(REGIONS, seed=1)
    out = _run(rounds, updates, round_=1)
    m = out["a"][1]
    assert m["secagg_refused"].get("wrong_round") == 1 and "secagg_failed" in m, (m.get("secagg_failed"), m["secagg_refused"])
    torch.testing.assert_close(out["a"][0][0], updates["a"][0])
    sums = [out[r][0][0] for r in ("b", "c", "d")]
    assert all("secagg_failed" not in out[r][1] for r in ("b", "c", "d"))
    torch.testing.assert_close(sums[0], sums[1], rtol=0, atol=0)
    torch.testing.assert_close(sums[0], sums[2], rtol=0, atol=0)
    for t in ts.values():
        t.close()


def test_a_forged_relayed_share_is_refused_and_counted_and_the_key_not_used():
    """b relays a's shares with one byte flipped: a's rebuilt keys of c and d fail the check that
    came with their masked updates (wrong_share, counted twice), a never sums with them."""
    ts, rounds = _cluster(deadline=1.0)
    send = rounds["b"].side.send

    def forge(peer, round_, phase, payload, **kw):
        if peer == "a" and phase == RELAY:
            payload = payload[:-1] + bytes([payload[-1] ^ 1]) if len(payload) > relay.TAG + 1 else payload
        return send(peer, round_, phase, payload, **kw)

    rounds["b"].side.send = forge
    updates = _updates(REGIONS)
    out = _run(rounds, updates)
    m = out["a"][1]
    assert m["secagg_refused"].get("wrong_share") == 1, m  # the flipped byte is in the last share only
    assert "secagg_failed" in m or out["a"][0][0].equal(out["b"][0][0]), m
    want = _grid_mean(updates, REGIONS, levels=127)
    for r in ("b", "c", "d"):
        torch.testing.assert_close(out[r][0][0], want[0], rtol=0, atol=1e-5)
    for t in ts.values():
        t.close()


def test_relay_messages_refuse_wrong_bindings_sizes_and_owners():
    """split/combine: all shares give the key, any fewer not; decode_relay refuses a relay bound
    to another round or link (wrong_round) and a wrong flag, size or owner (malformed)."""
    key = bytes(range(32))
    shares = relay.split(key, ["a", "c", "d"])  # b's key, one share per peer of b
    assert relay.combine(shares.values()) == key
    assert relay.combine([shares["a"], shares["c"]]) != key
    tag = relay.tag("run", 3, "b", "a")
    good = relay.encode_relay(tag, True, {"c": key, "d": shares["d"]}, REGIONS)  # b relays its shares of c's and d's keys
    assert relay.decode_relay(good, binding=tag, regions=REGIONS, relayer="b", me="a") == (True, {"c": key, "d": shares["d"]})
    for binding in (relay.tag("run", 2, "b", "a"), relay.tag("other", 3, "b", "a"), relay.tag("run", 3, "c", "a")):
        with pytest.raises(ValueError, match="wrong_round"):
            relay.decode_relay(good, binding=binding, regions=REGIONS, relayer="b", me="a")
    for bad in (good[:-1], tag + b"\x02", relay.encode_relay(tag, False, {"a": key}, REGIONS),
                relay.encode_relay(tag, False, {"b": key}, REGIONS), tag + b"\x01" + b"\x09" + key,
                tag + b"\x01" + 2 * (b"\x02" + key)):
        with pytest.raises(ValueError, match="malformed"):
            relay.decode_relay(bad, binding=tag, regions=REGIONS, relayer="b", me="a")
    keys, forged = relay.rebuild("run", 3, "a", REGIONS, {"b": (shares["a"], relay.check("run", 3, "b", key))},
                                 {"c": {"b": shares["c"]}, "d": {"b": shares["d"]}})
    assert keys == {"b": key} and forged == 0
    keys, forged = relay.rebuild("run", 3, "a", REGIONS, {"b": (shares["a"], relay.check("run", 4, "b", key))},
                                 {"c": {"b": shares["c"]}, "d": {"b": shares["d"]}})
    assert keys == {} and forged == 1
