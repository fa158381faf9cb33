"""Who talks to whom each round, and with which mixing weights.

A topology works on region indices 0..n-1. Row i of ``matrix(round)`` holds the weights region i
gives to each value it mixes (its own on the diagonal); every matrix is doubly stochastic, so
repeated mixing preserves the average and converges to it.

Static undirected graphs use Metropolis-Hastings weights ``w_ij = 1 / (1 + max(deg_i, deg_j))``,
``w_ii = 1 - sum_j w_ij`` (spectral gaps measured for n=16: ring 0.0507, exponential 0.50,
the project's field notes). Time-varying topologies (one-peer exponential, random matching)
give weight 1/2 to the single peer of the round.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

__all__ = [
    "Topology", "StaticTopology", "OnePeerExponential", "RandomMatching",
    "topology_names", "make_topology", "spectral_gap",
]


class Topology(ABC):
    """Neighbours and mixing weights of n regions in a given round."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"n: need at least one region, got {n}")
        self.n = n

    @abstractmethod
    def in_weights(self, i: int, round: int) -> dict[int, float]:
        """Weights region i gives to the values it receives in `round` (sender -> weight)."""

    @abstractmethod
    def out_neighbours(self, i: int, round: int) -> list[int]:
        """Regions that region i sends its value to in `round` (sorted)."""

    def self_weight(self, i: int, round: int) -> float:
        """The weight region i keeps for its own value: what its in-weights leave of 1."""
        return 1.0 - math.fsum(self.in_weights(i, round).values())

    def matrix(self, round: int) -> np.ndarray:
        """The n x n mixing matrix of `round` (row i: region i's weights); doubly stochastic."""
        w = np.zeros((self.n, self.n))
        for i in range(self.n):
            for j, wij in self.in_weights(i, round).items():
                w[i, j] = wij
            w[i, i] = self.self_weight(i, round)
        return w

    def _check(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise ValueError(f"i: region index {i} out of range 0..{self.n - 1}")


class StaticTopology(Topology):
    """An undirected graph fixed for the run, with Metropolis-Hastings weights."""

    def __init__(self, n: int, neighbours: Callable[[int], set[int]]):
        super().__init__(n)
        self._nbrs = [sorted(neighbours(i) - {i}) for i in range(n)]
        for i, nb in enumerate(self._nbrs):
            for j in nb:
                assert i in self._nbrs[j], f"graph must be undirected: {i}->{j} without {j}->{i}"
        deg = [len(nb) for nb in self._nbrs]
        self._w = [{j: 1.0 / (1 + max(deg[i], deg[j])) for j in nb} for i, nb in enumerate(self._nbrs)]

    def in_weights(self, i: int, round: int) -> dict[int, float]:
        """Metropolis-Hastings weights of i's graph neighbours; the same every round."""
        self._check(i)
        return dict(self._w[i])

    def out_neighbours(self, i: int, round: int) -> list[int]:
        """i's graph neighbours (undirected, so also its in-neighbours); the same every round."""
        self._check(i)
        return list(self._nbrs[i])


class OnePeerExponential(Topology):
    """Round t: send to i + 2^k, receive from i - 2^k, k = t mod ceil(log2 n); weights 1/2.

    For n a power of two, log2(n) consecutive rounds compute the exact average (each round
    halves the number of distinct values).
    """

    def __init__(self, n: int):
        super().__init__(n)
        self.period = max(1, math.ceil(math.log2(n))) if n > 1 else 1

    def _distance(self, round: int) -> int:
        return 2 ** (round % self.period)

    def in_weights(self, i: int, round: int) -> dict[int, float]:
        """Weight 1/2 for the one region 2^k behind i (none for n = 1)."""
        self._check(i)
        if self.n == 1:
            return {}
        return {(i - self._distance(round)) % self.n: 0.5}

    def out_neighbours(self, i: int, round: int) -> list[int]:
        """The one region 2^k ahead of i (none for n = 1)."""
        self._check(i)
        if self.n == 1:
            return []
        return [(i + self._distance(round)) % self.n]


class RandomMatching(Topology):
    """A fresh random perfect matching each round, seeded by (seed, round); weights 1/2.

    With n odd one region sits the round out. Every region computes the same matching from
    the shared seed, so no coordination message is needed.
    """

    def __init__(self, n: int, seed: int = 0):
        super().__init__(n)
        self.seed = seed
        self._cache: tuple[int, dict[int, int]] | None = None

    def partner(self, i: int, round: int) -> int | None:
        """i's partner in `round`'s matching, or None when i sits the round out (n odd)."""
        self._check(i)
        if self._cache is None or self._cache[0] != round:
            perm = np.random.default_rng([self.seed, round]).permutation(self.n)
            pairs: dict[int, int] = {}
            for a, b in zip(perm[0::2], perm[1::2]):
                pairs[int(a)], pairs[int(b)] = int(b), int(a)
            self._cache = (round, pairs)
        return self._cache[1].get(i)

    def in_weights(self, i: int, round: int) -> dict[int, float]:
        """Weight 1/2 for the round's partner; empty when i sits out."""
        p = self.partner(i, round)
        return {} if p is None else {p: 0.5}

    def out_neighbours(self, i: int, round: int) -> list[int]:
        """The round's partner, or nobody when i sits out."""
        p = self.partner(i, round)
        return [] if p is None else [p]


def _ring(n: int) -> Callable[[int], set[int]]:
    return lambda i: {(i - 1) % n, (i + 1) % n}


def _exponential(n: int) -> Callable[[int], set[int]]:
    # Undirected: peers at distance +-2^k for 2^k < n (MH weights give gap 0.50 at n=16).
    ks = range(max(1, math.ceil(math.log2(n)))) if n > 1 else range(0)
    return lambda i: {(i + s * 2**k) % n for k in ks for s in (1, -1)}


_MAKERS: dict[str, Callable[[int, int], Topology]] = {
    "full": lambda n, seed: StaticTopology(n, lambda i: set(range(n))),
    "ring": lambda n, seed: StaticTopology(n, _ring(n)),
    "exponential": lambda n, seed: StaticTopology(n, _exponential(n)),
    "one-peer-exponential": lambda n, seed: OnePeerExponential(n),
    "random-matching": lambda n, seed: RandomMatching(n, seed),
}


def topology_names() -> list[str]:
    """The topology kinds `make_topology` accepts (``network.topology``)."""
    return list(_MAKERS)


def make_topology(kind: str, n: int, *, seed: int = 0) -> Topology:
    """The topology `kind` for n regions; `seed` only matters to random-matching. ValueError for an unknown kind."""
    if kind not in _MAKERS:
        raise ValueError(f"kind: unknown topology {kind!r} (known: {', '.join(_MAKERS)})")
    return _MAKERS[kind](n, seed)


def spectral_gap(w: np.ndarray) -> float:
    """1 - second largest |eigenvalue| of a mixing matrix (how fast gossip converges)."""
    if w.shape[0] < 2:
        return 1.0
    mags = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
    return float(1.0 - mags[1])
