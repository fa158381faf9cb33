"""A run's privacy budget: the noise chosen for a target epsilon before round 0, the epsilon spent
after every round, and whether the next round may run (privacy.dp; docs/privacy.md).

Record level: every inner step is one Poisson-subsampled Gaussian step at rate
batch_size / shard size (the smallest shard: the worst-off region's records). Update level: every
round is one Gaussian step at rate 1 (each region's update is in every round). Everything else a
round does (the exchange, the outer step, secure aggregation) is post-processing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .accountant import RdpAccountant, noise_multiplier_for
from .prv import PrvAccountant, prv_noise_multiplier_for

Accountant = RdpAccountant | PrvAccountant
ACCOUNTANTS = ("prv", "rdp")


def make_accountant(kind: str, *, planned_steps: int = 0) -> Accountant:
    """An empty accountant of privacy.dp.accountant's kind (PRV's discretised for `planned_steps`)."""
    if kind not in ACCOUNTANTS:
        raise ValueError(f"accountant: expected one of {ACCOUNTANTS}, got {kind!r}")
    return PrvAccountant(horizon=planned_steps) if kind == "prv" else RdpAccountant()


def accountant_from_state(state: dict) -> Accountant:
    """The accountant a checkpoint kept (a state without a kind is RDP's: checkpoints from before PRV)."""
    return PrvAccountant.from_state(state) if state.get("kind") == "prv" else RdpAccountant.from_state(state)


@dataclass
class PrivacyBudget:
    """The accountant of one run plus its plan; `check_next` before a round, `spend` after it."""

    mode: Literal["record", "update"]
    noise_multiplier: float
    sample_rate: float
    delta: float
    target_epsilon: float | None = None
    on_target: Literal["stop", "warn"] = "stop"
    accountant: Accountant = field(default_factory=RdpAccountant)

    @classmethod
    def plan(cls, *, mode: str, noise_multiplier: float | None, target_epsilon: float | None, delta: float,
             on_target: str = "stop", rounds: int, steps_per_round: int, batch_size: int,
             smallest_shard: int, accountant: str = "rdp") -> PrivacyBudget:
        """The budget of a planned run; a null noise multiplier is the smallest that keeps `rounds`
        rounds of `steps_per_round` inner steps within `target_epsilon` by the `accountant` (rdp or prv)."""
        if mode not in ("record", "update"):
            raise ValueError(f"mode: expected record or update, got {mode!r}")
        if mode == "record":
            if not 1 <= batch_size <= smallest_shard:
                raise ValueError(f"batch_size: record-level DP samples {batch_size} of a shard of {smallest_shard}")
            rate, steps = batch_size / smallest_shard, rounds * steps_per_round
        else:
            rate, steps = 1.0, rounds
        # PRV's discretised for the planned steps: the noise search's last one, reused by every round.
        empty = make_accountant(accountant, planned_steps=steps)
        if noise_multiplier is None:
            if target_epsilon is None:
                raise ValueError("noise_multiplier: needed when there is no target_epsilon")
            search = prv_noise_multiplier_for if accountant == "prv" else noise_multiplier_for
            noise_multiplier = search(target_epsilon=target_epsilon, delta=delta, sample_rate=rate, steps=steps)
        return cls(mode=mode, noise_multiplier=noise_multiplier, sample_rate=rate, delta=delta,
                   target_epsilon=target_epsilon, on_target=on_target, accountant=empty)

    def _steps(self, inner_steps: int) -> int:
        return inner_steps if self.mode == "record" else 1

    def epsilon(self) -> float:
        """Epsilon spent so far (at the configured delta)."""
        return self.accountant.epsilon(self.delta)

    def epsilon_if(self, inner_steps: int) -> float:
        """Epsilon after one more round of `inner_steps` inner steps, nothing spent."""
        return self.accountant.epsilon_if(self.delta, noise_multiplier=self.noise_multiplier,
                                          sample_rate=self.sample_rate, steps=self._steps(inner_steps))

    def check_next(self, inner_steps: int) -> Literal["ok", "warn", "stop"]:
        """Whether the next round may run: ok, warn (over target, on_target warn) or stop."""
        if self.target_epsilon is None or self.epsilon_if(inner_steps) <= self.target_epsilon * (1 + 1e-9):
            return "ok"
        return "warn" if self.on_target == "warn" else "stop"

    def spend(self, inner_steps: int) -> float:
        """Account for a round that ran; returns the epsilon spent so far."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
                             steps=self._steps(inner_steps))
        return self.epsilon()

    def metrics(self) -> dict[str, float]:
        """What a round's metrics, summary.json and the report carry."""
        eps = self.epsilon()
        return {"dp_epsilon": eps if math.isfinite(eps) else float("inf"), "dp_delta": self.delta,
                "dp_noise_multiplier": self.noise_multiplier, "dp_sample_rate": self.sample_rate,
                "dp_steps": self.accountant.steps}
