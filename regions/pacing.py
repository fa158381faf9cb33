"""How rounds are paced when regions differ in speed (``sync.pacing``, docs/heterogeneity.md).

* ``barrier`` (the default): every region runs H steps; the round ends when all have reported.
* ``time-budget``: every region runs inner steps until a wall-clock budget the coordinator sets
  from the measured step times (budget = H x the median region's step time), so fast regions
  run more steps than slow ones. Each pseudo-gradient is weighted by the work behind it
  (``weighting: steps``, FedAvg's weighting by examples processed): scaled by tau_i / tau_eff,
  tau_i its steps and tau_eff the mean of the steps the coordinator expects of the round's
  regions, so a region that ran a few steps does not dilute the mean of the others' full rounds.
  With ``fednova_max_scale`` above 1 it is normalised FedNova-style instead (Wang et al. 2020):
  scaled by tau_eff / tau_i within [1/f, f], so a region's weight does not grow with how fast its
  hardware is (objective drift toward the fast regions' data, at the price of amplifying a slow
  region's few noisy steps).
* ``quorum``: a region's receive closes once `quorum` - 1 peer updates (plus its own) are in and
  a short grace has passed; the driver closes the round once `quorum` regions have reported and
  dispatches the next round to every region not still busy. A late update is not dropped: the
  receiver keeps it (at most `max_staleness` rounds old) and mixes it into its next outer step
  with the weight 1/n x (1 + staleness)^-`staleness_exponent` (polynomial staleness weighting,
  FedAsync, Xie et al. 2019), the mean renormalised. ``late_updates: drop`` discards them
  instead (deadline-and-drop). A region that finished late takes the current model from a peer
  (one state fetch) before its next round.

The functions here are pure: what a region computes from its own numbers and the plan. The
region's side of a paced round is two round hooks (regions/hooks.py): `StepWeight` on the update a
region contributes, and `StaleMix`, quorum's late updates folded into the mix (`mix_stale`) before
the outer step. The driver's side (the budget from the step times, quorum's closing of a round, who
is dispatched) is orchestrator/driver/pacing.py's Pacing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .hooks import RoundHook

if TYPE_CHECKING:  # annotations only: the config loader imports this module without torch
    import torch

    from .messages import RoundPlan


def _doc(text: str) -> dict:
    return {"doc": text}


@dataclass(frozen=True, kw_only=True)
class PacingSection:
    """``sync.pacing``: whether a round waits for its slowest region (docs/heterogeneity.md)."""

    mode: Literal["barrier", "time-budget", "quorum"] = field(default="barrier", metadata=_doc(
        "barrier: every region runs H steps and the round waits for all; time-budget: regions step until a "
        "wall-clock budget (fast ones run more steps; FedNova-normalised pseudo-gradients); quorum: a round "
        "closes once `quorum` regions are in, late updates are applied later with a staleness weight"))
    quorum: int = field(default=0, metadata=_doc(
        "quorum mode: regions whose updates close a round (0: all but one); capped by the regions in the round"))
    grace_s: float = field(default=0.2, metadata=_doc(
        "quorum mode: once the quorum is in, how long a receive (and the driver) still waits for the rest"))
    late_updates: Literal["apply", "drop"] = field(default="apply", metadata=_doc(
        "quorum mode: apply: a late update is mixed into the receiver's next outer step with a staleness weight; "
        "drop: it is discarded (deadline-and-drop)"))
    max_staleness: int = field(default=8, metadata=_doc(
        "quorum mode: rounds a late update may be behind and still be applied (older ones are refused as late)"))
    staleness_exponent: float = field(default=0.5, metadata=_doc(
        "quorum mode: a late update's weight is (1 + staleness)^-exponent of an on-time one"))
    max_steps_factor: float = field(default=4.0, metadata=_doc(
        "time-budget mode: most steps a region runs in a round, as a multiple of the round's H"))
    fednova_max_scale: float = field(default=1.0, metadata=_doc(
        "time-budget mode: the most a pseudo-gradient is scaled up or down by FedNova's normalisation "
        "(expected steps / its steps); 1 (default) turns it off: a plain mean, which weights a region by "
        "the steps behind its update; raise it (4) for non-IID shards (docs/heterogeneity.md)"))
    weighting: Literal["steps", "mean"] = field(default="steps", metadata=_doc(
        "time-budget mode: steps: each pseudo-gradient is scaled by its steps / the mean steps expected of the "
        "round's regions (at most max_steps_factor), so a region that ran few steps does not dilute the others' "
        "full rounds; mean: a plain mean. fednova_max_scale above 1 takes precedence over both"))
    fill_gaps: bool = field(default=True, metadata=_doc(
        "time-budget mode with sync.overlap: a region that has returned its round keeps taking inner steps "
        "until the next round arrives (they count in that round), instead of sitting idle while the driver "
        "gathers and plans or a slower region finishes (regions/gapfill.py)"))

    def __post_init__(self):
        if self.quorum < 0:
            raise ValueError(f"quorum: must be >= 0, got {self.quorum}")
        if not 0 <= self.grace_s <= 600:
            raise ValueError(f"grace_s: must be in [0, 600], got {self.grace_s}")
        if not 0 <= self.max_staleness <= 1000:
            raise ValueError(f"max_staleness: must be in [0, 1000], got {self.max_staleness}")
        if not 0 <= self.staleness_exponent <= 10:
            raise ValueError(f"staleness_exponent: must be in [0, 10], got {self.staleness_exponent}")
        if not 1 <= self.max_steps_factor <= 1000:
            raise ValueError(f"max_steps_factor: must be in [1, 1000], got {self.max_steps_factor}")
        if not 1 <= self.fednova_max_scale <= 1000:
            raise ValueError(f"fednova_max_scale: must be in [1, 1000], got {self.fednova_max_scale}")
        if self.weighting not in ("steps", "mean"):
            raise ValueError(f"weighting: must be steps or mean, got {self.weighting!r}")

    def quorum_of(self, participants: int) -> int:
        """Regions (own included) that close a round of `participants` regions."""
        k = self.quorum or max(1, participants - 1)
        return max(1, min(k, participants))


def budget_over(elapsed_s: float, durations: Sequence[float], budget_s: float) -> bool:
    """Whether a time-budget round stops after `elapsed_s` seconds and the steps that took
    `durations`: when the next step, predicted at the median so far, would end past the budget.
    Stopping only once past it let a region whose steps are 4x longer overshoot by up to one of
    them, and every round waited for that (bench hetero: fast regions idle 0.116 of the time)."""
    if elapsed_s >= budget_s:
        return True
    if not durations:
        return False
    ordered = sorted(durations)
    return elapsed_s + ordered[len(ordered) // 2] > budget_s


def stale_weight(staleness: int, exponent: float) -> float:
    """An update `staleness` rounds late counts (1 + staleness)^-exponent of an on-time one."""
    return float((1 + max(0, staleness)) ** -exponent)


def fednova_scale(steps: int, norm_steps: float | None, *, limit: float = 4.0) -> float:
    """The factor on a pseudo-gradient of `steps` inner steps: tau_eff / tau_i (1 without a norm),
    kept within [1/limit, limit]: a region that got far fewer steps than the coordinator expected
    (a stall, a loaded host) must not have its few noisy steps multiplied tenfold."""
    if not norm_steps or steps <= 0:
        return 1.0
    return float(min(limit, max(1.0 / limit, float(norm_steps) / steps)))


def update_scale(pacing: PacingSection, steps: int, norm_steps: float | None, *,
                 filled: int = 0) -> tuple[str | None, float]:
    """The factor on a time-budget round's pseudo-gradient, and the metric that reports it
    (None: no scaling): FedNova's when fednova_max_scale is above 1, else the step weight. Both
    count the steps run within the budget, which the coordinator's expectation is of: the
    `filled` steps taken between rounds (fill_gaps) stay in the update without a factor. Counting
    them made a region that filled a long gap (waiting for one back from an absence) send up to
    4x its steps times 4: rounds of bench hetero's flaky scenario took 2.4x as long to the target."""
    steps -= filled
    if not norm_steps or steps <= 0:
        return None, 1.0
    if pacing.fednova_max_scale > 1:
        return "fednova_scale", fednova_scale(steps, norm_steps, limit=pacing.fednova_max_scale)
    if pacing.weighting == "steps":
        return "step_weight", float(min(pacing.max_steps_factor, steps / float(norm_steps)))
    return None, 1.0


class StepWeight(RoundHook):
    """sync.pacing time-budget's step weight (or FedNova's factor, `update_scale`) on the update a
    region contributes (its own share of the mix too); the metric that reports it is added. The
    region's own unsynced progress (overlap) stays what it trained: a scaled update is a new list."""

    def __init__(self, settings: PacingSection):
        self.settings = settings

    def payload(self, plan: RoundPlan, tensors: list[torch.Tensor], metrics: dict[str, Any]) -> list[torch.Tensor]:
        key, scale = update_scale(self.settings, metrics["steps"], plan.norm_steps, filled=metrics.get("fill_steps", 0))
        if key is not None:
            metrics[key] = round(scale, 4)
        return tensors if scale == 1.0 else [t * scale for t in tensors]


class StaleMix(RoundHook):
    """sync.pacing quorum's late updates (late_updates: apply): the ones the exchange kept (`res.stale`,
    each at most max_staleness rounds old) folded into the round's mean by their staleness
    (`mix_stale`); `stale_applied` reports each one's peer, round and weight."""

    def __init__(self, settings: PacingSection):
        self.settings = settings

    def mix(self, plan: RoundPlan, mixed: list[torch.Tensor], res: Any, metrics: dict[str, Any]) -> list[torch.Tensor]:
        if not res.stale:
            return mixed
        # n counts the updates the round's own mix holds (own + received), what a stale weight is 1/n of.
        mixed, weights = mix_stale(mixed, [(r, t) for _, r, t in res.stale], round_=plan.round,
                                   n_regions=1 + len(res.received), exponent=self.settings.staleness_exponent)
        metrics["stale_applied"] = [{"peer": p, "round": r, "weight": round(w, 4)}
                                    for (p, r, _), w in zip(res.stale, weights)]
        return mixed


def mix_stale(mixed: Sequence[torch.Tensor], stale: Sequence[tuple[int, Sequence[torch.Tensor]]], *,
              round_: int, n_regions: int, exponent: float) -> tuple[list[torch.Tensor], list[float]]:
    """Fold late pseudo-gradients into a round's mean: (mixed + sum_s w_s/n x delta_s) / (1 + sum_s w_s/n),
    w_s = stale_weight(round_ - its round). `stale` holds (its round, its tensors). Returns the new
    mean and the weights used (the round's metrics report them)."""
    weights = [stale_weight(round_ - r, exponent) / n_regions for r, _ in stale]
    if not stale:
        return list(mixed), []
    total = 1.0 + sum(weights)
    out = []
    for i, m in enumerate(mixed):
        acc = m.clone()
        for w, (_, tensors) in zip(weights, stale):
            acc.add_(tensors[i].to(acc.device, acc.dtype), alpha=w)
        out.append(acc.div_(total))
    return out, [w * n_regions for w in weights]


__all__ = ["PacingSection", "StaleMix", "StepWeight", "budget_over", "fednova_scale", "mix_stale", "stale_weight", "update_scale"]
