"""The RoundHook seam: where a cross-cutting feature enters a region's round (regions/region.py).

A round of `Region.run_round` reads top to bottom:

    plan        every hook's `plan`, in order: the plan the round runs
    the round   the sync algorithm: inner steps -> payload -> [payload] -> [aggregate] or
                ([before_send] -> exchange (a hook's `exchange` in place of the Exchanger's, where one
                gives it) -> mix -> [mix]) -> [before_outer_step] -> outer step
    after_round every hook's `after_round`: the round's metrics, or FloatingPointError to reject it
    recover     only for a round that raised FloatingPointError: the first hook that returns
                metrics ends the round with them; none: the error fails the round as before
    the report  the region's own record (evaluation, links, refusals)
    report      every hook's `report`: its keys added to that record, the last step before returning

Every method is optional: a hook subclasses `RoundHook` and overrides what it needs; what it does
not override is the no-op each docstring names. The features that are hooks, each whole in its
module (the driver's side of a feature, where it has one, is named in that module's docstring):

    gap filling             regions/gapfill.py        GapFill: plan, after_round, report
    rollback                regions/rollback.py       Rollback: plan, before_outer_step, after_round, recover, report
    pacing (step weight)    regions/pacing.py         StepWeight: payload
    quorum's late updates   regions/pacing.py         StaleMix: mix
    differential privacy    regions/privacy/dp.py     DpHook: plan (record mode), payload (update mode)
    secure aggregation      regions/secagg/round.py   SecureAggregation: aggregate

A plug-in outside the wheel uses the same seam: `geofed bench attack`'s member
(benchmarks/bench/adversary.py) is a before_send and report hook, given to a Region as its `plugin`.

Two points beyond plan, before_send, exchange and after_round: `recover`, because
a rollback has to see a round that raised, and `report`, because gap filling may only be armed
once the round's evaluation is done (a fill step beside it would move the evaluation's random
state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .messages import RoundPlan

Tensors = Sequence["torch.Tensor"]
# regions/exchange.py's ExchangeResult. Not imported: mypy would then check the modules behind it
# (the transport, secure aggregation), which are not typed yet; it stands for that class here.
ExchangeResult = Any


class RoundHook(Protocol):
    """One cross-cutting feature of a region's round (module docstring: where each point is)."""

    def plan(self, plan: RoundPlan) -> RoundPlan:
        """Before the round: the plan it runs. No-op: `plan` unchanged."""
        return plan

    def payload(self, plan: RoundPlan, tensors: list[torch.Tensor], metrics: dict[str, Any]) -> list[torch.Tensor]:
        """After the inner steps, on the update the region contributes to the round: what it sends
        and what it mixes as its own (an algorithm with an outer step calls it, DiLoCo). A hook that
        changes it returns new tensors (with overlap `tensors` is also the region's own unsynced
        progress) and may add its keys to `metrics`. No-op: `tensors` unchanged."""
        return tensors

    def aggregate(self, plan: RoundPlan, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, Any]] | None:
        """The round's mean of every region's `tensors` and its metrics, in place of the exchange and
        the mix (secure aggregation: the masked sum gives the mean itself, which an algorithm with an
        outer step applies as a mix). The first hook that gives one ends the point. No-op: None."""
        return None

    def mix(self, plan: RoundPlan, mixed: list[torch.Tensor], res: ExchangeResult,
            metrics: dict[str, Any]) -> list[torch.Tensor]:
        """After the mix of the exchange `res`, before the outer step (an algorithm with an outer step
        calls it, DiLoCo): the mean the outer step applies (quorum folds late updates into it); a hook
        may add its keys to `metrics`. No-op: `mixed` unchanged."""
        return mixed

    def before_send(self, round_: int, tensors: Tensors, out_peers: Sequence[str]) -> tuple[Tensors, Sequence[str]]:
        """After the region has seen its own update (its norm is admission's reference) and before
        it is encoded: what is sent, and to whom. No-op: both unchanged."""
        return tensors, out_peers

    def exchange(self, plan: RoundPlan, tensors: Tensors, *, stream: str) -> ExchangeResult | None:
        """The round's exchange in place of the Exchanger's (push, collect until the deadline).
        No-op: None, the Exchanger's exchange runs."""
        return None

    def before_outer_step(self) -> None:
        """Once a round, just before an algorithm that announces it (DiLoCo: `announces_outer_step`)
        first changes its own state (state_dict's tensors: the global copy, the outer optimizer's,
        overlap's start), after its inner steps: rollback copies that state here rather than at the
        round's start, so the copy is not held through the inner steps. Without overlap it runs in a
        thread of its own while the round's exchange waits on the network (serial DiLoCo, the sharded
        exchange: sync.common.before_outer_step_during), joined before the outer step: it must only
        read the algorithm's state. No-op: nothing."""
        return None

    def after_round(self, plan: RoundPlan, metrics: dict[str, Any]) -> dict[str, Any]:
        """After the algorithm's round (outer step done): its metrics, or FloatingPointError when the
        round left the region unusable. No-op: `metrics` unchanged."""
        return metrics

    def recover(self, plan: RoundPlan, error: FloatingPointError, metrics: dict[str, Any] | None) -> dict[str, Any] | None:
        """A round that raised `error` (in the algorithm or an after_round): the metrics it ends with
        instead (`metrics`: what the round got to, None if it got none). No-op: None, the error stands."""
        return None

    def report(self, plan: RoundPlan, metrics: dict[str, Any]) -> None:
        """The round's report is made: add this hook's keys to `metrics`; the last thing before the
        region returns. No-op: nothing added."""
        return None


def overrides(hook: RoundHook, name: str) -> bool:
    """Whether `hook` does something at point `name` (its class defines it past RoundHook's no-op)."""
    return getattr(type(hook), name, None) is not getattr(RoundHook, name)


class BeforeSend:
    """The hooks' before_send folded into the one call the Exchanger makes between seeing the
    region's own update and encoding it (Exchanger.before_send)."""

    def __init__(self, hooks: Sequence[RoundHook]):
        self.hooks = hooks

    def outgoing(self, round_: int, tensors: Tensors, out_peers: Sequence[str]) -> tuple[Tensors, Sequence[str]]:
        for hook in self.hooks:
            tensors, out_peers = hook.before_send(round_, tensors, out_peers)
        return tensors, out_peers


__all__ = ["BeforeSend", "RoundHook", "Tensors", "overrides"]
