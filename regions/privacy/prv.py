"""A tighter accountant (privacy.dp.accountant: prv, the default): numerical composition of privacy
random variables (Gopi, Lee, Wutschitz 2021, "Numerical Composition of Differential Privacy"),
through Microsoft's `prv-accountant` package, for the Poisson-subsampled Gaussian steps of
record-level DP; for update-level DP (every step at rate 1) the exact (epsilon, delta) curve of
composed Gaussian mechanisms (Balle & Wang 2018; Dong, Roth, Su 2019: T Gaussians at noise sigma are
one Gaussian of mu = sqrt(T) / sigma).

RDP (accountant.py) bounds epsilon through Rényi divergences and a conversion that loses slack at
many compositions; PRV computes the privacy curve itself, to within `EPS_ERROR`. Its reported
epsilon is the package's upper bound, and never more than RDP's: both are valid bounds for the same
mechanism and delta, so the smaller is too (it also covers settings where the numerical
composition cannot run, e.g. a noise so small that epsilon is in the hundreds).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import lru_cache

from .accountant import RdpAccountant, epsilon_after, noise_multiplier_for
from .prv_compose import discretisation

EPS_ERROR = 0.02  # the numerical composition's epsilon error: the reported epsilon is its upper bound
Segment = tuple[float, float, int]  # (sample rate, noise multiplier, steps)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _horizon(steps: int, planned: int) -> int:
    """The steps a discretisation covers: the run's planned steps (one discretisation from the noise
    search to the last round), else the power of two at or above (a few for a run past its plan)."""
    return planned if steps <= planned else _pow2_at_least(steps)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Epsilon of a mu-Gaussian mechanism (sensitivity over noise std) at delta, exactly:
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), solved by bisection."""
    from scipy.special import log_ndtr

    def delta_at(eps: float) -> float:
        return math.exp(log_ndtr(-eps / mu + mu / 2)) - math.exp(eps + log_ndtr(-eps / mu - mu / 2))

    if delta_at(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_at(hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            return math.inf
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_at(mid) > delta else (lo, mid)
        if hi - lo < 1e-9 * hi:
            break
    return hi


@lru_cache(maxsize=256)
def prv_epsilon(segments: tuple[Segment, ...], delta: float, horizon: int = 0) -> float:
    """Epsilon after these steps (no RDP fallback: inf where the numerical composition fails), from
    a discretisation for `horizon` steps of each (rate, noise) where they are within it; kept, so a
    round's check and its spend compute it once."""
    segments = tuple(s for s in segments if s[2] > 0 and s[0] > 0)
    if not segments:
        return 0.0
    if any(s[1] <= 0 for s in segments):
        return math.inf
    if all(q == 1 for q, _, _ in segments):
        return gaussian_epsilon(math.sqrt(sum(n / s ** 2 for _, s, n in segments)), delta)
    counts: dict[tuple[float, float], int] = {}
    for q, s, n in segments:
        counts[(q, s)] = counts.get((q, s), 0) + n
    keys = tuple(counts)
    steps = [counts[k] for k in keys]
    try:
        with warnings.catch_warnings(), _quiet_numpy():
            warnings.simplefilter("ignore")
            disc = discretisation(keys, tuple(_horizon(n, horizon) for n in steps), EPS_ERROR, delta / 1000)
            eps = disc.epsilon(delta, steps)
    except (ValueError, ArithmeticError, RuntimeError, MemoryError):
        return math.inf
    return eps if math.isfinite(eps) and eps >= 0 else math.inf


def _quiet_numpy():
    import numpy as np

    return np.errstate(all="ignore")


@dataclass
class PrvAccountant:
    """The same interface as RdpAccountant (step, epsilon, epsilon_if, state): the steps kept as
    segments of one (rate, noise), the epsilon the smaller of PRV's and RDP's."""

    segments: list[list[float]] = field(default_factory=list)  # [rate, noise, steps], merged when equal
    rdp: RdpAccountant = field(default_factory=RdpAccountant)
    horizon: int = 0  # the run's planned steps: its discretisation's (0: powers of two)
    kind = "prv"

    @property
    def steps(self) -> int:
        return int(sum(n for _, _, n in self.segments))

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        self.rdp.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
        if self.segments and self.segments[-1][:2] == [sample_rate, noise_multiplier]:
            self.segments[-1][2] += steps
        else:
            self.segments.append([sample_rate, noise_multiplier, steps])

    def _key(self) -> tuple[Segment, ...]:
        return tuple((float(q), float(s), int(n)) for q, s, n in self.segments)

    def epsilon(self, delta: float) -> float:
        return min(prv_epsilon(self._key(), delta, self.horizon), self.rdp.epsilon(delta))

    def epsilon_if(self, delta: float, *, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        """Epsilon after `steps` more steps, nothing spent."""
        trial = PrvAccountant.from_state(self.state())
        trial.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
        return trial.epsilon(delta)

    def state(self) -> dict:
        return {"kind": "prv", "segments": [list(s) for s in self.segments], "rdp": self.rdp.state(),
                "steps": self.steps, "horizon": self.horizon}

    @classmethod
    def from_state(cls, state: dict) -> PrvAccountant:
        return cls(segments=[[float(q), float(s), int(n)] for q, s, n in state["segments"]],
                   rdp=RdpAccountant.from_state(state["rdp"]), horizon=int(state.get("horizon", 0)))


def prv_epsilon_after(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """Epsilon after `steps` steps at one noise multiplier and rate (the smaller of PRV and RDP),
    from a discretisation for exactly `steps` (the one a run planned for them reuses)."""
    acc = PrvAccountant(horizon=steps)
    acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
    return acc.epsilon(delta)


def prv_noise_multiplier_for(*, target_epsilon: float, delta: float, sample_rate: float, steps: int,
                             tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (to `tolerance`) whose PRV epsilon after `steps` steps is at
    most `target_epsilon`: bisection below RDP's answer (which PRV's epsilon never exceeds).

    Every PRV evaluation at a new noise builds a new discretisation (about a second), and the plain
    bisection needs 7 to 11 of them. So a model first evaluates the few bisection points nearest the
    answer (_NoiseBracket.locate), and the bisection then runs on what those outcomes imply
    (epsilon falls as the noise grows): the same answer in about 3 evaluations. Once per setting
    in a process (bench repetitions plan the same run again)."""
    return _prv_noise_search(float(target_epsilon), float(delta), float(sample_rate), int(steps), float(tolerance))


@lru_cache(maxsize=32)
def _prv_noise_search(target: float, delta: float, rate: float, steps: int, tolerance: float) -> float:
    hi = noise_multiplier_for(target_epsilon=target, delta=delta, sample_rate=rate, steps=steps, tolerance=tolerance)
    bracket = _NoiseBracket(target=target, delta=delta, rate=rate, steps=steps, ok_at=hi)
    lo = hi / 2
    # The bisection's points below are lo + k * step, exactly (RDP's answer is a short binary fraction;
    # were they not, locate's evaluations would only be of less use).
    step = hi - lo
    while step > tolerance:
        step /= 2
    bracket.locate(lo, step)
    while lo > tolerance and bracket.ok(lo):
        lo, hi = lo / 2, lo
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if bracket.ok(mid) else (mid, hi)
    if hi != bracket.ok_at and bracket.epsilon(hi) > target:  # inferred, not evaluated: epsilon is numerical
        return bracket.ok_at
    return hi


@dataclass
class _NoiseBracket:
    """What the noise search knows: every noise at or above `ok_at` keeps epsilon within the
    target, none at or below `fail_at` does (epsilon falls as the noise grows)."""

    target: float
    delta: float
    rate: float
    steps: int
    ok_at: float  # RDP's answer to start with
    fail_at: float = 0.0

    def epsilon(self, sigma: float) -> float:
        return prv_epsilon_after(noise_multiplier=sigma, sample_rate=self.rate, steps=self.steps, delta=self.delta)

    def ok(self, sigma: float) -> bool:
        """Whether `sigma` keeps epsilon within the target: known, or evaluated and remembered."""
        if sigma >= self.ok_at or sigma <= self.fail_at:
            return sigma >= self.ok_at
        return self._evaluate(sigma) <= self.target

    def _evaluate(self, sigma: float) -> float:
        eps = self.epsilon(sigma)
        if eps <= self.target:
            self.ok_at = min(self.ok_at, sigma)
        else:
            self.fail_at = max(self.fail_at, sigma)
        return eps

    def locate(self, lo: float, step: float, tries: int = 4) -> None:
        """Evaluate the points lo + k * step nearest the model's answer until two neighbours straddle
        it. The model: PRV's epsilon over RDP's barely moves with the noise (0.9293 at 2.30, 0.9292 at
        2.49 for bench privacy's dp_eps8), so Newton steps on log epsilon against log noise with
        RDP's slope land within a step of the answer."""
        sigma = self.ok_at
        eps = self._evaluate(sigma)  # passes (RDP's answer): evaluated for the model only
        slope = self._rdp_slope(sigma)
        k_ok, k_fail = round((sigma - lo) / step), 0  # k 0 (lo) stays the bisection's to evaluate
        for _ in range(tries):
            if k_ok - k_fail <= 1 or not (slope < 0 and 0 < eps < math.inf):
                return
            guess = sigma * (self.target / eps) ** (1 / slope)
            k = min(max(math.ceil((guess - lo) / step), k_fail + 1), k_ok - 1)
            sigma = lo + k * step
            eps = self._evaluate(sigma)
            k_ok, k_fail = (k, k_fail) if eps <= self.target else (k_ok, k)

    def _rdp_slope(self, sigma: float) -> float:
        """d log epsilon / d log noise by RDP around `sigma` (nan where RDP's epsilon is 0 or inf)."""
        def rdp(s: float) -> float:
            return epsilon_after(noise_multiplier=s, sample_rate=self.rate, steps=self.steps, delta=self.delta)

        r0, r1 = rdp(sigma), rdp(sigma * 1.01)
        return math.log(r1 / r0) / math.log(1.01) if 0 < r1 < r0 < math.inf else math.nan
