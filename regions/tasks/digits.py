"""`mlp-digits`: an MLP on scikit-learn's 8x8 digits (the data ships inside the sklearn wheel)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from .base import EvalResult, Task, register_task
from .digits_data import load_digits_arrays, stratified_split
from .sharding import TensorShard, label_histogram, partition_indices


@dataclass(frozen=True, kw_only=True)
class DigitsConfig:
    """``task.kind: mlp-digits``: an MLP on scikit-learn's bundled 8x8 digits (no download)."""

    kind: Literal["mlp-digits"] = "mlp-digits"
    hidden: int = field(default=64, metadata={"doc": "hidden units of each hidden layer of the MLP"})
    layers: int = field(default=1, metadata={"doc": "hidden layers: 1 is 64-hidden-10, 2 is 64-hidden-hidden-10"})
    activation: Literal["relu", "tanh"] = field(default="relu", metadata={"doc": (
        "of the hidden layers; tanh (a tempered sigmoid: bounded, so clipped, noised DP-SGD gradients stay "
        "smaller; Papernot et al. 2021) suits privacy.dp.mode record")})
    test_fraction: float = field(default=0.25, metadata={"doc": "held-out fraction (stratified) for evaluation"})
    partition: Literal["iid", "dirichlet"] = field(default="iid", metadata={"doc": "how training data is split across regions"})
    alpha: float = field(default=0.5, metadata={"doc": "Dirichlet concentration for partition: dirichlet (small = skewed)"})
    batch_size: int | None = field(default=None, metadata={"doc": "overrides sync.inner.batch_size for this task"})

    def __post_init__(self):
        if not 1 <= self.hidden <= 65536:
            raise ValueError(f"hidden: must be in [1, 65536], got {self.hidden}")
        if not 1 <= self.layers <= 8:
            raise ValueError(f"layers: must be in [1, 8], got {self.layers}")
        if not 0.05 <= self.test_fraction <= 0.9:
            raise ValueError(f"test_fraction: must be in [0.05, 0.9], got {self.test_fraction}")
        if not 0 < self.alpha <= 1e6:
            raise ValueError(f"alpha: must be in (0, 1e6], got {self.alpha}")


class DigitsTask(Task):
    """Digit classification with an MLP; the train/test split is fixed (seed 0), the partition
    across regions follows the run seed, the metric is held-out accuracy.
    """

    kind = "mlp-digits"

    def __init__(self, cfg: DigitsConfig, *, batch_size: int = 32, seed: int = 0):
        self.cfg = cfg
        self.batch_size = cfg.batch_size or batch_size
        # sklearn's file and sklearn's split, without importing sklearn (digits_data.py: a cold start's largest cost).
        data, y = load_digits_arrays()
        x = (data / 16.0).astype(np.float32)  # pixel values are 0..16
        # The split is fixed (seed 0), not the run seed, so runs with different seeds are judged on the same data.
        train, test = stratified_split(y, cfg.test_fraction, seed=0)
        self.x_train, self.x_test, self.y_train, self.y_test = x[train], x[test], y[train], y[test]
        self._parts: dict[tuple[int, int], list[np.ndarray]] = {}

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        h = self.cfg.hidden
        act = nn.Tanh if self.cfg.activation == "tanh" else nn.ReLU
        body = [nn.Linear(64, h), act()]
        for _ in range(self.cfg.layers - 1):
            body += [nn.Linear(h, h), act()]
        return nn.Sequential(*body, nn.Linear(h, 10))

    def _partition(self, n_regions: int, seed: int) -> list[np.ndarray]:
        key = (n_regions, seed)
        if key not in self._parts:
            self._parts[key] = partition_indices(self.y_train, n_regions, kind=self.cfg.partition,
                                                 alpha=self.cfg.alpha, seed=seed)
        return self._parts[key]

    def shard(self, region_index: int, n_regions: int, seed: int) -> TensorShard:
        idx = self._partition(n_regions, seed)[region_index]
        return TensorShard(torch.from_numpy(self.x_train[idx]), torch.from_numpy(self.y_train[idx]), self.batch_size)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> EvalResult:
        model.eval()
        with torch.no_grad():
            device = next(model.parameters()).device
            pred = model(torch.from_numpy(self.x_test).to(device)).argmax(1).cpu().numpy()
        model.train()
        return EvalResult(metric="accuracy", value=float((pred == self.y_test).mean()))

    def describe(self) -> dict:
        return {"train_examples": len(self.y_train), "test_examples": len(self.y_test)}

    def partition_stats(self, n_regions: int, seed: int) -> dict:
        parts = self._partition(n_regions, seed)
        return {"examples": [len(p) for p in parts], "labels": label_histogram(self.y_train, parts, 10)}


register_task("mlp-digits", DigitsConfig, lambda cfg, **kw: DigitsTask(cfg, **kw))
