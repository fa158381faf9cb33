"""A user's own training loop for the loop API's tests (tests/integration/test_loop_api_ray.py,
tests/unit/test_trainer.py; its Loader also tests/unit/test_loop_api.py): the Task's own model, an
equal AdamW, the shard's batches (seeded as a Region seeds its stream) and the task's loss, so that
it trains the weights `geofed run` trains for the same seeds.

Run as a script it is the user's: `python user_loop.py CONFIG RUN_DIR [--resume]` runs
`Trainer(train_region, ...).fit()` (the function then travels to the actors by value, as a
script's `__main__` function does); the kill -9 test starts it, kills it and runs it again with
--resume, which is how a loop-API run is continued (orchestrator/trainer.py).
"""

from __future__ import annotations

import sys

import torch

from geofed.regions.tasks import make_task


class Loader:
    """A data loader with a position (what ctx.sync's `state=` is for): the task's shard, seeded as
    a Region seeds its stream, at most `limit` batches (None: no end)."""

    def __init__(self, ctx, task, limit: int | None = None):
        self.shard = task.shard(ctx.region_index, ctx.num_regions, ctx.seed)
        self.seed = ctx.seed * 1000 + ctx.region_index  # as Region seeds its stream
        self.limit, self.drawn = limit, 0

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        stream = self.shard.batches(gen)
        for _ in range(self.drawn):  # a restored position replays to the same batch
            next(stream)
        while self.limit is None or self.drawn < self.limit:
            self.drawn += 1
            yield next(stream)

    def state_dict(self):
        return {"drawn": self.drawn}

    def load_state_dict(self, state):
        self.drawn = int(state["drawn"])


def train_region(ctx) -> None:
    cfg = ctx.config
    task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=ctx.seed, device="cpu")
    model = task.build_model(ctx.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sync.inner.lr,
                            weight_decay=cfg.sync.inner.weight_decay)
    loader = Loader(ctx, task)
    sync = ctx.sync(model, opt, state={"loader": loader}, examples=loader.shard.num_examples,
                    evaluate=lambda m: task.evaluate(m))
    losses = []
    for batch in loader:
        opt.zero_grad(set_to_none=False)
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        sync.step(loss=losses[-1])
        if sync.should_stop:
            break
    ctx.report(batches=loader.drawn, last_loss=losses[-1] if losses else None, stopped=sync.should_stop,
               region=ctx.region)


if __name__ == "__main__":
    from geofed.orchestrator import Trainer

    config, run_dir = sys.argv[1], sys.argv[2]
    if "--resume" in sys.argv[3:]:
        Trainer(train_region, config, resume=run_dir, show_progress=False, report=False).fit()
    else:
        Trainer(train_region, config, out=run_dir, show_progress=False, report=False).fit()
