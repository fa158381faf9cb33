"""The driver's side of privacy.dp (docs/privacy.md): the run's
PrivacyBudget planned before round 0 (the noise multiplier for target_epsilon), checked before
every round (on_target stop ends the run as run.target does; warn goes on with a warning and an
event), spent after it, and carried in the round plans, rounds.jsonl, summary.json and the
driver checkpoint (so --resume keeps the accountant).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from typing import Any

from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.messages import RoundReport
from geofed.regions.privacy.budget import PrivacyBudget, accountant_from_state

from .recovery import RunFailed


def planned_steps(cfg: Any) -> tuple[int, int]:
    """(rounds, inner steps per round) the budget is planned for: the policy's H (fixed), else its
    target H; run.max_steps, when set, bounds the rounds."""
    policy = cfg.sync.policy
    H = getattr(policy, "H", None) or getattr(policy, "target_H", None) or getattr(policy, "initial_H", 1)
    if algorithm_traits(cfg.sync.algorithm).per_step:
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


class DpBudget:
    """privacy.dp's budget across the round loop (a no-op with mode off): `plan` before round 0,
    `plans` before each round, `spend` after it, `state_dict`/`load_state_dict` in the driver
    checkpoint, `summary` in summary.json. `stopped`: the event that ended the run at the budget."""

    def __init__(self, cfg: Any, journal: Any):
        self.cfg, self.journal = cfg, journal
        self.budget: PrivacyBudget | None = None
        self.stopped: dict[str, Any] | None = None
        self._warned = False

    def plan(self, placement: Mapping[str, Mapping[str, Any]]) -> None:
        """Before round 0 (and before a resume restores the accountant): the budget of the planned
        run, the sample rate on the smallest shard (`placement`: each region's node_info, its examples)."""
        dp = self.cfg.privacy.dp
        if dp.mode == "off":
            return
        rounds, H = planned_steps(self.cfg)
        smallest = min(int(info["examples"]) for info in placement.values())
        try:
            self.budget = PrivacyBudget.plan(
                mode=dp.mode, noise_multiplier=dp.noise_multiplier, target_epsilon=dp.target_epsilon,
                delta=dp.delta, on_target=dp.on_target, rounds=rounds, steps_per_round=H,
                batch_size=self.cfg.sync.inner.batch_size, smallest_shard=smallest, accountant=dp.accountant)
        except ValueError as exc:
            raise RunFailed(f"privacy.dp: {exc}") from None
        self.journal.event("privacy_planned", mode=dp.mode, noise_multiplier=self.budget.noise_multiplier,
                           sample_rate=self.budget.sample_rate, planned_rounds=rounds, planned_H=H,
                           target_epsilon=dp.target_epsilon, delta=dp.delta, accountant=dp.accountant)

    def plans(self, r: int, plans: dict[str, Any]) -> dict[str, Any] | None:
        """The round's plans with the noise to apply, or None when the budget stops the run before it."""
        budget = self.budget
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
                if budget.accountant.steps == 0:
                    raise RunFailed(f"privacy.dp.target_epsilon: one round would spend epsilon "
                                    f"{fields['epsilon_next']:.3g} > {budget.target_epsilon} at noise_multiplier "
                                    f"{budget.noise_multiplier}")
                self.stopped = {"round": r, **fields}
                self.journal.event("privacy_budget_reached", **fields)
                return None
            self.journal.event("privacy_budget_exceeded", **fields)
            if not self._warned:
                self._warned = True
                print(f"geofed: warning: round {r} takes epsilon to {fields['epsilon_next']:.3g}, past "
                      f"privacy.dp.target_epsilon {budget.target_epsilon} (on_target: warn)", file=sys.stderr)
        dp = self.cfg.privacy.dp
        return {reg: dataclasses.replace(p, dp_mode=dp.mode, dp_clip=dp.clip, dp_noise=budget.noise_multiplier)
                for reg, p in plans.items()}

    def spend(self, results: Mapping[str, RoundReport]) -> dict[str, Any]:
        """After a round: its steps spent (the most any region took: each region's records are
        accounted on their own); the fields of the round's record."""
        if self.budget is None or not results:
            return {}
        self.budget.spend(max(int(m.steps.steps) for m in results.values()))
        return self.budget.metrics()

    def state_dict(self) -> dict[str, Any]:
        """The driver checkpoint's entries (none with DP off)."""
        return {} if self.budget is None else {"privacy": budget_state(self.budget)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.budget is not None and state.get("privacy"):
            self.budget = budget_from_state(state["privacy"])

    def summary(self) -> dict[str, Any] | None:
        """summary.json's privacy entry (None with DP off)."""
        b = self.budget
        if b is None:
            return None
        eps = b.epsilon()
        return {"mode": b.mode, "epsilon": eps if math.isfinite(eps) else None, "delta": b.delta,
                "noise_multiplier": b.noise_multiplier, "sample_rate": b.sample_rate, "steps": b.accountant.steps,
                "accountant": b.accountant.kind,
                "clip": self.cfg.privacy.dp.clip, "target_epsilon": b.target_epsilon, "on_target": b.on_target,
                "stopped_at_budget": self.stopped}
