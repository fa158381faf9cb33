"""The same task trained centrally in one process: the reference a federated run is judged by."""

from __future__ import annotations

import torch

from geofed.regions.tasks.base import EvalResult, Task


def train_centrally(task: Task, *, steps: int, lr: float, weight_decay: float = 0.0, seed: int = 0,
                    optimizer: str = "adamw") -> EvalResult:
    """Train `task`'s model on all of its training data (one shard) for `steps` steps."""
    torch.manual_seed(seed)
    model = task.build_model(seed)
    shard = task.shard(0, 1, seed)
    gen = torch.Generator().manual_seed(seed)
    batches = shard.batches(gen)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        task.loss(model, next(batches)).backward()
        opt.step()
    return task.evaluate(model)
