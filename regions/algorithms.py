"""What a region sends each round and how it mixes what comes back.

- diloco: H inner steps, pseudo-gradient delta = global - local, mixed over the topology,
  outer SGD+Nesterov on the global copy (DiLoCo, arXiv 2311.08105). With overlap the exchange
  of round r runs while round r+1 computes and is applied one round late.
- allreduce: the per-step data-parallel baseline: every step's gradient is averaged (fp32).
- gossip: decentralized model mixing; CHOCO-SGD compressed gossip when enabled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from .exchange import ExchangeResult

if TYPE_CHECKING:
    from .worker import RegionWorker, RoundPlan


def mix(own: Sequence[torch.Tensor], received: dict[str, list[torch.Tensor]],
        in_weights: dict[str, float], self_weight: float) -> list[torch.Tensor]:
    """Weighted sum; the weight of a peer that did not arrive is folded into our own."""
    w_self = self_weight + sum(w for p, w in in_weights.items() if p not in received)
    out = [t * w_self for t in own]
    for peer, tensors in received.items():
        w = in_weights.get(peer, 0.0)
        if w:
            for acc, t in zip(out, tensors):
                acc.add_(t, alpha=w)
    return out


def exchange_metrics(res: ExchangeResult) -> dict[str, Any]:
    return {"bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received,
            "transfers": res.transfers, "peers_missing": res.missing, "wait_s": round(res.wait_s, 6),
            "send_failures": res.send_failures}


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


class AllReduceSync:
    """Per-step gradient averaging in fp32: what plain data parallelism sends, as a baseline."""

    def __init__(self, w: "RegionWorker"):
        self.w = w

    def run_round(self, plan: "RoundPlan") -> dict[str, Any]:
        w = self.w
        t0 = time.monotonic()
        loss = w.forward_backward()
        compute_s = time.monotonic() - t0
        grads = [p.grad.detach().clone() for p in w.params]
        t1 = time.monotonic()
        res = w.exchange(plan, grads)
        mixed = w.mix(plan, grads, res)
        for p, g in zip(w.params, mixed):
            p.grad.copy_(g)
        t2 = time.monotonic()
        w.optimizer_step(plan.lr_scale)
        compute_s += time.monotonic() - t2
        return {"train_loss": loss, "compute_s": compute_s, "step_time_s": compute_s, "steps": 1,
                "sync_s": t2 - t1, **exchange_metrics(res)}

    def finish(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass

    def close(self) -> None:
        pass


class GossipSync:
    """Decentralized gossip on the parameters after H local steps (D-PSGD with local updates).

    With `sync.gossip.choco`, CHOCO-SGD (Koloskova et al. 2019): each region keeps public copies
    x_hat of itself and its neighbours, sends Q(x - x_hat_self), and moves
    x += gamma * sum_j w_ij (x_hat_j - x_hat_self). Compression errors do not accumulate.
    """

    def __init__(self, w: "RegionWorker"):
        self.w = w
        self.choco = w.cfg.sync.gossip.choco
        self.gamma = w.cfg.sync.gossip.gamma
        self.hat_self = [torch.zeros_like(p) for p in w.params]
        self.hat: dict[str, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def run_round(self, plan: "RoundPlan") -> dict[str, Any]:
        w = self.w
        metrics = w.inner_steps(plan.H, plan.lr_scale)
        t0 = time.monotonic()
        x = [p.detach() for p in w.params]
        if self.choco:
            res = self._choco(plan, x)
        else:
            res = w.exchange(plan, x)
            mixed = w.mix(plan, x, res)
            with torch.no_grad():
                for p, m in zip(w.params, mixed):
                    p.copy_(m)
        metrics["sync_s"] = time.monotonic() - t0
        metrics.update(exchange_metrics(res))
        return metrics

    def _choco(self, plan, x) -> ExchangeResult:
        w = self.w
        diff = [xi - h for xi, h in zip(x, self.hat_self)]
        res = w.exchange(plan, diff, single_codec=True)
        q_self = next(iter(res.own_decoded.values()), diff)
        for h, q in zip(self.hat_self, q_self):
            h.add_(q)
        in_w = w.in_weights(plan.round)
        for peer, q in res.received.items():
            copy = self.hat.setdefault(peer, [torch.zeros_like(p) for p in w.params])
            for h, qi in zip(copy, q):
                h.add_(qi)
        with torch.no_grad():
            for k, p in enumerate(w.params):
                step = torch.zeros_like(p)
                for peer, weight in in_w.items():
                    if peer in self.hat:
                        step.add_(self.hat[peer][k] - self.hat_self[k], alpha=weight)
                p.add_(step, alpha=self.gamma)
        return res

    def finish(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"hat_self": self.hat_self, "hat": self.hat}

    def load_state_dict(self, d: dict) -> None:
        self.hat_self = [t.clone() for t in d["hat_self"]]
        self.hat = {k: [t.clone() for t in v] for k, v in d["hat"].items()}

    def close(self) -> None:
        pass


ALGORITHMS = {"diloco": DilocoSync, "allreduce": AllReduceSync, "gossip": GossipSync}
