"""Issue 15, finding 2: one update of finite huge values (3e38, a valid checksum) from a compromised
peer crashed the run: the receiving region's loss went NaN, inner_steps raised FloatingPointError.

Here real Regions (digits MLP, DiLoCo over the full topology) exchange over the in-memory
transport, the gRPC transport's twin (same mailbox, validator, exchanger), and a third region's
transport is driven by hand as the compromised peer. The live run is in test_hostile_peer_run.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from geofed.compression import encode_update
from geofed.orchestrator.config import config_from_mapping
from geofed.bench.hostile_peer import huge_update
from geofed.p2p.mailbox import Refusal
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions.exchange import ExchangeResult
from geofed.p2p.robust import UpdateAdmission, coordinate_median, robust_mix, trim_count, trimmed_mean
from geofed.regions.region import Region
from geofed.regions.messages import RoundPlan

pytestmark = pytest.mark.timeout(120)

REGIONS = ["a", "b", "c"]  # c is the compromised peer


def _cfg(**security):
    return config_from_mapping({
        "run": {"seed": 0},
        "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": REGIONS},
        "network": {"emulation": {"mode": "none"}},
        "sync": {"policy": {"kind": "fixed", "H": 5}, "inner": {"lr": 0.01},
                 "deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 2.0}},
        "security": security,
    })


class Trio:
    """Honest workers a and b; c's transport pushes whatever the test hands it."""

    def __init__(self, tmp_path, **security):
        self.hub = InMemoryHub()
        cfg = _cfg(**security)
        self.workers = {r: Region(cfg, r, tmp_path, transport=InMemoryTransport(r, self.hub)) for r in ("a", "b")}
        self.c = InMemoryTransport("c", self.hub)
        self.c.start()
        self.c.connect({r: "x" for r in REGIONS})
        for w in self.workers.values():
            w.start()
            w.connect({r: "x" for r in REGIONS})
        self.shapes = self.workers["a"].shapes
        self.pool = ThreadPoolExecutor(2)

    def c_pushes(self, round_, payload) -> dict[str, str]:
        out = {}
        for peer in ("a", "b"):
            try:
                self.c.send(peer, round_, payload, timeout_s=2)
                out[peer] = "accepted"
            except Exception as exc:  # noqa: BLE001 - the reason is what the test looks at
                out[peer] = getattr(exc, "reason", repr(exc))
        return out

    def honest(self, value=1e-3) -> bytes:
        return encode_update("identity", [torch.full(s, value) for s in self.shapes])

    def round(self, r):
        plans = {reg: RoundPlan(round=r, H=5) for reg in self.workers}
        reports = self.pool.map(lambda reg: self.workers[reg].run_round(plans[reg]), plans)
        return {reg: m.to_record() for reg, m in zip(plans, reports)}  # records: the tests check their keys

    def close(self):
        for w in self.workers.values():
            w.close()
        self.c.close()
        self.pool.shutdown()


@pytest.fixture
def trio(tmp_path, request):
    t = Trio(tmp_path, **getattr(request, "param", {}))
    yield t
    t.close()


def _finite(w) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in w.params)


def test_an_update_of_huge_finite_values_is_refused_and_the_run_goes_on(trio):
    """On main the update was accepted (only NaN/Inf were refused), mixed, and the next round's
    inner steps raised FloatingPointError."""
    assert trio.c_pushes(0, huge_update(trio.shapes)) == {"a": "out_of_bounds", "b": "out_of_bounds"}
    trio.c_pushes(0, trio.honest())  # c's slot is still free: the refused copy was never filed
    for r in range(3):
        if r:
            trio.c_pushes(r, trio.honest())
        results = trio.round(r)
        assert all("rolled_back" not in m for m in results.values())
    for w in trio.workers.values():
        assert _finite(w) and w.transport.stats()["refused"] == {"out_of_bounds": 1}
        assert w.evaluate()["value"] > 0.3


@pytest.mark.parametrize("trio", [{"robust_aggregation": "none", "max_update_value": 3.4e38}], indirect=True)
def test_a_round_that_turns_the_model_non_finite_is_rolled_back(trio):
    """Admission off: the 3e38 update is mixed in; the region restores the start of the round,
    drops the round's inputs, reports it, and trains on."""
    trio.c_pushes(0, trio.honest())
    trio.round(0)
    start = {r: [p.detach().clone() for p in w.params] for r, w in trio.workers.items()}
    inner = {r: [s["exp_avg"].clone() for s in w.inner.state.values()] for r, w in trio.workers.items()}
    trio.c_pushes(1, huge_update(trio.shapes))
    results = trio.round(1)
    for region, w in trio.workers.items():
        m = results[region]
        assert m["rolled_back"]["dropped"] == ["b", "c"] if region == "a" else ["a", "c"], m["rolled_back"]
        assert "loss" in m["rolled_back"]["why"] and m["steps"] == 0
        assert all(torch.equal(p, s) for p, s in zip(w.params, start[region]))  # the round's start
        assert all(torch.equal(s["exp_avg"], e) for s, e in zip(w.inner.state.values(), inner[region]))
    trio.c_pushes(2, trio.honest())
    results = trio.round(2)
    assert all("rolled_back" not in m and m["steps"] == 5 for m in results.values())
    assert all(_finite(w) for w in trio.workers.values())


@pytest.mark.parametrize("trio", [{"robust_aggregation": "none", "max_update_value": 3.4e38}], indirect=True)
def test_three_rollbacks_in_a_row_still_fail_the_region(trio):
    trio.c_pushes(0, trio.honest())
    trio.round(0)
    for r in (1, 2):
        trio.c_pushes(r, huge_update(trio.shapes))
        assert all("rolled_back" in m for m in trio.round(r).values())
    trio.c_pushes(3, huge_update(trio.shapes))
    with pytest.raises(FloatingPointError, match="3 rounds in a row"):
        trio.round(3)


@pytest.mark.parametrize("trio", [{"robust_aggregation": "clip"}], indirect=True)
def test_clip_scales_an_outsized_update_down_to_the_bound(trio):
    for r in range(2):
        trio.c_pushes(r, trio.honest())
        trio.round(r)
    bound = trio.workers["a"].admission.bound()
    assert bound is not None
    assert trio.c_pushes(2, trio.honest(1e3)) == {"a": "accepted", "b": "accepted"}  # under the value bound
    results = trio.round(2)
    assert results["a"]["clipped"] == {"c": 1} and results["b"]["clipped"] == {"c": 1}
    assert all(_finite(w) for w in trio.workers.values())


@pytest.mark.parametrize("trio", [{"robust_aggregation": "median"}], indirect=True)
def test_median_refuses_an_outlier_norm_and_mixes_coordinate_wise(trio):
    for r in range(2):
        trio.c_pushes(r, trio.honest())
        trio.round(r)
    assert trio.c_pushes(2, trio.honest(1e3)) == {"a": "outlier", "b": "outlier"}
    trio.c_pushes(2, trio.honest())
    trio.round(2)
    assert trio.workers["a"].transport.stats()["refused"] == {"outlier": 1}


def test_median_and_trimmed_mean_ignore_one_hostile_value_in_three():
    honest = [[torch.tensor([1.0, 2.0])], [torch.tensor([1.2, 1.8])]]
    hostile = [torch.tensor([3e38, -3e38])]
    for out in (coordinate_median([*honest, hostile]), trimmed_mean([*honest, hostile], 1),
                robust_mix(honest[0], {"b": honest[1], "c": hostile}, how="median"),
                robust_mix(honest[0], {"b": honest[1], "c": hostile}, how="trimmed-mean")):
        assert 1.0 <= float(out[0][0]) <= 1.2 + 1e-6 and 1.8 - 1e-6 <= float(out[0][1]) <= 2.0
    assert [trim_count(n, 0.25) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 0, 1, 1, 1, 2, 2]
    assert torch.equal(coordinate_median([[torch.tensor([1.0])], [torch.tensor([3.0])]])[0], torch.tensor([2.0]))


def test_one_sender_cannot_raise_the_reference_norm_by_escalating():
    """The reference is shared by all senders and the region's own updates: a peer that sends 9x
    its last accepted norm every time stays clipped near the honest scale (a per-sender median
    would have followed it up)."""
    adm = UpdateAdmission(mode="clip", norm_multiple=10.0)
    for _ in range(3):
        adm.observe_own([torch.ones(4)])  # norm 2
    norms = []
    value = 1.0
    for _ in range(30):  # a round: the region's own update, honest b's, hostile c's
        adm.observe_own([torch.ones(4)])
        adm.admit("b", [torch.full((4,), 1.1)])
        value *= 9
        out = adm.admit("c", [torch.full((4,), min(value, 1e5))])
        norms.append(float(torch.linalg.vector_norm(out[0])))
    assert max(norms) <= 10 * 2.2 * 1.0001, norms
    with pytest.raises(Refusal) as ei:
        adm.admit("c", [torch.full((4,), 3e38)])
    assert ei.value.reason == "out_of_bounds"


# -- issue 36, N4: the default bounds one member's pull on the mean to its share --------------------

FOUR = ["a", "b", "c", "d"]  # d is the hostile member


def _unit(tensors):
    n = float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))
    return [t / n for t in tensors]


def _flat(tensors):
    return torch.cat([t.flatten().double() for t in tensors])


@pytest.mark.parametrize("attack", ["flip_at_bound", "x-1000", "x-9", "x+9"])
def test_under_the_default_one_member_keeps_the_mean_step_forward_and_its_share(tmp_path, attack):
    """Region a of four, the default security section, its real admission and mix on real tensors:
    three honest updates of norm 1 around a common direction, and d's update sign-flipped at the
    bound (10 x the median norm, what the attack sent), x-1000, x-9 or x+9. The mean step must point
    the honest way (cosine with the honest mean > 0) and d's pull on it must be at most its 1/4
    share at the median norm (0.25). Before (clip at 10 x a window's median on arrival, the plain
    mean after): d's update reached the mix at norm 9-10 with weight 1/4, a pull of 2.25-2.5, and
    for the flips the mean step pointed backwards (cosine < 0)."""
    cfg = config_from_mapping({"run": {"seed": 0}, "task": {"kind": "mlp-digits", "hidden": 16},
                               "regions": {"names": FOUR}, "network": {"emulation": {"mode": "none"}}})
    w = Region(cfg, "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()))
    try:
        g = torch.Generator().manual_seed(0)
        common = [torch.randn(s, generator=g) for s in w.shapes]

        def honest():
            return _unit([c + 0.8 * torch.randn(c.shape, generator=g) for c in common])

        for _ in range(3):  # earlier rounds: the admission's window holds honest norms (1)
            w.admission.observe_own(honest())
        ups = {r: honest() for r in FOUR}
        mean_honest = [sum(ups[r][k] for r in "abc") / 3 for k in range(len(common))]
        hostile = {"flip_at_bound": [-10.0 * t for t in _unit(mean_honest)], "x-1000": [-1000.0 * t for t in ups["d"]],
                   "x-9": [-9.0 * t for t in ups["d"]], "x+9": [9.0 * t for t in ups["d"]]}[attack]
        received = {"b": w.admission.admit("b", ups["b"]), "c": w.admission.admit("c", ups["c"]),
                    "d": w.admission.admit("d", hostile)}
        mixed = w.mix(RoundPlan(round=0, H=1), ups["a"], ExchangeResult(received=received, own_decoded={}, missing=[]))
        step, want = _flat(mixed), _flat(mean_honest)
        cosine = float(step @ want / (step.norm() * want.norm()))
        assert cosine > 0, cosine
        # The honest updates (norm 1) are at or under the round's median norm: they are mixed as they
        # are, so what is left of the mean once they are taken out is d's pull.
        pull = float((step - _flat([sum(ups[r][k] for r in "abc") / 4 for k in range(len(common))])).norm())
        assert pull <= 0.25 * 1.0001, pull
        assert w.admission.take_clipped() == {"d": 1}  # counted, whatever the direction
    finally:
        w.close()
