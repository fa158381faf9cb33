"""Issue 36, N2: a member that answers heartbeats but never pushes (or whose pushes are refused)
cannot stretch the rounds.

Before: every miss widened each receiver's adaptive deadline x1.5 (30, 45, 67.5, 101 then 120 s a
round: 6 rounds in 414 s against 20 rounds in 28 s undisturbed), and updates refused as `outlier`
counted as misses the same way, each one waited out to the deadline.

Here: a refused update is no miss of the network (the receiver stops waiting for its sender at
the refusal and its deadline does not widen), and a member whose update most of its peers missed
for WithholdWatch.after rounds in a row is left out of the plan like a stalled region: nobody
waits for it; it trains alone, and it is tried again after a while (probation: it first takes the
model of a current region; an update that arrives puts it back; another miss mutes it again, for
twice as long).
"""

from __future__ import annotations

import time

import torch

from geofed.compression import CodecSpec
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.coordinator import Coordinator
from geofed.orchestrator.driver.recovery import WithholdWatch
from geofed.p2p.admission import Refusal
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions.exchange import Exchanger

REGIONS = ["a", "b", "c", "d"]
EVERYONE = {r: set(REGIONS) - {r} for r in REGIONS}


def _round(missing_x: bool, x: str = "a"):
    return {r: {"peers_missing": [x] if missing_x and r != x else []} for r in REGIONS}


# -- the driver's watch ----------------------------------------------------------------------------
def test_a_member_missed_by_most_peers_two_rounds_running_is_muted_then_tried_again():
    w = WithholdWatch(after=2, first_out=2)
    assert w.observe(0, _round(True), EVERYONE) == []
    (rec,) = w.observe(1, _round(True), EVERYONE)
    assert rec["region"] == "a" and rec["rounds_out"] == 2 and rec["missed_by"] == ["b", "c", "d"]
    assert w.muted(2) == w.muted(3) == {"a"}
    assert w.back(3) == set() and w.back(4) == {"a"} and w.muted(4) == set()
    # Probation: one more withheld round mutes it at once, for twice as long.
    (rec,) = w.observe(4, _round(True), EVERYONE)
    assert rec["rounds_out"] == 4 and w.muted(8) == {"a"} and w.muted(9) == set()
    assert w.back(9) == {"a"}
    # An update that arrives on probation puts it back for good: the next miss needs `after` rounds again.
    assert w.observe(9, _round(False), EVERYONE) == []
    assert w.observe(10, _round(True), EVERYONE) == []
    (rec,) = w.observe(11, _round(True), EVERYONE)
    assert rec["rounds_out"] == 2  # its count of failed tries was reset
    restored = WithholdWatch()
    restored.load_state_dict(w.state_dict())
    assert restored.muted(12) == {"a"}


def test_one_cut_link_or_a_two_region_run_mutes_nobody():
    w = WithholdWatch(after=1)
    one_link = {r: {"peers_missing": ["a"] if r == "b" else []} for r in REGIONS}  # a -> b down
    assert w.observe(0, one_link, EVERYONE) == []
    two = {"a": {"peers_missing": []}, "b": {"peers_missing": ["a"]}}
    assert w.observe(1, two, {"a": {"b"}, "b": {"a"}}) == []  # a withholder and a cut link look alike


def test_the_plan_leaves_a_muted_member_out_of_everyone_elses_round():
    cfg = config_from_mapping({"task": {"kind": "mlp-digits", "hidden": 8}, "regions": {"names": REGIONS},
                               "network": {"emulation": {"mode": "none"}},
                               "sync": {"policy": {"kind": "fixed", "H": 5}}})

    class Clock:
        def now(self):
            return 0.0

    coord = Coordinator(cfg, model_numel=100, clock=Clock())
    plans = coord.plan(0, alive=list(REGIONS), evaluate=True, muted={"a"})
    assert plans["a"].alive == ("a",) and not plans["a"].evaluate  # it trains alone
    for r in "bcd":
        assert plans[r].alive == ("b", "c", "d")
    assert [r for r, p in plans.items() if p.evaluate] == ["b"]


# -- the receiver: a refusal is not a miss of the network ------------------------------------------
def _exchangers(deadline_s: float):
    hub = InMemoryHub()
    ts = {r: InMemoryTransport(r, hub) for r in ("a", "b", "x")}
    for t in ts.values():
        t.start()
        t.connect({r: f"inmem:{r}" for r in ts})

    def validator(sender, round_, payload):
        if sender == "x":
            raise Refusal("outlier", "norm 1e3 exceeds 10 x the recent median norm")  # as UpdateAdmission refuses it
        return payload

    ts["a"].set_validator(validator)
    deadline = AdaptiveDeadline(deadline_s, 0.1, 4 * deadline_s, 3.0)
    ex = {r: Exchanger(t, error_feedback=False, deadline=deadline if r == "a" else AdaptiveDeadline(1, 0.1, 4, 3.0),
                       send_timeout_s=5.0) for r, t in ts.items()}
    return ts, ex, deadline


def test_a_refused_update_is_not_waited_for_and_does_not_widen_the_deadline():
    """Before: the receiver waited out its whole deadline (3.0 s) for the refused sender, and the
    deadline widened x1.5 (3.0 -> 4.5 s) as for a network miss."""
    ts, ex, deadline = _exchangers(3.0)
    spec = CodecSpec.parse("identity")
    try:
        for round_ in range(2):
            for sender in ("b", "x"):
                ts[sender].expect(round_, [])
                ex[sender].exchange(round_, [torch.ones(4)], out_peers=["a"], in_peers=[], codecs={},
                                    default_codec=spec)
            t0 = time.monotonic()
            res = ex["a"].exchange(round_, [torch.ones(4)], out_peers=[], in_peers=["b", "x"], codecs={},
                                   default_codec=spec)
            waited = time.monotonic() - t0
            assert res.missing == ["x"] and set(res.received) == {"b"}  # still a miss for the mix and the driver
            assert waited < 1.0, waited
            assert deadline.current() == 3.0  # not widened
        assert ts["a"].stats()["refused"] == {"outlier": 2}
    finally:
        for r in ex:
            ex[r].close()
            ts[r].close()
