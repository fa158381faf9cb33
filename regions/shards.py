"""The sharded WAN exchange of a region of N workers (regions.shard_exchange, docs/regions-as-clusters.md).

With `regions.workers: N` and `regions.shard_exchange: true`, worker k of a region owns shard k of the
flat parameters: fragment k of `sync.fragments`' Layout over N parts (regions/sync/fragments.py: N
contiguous runs of rows, balanced by element count). At the end of each round's inner steps (which
leave every worker's model bitwise equal, regions/workers.py) each worker

1. takes its shard's pseudo-gradient (global copy - live model, on the shard's rows only),
2. passes it through the round hooks' `payload` point and exchanges it with worker k of every peer
   region over its own gRPC server and transport (mutual TLS with the region's certificate: peers
   accept it as that region), with its own codec stream (`shard<k>`: its own error-feedback residual),
3. mixes its shard (the region's mix: the topology's weights, the robust mixes, the hooks' `mix`
   point), and
4. the mixed shards are gathered inside the region (one broadcast from each worker over the
   region's process group, in place into one flat tensor in model order), so every worker holds the
   round's whole mean, and every worker takes the same outer step on its whole global copy
   (elementwise, the same inputs: bitwise the same result everywhere) and restarts its model from it.
   Worker 0's rollback copy is taken while its exchange waits on the WAN.

Each phase's seconds on every worker go into the round's metrics (`shard_phases_s`,
docs/regions-as-clusters.md: where the round's time goes, and why the outer step is not sharded).

So a region's WAN bytes leave through all its workers' processes (nodes), 1/N of the model each,
while worker 0 still holds the region's whole DiLoCo state (global copy, outer momentum) for
checkpoints, FetchState and a restore, as a one-worker region does. What stays worker k's own is
its codec stream (error feedback) and link estimates; worker 0's checkpoints do not hold the other
workers' residuals (a restored region's workers 1..N-1 restart them at zero).

`ShardPeers` is what the driver hands worker 0 (orchestrator/driver/shards.py): where worker k of every
region serves, for k = 1..N-1 (rank 0's peers are the region's own, connected as before); worker 0
passes each follower its rank's (regions/workers.py, PEERS).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .sync.common import before_outer_step_during, exchange_metrics
from .sync.diloco import DilocoSync
from .sync.fragments import Layout
from .sync.protocol import Shapes, SyncContext

if TYPE_CHECKING:
    from .messages import RoundPlan
    from .workers import WorkerGroup


@dataclass(frozen=True, kw_only=True)
class ShardPeers:
    """Where each peer region's shard workers serve: `addresses[k]` is {region: HOST:PORT} of worker k
    of every region of the run (k = 1..N-1), the region's own entry included (Region.connect skips it)."""

    region: str  # whose workers these are for (a message handed to another region is refused)
    addresses: dict[int, dict[str, str]] = field(default_factory=dict)

    def for_rank(self, rank: int) -> dict[str, str]:
        """Worker `rank`'s peers: worker `rank` of every region."""
        if rank not in self.addresses:
            raise ValueError(f"region {self.region}: no shard peers for worker {rank} "
                             f"(the driver sent ranks {sorted(self.addresses)})")
        return dict(self.addresses[rank])


class ShardedDiloco:
    """DiLoCo with its exchange sharded over the region's workers (module docstring). Every worker builds
    one; worker 0's `run_round` leads the round, the others run `exchange_shard` when worker 0 says so.
    The whole model's DiLoCo state (`full`: a DilocoSync of one part, no overlap) is kept by every
    worker; what it sends and receives is its shard's."""

    traits = DilocoSync.traits
    announces_outer_step = True
    evaluates_in_exchange = False  # no overlap (the config refuses it)
    restores_live = True

    def __init__(self, ctx: SyncContext, group: WorkerGroup):
        self.ctx, self.group = ctx, group
        self.full = DilocoSync(ctx)
        self.layout = Layout(ctx.shapes, group.size)
        self.rank = group.rank
        dtypes = {p.dtype for p in ctx.params}
        if len(dtypes) != 1:
            raise ValueError(f"regions.shard_exchange: the model's trainable parameters have several dtypes "
                             f"({sorted(map(str, dtypes))}); the sharded exchange gathers one flat tensor a shard")
        self.dtype = next(iter(dtypes))
        self.live = self.layout.views(ctx.params, self.rank)
        self.globals = self.layout.views(self.full.parts[0].global_params, self.rank)
        # every shard's piece shapes (the same Layout on every worker); the pieces of shards 0..N-1 in
        # order are the model's parameters flat in model order (split_fragments), so shard k is the
        # run [bounds[k][0], bounds[k][1]) of one flat tensor and parameter i the run at offsets[i]
        self.piece_shapes = [[tuple(v.shape) for v in self.layout.views(ctx.params, k)] for k in range(group.size)]
        sizes = [sum(_numel(s) for s in shapes) for shapes in self.piece_shapes]
        self.bounds = [(sum(sizes[:k]), sum(sizes[:k + 1])) for k in range(group.size)]
        numels = [p.numel() for p in ctx.params]
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        assert self.bounds[-1][1] == sum(numels), (self.bounds, sum(numels))  # every element in one shard
        self.stream = f"shard{self.rank}"

    @classmethod
    def wire_shapes(cls, settings: Any, shapes: Shapes) -> Shapes:
        return list(shapes)  # the size limits' bound: at most the whole model

    def round_wire_shapes(self, round_: int) -> Shapes:
        """What one message holds: this worker's shard (the receiver's decode check)."""
        return list(self.piece_shapes[self.rank])

    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """Worker 0: H inner steps (every worker takes them), then the sharded exchange and outer step."""
        metrics = self.ctx.stepper.inner_steps(plan.H, plan.lr_scale, budget_s=plan.budget_s, max_steps=plan.max_steps)
        for p in self.ctx.params:
            p.grad = None
        t0 = time.monotonic()
        self.group.lead_shard(plan, metrics)
        lead_s = time.monotonic() - t0
        metrics.update(self.exchange_shard(plan, metrics))
        metrics["sync_s"] = time.monotonic() - t0
        if "shard_phases_s" in metrics:
            metrics["shard_phases_s"]["lead"] = round(lead_s, 4)
        return metrics

    def exchange_shard(self, plan: RoundPlan, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every worker: its shard's pseudo-gradient exchanged with worker k of the peers and mixed, the
        mixed shards gathered, the outer step on the whole global copy. Worker 0 gets the region's
        exchange metrics (bytes: every worker's summed, and each worker's in `worker_bytes_sent`)."""
        ctx, metrics = self.ctx, ({} if metrics is None else metrics)
        clock = _Phases()
        with torch.no_grad():
            delta = [g - v for g, v in zip(self.globals, self.live)]
        clock.mark("delta")

        def exchange_and_gather() -> tuple[Any, float, torch.Tensor]:
            sent = ctx.payload(plan, delta, metrics)
            clock.mark("payload")
            res = ctx.exchange(plan, sent, stream=self.stream)
            clock.mark("exchange")
            exchange_s = clock.since_start()
            mixed = ctx.mix_hooks(plan, ctx.mix(plan, sent, res, consume_own=True), res, metrics)
            clock.mark("mix")
            # the round's whole mean, one flat tensor in model order: this worker's shard copied into its
            # run, the others' received into theirs (no per-shard tensors, no reassembly)
            flat = torch.empty(self.bounds[-1][1], dtype=self.dtype, device=self.group.device)
            a, _ = self.bounds[self.rank]
            with torch.no_grad():
                for t in mixed:
                    flat[a:a + t.numel()].view_as(t).copy_(t)
                    a += t.numel()
            self.group.gather_shards(flat, self.bounds)
            clock.mark("gather")
            return res, exchange_s, flat

        # Worker 0's rollback copy of the algorithm's state is taken while its exchange waits on the WAN,
        # as a one-worker region's is (common.before_outer_step_during); `rollback_wait` is what is left
        # of it after the gather.
        if self.group.leader:
            res, exchange_s, flat = before_outer_step_during(ctx.before_outer_step, exchange_and_gather)
        else:
            res, exchange_s, flat = exchange_and_gather()
        clock.mark("rollback_wait")
        part = self.full.parts[0]
        part.step([flat[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, ctx.params)])
        del flat
        clock.mark("outer_step")
        part.set_live(part.global_params)
        clock.mark("set_live")
        own = {"bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received, "missing": list(res.missing),
               "exchange_s": round(exchange_s, 6), "phases_s": dict(clock.phases)}
        every = self.group.gather_metrics(own)
        clock.mark("metrics")
        out = exchange_metrics(res)
        if every is not None:  # worker 0: the region's
            out["bytes_sent"] = sum(m["bytes_sent"] for m in every)
            out["bytes_received"] = sum(m["bytes_received"] for m in every)
            out["peers_missing"] = sorted({p for m in every for p in m["missing"]})
            out["worker_bytes_sent"] = [m["bytes_sent"] for m in every]
            out["worker_bytes_received"] = [m["bytes_received"] for m in every]
            out["worker_exchange_s"] = [m["exchange_s"] for m in every]
            # each phase's seconds on every worker (by rank); the metrics gather's own is worker 0's
            out["shard_phases_s"] = {name: [m["phases_s"][name] for m in every] for name in every[0]["phases_s"]}
            out["shard_phases_s"]["metrics"] = clock.phases["metrics"]
        return out

    # -- the rest is the whole model's DiLoCo, kept alike on every worker --------------------
    def finish(self) -> dict[str, Any]:
        return {}

    def eval_params(self) -> list[torch.Tensor]:
        return self.full.eval_params()

    @property
    def global_params(self) -> list[torch.Tensor]:
        return self.full.eval_params()

    def state_dict(self) -> dict[str, Any]:
        return self.full.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.full.load_state_dict(d)

    def rolled_back(self) -> None:
        """Nothing to undo: the worker restored our state_dict with the round's start."""

    def close(self) -> None:
        self.full.close()


class _Phases:
    """Seconds of each phase of a worker's shard exchange, in order (the round's `shard_phases_s`)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.monotonic()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = round(now - self.last, 4)
        self.last = now

    def since_start(self) -> float:
        return self.last - self.t0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["ShardPeers", "ShardedDiloco"]
