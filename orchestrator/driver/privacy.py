"""The driver's side of privacy.dp (docs/privacy.md), as a base class of Runner: the run's
PrivacyBudget planned before round 0 (the noise multiplier for target_epsilon), checked before
every round (on_target stop ends the run as run.target does; warn goes on with a warning and an
event), spent after it, and carried in the round plans, rounds.jsonl, summary.json and the
driver checkpoint (so --resume keeps the accountant).

It works on the Runner's state: ``cfg``, ``actors``, ``regions`` and its ``_event``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

from geofed.regions.privacy.budget import PrivacyBudget, accountant_from_state

from .recovery import RunFailed


def planned_steps(cfg: Any) -> tuple[int, int]:
    """(rounds, inner steps per round) the budget is planned for: the policy's H (fixed), else its
    target H; run.max_steps, when set, bounds the rounds."""
    policy = cfg.sync.policy
    H = getattr(policy, "H", None) or getattr(policy, "target_H", None) or getattr(policy, "initial_H", 1)
    if cfg.sync.algorithm == "allreduce":
        H = 1
    rounds = cfg.run.rounds
    if cfg.run.max_steps:
        rounds = min(rounds, math.ceil(cfg.run.max_steps / H))
    return rounds, H


def budget_state(budget: PrivacyBudget) -> dict[str, Any]:
    """What the driver checkpoint keeps: the plan and the accountant."""
    return {"mode": budget.mode, "noise_multiplier": budget.noise_multiplier, "sample_rate": budget.sample_rate,
            "delta": budget.delta, "target_epsilon": budget.target_epsilon, "on_target": budget.on_target,
            "accountant": budget.accountant.state()}


def budget_from_state(state: dict[str, Any]) -> PrivacyBudget:
    """The budget a driver checkpoint kept (budget_state)."""
    return PrivacyBudget(mode=state["mode"], noise_multiplier=float(state["noise_multiplier"]),
                         sample_rate=float(state["sample_rate"]), delta=float(state["delta"]),
                         target_epsilon=state["target_epsilon"], on_target=state["on_target"],
                         accountant=accountant_from_state(state["accountant"]))


class DpAccounting:
    """privacy.dp's budget across the round loop (a no-op with mode off)."""

    dp_budget: PrivacyBudget | None = None
    dp_stopped: dict[str, Any] | None = None  # the event that ended the run at the budget
    _dp_warned = False

    def _plan_privacy(self) -> None:
        """Before round 0 (and before a resume restores the accountant): the budget of the planned run."""
        dp = self.cfg.privacy.dp
        if dp.mode == "off":
            return
        rounds, H = planned_steps(self.cfg)
        smallest = min(int(self.actors.info[r]["examples"]) for r in self.regions)
        try:
            self.dp_budget = PrivacyBudget.plan(
                mode=dp.mode, noise_multiplier=dp.noise_multiplier, target_epsilon=dp.target_epsilon,
                delta=dp.delta, on_target=dp.on_target, rounds=rounds, steps_per_round=H,
                batch_size=self.cfg.sync.inner.batch_size, smallest_shard=smallest, accountant=dp.accountant)
        except ValueError as exc:
            raise RunFailed(f"privacy.dp: {exc}") from None
        self._event("privacy_planned", mode=dp.mode, noise_multiplier=self.dp_budget.noise_multiplier,
                    sample_rate=self.dp_budget.sample_rate, planned_rounds=rounds, planned_H=H,
                    target_epsilon=dp.target_epsilon, delta=dp.delta, accountant=dp.accountant)

    def _dp_plans(self, r: int, plans: dict[str, Any]) -> dict[str, Any] | None:
        """The round's plans with the noise to apply, or None when the budget stops the run before it."""
        budget = self.dp_budget
        if budget is None:
            return plans
        some = next(iter(plans.values()), None)
        if some is None:
            return plans
        steps = some.max_steps if some.budget_s is not None and some.max_steps else some.H
        verdict = budget.check_next(steps)
        if verdict != "ok":
            fields = {"epsilon": budget.epsilon(), "epsilon_next": budget.epsilon_if(steps),
                      "target_epsilon": budget.target_epsilon}
            if verdict == "stop":
                if r == self.next_round and budget.accountant.steps == 0:
                    raise RunFailed(f"privacy.dp.target_epsilon: one round would spend epsilon "
                                    f"{fields['epsilon_next']:.3g} > {budget.target_epsilon} at noise_multiplier "
                                    f"{budget.noise_multiplier}")
                self.dp_stopped = {"round": r, **fields}
                self._event("privacy_budget_reached", **fields)
                return None
            self._event("privacy_budget_exceeded", **fields)
            if not self._dp_warned:
                self._dp_warned = True
                print(f"geofed: warning: round {r} takes epsilon to {fields['epsilon_next']:.3g}, past "
                      f"privacy.dp.target_epsilon {budget.target_epsilon} (on_target: warn)", file=sys.stderr)
        dp = self.cfg.privacy.dp
        return {reg: dataclasses.replace(p, dp_mode=dp.mode, dp_clip=dp.clip, dp_noise=budget.noise_multiplier)
                for reg, p in plans.items()}

    def _dp_spend(self, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """After a round: its steps spent (the most any region took: each region's records are
        accounted on their own); the fields of the round's record."""
        if self.dp_budget is None or not results:
            return {}
        self.dp_budget.spend(max(int(m.get("steps", m.get("H", 1))) for m in results.values()))
        return self.dp_budget.metrics()

    def _dp_state(self) -> dict[str, Any]:
        return {} if self.dp_budget is None else {"privacy": budget_state(self.dp_budget)}

    def _dp_restore(self, state: dict[str, Any]) -> None:
        if self.dp_budget is not None and state.get("privacy"):
            self.dp_budget = budget_from_state(state["privacy"])

    def _dp_summary(self) -> dict[str, Any] | None:
        """summary.json's privacy entry (None with DP off)."""
        b = self.dp_budget
        if b is None:
            return None
        eps = b.epsilon()
        return {"mode": b.mode, "epsilon": eps if math.isfinite(eps) else None, "delta": b.delta,
                "noise_multiplier": b.noise_multiplier, "sample_rate": b.sample_rate, "steps": b.accountant.steps,
                "accountant": b.accountant.kind,
                "clip": self.cfg.privacy.dp.clip, "target_epsilon": b.target_epsilon, "on_target": b.on_target,
                "stopped_at_budget": self.dp_stopped}
