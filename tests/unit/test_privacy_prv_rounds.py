"""The PRV accountant's per-round cost (regions/privacy/prv_compose.py): a run composes every round
within the one discretisation its plan built, in double precision, and reports what an independent
fresh computation reports, never less than the package's own composition of the same discretisation."""

from __future__ import annotations

import warnings

import pytest
from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

from geofed.regions.privacy.accountant import epsilon_after
from geofed.regions.privacy.budget import PrivacyBudget, accountant_from_state
from geofed.regions.privacy.prv import EPS_ERROR, prv_epsilon
from geofed.regions.privacy.prv_compose import Discretisation, discretisation

DP_EPS8 = dict(rate=32 / 336, noise=2.35589599609375, delta=1e-5)  # bench privacy's arm, PRV's noise for epsilon 8


def fresh_epsilon(rate: float, noise: float, steps: int, delta: float) -> float:
    """The package on its own: a discretisation for exactly `steps`, its long double composition."""
    prv = PoissonSubsampledGaussianMechanism(sampling_probability=rate, noise_multiplier=noise)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = PRVAccountant(prvs=[prv], eps_error=EPS_ERROR, delta_error=delta / 1000, max_self_compositions=[steps])
        return acc.compute_epsilon(delta, [steps])[2]


def test_a_runs_epsilons_are_a_fresh_computations_and_build_one_discretisation():
    """dp_eps8's 30 rounds of 50 steps: one discretisation (at most: another test may have built it),
    and at 50, 750 and 1500 steps the epsilon of the package's own accountant for that step count,
    to 1e-4 (the discretisations differ; EPS_ERROR is 0.02); at 1500 within PLD's 7.956 and its error."""
    budget = PrivacyBudget.plan(mode="record", noise_multiplier=DP_EPS8["noise"], target_epsilon=8.0,
                                delta=DP_EPS8["delta"], rounds=30, steps_per_round=50, batch_size=32,
                                smallest_shard=336, accountant="prv")
    built = discretisation.cache_info().misses
    eps = []
    for _ in range(30):
        assert budget.check_next(50) == "ok"
        budget.spend(50)
        eps.append(budget.metrics()["dp_epsilon"])
    assert discretisation.cache_info().misses - built <= 1
    # The package's domain (179,074 = 2 x 7 x 12791 points) widened to an FFT-friendly length.
    assert len(discretisation(((DP_EPS8["rate"], DP_EPS8["noise"]),), (1500,), EPS_ERROR, 1e-8)) == 180_000
    assert all(a < b for a, b in zip(eps, eps[1:]))
    for rounds in (1, 15, 30):
        steps = 50 * rounds
        fresh = fresh_epsilon(DP_EPS8["rate"], DP_EPS8["noise"], steps, DP_EPS8["delta"])
        assert eps[rounds - 1] == pytest.approx(fresh, abs=1e-4)
        assert eps[rounds - 1] < epsilon_after(noise_multiplier=DP_EPS8["noise"], sample_rate=DP_EPS8["rate"],
                                               steps=steps, delta=DP_EPS8["delta"])  # PRV's, not RDP's
    assert 7.956 <= eps[-1] <= 7.956 + 2 * EPS_ERROR


def test_uneven_rounds_compose_as_a_fresh_power_does_and_never_under_the_packages_own():
    """Rounds of uneven steps (a budget_s round checks max_steps, then spends what it ran) take the
    kept powers along other paths: the same epsilon as the power taken at once (to 1e-7: the search
    divides a difference of sums), and never under the package's long double composition of the same
    discretisation (by at most 1e-4)."""
    rate, noise, delta = 0.05, 1.2, 1e-5
    disc = discretisation(((rate, noise),), (400,), EPS_ERROR, delta / 1000)
    steps = 0
    for check, ran in [(50, 50), (80, 63), (50, 50), (80, 80), (37, 37), (50, 12)]:
        disc.epsilon(delta, [steps + check])
        steps += ran
        got = disc.epsilon(delta, [steps])
        once = Discretisation(disc.accountant).epsilon(delta, [steps])
        assert got == pytest.approx(once, abs=1e-7)
        package = disc.accountant.compute_epsilon(delta, [steps])[2]
        assert package <= got <= package + 1e-4


def test_two_noises_compose_through_the_packages_convolution():
    """A run whose noise changed (two segments): the package's heterogeneous composition, here in
    double precision: at or above its own, by at most 1e-4."""
    disc = discretisation(((0.05, 1.0), (0.05, 1.5)), (200, 200), EPS_ERROR, 1e-8)
    got = disc.epsilon(1e-5, [120, 200])
    package = disc.accountant.compute_epsilon(1e-5, [120, 200])[2]
    assert package <= got <= package + 1e-4
    assert prv_epsilon(((0.05, 1.0, 120), (0.05, 1.5, 200)), 1e-5, 200) == got


def test_a_planned_budget_builds_nothing_in_its_rounds_and_a_resume_keeps_its_horizon():
    """The noise search's last discretisation covers the planned steps; a checkpoint keeps them."""
    budget = PrivacyBudget.plan(mode="record", noise_multiplier=None, target_epsilon=3.0, delta=1e-5, rounds=8,
                                steps_per_round=25, batch_size=32, smallest_shard=900, accountant="prv")
    built = discretisation.cache_info().misses
    for _ in range(4):
        assert budget.check_next(25) == "ok"
        budget.spend(25)
    restored = accountant_from_state(budget.accountant.state())
    assert restored.horizon == budget.accountant.horizon == 200
    resumed = PrivacyBudget(mode="record", noise_multiplier=budget.noise_multiplier, sample_rate=budget.sample_rate,
                            delta=budget.delta, target_epsilon=3.0, accountant=restored)
    for _ in range(4):
        assert resumed.check_next(25) == "ok"
        resumed.spend(25)
    assert discretisation.cache_info().misses == built
    assert resumed.epsilon() <= 3.0 and resumed.check_next(25) == "stop"
