"""Splitting labelled examples across regions: iid, or label skew drawn from a Dirichlet."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch

from .base import Shard


def partition_indices(labels: np.ndarray, n_regions: int, *, kind: Literal["iid", "dirichlet"],
                      alpha: float, seed: int) -> list[np.ndarray]:
    """Indices of each region's examples. Every example goes to exactly one region.

    Dirichlet: per class, proportions ~ Dir(alpha) across regions (Hsu et al. 2019); small alpha
    means each region sees few classes. Regions are topped up so none is empty.
    """
    rng = np.random.default_rng(seed)
    n = len(labels)
    if n_regions > n:
        raise ValueError(f"regions: {n_regions} regions but only {n} training examples")
    if kind == "iid":
        return [np.sort(part) for part in np.array_split(rng.permutation(n), n_regions)]
    parts: list[list[int]] = [[] for _ in range(n_regions)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        props = rng.dirichlet(np.full(n_regions, alpha))
        cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
        for r, chunk in enumerate(np.split(idx, cuts)):
            parts[r].extend(chunk.tolist())
    # A region with no examples cannot train; move one example from the largest region.
    for r in range(n_regions):
        if not parts[r]:
            donor = max(range(n_regions), key=lambda i: len(parts[i]))
            parts[r].append(parts[donor].pop())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


class TensorShard(Shard):
    """Examples held in memory; batches are drawn by reshuffled epochs."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int):
        assert len(x) == len(y) and len(x) > 0
        self.x, self.y, self.batch_size = x, y, batch_size

    @property
    def num_examples(self) -> int:
        return len(self.x)

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.x)
        bs = min(self.batch_size, n)
        while True:
            perm = torch.randperm(n, generator=generator)
            for start in range(0, n - bs + 1, bs):
                idx = perm[start:start + bs]
                yield self.x[idx], self.y[idx]

    def poisson_batches(self, generator: torch.Generator, rate: float) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Poisson-sampled batches (record-level DP): every example in with probability `rate`."""
        if not 0 < rate <= 1:
            raise ValueError(f"rate: must be in (0, 1], got {rate}")
        n = len(self.x)
        while True:
            idx = torch.nonzero(torch.rand(n, generator=generator) < rate).flatten()
            yield self.x[idx], self.y[idx]


def label_histogram(labels: np.ndarray, parts: list[np.ndarray], n_classes: int) -> list[list[int]]:
    """Per part, how many examples of each label it holds: how skewed a partition is."""
    return [np.bincount(labels[p], minlength=n_classes).tolist() for p in parts]
