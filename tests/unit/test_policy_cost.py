"""The sync cost model: D per link, H from D and back, the ladder."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from geofed.compression import CodecSpec, make_codec
from geofed.orchestrator.policies import cost
from geofed.orchestrator.policies.types import LinkEstimate

steps = st.floats(1e-4, 1.0)
syncs = st.floats(1e-3, 100.0)
fractions = st.floats(0.01, 0.9)


def test_sync_time_is_rtt_plus_serialisation():
    link = LinkEstimate(bandwidth_bps=50e6, rtt_s=0.08)
    assert cost.sync_time(link, 1_000_000, rtt_factor=1.0) == pytest.approx(0.08 + 8e6 / 50e6)
    assert cost.sync_time(link, 1_000_000, rtt_factor=2.0) == pytest.approx(0.16 + 8e6 / 50e6)
    assert cost.sync_time(LinkEstimate(bandwidth_bps=8e6), 1_000_000, rtt_factor=1.0) == pytest.approx(1.0)


@given(syncs, steps, fractions)
def test_serial_H_is_the_smallest_that_keeps_comm_under_the_fraction(D, step, f):
    H = cost.ceil_H(cost.H_for_sync(D, step, overlap=False, comm_fraction=f, margin=1.0))
    assert D / (H * step + D) <= f * (1 + 1e-6)
    if H > 1:
        assert D / ((H - 1) * step + D) > f


@given(syncs, steps, st.floats(1.0, 3.0))
def test_overlap_H_is_the_smallest_that_hides_the_sync(D, step, margin):
    H = cost.ceil_H(cost.H_for_sync(D, step, overlap=True, comm_fraction=0.1, margin=margin))
    assert H * step >= margin * D * (1 - 1e-9)
    if H > 1:
        assert (H - 1) * step < margin * D


@given(st.floats(1.0, 1e5), steps, fractions, st.booleans())
def test_budget_is_the_inverse_of_H_for_sync(H, step, f, overlap):
    T = cost.budget_for_H(H, step, overlap=overlap, comm_fraction=f, margin=1.3)
    assert cost.H_for_sync(T, step, overlap=overlap, comm_fraction=f, margin=1.3) == pytest.approx(H)


def test_ladder_orders_by_ratio_and_caches_per_size():
    calls = []

    def ratio(spec, numel):
        calls.append((spec, numel))
        return {"int4": 7.5, "fp16": 2.0, "int8": 3.9}[spec.key]

    ladder = cost.Ladder([CodecSpec.parse(s) for s in ("int4", "fp16", "int8")], ratio)
    assert [g.spec.key for g in ladder.rungs(1000)] == ["fp16", "int8", "int4"]
    ladder.rungs(1000)
    assert len(calls) == 3
    assert ladder.index_of(CodecSpec.parse({"kind": "int8"}), 1000) == 1
    assert ladder.index_of(CodecSpec.parse("topk"), 1000) is None


def test_ladder_refuses_a_nonsense_ratio():
    with pytest.raises(ValueError, match="estimate_ratio gave"):
        cost.Ladder([CodecSpec.parse("int8")], lambda s, n: math.nan).rungs(10)


def test_least_fitting_prefers_least_compression_and_falls_back_to_the_strongest():
    assert cost.least_fitting([3.0, 2.0, 1.0], 2.5) == 1
    assert cost.least_fitting([3.0, 2.0, 1.0], 5.0) == 0
    assert cost.least_fitting([3.0, 2.0, 1.0], 0.5) == 2


def test_default_ratio_asks_the_codec():
    spec = CodecSpec.parse({"kind": "topk", "inner": "int8", "fraction": 0.01})
    assert cost.compression_ratio(spec, 1_000_000) == make_codec(spec).estimate_ratio(1_000_000) > 100
