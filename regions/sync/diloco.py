"""diloco: H inner steps, pseudo-gradient delta = global - local, mixed over the topology, outer
SGD+Nesterov on the global copy (DiLoCo, arXiv 2311.08105). With overlap the exchange of round r
runs while round r+1 computes and is applied one round late."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ..exchange import ExchangeResult
from .common import exchange_metrics

if TYPE_CHECKING:
    from ..worker import RegionWorker, RoundPlan


class DilocoSync:
    def __init__(self, w: "RegionWorker"):
        self.w = w
        outer = w.cfg.sync.outer
        self.global_params = [p.detach().clone() for p in w.params]
        for g in self.global_params:
            g.grad = torch.zeros_like(g)
        self.outer_opt = torch.optim.SGD(self.global_params, lr=outer.lr, momentum=outer.momentum,
                                         nesterov=outer.nesterov and outer.momentum > 0)
        self.overlap = w.cfg.sync.overlap
        self._pending: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="geofed-overlap") if self.overlap else None

    def run_round(self, plan: "RoundPlan") -> dict[str, Any]:
        w = self.w
        snapshot = [p.detach().clone() for p in w.params] if self.overlap else self.global_params
        metrics = w.inner_steps(plan.H, plan.lr_scale)
        delta = [s - p.detach() for s, p in zip(snapshot, w.params)]
        t0 = time.monotonic()
        if not self.overlap:
            res = w.exchange(plan, delta)
            self._apply(res, delta, plan)
            metrics.update(exchange_metrics(res))
        else:
            if self._pending is not None:
                metrics.update(self._finish_pending())
            self._pending = self._pool.submit(self._exchange_and_mix, plan, delta)
            self._load_global()
        metrics["sync_s"] = time.monotonic() - t0
        return metrics

    def finish(self) -> dict[str, Any]:
        """Apply the last in-flight exchange (overlap), so the final model includes every round."""
        return self._finish_pending() if self._pending is not None else {}

    def _exchange_and_mix(self, plan, delta):
        res = self.w.exchange(plan, delta)
        return res, self.w.mix(plan, delta, res)

    def _finish_pending(self) -> dict[str, Any]:
        res, mixed = self._pending.result(timeout=self.w.cfg.sync.deadline.max_s * 2 + 60)
        self._pending = None
        self._outer_step(mixed)
        self._load_global()
        return exchange_metrics(res)

    def _apply(self, res: ExchangeResult, delta, plan) -> None:
        self._outer_step(self.w.mix(plan, delta, res))
        self._load_global()

    def _outer_step(self, mixed: list[torch.Tensor]) -> None:
        for g, m in zip(self.global_params, mixed):
            g.grad.copy_(m)
        self.outer_opt.step()

    def _load_global(self) -> None:
        with torch.no_grad():
            for p, g in zip(self.w.params, self.global_params):
                p.copy_(g)

    def state_dict(self) -> dict:
        return {"global": [g.detach().clone() for g in self.global_params], "outer": self.outer_opt.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        with torch.no_grad():
            for g, s in zip(self.global_params, d["global"]):
                g.copy_(s)
        self.outer_opt.load_state_dict(d["outer"])
        self._load_global()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
