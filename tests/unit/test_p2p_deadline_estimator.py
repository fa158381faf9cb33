import random

import pytest

from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.estimator import LinkEstimator


def test_deadline_starts_at_initial_then_follows_median_plus_k_mad_clamped():
    d = AdaptiveDeadline(30.0, 1.0, 120.0, 4.0)
    assert d.current() == 30.0
    for s in (2.0, 3.0, 4.0):
        d.observe(s)
    # median 3, MAD 1 -> 3 + 4 * 1
    assert d.current() == pytest.approx(7.0)
    for _ in range(40):
        d.observe(0.01)
    assert d.current() == 1.0  # clamped at min_s
    for _ in range(40):
        d.observe(500.0)
    assert d.current() == 120.0  # clamped at max_s


def test_equal_samples_still_leave_slack():
    d = AdaptiveDeadline(30.0, 0.1, 120.0, 4.0)
    for _ in range(10):
        d.observe(10.0)
    assert d.current() == pytest.approx(14.0)  # MAD floored at 10% of the median


def test_misses_stretch_the_deadline_and_a_complete_round_resets_it():
    d = AdaptiveDeadline(5.0, 1.0, 20.0, 2.0)
    for s in (2.0, 2.0, 2.0):
        d.observe(s)
    base = d.current()
    d.observe_miss()
    d.observe_miss()
    assert d.current() == pytest.approx(base * 2.25)
    for _ in range(20):
        d.observe_miss()
    assert d.current() == 20.0
    d.observe(2.0)
    assert d.current() == pytest.approx(base)
    restored = AdaptiveDeadline(5.0, 1.0, 20.0, 2.0)
    restored.load_state_dict(d.state_dict())
    assert restored.current() == d.current()


def test_deadline_config_errors_name_the_key():
    with pytest.raises(ValueError, match="initial_s:"):
        AdaptiveDeadline(0.5, 1.0, 2.0, 1.0)
    with pytest.raises(ValueError, match="k:"):
        AdaptiveDeadline(1.0, 1.0, 2.0, -1.0)


def _transfer(bw_bps, rtt_s, nbytes, rng):
    # Sender-timed transfer over a shaped link: RTT + serialisation, slowed a little by noise.
    return rtt_s + nbytes * 8 / bw_bps * (1 + abs(rng.gauss(0, 0.03)))


def test_estimator_is_within_10_percent_after_3_transfers_and_follows_steps():
    rng = random.Random(0)
    est = LinkEstimator()
    assert est.bandwidth_bps is None and est.rtt_s is None
    for _ in range(5):
        est.observe_rtt(0.080 + abs(rng.gauss(0, 0.004)))
    assert est.rtt_s == pytest.approx(0.080, rel=0.05)
    for size in (1 << 20, 4 << 20, 2 << 20):
        est.observe_transfer(size, _transfer(50e6, 0.080, size, rng))
    assert est.bandwidth_bps == pytest.approx(50e6, rel=0.10)
    for bw in (10e6, 200e6):  # a step down, then up
        for _ in range(3):
            est.observe_transfer(8 << 20, _transfer(bw, 0.080, 8 << 20, rng))
        assert est.bandwidth_bps == pytest.approx(bw, rel=0.10)


def test_small_transfers_measure_rtt_not_bandwidth():
    est = LinkEstimator()
    est.observe_transfer(1000, 0.05)
    assert est.bandwidth_bps is None and est.rtt_s == 0.05
    est.observe_transfer(1 << 20, 0.1, includes_rtt=False)  # receiver-timed: no RTT to subtract
    assert est.bandwidth_bps == pytest.approx((1 << 20) * 8 / 0.1)
    assert est.snapshot()["transfers"] == 2
    with pytest.raises(ValueError, match="seconds:"):
        est.observe_transfer(10, 0.0)


def test_silence_does_not_widen_the_deadline_but_a_late_arrival_does():
    """Issue 36 N2, gap 1a: a peer that never arrives while every other in-neighbour arrived well
    inside the deadline is silence, not lateness. Before: observe_miss() widened x1.5 on every such
    round (AttributeError here: there was no observe_incomplete/observe_late)."""
    d = AdaptiveDeadline(5.0, 0.5, 10.0, 4.0)
    d.observe_incomplete([0.2, 0.3], deadline_s=5.0)  # the others came in 0.3 s of 5 s
    d.observe_incomplete([0.2, 0.3], deadline_s=5.0)
    assert d.current() == 5.0
    d.observe_incomplete([0.3], deadline_s=5.0)  # the last arrivals are samples: 3 of them now
    assert d.current() == pytest.approx(0.5)  # median 0.3 + 4 x MAD 0 (floored at 0.03), clamped at min_s
    d = AdaptiveDeadline(5.0, 0.5, 10.0, 4.0)
    # Evidence of a slow network (the others came close to the deadline) still widens it.
    d.observe_incomplete([4.5], deadline_s=5.0)
    assert d.current() == pytest.approx(7.5)
    # No other in-neighbour to compare with: no evidence either way, widen as before.
    e = AdaptiveDeadline(5.0, 0.5, 10.0, 4.0)
    e.observe_incomplete([], deadline_s=5.0)
    assert e.current() == pytest.approx(7.5)
    # An update that arrived 6.4 s after its round's receive began (refused late): the next
    # round's deadline covers it, with the margin of the growth factor.
    f = AdaptiveDeadline(5.0, 0.5, 10.0, 4.0)
    for s in (0.3, 0.3, 0.3):
        f.observe(s)
    f.observe_late(6.4)
    assert 6.4 < f.current() <= 10.0
    f.observe_late(50.0)
    assert f.current() == 10.0
    with pytest.raises(ValueError, match="seconds:"):
        f.observe_late(-1.0)
