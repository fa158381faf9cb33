"""The bandwidth policy's byte budget (``min_compression``): H x codec ratio >= the budget on every
link, reached by the least compression the ladder allows at target_H, with H raised where needed."""

import math
from pathlib import Path

import pytest
import yaml
from geofed.compression import CodecSpec, make_codec
from geofed.orchestrator.policies import (
    BandwidthPolicyConfig,
    LinkEstimate,
    make_policy,
)
from support.policy_sim import table_ratio
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_links import measurements, mesh

RATIOS = {"fp16": 2.0, "int8": 3.9, "int4": 7.5, "topk": 50.0}
LADDER = ["int8", "int4", "topk"]
NUMEL = 100_000
ratio = table_ratio(RATIOS)


def meas(round_, links, *, step=0.01, overlap=True):
    return measurements(round_, links, numel=NUMEL, step=step, overlap=overlap)


def policy(ladder=LADDER, codec="int8", **kw):
    kw = {"H_min": 1, "initial_H": 50, "target_H": 50, "hysteresis": 0.0, "hold_rounds": 0, **kw}
    return make_policy(BandwidthPolicyConfig(**kw), codec=codec, ladder=ladder, ratio=ratio)


def test_off_by_default_the_least_compression_that_fits():
    d = policy().decide(meas(1, mesh(50e6)))
    assert {c.key for c in d.codecs.values()} == {"int8"} and "H_bytes" not in d.details


def test_a_budget_takes_the_least_compression_that_meets_it_at_target_H():
    # int8 at H 50 gives 195x, int4 375x: a budget of 300 rules int8 out, int4 meets it
    d = policy(min_compression=300).decide(meas(1, mesh(50e6)))
    assert {c.key for c in d.codecs.values()} == {"int4"} and d.H * 7.5 >= 300
    # 1000x needs H 134 with int4 (past target_H 50) or H 20 with top-k: top-k, H from the sync
    d = policy(min_compression=1000).decide(meas(1, mesh(50e6)))
    assert {c.key for c in d.codecs.values()} == {"topk"} and d.H * 50 >= 1000
    assert d.details["H_bytes"] == pytest.approx(20.0)


def test_H_is_raised_when_even_the_strongest_codec_needs_it():
    d = policy(min_compression=10_000).decide(meas(1, mesh(50e6, rtt=0.001), step=0.05))
    assert d.H == 200 and {c.key for c in d.codecs.values()} == {"topk"} and d.details["bound_by"] == "bytes"
    assert "H_max" not in d.reason and "byte budget 10000x needs H>=200" in d.reason
    capped = policy(min_compression=10_000, H_max=100).decide(meas(1, mesh(50e6), step=0.05))
    assert capped.H == 100 and {c.key for c in capped.codecs.values()} == {"topk"}  # the bound wins; strongest codec


def test_the_first_round_already_keeps_the_budget():
    unmeasured = {k: LinkEstimate() for k in mesh(50e6)}
    d = policy(min_compression=300).decide(meas(0, unmeasured, step=None))
    assert d.H == 50 and {c.key for c in d.codecs.values()} == {"int4"} and d.details["event"] == "initial"
    d = policy(min_compression=5000).decide(meas(0, unmeasured, step=None))
    assert d.H == 100 and {c.key for c in d.codecs.values()} == {"topk"}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0.3e6, 500e6), min_size=3, max_size=8), st.floats(1.0, 5000.0),
       st.floats(0.001, 0.05), st.booleans(), st.integers(10, 400))
def test_every_round_keeps_H_times_ratio_within_the_budget(bws, budget, step, overlap, target_H):
    p = policy(min_compression=budget, target_H=target_H, hysteresis=0.25, hold_rounds=2, H_max=1_000_000)
    for r, bw in enumerate(bws, start=1):
        d = p.decide(meas(r, mesh(bw), step=step, overlap=overlap))
        worst = min(RATIOS[spec.key] for spec in d.codecs.values())
        assert d.H * worst >= budget * (1 - 1e-9) or math.isclose(d.H * worst, budget, rel_tol=1e-6), (r, d.reason)


def test_slow_links_still_get_stronger_codecs_than_fast_ones_within_the_budget():
    speeds = {"r0": 400e6, "r1": 100e6, "r2": 10e6, "r3": 0.5e6}
    links = mesh(lambda name: speeds[name.split("->")[0]], rtt=0.05)
    d = policy(min_compression=500, target_H=100).decide(meas(1, links))  # int8 would need H 129
    assert d.codecs["r0->r1"].key == "int4" and d.codecs["r3->r0"].key == "topk"


def test_the_key_is_checked():
    with pytest.raises(ValueError, match="min_compression"):
        BandwidthPolicyConfig(min_compression=0.5)


@pytest.mark.parametrize("numel", [20_800, 85_002])  # bench wan's char GRU; bench cluster's digits MLP
def test_bench_wan_policy_runs_int3_at_H100_within_the_byte_budget(numel):
    # configs/bench-wan.yaml with the codecs' own ratios: int3 (10.0-10.2x) meets the 1000x budget
    # at H 100, where int4 needed H 127 (issue 14: bench cluster's race is decided by round 0), both
    # before anything is measured and once fast links are.
    doc = yaml.safe_load((Path(__file__).parents[2] / "configs" / "bench-wan.yaml").read_text())
    pol = {k: v for k, v in doc["sync"]["policy"].items() if k != "kind"}
    ladder = [CodecSpec.parse(s) for s in doc["compression"]["ladder"]]
    p = make_policy(BandwidthPolicyConfig(**pol), codec=CodecSpec.parse(doc["compression"]["codec"]), ladder=ladder)
    m0 = measurements(0, {k: LinkEstimate() for k in mesh(1.0)}, numel=numel, step=None, overlap=True)
    d = p.decide(m0)
    assert d.H == 100 and {c.key for c in d.codecs.values()} == {"int3"}
    d = p.decide(measurements(1, mesh(16.7e6), numel=numel, step=0.004, overlap=True))
    assert {c.key for c in d.codecs.values()} == {"int3"} and d.H == 100
    assert d.H * make_codec("int3").estimate_ratio(numel) >= 1000 > d.H * make_codec("int4").estimate_ratio(numel)
