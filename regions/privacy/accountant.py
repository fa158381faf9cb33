"""An RDP accountant for the (Poisson-)subsampled Gaussian mechanism (Mironov, Talwar, Zhang 2019,
"Rényi Differential Privacy of the Sampled Gaussian Mechanism"), with the epsilon conversion of
Balle et al. 2020 (tighter than Mironov's log(1/delta)/(alpha-1)), and the search for the noise
multiplier that meets a target epsilon. Pure Python (math only): the same numbers Opacus and
TF-Privacy compute.

Record-level DP: one step at sampling rate q = expected batch / shard size per inner step.
Update-level DP: one step at q = 1 per round (every region's update is in every round).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

# Opacus's and TF-Privacy's default orders: fine near 1, where small epsilons are found, then integers.
DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256])


def _log_add(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    return hi if lo == -math.inf else hi + math.log1p(math.exp(lo - hi))


def _log_sub(a: float, b: float) -> float:
    """log(exp(a) - exp(b)) for a >= b."""
    if b == -math.inf:
        return a
    if a <= b:
        return -math.inf
    return a + math.log(-math.expm1(b - a))


def _log_erfc(x: float) -> float:
    """log(erfc(x)) without underflow for large x (erfc(27) is below the smallest double)."""
    if x < 25:
        return math.log(math.erfc(x))
    # Asymptotic series: erfc(x) ~ exp(-x^2) / (x sqrt(pi)) * (1 - 1/(2x^2) + 3/(4x^4) - 15/(8x^6)).
    r = 1 / (x * x)
    return -x * x - math.log(x) - 0.5 * math.log(math.pi) + math.log1p(-r / 2 + 3 * r * r / 4 - 15 * r ** 3 / 8)


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha for integer alpha: a finite binomial sum."""
    log_a = -math.inf
    for i in range(alpha + 1):
        log_coef = math.log(math.comb(alpha, i)) + i * math.log(q) + (alpha - i) * math.log1p(-q)
        log_a = _log_add(log_a, log_coef + (i * i - i) / (2 * sigma ** 2))
    return log_a


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    """log A_alpha for fractional alpha: two infinite series, summed until their terms vanish."""
    log_a0 = log_a1 = -math.inf
    z0 = sigma ** 2 * math.log(1 / q - 1) + 0.5
    coef, i = 1.0, 0  # the generalised binomial coefficient C(alpha, i), built term by term
    while True:
        j = alpha - i
        log_coef = math.log(abs(coef))
        log_t0 = log_coef + i * math.log(q) + j * math.log1p(-q)
        log_t1 = log_coef + j * math.log(q) + i * math.log1p(-q)
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * sigma ** 2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma ** 2) + log_e1
        if coef > 0:
            log_a0, log_a1 = _log_add(log_a0, log_s0), _log_add(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        if max(log_s0, log_s1) < -30 or i > 10_000:
            return _log_add(log_a0, log_a1)
        coef *= (alpha - i) / (i + 1)
        i += 1


def rdp_subsampled_gaussian(q: float, sigma: float, alpha: float) -> float:
    """The RDP of one step of the Poisson-subsampled Gaussian mechanism at order alpha > 1:
    sampling rate q, noise std sigma times the sensitivity (clip)."""
    if not 0 <= q <= 1 or sigma < 0 or not alpha > 1:
        raise ValueError(f"need q in [0, 1], sigma >= 0, alpha > 1; got {q}, {sigma}, {alpha}")
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if q == 1:
        return alpha / (2 * sigma ** 2)  # the Gaussian mechanism itself
    log_a = _log_a_int(q, sigma, int(alpha)) if float(alpha).is_integer() else _log_a_frac(q, sigma, alpha)
    return log_a / (alpha - 1)


@lru_cache(maxsize=64)
def rdp_per_step(q: float, sigma: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    """One step's RDP at every order: the same for every round of a run, and 15 ms to compute
    (the fractional orders' series), so kept."""
    return tuple(rdp_subsampled_gaussian(q, sigma, a) for a in orders)


def epsilon_from_rdp(rdp: Sequence[float], orders: Sequence[float], delta: float) -> tuple[float, float]:
    """(epsilon, the order that gave it) for `delta`: min over orders of
    rdp - (log delta + log alpha)/(alpha - 1) + log((alpha - 1)/alpha) (Balle et al. 2020, Thm 21)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta: must be in (0, 1), got {delta}")
    best = (math.inf, math.nan)
    for r, a in zip(rdp, orders):
        eps = r - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
        best = min(best, (max(0.0, eps), a))
    return best


@lru_cache(maxsize=256)
def _epsilon_of(rdp: tuple[float, ...], orders: tuple[float, ...], delta: float) -> float:
    """epsilon_from_rdp's epsilon, kept: a round asks for the same one up to three times."""
    return epsilon_from_rdp(rdp, orders, delta)[0]


@dataclass
class RdpAccountant:
    """Composes steps of the subsampled Gaussian mechanism (RDP adds up over steps)."""

    kind = "rdp"

    orders: tuple[float, ...] = DEFAULT_ORDERS
    rdp: list[float] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self):
        if not self.rdp:
            self.rdp = [0.0] * len(self.orders)

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Account for `steps` steps at this noise multiplier and sampling rate."""
        if steps < 0:
            raise ValueError(f"steps: must be >= 0, got {steps}")
        per_step = rdp_per_step(float(sample_rate), float(noise_multiplier), tuple(self.orders))
        for k, r in enumerate(per_step):
            self.rdp[k] += steps * r
        self.steps += steps

    def epsilon(self, delta: float) -> float:
        """The epsilon spent so far at `delta`."""
        return _epsilon_of(tuple(self.rdp), tuple(self.orders), delta)

    def epsilon_if(self, delta: float, *, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        """Epsilon after `steps` more steps, nothing spent."""
        trial = RdpAccountant.from_state(self.state())
        trial.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
        return trial.epsilon(delta)

    def state(self) -> dict:
        """What a checkpoint keeps: the orders, the RDP per order, the steps."""
        return {"orders": list(self.orders), "rdp": list(self.rdp), "steps": self.steps}

    @classmethod
    def from_state(cls, state: dict) -> RdpAccountant:
        return cls(orders=tuple(state["orders"]), rdp=list(state["rdp"]), steps=int(state["steps"]))


def epsilon_after(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                  orders: Sequence[float] = DEFAULT_ORDERS) -> float:
    """Epsilon after `steps` steps, all at one noise multiplier and sampling rate."""
    rdp = [steps * rdp_subsampled_gaussian(sample_rate, noise_multiplier, a) for a in orders]
    return epsilon_from_rdp(rdp, orders, delta)[0]


def noise_multiplier_for(*, target_epsilon: float, delta: float, sample_rate: float, steps: int,
                         tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (to `tolerance`) whose epsilon after `steps` steps is at most
    `target_epsilon`; bisection, epsilon falling as the noise grows."""
    if not target_epsilon > 0 or steps < 1:
        raise ValueError(f"target_epsilon: must be > 0 with steps >= 1, got {target_epsilon}, {steps}")

    def eps(sigma: float) -> float:
        return epsilon_after(noise_multiplier=sigma, sample_rate=sample_rate, steps=steps, delta=delta)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            raise ValueError(f"target_epsilon: {target_epsilon} is out of reach at delta {delta} after {steps} steps")
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi
