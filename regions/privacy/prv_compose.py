"""The numerical composition behind prv.py's epsilon, cheap enough for every round.

`prv-accountant` discretises each privacy random variable once for up to a horizon of steps
(`PRVAccountant`), then composes n of them with one FFT. Its composition is long double
throughout (complex256 powers, FFTs and sums: 0.25 s a step count at the 179,074 points of
1500 steps), and its domain length is whatever the error bounds give (179,074 = 2 x 7 x 12791 for
bench privacy's dp_eps8), where an FFT is ten times slower than at a length of small primes.
Here the discretisation is still the package's, on a domain widened to the next such length (a
wider domain is as safe: its tails hold less mass), and the composition is in double precision:
the Fourier power advanced from the last step count, one inverse FFT and the epsilon search,
a few ms. The search asks for delta less a bound on double precision's rounding (_rounding_bound),
so the epsilon stays the package's upper bound for its discretisation (it only grows: by 6e-6 to
3e-5 over dp_eps8's rounds), within `eps_error` of the true epsilon. docs/privacy.md has the numbers.
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import numpy as np

# scipy.fft is imported where it is used: only a run with privacy.dp.target_epsilon needs it, and the
# driver imports this module for every run (~0.2-0.3 s of CPU before round 0).

_POWERS_KEPT = 4  # Fourier powers kept per PRV: the last few step counts and the steps between them


@lru_cache(maxsize=16)
def discretisation(keys: tuple[tuple[float, float], ...], horizons: tuple[int, ...], eps_error: float,
                   delta_error: float) -> Discretisation:
    """The discretised PRVs of these (rate, noise) keys, for up to `horizons` steps of each: built
    once (about half a second for 1500 steps), composed for any step counts within them."""
    try:
        from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant
        from prv_accountant.accountant import compute_safe_domain_size
    except ImportError as exc:  # a dependency of geofed; missing only in a hand-made environment
        raise ImportError("privacy.dp.accountant: prv needs the package prv-accountant (pip install "
                          "'prv-accountant>=0.2,<0.3'), or set privacy.dp.accountant: rdp") from exc

    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=s) for q, s in keys]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # eps_max's "assuming that true epsilon < ...": it is the safe size
        half_width = compute_safe_domain_size(prvs, list(horizons), eps_error=eps_error, delta_error=delta_error)
        # The package's mesh (Gopi et al., Theorem 5.5), so its error bounds hold as they are.
        mesh = eps_error / np.sqrt(sum(horizons) / 2 * np.log(12 / delta_error))
        acc = PRVAccountant(prvs=prvs, eps_error=eps_error, delta_error=delta_error,
                            max_self_compositions=list(horizons),
                            eps_max=_smooth_half_width(float(half_width), float(mesh)))
    return Discretisation(acc)


def _smooth_half_width(half_width: float, mesh: float) -> float:
    """A half width whose aligned domain (2 ceil(w / mesh) + 2 points, the package's
    Domain.create_aligned) holds the one of `half_width` and has an even length of small primes
    (scipy's next_fast_len)."""
    from scipy.fft import next_fast_len

    points = 2 * math.ceil(half_width / mesh) + 2
    while (points := next_fast_len(points, real=True)) % 2:
        points += 1
    return (points // 2 - 1 - 0.25) * mesh  # ceil gives points // 2 - 1, away from rounding at the integer


class Discretisation:
    """The package's discretised PRVs (its PRVAccountant) and their Fourier transforms in double
    precision, with the last few powers of each kept: a run asks for 50, 100, 150, ... steps."""

    def __init__(self, accountant):
        self.accountant = accountant
        self.dprvs = list(accountant.composer.prvs)
        self.fourier = [sc.F.astype(np.complex128) for sc in accountant.composer.self_composers]
        self.horizons = tuple(accountant.max_self_compositions)
        self.dt = float(self.dprvs[0].domain.dt())
        self._decay: np.ndarray | None = None
        self._powers: list[dict[int, np.ndarray]] = [{} for _ in self.dprvs]

    def __len__(self) -> int:
        return len(self.dprvs[0].pmf)

    def power(self, i: int, n: int) -> np.ndarray:
        """F_i ** n: the nearest kept power below times the rest (kept too: a round's steps recur)."""
        kept = self._powers[i]  # oldest first
        if n in kept:
            kept[n] = kept.pop(n)
            return kept[n]
        below = max((m for m in kept if m < n), default=0)
        rest = kept[n - below] if n - below in kept else np.power(self.fourier[i], n - below)
        value = rest if below == 0 else kept[below] * rest
        kept.pop(n - below, None)
        kept[n - below] = rest
        kept[n] = value
        while len(kept) > _POWERS_KEPT:
            del kept[next(iter(kept))]
        return kept[n]

    def epsilon(self, delta: float, counts: list[int]) -> float:
        """The package's upper bound on epsilon after `counts` steps of each PRV (its
        compute_epsilon's third value), computed in double precision; inf where delta is out of reach."""
        if any(n > h for n, h in zip(counts, self.horizons)):
            raise ValueError(f"{counts} steps exceed the discretisation's horizons {self.horizons}")
        from prv_accountant.composers import ConvolutionTree
        from prv_accountant.discrete_privacy_random_variable import DiscretePrivacyRandomVariable

        composed = [DiscretePrivacyRandomVariable(*self._self_composed(i, n)) for i, n in enumerate(counts)]
        f_n = composed[0] if len(composed) == 1 else ConvolutionTree(composed).compute_composition([1] * len(composed))
        delta_inf = -math.expm1(float(f_n.log_pmc_inf))
        delta_fin = (delta - delta_inf) / (1 - delta_inf)
        if delta_fin <= 0:
            return math.inf
        pmf = np.asarray(f_n.pmf, dtype=np.float64)
        target = delta_fin - self.accountant.delta_error - _rounding_bound(pmf, sum(counts))
        if target <= 0:
            raise ValueError("floating point errors would dominate at this delta")
        return self._find_epsilon(pmf, float(f_n.domain.t_min()), target) + self.accountant.eps_error

    def _find_epsilon(self, pmf: np.ndarray, t_min: float, target: float) -> float:
        """DiscretePrivacyRandomVariable.compute_epsilon's find_epsilon(target): the first node t_i
        whose delta(t_i) = sum_{j >= i} p_j (1 - e^(t_i - t_j)) is at most `target`, and the epsilon
        there. Sums from the top, so the nodes from t = 0 up give the same sums as all of them: those
        first (an epsilon below 0 needs the rest)."""
        if self._decay is None:  # e^(t_i - t_j) = decay_j / decay_i, whatever the shift
            self._decay = np.exp(-self.dt * np.arange(len(self), dtype=np.float64))
        start = min(max(0, math.ceil(-t_min / self.dt) - 1), len(pmf) - 1)
        for first in (start, 0) if start else (0,):
            p, decay = pmf[first:], self._decay[:len(pmf) - first]
            d1 = np.cumsum(p[::-1])[::-1]
            d2 = np.cumsum((p * decay)[::-1])[::-1]  # e^(t_first) sum_{j >= i} p_j e^(-t_j)
            i = int(np.searchsorted(d2 / decay - d1, -target, side="left"))
            if i > 0:
                break
        if i <= 0 or i >= len(p):
            raise RuntimeError("cannot compute epsilon")
        return float(np.log((d1[i] - target) / d2[i])) + t_min + first * self.dt

    def _self_composed(self, i: int, n: int):
        """(pmf, domain, log mass at infinity) of n self-compositions of PRV i: the package's
        Fourier composer (composers.Fourier.compute_composition), on the kept power."""
        from scipy.fft import irfft

        dprv = self.dprvs[i]
        f_n = irfft(self.power(i, n), len(self))
        shift = n - 1 + (len(f_n) // 2 if n % 2 == 0 else 0)
        domain = dprv.domain.shift_right(dprv.domain.shifts() * (n - 1))
        return np.roll(f_n, shift), domain, dprv.log_pmc_inf * n


def _rounding_bound(pmf: np.ndarray, compositions: int) -> float:
    """A bound on double precision's error in any delta the search reads (a sum over the pmf with
    weights in [0, 1]): the inverse FFT's and the power's relative error (u (log2 N + n) in the
    2-norm, Higham ch. 24) over sqrt(N) points, plus the running sums' N u; 16 times that."""
    u, size = np.finfo(np.float64).eps, len(pmf)
    fft = math.sqrt(size) * (math.log2(size) + compositions) * math.sqrt(float(np.add.reduce(pmf * pmf)))
    return 16 * u * (size + fft)
