"""The seam between a region worker and its sync algorithm.

The worker owns the model, data, optimizer, transport and topology; an algorithm owns what a
round sends and how it mixes what comes back. It gets a `SyncContext` (the parameters, an
inner stepper, the exchange) instead of the worker itself, so an algorithm can be written and
tested against that surface alone. To add one: a class with the `SyncAlgorithm` members in
regions/sync/NAME.py, an entry in regions/sync/__init__.py's ALGORITHMS, and the name in
orchestrator/config's `sync.algorithm` choices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..exchange import ExchangeResult
    from ..messages import RoundPlan

Shapes = list[tuple[int, ...]]


class InnerStepper(Protocol):
    """The region's local training: forward/backward on its shard and the inner optimizer."""

    def inner_steps(self, H: int, lr_scale: float, *, before_step: Callable[[int], None] | None = None,
                    budget_s: float | None = None, max_steps: int | None = None) -> dict[str, Any]:
        """H local steps, or (sync.pacing time-budget) as many as fit in budget_s, at most max_steps;
        returns train_loss, compute_s, step_time_s, steps. Raises FloatingPointError (with `.metrics`)
        when the loss is not finite."""

    def forward_backward(self) -> float:
        """One batch's loss, gradients left in the parameters' .grad."""

    def optimizer_step(self, lr_scale: float) -> None:
        """One inner optimizer step at the configured lr times `lr_scale`."""


@dataclass(frozen=True, kw_only=True)
class SyncContext:
    """What an algorithm may use of its region. Callables are the worker's bound methods."""

    region: str
    index: int
    params: list[torch.Tensor]          # the live model parameters (updated in place)
    shapes: Shapes                      # their shapes, in order
    settings: Any                       # the run's `sync:` section (SyncConfig; duck-typed here)
    seed: int                           # run.seed
    stepper: InnerStepper
    # exchange(plan, tensors, *, single_codec=False, send=True, stream="", spread_s=0.0, window_s=0.0)
    # -> ExchangeResult: push to this round's out-neighbours (none when send=False), each push paced
    # over spread_s (sync.spread_sends), collect from in-neighbours until the deadline (at least
    # window_s: the compute an overlapped exchange hides behind); a named stream has codec states of
    # its own (a fragment's layout and error feedback).
    exchange: Callable[..., ExchangeResult]
    # mix(plan, own, result, *, consume_own=False, into_received=False) -> tensors: the topology's weighted (or
    # the configured robust) mix; consume_own: the caller gives `own` up and the weighted mix may be summed
    # into it; into_received: `own` stays untouched and the mix may be written into the received updates.
    mix: Callable[[RoundPlan, Sequence[torch.Tensor], ExchangeResult], list[torch.Tensor]]
    in_weights: Callable[[int], dict[str, float]]   # round -> {in-neighbour: mixing weight}
    fetch_state: Callable[..., bytes]               # (peer, *, timeout_s) -> that peer's state bytes
    # evaluate(params, *, restore_rng) -> metric dict, on a scratch copy of the model.
    evaluate: Callable[..., dict[str, Any]]
    # hurry() -> None: this region's spread pushes in flight go out now (sync.spread_sends).
    hurry: Callable[[], None] = lambda: None
    # aggregate(plan, tensors) -> (mean, metrics) or None: the round hooks' `aggregate` point
    # (regions/hooks.py; secure aggregation's masked sum), in place of `exchange` and `mix` where a hook
    # gives one. The config refuses secure aggregation with overlap and fragments.
    aggregate: Callable[[RoundPlan, list[torch.Tensor]], tuple[list[torch.Tensor], dict[str, Any]] | None] = \
        lambda plan, tensors: None
    # payload(plan, tensors, metrics) -> tensors: the round hooks' `payload` point (regions/hooks.py) on
    # the update the region contributes (pacing's step weight, update-level DP); an outer step calls it.
    payload: Callable[[RoundPlan, list[torch.Tensor], dict[str, Any]], list[torch.Tensor]] = \
        lambda plan, tensors, metrics: tensors
    # mix_hooks(plan, mixed, result, metrics) -> tensors: the round hooks' `mix` point (regions/hooks.py)
    # on the round's mean before the outer step (quorum's late updates); an outer step calls it.
    mix_hooks: Callable[[RoundPlan, list[torch.Tensor], ExchangeResult, dict[str, Any]], list[torch.Tensor]] = \
        lambda plan, mixed, res, metrics: mixed
    # before_outer_step() -> None: the round hooks' `before_outer_step` point (regions/hooks.py): an
    # algorithm whose `announces_outer_step` is true calls it once a round before it changes its own state.
    before_outer_step: Callable[[], None] = lambda: None
    # screen(plan, theta, result) -> result without the updates refused as harmful (regions/gauntlet.py):
    # security.score_updates scores each received update against theta, the model its outer step starts from.
    screen: Callable[[RoundPlan, Sequence[torch.Tensor], ExchangeResult], ExchangeResult] | None = None


class SyncAlgorithm(Protocol):
    """One sync algorithm of a region. Built as ``cls(ctx)``; one instance per worker."""

    evaluates_in_exchange: bool  # True: an eval round's model is evaluated when its exchange completes
    # True: within a round its state_dict's tensors change only after it called ctx.before_outer_step()
    # (rollback copies them then, not at the round's start); False: they may change at any time.
    announces_outer_step: bool
    # True: load_state_dict of its own state also sets the live parameters (DiLoCo's whole model
    # restarts from its global copy), so a rollback need not copy them.
    restores_live: bool

    @classmethod
    def wire_shapes(cls, settings: Any, shapes: Shapes) -> Shapes:
        """The tensors one message holds, for the receiver's decode check and the size limits."""

    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """Local steps, the exchange, the mix; returns the round's metrics."""

    def finish(self) -> dict[str, Any]:
        """Apply whatever is still in flight (overlap) so the model includes every round."""

    def eval_params(self) -> list[torch.Tensor]:
        """The parameters that are the run's result on this region."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint and a rejoining peer need (tensors and plain values only)."""

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore own state, or (another region's `d`) rejoin from a donor's."""

    def rolled_back(self) -> None:
        """The worker restored the start of a round (a non-finite round was undone)."""

    def close(self) -> None:
        """Stop background work; called once."""
