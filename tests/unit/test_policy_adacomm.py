"""AdaComm on top of a fixed or bandwidth base: tau_l = ceil(tau_0 * sqrt(F_l/F_0) * (lr0/lr)^1.5)."""

import json
import math

import pytest

from geofed.orchestrator.policies import (AdacommPolicyConfig, BandwidthPolicyConfig, FixedPolicyConfig,
                                          LinkEstimate, Measurements, make_policy)
from support.policy_sim import table_ratio

ratio = table_ratio({"fp16": 2.0, "int8": 3.9})
LINKS = {"a->b": LinkEstimate(bandwidth_bps=50e6, rtt_s=0.08), "b->a": LinkEstimate(bandwidth_bps=50e6, rtt_s=0.08)}


def meas(round_, loss, *, now=None, lr=1.0, lr0=1.0, links=LINKS):
    return Measurements(now_s=float(round_ if now is None else now), round=round_, step_time_s=0.01, loss=loss,
                        lr=lr, lr0=lr0, model_numel=1_000_000, links=links, overlap=False)


def adacomm(base=None, **kw):
    base = FixedPolicyConfig(H=64) if base is None else base
    return make_policy(AdacommPolicyConfig(base=base, **kw), codec="fp16", ratio=ratio)


def test_the_factor_follows_sqrt_of_the_loss_ratio_and_is_held_for_an_interval():
    losses = [None, 2.0, 1.8, 1.5, 1.2, 1.0, 0.9, 0.7, 0.5, 0.4, 0.3, 0.2]
    p = adacomm(interval_rounds=3, lr_exponent=0.0)
    Hs = [p.decide(meas(r, loss)).H for r, loss in enumerate(losses)]
    # F0 = 2.0 seen at round 1; new intervals start at rounds 4, 7, 10 with the loss seen then.
    expect = [64, 64, 64, 64] + [math.ceil(64 * math.sqrt(1.2 / 2.0))] * 3 \
        + [math.ceil(64 * math.sqrt(0.7 / 2.0))] * 3 + [math.ceil(64 * math.sqrt(0.3 / 2.0))] * 2
    assert Hs == expect
    assert Hs[-1] < Hs[4] < Hs[0]


def test_the_lr_ratio_enters_with_its_exponent():
    p = adacomm(interval_rounds=1, lr_exponent=1.5)
    p.decide(meas(0, 1.0))
    d = p.decide(meas(1, 1.0, lr=0.25, lr0=1.0))
    assert d.H == math.ceil(64 * 4 ** 1.5) and d.details["lr_ratio"] == pytest.approx(4.0)
    assert "lr0/lr 4" in d.reason


def test_interval_s_uses_the_clock_passed_in():
    p = adacomm(interval_s=10.0, lr_exponent=0.0)
    p.decide(meas(0, 4.0, now=0.0))
    assert p.decide(meas(1, 1.0, now=9.9)).H == 64
    assert p.decide(meas(2, 1.0, now=10.0)).H == 32
    assert p.decide(meas(3, 0.25, now=15.0)).H == 32


def test_without_a_usable_loss_the_base_H_stands():
    p = adacomm(interval_rounds=1)
    for r, loss in enumerate([None, float("nan"), -1.0, 0.0]):
        d = p.decide(meas(r, loss))
        assert d.H == 64 and d.details["event"] == "initial" and "waits for a loss" in d.reason


def test_bounds_apply_after_the_factor():
    p = adacomm(interval_rounds=1, lr_exponent=0.0, H_min=20, H_max=100)
    p.decide(meas(0, 1.0))
    assert p.decide(meas(1, 0.01)).H == 20
    assert p.decide(meas(2, 100.0)).H == 100


def test_on_a_bandwidth_base_it_scales_the_bandwidth_H_and_keeps_its_codecs():
    base_cfg = BandwidthPolicyConfig(hysteresis=0.0, hold_rounds=0)
    p = adacomm(base=base_cfg, interval_rounds=1, lr_exponent=0.0)
    twin = make_policy(base_cfg, codec="fp16", ratio=ratio)
    for r, loss in enumerate([3.0, 3.0, 0.75]):
        d, b = p.decide(meas(r, loss)), twin.decide(meas(r, loss))
    assert d.H == math.ceil(b.H * 0.5) and d.codecs == b.codecs
    assert d.details["H_base"] == b.H and d.details["base"]["kind"] == "bandwidth"


def test_a_resumed_adacomm_continues_with_the_same_state():
    losses = [None, 2.0, 1.5, 1.2, 1.0, 0.8, 0.6, 0.5, 0.4]
    rounds = [meas(r, loss, links=LINKS) for r, loss in enumerate(losses)]
    base = BandwidthPolicyConfig(hold_rounds=1)
    straight = adacomm(base=base, interval_rounds=2)
    expected = [straight.decide(m).H for m in rounds]
    first = adacomm(base=base, interval_rounds=2)
    for m in rounds[:4]:
        first.decide(m)
    resumed = adacomm(base=base, interval_rounds=2)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.decide(m).H for m in rounds[4:]] == expected[4:]
    assert len(set(expected)) > 2
