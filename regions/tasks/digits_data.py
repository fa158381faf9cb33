"""The digits data of `mlp-digits` without importing scikit-learn.

Importing `sklearn.datasets` costs about 1.7 s of CPU (scipy, joblib, ...), paid by the driver
and by every region actor before round 0: on a small host with several regions that was the
largest part of a cold start (docs/launch.md, "Start-up"). The data itself is one 180 KB csv.gz
inside the sklearn wheel, which `importlib.util.find_spec` locates without running sklearn.

Both functions give exactly what sklearn's `load_digits` and `train_test_split(..., stratify=y)`
give (tests/unit/test_digits_data.py compares them); if the wheel's layout changes (no such
file), `load_digits_arrays` falls back to sklearn itself.
"""

from __future__ import annotations

import gzip
import importlib.util
from math import ceil
from pathlib import Path

import numpy as np


def bundled_digits_file() -> Path | None:
    """sklearn's `datasets/data/digits.csv.gz`, found without importing sklearn; None if absent."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(data float64 of shape (1797, 64), pixel values 0..16; target int64): load_digits()'s
    `data` and `target`. sklearn reads the same file the same way (np.loadtxt of the csv)."""
    path = bundled_digits_file()
    if path is None:
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.data, d.target.astype(np.int64)
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """sklearn.utils.extmath._approximate_mode: per-class draws proportional to the counts, the
    leftover draws given by largest remainder, ties broken by `rng` (its draws matter)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices: train_test_split(..., test_size=test_fraction, random_state=seed,
    stratify=y), i.e. StratifiedShuffleSplit's first split, draw for draw (so a run's held-out set
    is the one it was before sklearn went out of the import path)."""
    n = len(y)
    n_test = ceil(test_fraction * n)
    n_train = n - n_test
    _, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    if class_counts.min() < 2 or min(n_train, n_test) < len(class_counts):
        raise ValueError(f"test_fraction: {test_fraction} leaves a class without a train or a test example")
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i, count in enumerate(class_counts):
        perm = class_indices[i].take(rng.permutation(count), mode="clip")
        train.extend(perm[: n_i[i]])
        test.extend(perm[n_i[i]: n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)
