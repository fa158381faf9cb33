"""sync.fragments (Streaming DiLoCo, regions/sync/fragments.py) over the in-memory transport: the
split, the schedule (fragment round % N), N=1 the whole model as one part, resume mid-schedule."""

from __future__ import annotations

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.sync import DilocoSync, algorithm_class, split_fragments
from geofed.regions.messages import RoundPlan

REGIONS = ["a", "b", "c"]


def _cfg(*, fragments=1, overlap=False, codec="identity", ef=False, extra=None):
    m = {"run": {"name": "t", "seed": 3},
         "task": {"kind": "mlp-digits", "hidden": 16},
         "regions": {"names": REGIONS},
         "sync": {"overlap": overlap, "fragments": fragments, "outer": {"momentum": 0.5}, "inner": {"lr": 0.01}},
         "compression": {"codec": codec, "error_feedback": ef},
         "network": {"emulation": {"mode": "none"}}}
    for key, value in (extra or {}).items():
        section, _, name = key.partition(".")
        m.setdefault(section, {})[name] = value
    return config_from_mapping(m)


def _train(tmp_path, cfg, rounds, *, name, H=4, start=0, group=None, keep=False):
    c = group or InProcessRegions(cfg, tmp_path / name)
    out = []
    for r in range(start, start + rounds):
        reports = c.run_round({reg: RoundPlan(round=r, H=H, final=(r == start + rounds - 1) and not keep)
                               for reg in REGIONS})
        out.append({reg: m.to_record() for reg, m in reports.items()})  # fragment keys live in the record's extra
    return c, out


def _globals(c):
    return {reg: [g.clone() for g in w.algorithm.eval_params()] for reg, w in c.workers.items()}


def test_split_covers_every_element_once_contiguous_and_balanced():
    shapes = [(64, 16), (16,), (16, 10), (10,), (300,), (5, 5), ()]
    rows = [s[0] if s else 1 for s in shapes]
    for n in (1, 2, 3, 5, 8, 40):
        frags = split_fragments(shapes, n)
        flat = [p for f in frags for p in f]
        assert len(frags) == n and all(frags)
        # in model order, each parameter's rows covered once, end to end
        for i, r in enumerate(rows):
            mine = [(a, b) for j, a, b in flat if j == i]
            assert mine[0][0] == 0 and mine[-1][1] == r and all(x[1] == y[0] for x, y in zip(mine, mine[1:]))
        assert [j for j, _, _ in flat] == sorted(j for j, _, _ in flat)
    # char-lm's GRU: 59% of the model in one matrix, still split within one row of even
    gru = [(62, 16), (192, 16), (192, 64), (192,), (192,), (62, 64), (62,)]
    sizes = [sum((b - a) * (s[1] if len(gru[i]) > 1 else 1) for i, a, b in f for s in [gru[i]])
             for f in split_fragments(gru, 3)]
    assert max(sizes) - min(sizes) <= 64 and sum(sizes) == 20766
    with pytest.raises(ValueError, match="sync.fragments"):
        split_fragments([(2,), (3,)], 6)


def test_one_fragment_is_the_whole_model_as_one_part(tmp_path):
    # N = 1 is DiLoCo itself, not a special case: one part over the parameters themselves, DiLoCo's
    # codec stream and checkpoint format.
    c = InProcessRegions(_cfg(overlap=True), tmp_path / "n1")
    try:
        w = c.workers["a"]
        algo = w.algorithm
        assert algorithm_class(_cfg().sync) is DilocoSync and len(algo.parts) == 1
        (part,) = algo.parts
        assert part.stream == "" and all(v.data_ptr() == p.data_ptr() for v, p in zip(part.live, w.params))
        assert set(algo.state_dict()) == {"global", "outer"} and algo.eval_params() is part.global_params
    finally:
        c.close()


def test_two_fragments_each_synced_every_other_round(tmp_path):
    cfg = _cfg(fragments=2)
    c = InProcessRegions(cfg, tmp_path / "n2")
    try:
        algo = c.workers["a"].algorithm
        assert isinstance(algo, DilocoSync) and len(algo.parts) == 2
        rows0 = c.workers["a"].params[0].shape[0]
        (i0, a0, b0), (i1, a1, b1) = algo.layout.pieces[:2]  # the first weight (most of the MLP) cut between rows
        assert (i0, a0, i1, b1) == (0, 0, 0, rows0) and 0 < b0 == a1 < rows0
        numel = [sum(g.numel() for g in part.global_params) for part in algo.parts]
        assert abs(numel[0] - numel[1]) <= c.workers["a"].params[0][0].numel()  # within one row
        before = [[g.clone() for g in part.global_params] for part in algo.parts]
        for r in range(4):
            res = c.run_round({reg: RoundPlan(round=r, H=4) for reg in REGIONS})
            now = [[g.clone() for g in part.global_params] for part in algo.parts]
            f = r % 2
            assert res["a"].extra["fragment"] == f
            changed = [k for k in range(2) if not all(torch.equal(x, y) for x, y in zip(before[k], now[k]))]
            assert changed == [f], (r, changed)  # only this round's fragment moved
            # identity codec: 4 bytes a float, to 2 peers, plus the wire format's headers
            assert 8 * numel[f] <= res["a"].exchange.bytes_sent < 8 * numel[f] + 2048
            before = now
        g = _globals(c)
        for reg in ("b", "c"):  # one global model everywhere (up to the order of the mix's sum)
            assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(g["a"], g[reg]))
        # the live model differs from the global one only in the fragment not synced last
        p0, p1 = algo.parts
        assert all(torch.equal(v, g) for v, g in zip(p1.live, p1.global_params))
        assert not any(torch.equal(v, g) for v, g in zip(p0.live, p0.global_params))
        assert [tuple(t.shape) for t in algo.eval_params()] == [tuple(p.shape) for p in c.workers["a"].params]
    finally:
        c.close()


@pytest.mark.parametrize("overlap", [True, "eager"])
def test_fragments_with_overlap_and_a_lossy_codec_learn(tmp_path, overlap):
    cfg = _cfg(fragments=2, overlap=overlap, codec="int8", ef=True)
    c, out = _train(tmp_path, cfg, 8, name=f"o{overlap}", H=8)
    try:
        assert out[1]["a"]["exchange_fragment"] == 0 and out[2]["a"]["exchange_fragment"] == 1
        g = _globals(c)
        for reg in ("b", "c"):  # a lossy codec: each region mixes its own exact update (as DiLoCo N=1: 3e-4)
            assert all(torch.allclose(x, y, atol=2e-3) for x, y in zip(g["a"], g[reg]))
        ev = c.workers["a"].evaluate_synced()
        assert ev["value"] > 0.5, ev
        keys = set(c.workers["a"].exchanger.states)
        assert {k.split("@")[1] for k in keys} == {"frag0", "frag1"}  # a codec stream per fragment
    finally:
        c.close()


def test_resume_mid_schedule_continues_exactly(tmp_path):
    cfg = _cfg(fragments=3, codec="int8", ef=True)
    whole, _ = _train(tmp_path, cfg, 7, name="whole")
    want = _globals(whole)
    whole.close()
    first, _ = _train(tmp_path, cfg, 4, name="split", keep=True)  # rounds 0-3: round 4 is fragment 1
    first.call(lambda r: r.save_checkpoint())
    first.close()
    again = InProcessRegions(cfg, tmp_path / "split")
    try:
        assert all(v["round"] == 3 for v in again.call(lambda r: r.restore_checkpoint()).values())
        _train(tmp_path, cfg, 3, name="split", start=4, group=again)
        got = _globals(again)
        for reg in REGIONS:
            assert all(torch.equal(x, y) for x, y in zip(want[reg], got[reg])), reg
    finally:
        again.close()


@pytest.mark.parametrize("extra, words", [
    ({"sync.algorithm": "gossip"}, "sync.algorithm diloco"),
    ({"sync.topology": "one-peer-exponential"}, "static topology"),
    ({"sync.pacing": {"mode": "quorum", "quorum": 2}}, "quorum"),
])
def test_config_refuses_what_fragments_do_not_support(extra, words):
    with pytest.raises(Exception, match="fragments") as info:
        _cfg(fragments=2, extra=extra)
    assert words in str(info.value)


def test_config_refuses_secure_aggregation_with_fragments():
    with pytest.raises(Exception, match="sync.fragments.*secure aggregation"):
        _cfg(fragments=2, codec="int8", extra={"security.secure_aggregation": True})


def test_peak_to_mean_of_a_link():
    from geofed.orchestrator.driver.linkrate import busiest, link_peak_to_mean, peak_to_mean

    # 1000 bytes every second, each push 0.1 s long: every 1 s window holds the same bytes
    steady = [(k + 0.5, 0.1, 1000.0) for k in range(10)]
    assert peak_to_mean(steady, 1.0) == pytest.approx(1.0)
    # the same 10 000 bytes as one push in the first of ten windows: 10x the mean
    burst = [(0.5, 0.1, 10_000.0), (9.5, 0.0, 0.0)]
    assert peak_to_mean(burst + [(9.9, 0.0, 1e-9)], 1.0) == pytest.approx(10.0, rel=1e-3)
    # 4000 bytes every 2 s as one push, or as four fragments of 1000 spread over the period
    whole = [(2 * k + 0.1, 0.1, 4000.0) for k in range(10)]
    frags = [(0.5 * k + 0.1, 0.1, 1000.0) for k in range(40)]
    assert peak_to_mean(whole, 1.0) > 1.8 and peak_to_mean(frags, 1.0) < 1.1
    assert peak_to_mean([(0.1, 0.1, 5.0)]) is None  # under MIN_WINDOWS
    metrics = [{"region": "a", "transfers": [{"peer": "b", "direction": "send", "bytes": b, "seconds": s, "t_end": t}
                                             for t, s, b in whole]}]
    ratios = link_peak_to_mean(metrics)
    assert set(ratios) == {"a->b"} and ratios["a->b"] == peak_to_mean(whole)
    assert busiest({"a->b": {"bytes": 5, "peak_to_mean": 2.0}, "b->a": {"bytes": 9, "peak_to_mean": 1.5}}) == ("b->a", 1.5)


def test_admission_keeps_a_reference_norm_per_fragment():
    from geofed.p2p.robust import AdmissionPerLayout

    adm = AdmissionPerLayout(mode="clip", norm_multiple=10.0)
    small, big = [torch.full((4,), 0.01)], [torch.full((2, 3), 5.0)]
    for _ in range(4):
        adm.observe_own(small)
        adm.observe_own(big)
    # a big fragment's normal update is not clipped against the small fragment's norms
    assert torch.equal(adm.admit("b", [torch.full((2, 3), 5.0)])[0], big[0])
    out = adm.admit("b", [torch.full((4,), 10.0)])  # 1000x the small fragment's norm
    assert float(out[0].norm()) < 1.0 and adm.take_clipped() == {"b": 1}


def test_the_coordinator_plans_rounds_of_H_over_N_steps():
    from geofed.orchestrator.driver.coordinator import Coordinator

    class ManualClock:
        def now(self) -> float:
            return 0.0

    cfg = _cfg(fragments=3, extra={"sync.policy": {"kind": "fixed", "H": 100}, "run.max_steps": 200})
    c = Coordinator(cfg, model_numel=1000, clock=ManualClock())
    plans = [c.plan(r, alive=REGIONS, evaluate=False)["a"] for r in range(6)]
    # every parameter syncs every 100 steps: rounds of 34, the last one what is left of max_steps
    assert [p.H for p in plans[:5]] == [34] * 5 and plans[5].H == 30 and plans[5].final
    assert "H 100/3 fragments per round" in c.last_reason
