"""The two baselines of ``geofed bench dfgl``, with no exchange at all, in this process.

``centralized``: one model on the whole graph (the accuracy decentralized training must match);
``local_only``: each region trains alone on its own subgraph (what it gets without its peers).
Both train full batch (one step is one epoch) with Adam, as the bench's gossip arms do (AdamW
with weight decay 0: the task's loss holds the L2 term). They are plain training loops, not a
second decentralized loop: the decentralized arms are the runtime's own Regions, over
gRPC (geofed.bench.dfgl) or the in-memory transport (geofed.regions.inprocess).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from geofed.regions.tasks.base import Task


def centralized(task: Task, *, epochs: int = 200, lr: float = 0.01, seed: int = 0) -> dict[str, Any]:
    """One process, whole graph, same model and optimizer: the accuracy to match."""
    gen = _seeded(seed)
    t0 = time.perf_counter()
    model = task.build_model(seed)
    _train(task, model, next(task.shard(0, 1, seed).batches(gen)), epochs, lr)
    acc = task.evaluate(model).value
    return {"acc": acc, "bytes_per_region": 0.0, "wall_s": time.perf_counter() - t0, "epochs": epochs}


def local_only(task: Task, n_regions: int, *, epochs: int = 200, lr: float = 0.01, seed: int = 0) -> dict[str, Any]:
    """Each region trains alone on its subgraph; no exchange. Accuracy is the mean over regions."""
    gen = _seeded(seed)
    t0 = time.perf_counter()
    accs = []
    for r in range(n_regions):
        model = task.build_model(seed)
        _train(task, model, next(task.shard(r, n_regions, seed).batches(gen)), epochs, lr)
        accs.append(task.evaluate(model).value)
    return {"acc": sum(accs) / n_regions, "region_acc": accs, "bytes_per_region": 0.0,
            "wall_s": time.perf_counter() - t0, "epochs": epochs}


def _seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)  # dropout draws from the global generator
    return torch.Generator().manual_seed(seed)


def _train(task: Task, model: nn.Module, batch: Any, epochs: int, lr: float) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        task.loss(model, batch).backward()
        opt.step()
