"""Your own model and data in geofed: a Task is four methods (see geofed.regions.tasks.Task).

This example trains logistic regression on scikit-learn's breast-cancer data (it ships inside
the sklearn wheel, so nothing downloads). Run it with:

    geofed run examples/my-task.yaml

The config names this file's factory as `task.kind: python:my_task:make_task`, puts this folder
on the import path with `task.path: examples`, and passes `task.options` to `make_task`.
`@task_factory` marks `make_task` as a function a config may name: geofed calls no other.
(A config that names a plug-in is code: loading it imports this module, top-level code and all.)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split
from torch import nn

from geofed.regions.tasks import EvalResult, Shard, Task, task_factory


class ArrayShard(Shard):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int):
        self.x, self.y, self.batch_size = x, y, batch_size

    @property
    def num_examples(self) -> int:
        return len(self.x)

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            idx = torch.randint(0, len(self.x), (self.batch_size,), generator=generator)
            yield self.x[idx], self.y[idx]


class BreastCancerTask(Task):
    kind = "python:my_task:make_task"

    def __init__(self, batch_size: int):
        data = load_breast_cancer()
        x = data.data.astype(np.float32)
        x = (x - x.mean(0)) / x.std(0)  # standardise: the features span 5 orders of magnitude
        y = data.target.astype(np.float32)
        self.x_train, self.x_test, self.y_train, self.y_test = (
            torch.from_numpy(a) for a in train_test_split(x, y, test_size=0.3, random_state=0, stratify=y))
        self.batch_size = batch_size

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Linear(self.x_train.shape[1], 1)

    def shard(self, region_index: int, n_regions: int, seed: int) -> Shard:
        parts = np.array_split(np.random.default_rng(seed).permutation(len(self.x_train)), n_regions)
        idx = torch.from_numpy(parts[region_index])
        return ArrayShard(self.x_train[idx], self.y_train[idx], self.batch_size)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)

    def evaluate(self, model: nn.Module) -> EvalResult:
        with torch.no_grad():
            pred = (model(self.x_test).squeeze(1) > 0).float()
        return EvalResult(metric="accuracy", value=float((pred == self.y_test).float().mean()))


@task_factory
def make_task(batch_size: int = 16) -> Task:
    """The factory `task.kind` names; `task.options` become its keyword arguments."""
    return BreastCancerTask(batch_size)
