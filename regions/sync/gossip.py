"""gossip: decentralized model mixing; CHOCO-SGD compressed gossip when enabled."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ..exchange import ExchangeResult
from .common import exchange_metrics

if TYPE_CHECKING:
    from ..worker import RegionWorker, RoundPlan


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
