"""The Algorithm seam: what a round sends and what a region makes of what came back.

A round is: inner steps, ``payload`` (what leaves the region), the hooks on what is sent (pacing's
step weight, update-level DP), the exchange, ``apply`` (the mix and the step it feeds). The round
itself is the caller's (regions/sync/diloco.py, allreduce.py, gossip.py today); an algorithm holds
only its own state, which ``state_dict``/``load_state_dict`` carry through checkpoints, rollbacks
and a rejoining region's catch-up. DiLoCo (one per fragment), all-reduce and gossip/CHOCO implement
it; overlap and fragments wrap DiLoCo's rather than branch inside it.

The types are what the seam reads, not the worker's classes: a plan has a round, a received
exchange has the updates by sender (regions/exchange.py's ExchangeResult is one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch


class PlanView(Protocol):
    """The part of a round's plan (regions/messages.py: RoundPlan) every algorithm reads."""

    @property
    def round(self) -> int: ...


class Received(Protocol):
    """What an exchange brought back (regions/exchange.py: ExchangeResult)."""

    @property
    def received(self) -> Mapping[str, Sequence[torch.Tensor]]: ...


@runtime_checkable
class Algorithm(Protocol):
    """One region's sync algorithm, as the round sees it."""

    def payload(self, plan: PlanView, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What this region sends this round, taken from `params` (the live tensors it owns)."""
        ...

    def apply(self, plan: PlanView, own: Sequence[torch.Tensor], received: Received) -> dict[str, Any]:
        """Mix `own` (what was sent) with what was `received` and apply it; metrics it adds to the round's.
        `own` may be used up (DiLoCo sums the mix into it)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Its own state: tensors and plain values only."""
        ...

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore what `state_dict` gave (a checkpoint's, a rollback's or a donor's)."""
        ...


class OuterPart(Algorithm, Protocol):
    """One part of a DiLoCo-style algorithm (the whole model, or one fragment) as its wrappers see
    it: overlap (regions/sync/overlap.py) hands a part's exchange over a round, fragments
    (regions/sync/fragments.py) checkpoint the parts together. regions/sync/diloco.py's Diloco is one.
    """

    stream: str                          # the exchange stream its updates travel on ("" for the whole model)
    global_params: list[torch.Tensor]    # the global copy the outer optimizer steps
    outer_opt: torch.optim.Optimizer
    start: list[torch.Tensor] | None     # where the unsent progress starts (overlap), else None

    def mixed(self, plan: Any, own: Sequence[torch.Tensor], res: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The mix of `own` with what `res` brought, and the metrics of screening it."""
        ...

    def step(self, mixed: Sequence[torch.Tensor]) -> None:
        """The outer optimizer's step on the global copy with the mixed pseudo-gradient."""
        ...

    def preview(self, mixed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What `step` would make of the global copy, on copies (nothing changes)."""
        ...

    def set_live(self, values: Sequence[torch.Tensor], *, start: bool = False) -> None:
        """Copy `values` into the live tensors (and, `start`, mark them where progress starts)."""
        ...

    def restart_behind(self, delta: Sequence[torch.Tensor]) -> None:
        """``local = global - delta`` in place, marked where progress starts (delayed overlap's restart)."""
        ...

    def rebase(self) -> None:
        """Move the unsent progress onto the new global copy: ``local = global - (start - local)``."""
        ...


__all__ = ["Algorithm", "OuterPart", "PlanView", "Received"]
