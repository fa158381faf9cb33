"""Issue 36, N4 and "every hostile act counted": a member's update is scored on each receiver's own
data before it counts (regions/gauntlet.py), and one that makes the receiver's loss worse is refused
as `harmful`, counted by sender, and not taken for a network miss.

Four real Regions (digits MLP, DiLoCo over the full topology) over the in-memory transport,
the gRPC transport's twin; region d runs benchmarks/bench/adversary.py's hooks (its own code lies).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from geofed.bench.adversary import Adversary
from geofed.bench.attack_results import account
from geofed.orchestrator.config import ConfigError, config_from_mapping, load_config
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions.exchange import ExchangeResult
from geofed.regions.messages import RoundPlan
from geofed.regions.region import Region

pytestmark = pytest.mark.timeout(180)

FOUR = ["a", "b", "c", "d"]  # d turns hostile


def _cfg(**security):
    return config_from_mapping({
        "run": {"seed": 0},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": FOUR},
        "network": {"emulation": {"mode": "none"}},
        "compression": {"codec": "fp16"},
        "sync": {"policy": {"kind": "fixed", "H": 60}, "inner": {"kind": "adamw", "lr": 0.003},
                 "outer": {"lr": 0.7, "momentum": 0.9},
                 "deadline": {"initial_s": 5.0, "min_s": 1.0, "max_s": 10.0}},
        "security": security,
    })


def _run(tmp_path, adversary, rounds=3, *, turn=None, **security):
    """Each round's metrics of every region (region -> list of records). `turn`: (round, Adversary):
    from that round on the member lies that way instead."""
    cfg = _cfg(**security)
    hub = InMemoryHub()
    workers = {r: Region(cfg, r, tmp_path, transport=InMemoryTransport(r, hub),
                               plugin=adversary if r == "d" else None) for r in FOUR}
    out = {r: [] for r in FOUR}
    try:
        for w in workers.values():
            w.start()
        for w in workers.values():
            w.connect({r: "inmem" for r in FOUR})
        with ThreadPoolExecutor(len(FOUR)) as pool:
            for r in range(rounds):
                if turn is not None and r == turn[0]:
                    workers["d"].plugin.spec = turn[1]
                plan = RoundPlan(round=r, H=60)
                for reg, m in zip(FOUR, pool.map(lambda reg, p=plan: workers[reg].run_round(p), FOUR)):
                    out[reg].append(m.to_record())  # records: the bench's `account` reads them, `hostile` is in extra
    finally:
        for w in workers.values():
            w.close()
    return out


@pytest.mark.parametrize("adversary", [Adversary(kind="scale", factor=-9.0), Adversary(kind="bound", factor=-1.0)],
                         ids=["flip_x-9", "flip_bound"])
def test_a_sign_flipped_update_is_refused_as_harmful_and_honest_ones_admitted(tmp_path, adversary):
    """Every honest region refuses d's flipped update every round as harmful, counts it by sender and
    by reason, and does not record d as missing; no honest update is refused. Before: nothing scored
    updates (KeyError 'harmful': the flip went into the mix, clipped to the median norm)."""
    out = _run(tmp_path, adversary)
    for reg in "abc":
        for m in out[reg]:
            assert m["harmful"] == {"d": 1}, (reg, m["round"], m["harmful"])
            assert m["refusals"].get("harmful") == 1
            assert "d" not in m["peers_missing"]
    assert sum(m["hostile"].get("flipped", 0) for m in out["d"]) == 9


def test_regions_that_refuse_the_same_update_keep_one_model(tmp_path):
    """The honest regions refuse d's flip every round and still hold one global model: d's weight goes
    to every region of the round alike, as a region left out of it. Before: it was folded into each
    one's own weight, as a network miss is, and a, b and c drifted apart every round: a and b 0.12
    apart (largest coordinate) after 2 rounds, bench attack's resync donors 15-26 apart (L2) and refused
    as bad_state. Now 5e-5 (the fp16 codec's rounding: a region mixes its own update unrounded)."""
    cfg = _cfg()
    hub = InMemoryHub()
    workers = {r: Region(cfg, r, tmp_path, transport=InMemoryTransport(r, hub),
                               plugin=Adversary(kind="scale", factor=-9.0) if r == "d" else None) for r in FOUR}
    try:
        for w in workers.values():
            w.start()
        for w in workers.values():
            w.connect({r: "inmem" for r in FOUR})
        with ThreadPoolExecutor(len(FOUR)) as pool:
            for r in range(2):
                plan = RoundPlan(round=r, H=60)
                results = dict(zip(FOUR, pool.map(lambda reg, p=plan: workers[reg].run_round(p), FOUR)))
                assert all(results[reg].security.harmful == {"d": 1} for reg in "abc")
        a = workers["a"].algorithm.global_params
        for reg in "bc":
            other = workers[reg].algorithm.global_params
            gap = max(float((x - y).abs().max()) for x, y in zip(a, other))
            assert gap < 1e-3, (reg, gap)
    finally:
        for w in workers.values():
            w.close()


def test_undisturbed_no_update_is_refused(tmp_path):
    """The same four regions, none hostile: every update is admitted (the bar sits above honest
    heterogeneity). Before: no `harmful` key."""
    out = _run(tmp_path, None)
    for reg in FOUR:
        assert all(m["harmful"] == {} and "harmful" not in m["refusals"] for m in out[reg])


def test_the_gauntlet_screens_what_the_mix_gets(tmp_path):
    """Region a's gauntlet on real tensors: a peer's real pseudo-gradient (b's local progress from the
    global model) is passed on; the same update x-9 is taken out, leaving the others. Before: the
    worker had no gauntlet (AttributeError)."""
    cfg = _cfg()
    hub = InMemoryHub()
    a = Region(cfg, "a", tmp_path, transport=InMemoryTransport("a", hub))
    b = Region(cfg, "b", tmp_path, transport=InMemoryTransport("b", hub))
    try:
        theta = [g.detach().clone() for g in a.algorithm.global_params]
        b.inner_steps(40, 1.0)
        honest = [t - p.detach() for t, p in zip(theta, b.params)]
        res = ExchangeResult(received={"b": honest, "d": [-9.0 * t for t in honest], "c": [0.5 * t for t in honest]},
                             own_decoded={}, missing=[])
        kept = a.gauntlet.screen(RoundPlan(round=0, H=40), theta, res)
        assert sorted(kept.received) == ["b", "c"]
        assert a.gauntlet.take() == {"d": 1}
        by = {sc.sender: sc for sc in a.gauntlet.last}
        assert by["b"].harm < 0 < a.gauntlet.margin < by["d"].harm
    finally:
        a.close()
        b.close()


def test_the_gauntlet_is_off_when_turned_off(tmp_path):
    """security.score_updates false: the worker builds no gauntlet. Before: the key did not exist."""
    off = Region(_cfg(score_updates=False), "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()))
    try:
        assert off.gauntlet is None
    finally:
        off.close()


@pytest.mark.parametrize("key, value, says", [
    ("score_batches", 0, "security.score_batches: must be in [1, 64]"),
    ("score_batches", 65, "security.score_batches: must be in [1, 64]"),
    ("score_margin", 0, "security.score_margin: must be in (0, 1e6]"),
    ("score_updates", "yes", "security.score_updates: expected true/false"),
])
def test_the_score_keys_are_validated_with_their_dotted_name(tmp_path, key, value, says):
    """A bad value of a new key is a ConfigError naming the file and the key. Before: the keys did
    not exist (unknown key)."""
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"task": {"kind": "mlp-digits"}, "regions": {"names": FOUR},
                                "network": {"emulation": {"mode": "none"}}, "security": {key: value}}))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert says in str(exc.value) and "run.yaml" in str(exc.value)


def test_the_defaults_score_updates():
    """Default on where it applies: 4 batches, a margin of 0.5."""
    sec = _cfg().security
    assert (sec.score_updates, sec.score_batches, sec.score_margin) == (True, 4, 0.5)


def test_bench_accounting_counts_only_the_members_harmful_refusals():
    """geofed bench attack counts a harmful refusal as catching the member only when the member's
    update was refused; an honest update refused as harmful is listed, not counted. Before: harmful
    refusals were counted by reason whatever their sender (and there were none)."""
    metrics = [
        {"region": "d", "round": 0, "hostile": {"flipped": 3}},
        {"region": "a", "round": 0, "refusals": {"harmful": 2}, "harmful": {"d": 1, "b": 1}, "clipped": {}},
        {"region": "b", "round": 0, "refusals": {"harmful": 1}, "harmful": {"d": 1}, "clipped": {}},
        {"region": "c", "round": 0, "refusals": {}, "harmful": {}, "clipped": {"d": 1}},
    ]
    summary = {"refusals": {"by_reason": {"harmful": 3}, "by_region": {"a": 2, "b": 1}}}
    refusals, acts, counted = account(metrics, summary, attacker="d")
    assert acts == {"flipped": 3}
    assert refusals["harmful"] == 2 and refusals["harmful_other"] == 1 and refusals["clipped"] == 1
    assert counted == 3


def test_a_member_refused_as_harmful_twice_is_quarantined_and_every_later_act_counted(tmp_path):
    """A member's x-9 is caught by its score only while its own update is large; once its update
    shrinks (bench attack: the member's loss reached 0 by round 5), x-9 of ~0 reads harmless, passes,
    and was not counted (flip_x-9: 21 of 60 acts). Here d flips x-9 in rounds 0-1, then sends x+0.01
    (a lie too small to read): every honest region quarantined d after its two harmful rounds and
    refused rounds 2-4 as `quarantined`, counted by sender. Before: rounds 2-4 were admitted
    (KeyError 'quarantined'; nothing was counted)."""
    out = _run(tmp_path, Adversary(kind="scale", factor=-9.0), rounds=5,
               turn=(2, Adversary(kind="scale", factor=0.01)))
    for reg in "abc":
        for m in out[reg][:2]:
            assert m["harmful"] == {"d": 1}, (reg, m["round"], m["harmful"])
        for m in out[reg][2:]:
            assert m["harmful"] == {} and m["quarantined"] == {"d": 1}, (reg, m["round"], m["harmful"], m["quarantined"])
            assert m["refusals"].get("quarantined") == 1 and "d" not in m["peers_missing"]
    acts = sum(sum(m["hostile"].values()) for m in out["d"])
    metrics = [m for reg in FOUR for m in out[reg]]
    refusals, _, counted = account(metrics, None, attacker="d")
    assert acts == 15 and counted == 15 and refusals["quarantined"] == 9, (acts, counted, refusals)


def test_an_honest_sender_refused_once_is_not_quarantined_and_release_asks_for_harmless_updates():
    """One harmful reading of an honest sender (borderline, non-IID) must not shut it out; two in
    three rounds do, until 8 harmless ones in a row (16 the second time)."""
    import torch
    from geofed.regions.gauntlet import Gauntlet, Score

    model = torch.nn.Linear(2, 1)
    g = Gauntlet(model=model, loss=lambda m, b: m(b).pow(2).mean(), batches=[torch.ones(4, 2)], margin=0.5)
    g.record(0, [Score(sender="b", round=0, loss_before=1.0, loss_after=3.0, spread=0.0)], {"b"})
    for r in (1, 2, 3):
        g.record(r, [Score(sender="b", round=r, loss_before=1.0, loss_after=1.0, spread=0.0)], set())
        assert not g.in_quarantine("b")
    g.record(4, [Score(sender="b", round=4, loss_before=1.0, loss_after=3.0, spread=0.0)], {"b"})
    assert not g.in_quarantine("b")  # rounds 2-4: one harmful of three
    g.record(5, [Score(sender="b", round=5, loss_before=1.0, loss_after=3.0, spread=0.0)], {"b"})
    assert g.in_quarantine("b")  # rounds 4-5: two of three
    harmless = [Score(sender="b", round=0, loss_before=1.0, loss_after=1.0, spread=0.0, loss_reversed=2.0)]
    for r in range(6, 13):
        g.record(r, harmless, set())
    g.record(13, [Score(sender="b", round=13, loss_before=1.0, loss_after=3.0, spread=0.0)], {"b"})
    for r in range(14, 21):  # a harmful one restarts the count: 7 harmless are not yet 8
        g.record(r, harmless, set())
        assert g.in_quarantine("b"), r
    g.record(21, harmless, set())
    assert not g.in_quarantine("b")
    for r, refused in ((22, {"b"}), (23, {"b"})):  # a second quarantine asks for twice as long
        g.record(r, [Score(sender="b", round=r, loss_before=1.0, loss_after=3.0, spread=0.0)], refused)
    assert g.in_quarantine("b") and g.release_after("b") == 16
