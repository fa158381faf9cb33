"""What the language-model tasks (char-lm, gpt, hf-causal-lm) share: a token stream cut into
regions' stretches, random training windows, and the held-out loss on fixed windows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal

import torch
from torch import nn

from .base import EvalResult, Shard


class WindowShard(Shard):
    """Random windows of `length` + 1 tokens of `ids` (inputs and their next-token targets)."""

    def __init__(self, ids: torch.Tensor, length: int, batch_size: int):
        if len(ids) <= length + 1:
            raise ValueError(f"task.max_chars: a region's text ({len(ids)} tokens) is shorter than its window + 1")
        self.ids, self.length, self.batch_size = ids, length, batch_size

    @property
    def num_examples(self) -> int:
        return len(self.ids) - self.length - 1

    def batches(self, generator: torch.Generator) -> Iterator[torch.Tensor]:
        offsets = torch.arange(self.length + 1)
        while True:
            starts = torch.randint(0, self.num_examples, (self.batch_size,), generator=generator)
            yield self.ids[starts[:, None] + offsets]


def region_shard(train_ids: torch.Tensor, region_index: int, n_regions: int, *, length: int, batch_size: int,
                 partition: Literal["contiguous", "iid"]) -> WindowShard:
    """contiguous: region i trains on the i-th of n equal stretches (non-IID); iid: on all of it."""
    if partition == "iid":
        return WindowShard(train_ids, length, batch_size)
    bounds = torch.linspace(0, len(train_ids), n_regions + 1).long()
    return WindowShard(train_ids[bounds[region_index]:bounds[region_index + 1]], length, batch_size)


def heldout_loss(loss: Callable[[nn.Module, torch.Tensor], torch.Tensor], model: nn.Module, test_ids: torch.Tensor,
                 *, length: int, windows: int) -> EvalResult:
    """`loss` on `windows` fixed, evenly spaced windows of the held-out tokens: the same text for
    every region and run. The model is evaluated in eval mode, on its own device."""
    n = len(test_ids) - length - 1
    starts = torch.linspace(0, n - 1, windows).long()
    batch = test_ids[starts[:, None] + torch.arange(length + 1)].to(next(model.parameters()).device)
    model.eval()
    with torch.no_grad():
        value = float(loss(model, batch))
    model.train()
    return EvalResult(metric="loss", value=value, higher_is_better=False)
