"""The plan stages: what becomes of the policy's H before a round is planned. Each rule is whole in
one small object; Coordinator.plan applies them in order to the round's Step (its H and the reason
rounds.jsonl shows), given the inner steps done before the round:

1. Calibration (sync.pacing time-budget): a short round while some region has no step time yet.
2. StepBudget (run.max_steps): the last round takes what is left of the budget.
3. EvalMarks (run.eval_at_steps): a round that would pass a mark ends on it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

CALIBRATION_STEPS = 10  # time-budget: the steps of a round that measures regions without a step time


@dataclass(frozen=True, kw_only=True)
class Step:
    """A round's inner steps and why."""

    H: int
    reason: str

    def cut(self, H: int, why: str) -> Step:
        return Step(H=H, reason=f"{self.reason} | H {self.H}->{H}: {why}")


class Calibration:
    """sync.pacing time-budget: while some region has no step time yet, a round of at most
    CALIBRATION_STEPS measures them all, instead of a barrier round of H steps that waits for the
    slowest. `step_time(region)`: the coordinator's measured step time, None before one."""

    def __init__(self, step_time: Callable[[str], float | None]):
        self.step_time = step_time

    def active(self, alive: Collection[str]) -> bool:
        return any(self.step_time(r) is None for r in alive)

    def apply(self, step: Step, *, alive: Collection[str], steps_done: int) -> Step:
        if step.H > CALIBRATION_STEPS and self.active(alive):
            return step.cut(CALIBRATION_STEPS, "time-budget calibration round")
        return step


class StepBudget:
    """run.max_steps (0: none): the run ends once every region has run that many inner steps. The
    last round takes what is left, also a remainder under H/2 (a round of a few steps would cost a
    whole exchange and report a loss over a handful of batches)."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def spent(self, steps_done: int) -> bool:
        return bool(self.max_steps) and steps_done >= self.max_steps

    def apply(self, step: Step, *, alive: Collection[str], steps_done: int) -> Step:
        left = self.max_steps - steps_done
        if not self.max_steps or (step.H < left and left - step.H >= step.H // 2):
            return step
        if left == step.H:
            return step
        return step.cut(left, f"what is left of run.max_steps={self.max_steps}")


class EvalMarks:
    """run.eval_at_steps: a round that would pass a mark ends on it (and evaluates); the next goes
    on from there."""

    def __init__(self, marks: Collection[int]):
        self.marks = tuple(marks)

    def hit(self, steps_done: int) -> bool:
        return steps_done in self.marks

    def apply(self, step: Step, *, alive: Collection[str], steps_done: int) -> Step:
        mark = next((m for m in self.marks if steps_done < m < steps_done + step.H), None)
        if mark is None:
            return step
        return step.cut(mark - steps_done, f"run.eval_at_steps {mark}")
