"""`mlp-digits`: an MLP on scikit-learn's 8x8 digits (the data ships inside the sklearn wheel)."""

from __future__ import annotations


import numpy as np
import torch
from torch import nn

from .base import EvalResult, Task, register_task
from .configs import DIGITS_INPUT_SCALE, DigitsConfig
from .digits_data import load_digits_arrays, stratified_split
from .sharding import TensorShard, label_histogram, partition_indices


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
        x = (data / DIGITS_INPUT_SCALE).astype(np.float32)  # the export's model card says so (DigitsConfig.preprocessing)
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
