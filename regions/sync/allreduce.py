"""allreduce: the per-step data-parallel baseline: every step's gradient is averaged (fp32)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..algorithm_traits import algorithm_traits
from .common import exchange_metrics
from .protocol import Shapes, SyncContext

if TYPE_CHECKING:
    from ..exchange import ExchangeResult
    from ..messages import RoundPlan


class AllReduceSync:
    """Per-step gradient averaging in fp32: what plain data parallelism sends, as a baseline."""

    traits = algorithm_traits("allreduce")
    announces_outer_step = False  # its state may change at any point of a round: rollback copies it at the start
    restores_live = False

    evaluates_in_exchange = False

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx

    @classmethod
    def wire_shapes(cls, settings: Any, shapes: Shapes) -> Shapes:
        """One message is the gradient: the parameters' shapes."""
        return list(shapes)

    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """One step whatever plan.H says: forward/backward, the gradient exchanged and mixed, then one
        inner optimizer step on the mixed gradient.
        """
        ctx = self.ctx
        t0 = time.monotonic()
        loss = ctx.stepper.forward_backward()
        compute_s = time.monotonic() - t0
        grads = self.payload(plan, ctx.params)
        t1 = time.monotonic()
        res = ctx.exchange(plan, grads)
        self.apply(plan, grads, res)
        t2 = time.monotonic()
        ctx.stepper.optimizer_step(plan.lr_scale)
        compute_s += time.monotonic() - t2
        return {"train_loss": loss, "compute_s": compute_s, "step_time_s": compute_s, "steps": 1,
                "sync_s": t2 - t1, **exchange_metrics(res)}

    def payload(self, plan: RoundPlan, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The step's gradient (copied: the mix writes the parameters' .grad)."""
        return [p.grad.detach().clone() for p in params]

    def apply(self, plan: RoundPlan, own: Sequence[torch.Tensor], received: ExchangeResult) -> dict[str, Any]:
        """The mixed gradient into the parameters' .grad, for the inner optimizer's step."""
        for p, g in zip(self.ctx.params, self.ctx.mix(plan, own, received)):
            p.grad.copy_(g)
        return {}

    def finish(self) -> dict:
        """Nothing is ever in flight between rounds."""
        return {}

    def eval_params(self) -> list:
        """Every step is averaged: the local model is everyone's."""
        return self.ctx.params

    def state_dict(self) -> dict:
        """No state of its own: the model and the inner optimizer are the worker's."""
        return {}

    def load_state_dict(self, d: dict) -> None:
        """No state of its own (see state_dict)."""
        pass

    def rolled_back(self) -> None:
        """No state of its own to start over."""
        pass

    def close(self) -> None:
        """No background work."""
        pass
