"""An MLP on scikit-learn's digits (the data ships inside sklearn's wheel: nothing downloads).

plain.py is an ordinary PyTorch script: `python examples/own_loop/plain.py`. geofed_loop.py is the
same script trained across regions by geofed (`python examples/own_loop/geofed_loop.py --rounds 2`);
`diff plain.py geofed_loop.py` shows everything geofed asks of a training loop (docs/own-loop.md).
"""

import argparse

import torch
from geofed.orchestrator import Trainer
from sklearn.datasets import load_digits
from torch import nn


class Batches:
    """Shuffled mini-batches, epoch after epoch. state_dict/load_state_dict save and restore the
    position, so a resumed run goes on with the batch it would have drawn next."""

    def __init__(self, x, y, batch_size, seed=0):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.epoch, self.pos = 0, 0

    def __iter__(self):
        while True:
            order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            while self.pos + self.batch_size <= len(order):
                idx = order[self.pos:self.pos + self.batch_size]
                self.pos += self.batch_size
                yield self.x[idx], self.y[idx]
            self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]


def split_digits(index=0, count=1):
    """(x, y) of the training part's shard `index` of `count`, and the held-out (x, y): 20%, fixed."""
    digits = load_digits()
    x, y = torch.tensor(digits.data / 16, dtype=torch.float32), torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:len(x) // 5], order[len(x) // 5:]
    mine = train[index::count]
    return (x[mine], y[mine]), (x[test], y[test])


def accuracy(model, x, y):
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(ctx):
    torch.manual_seed(0)
    (x, y), test = split_digits(ctx.region_index, ctx.num_regions)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = Batches(x, y, batch_size=32)
    sync = ctx.sync(model, opt, state={"data": loader})
    for step, (xb, yb) in enumerate(loader, start=1):
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
        sync.step(loss=loss.item())
        if sync.should_stop:
            break
    ctx.report(accuracy=accuracy(model, *test), steps=step)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    Trainer(train, overrides=[f"run.rounds={parser.parse_args().rounds}"]).fit()
