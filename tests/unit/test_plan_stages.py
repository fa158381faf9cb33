"""The plan stages (orchestrator/driver/plan_stages.py): what becomes of the policy's H, rule by
rule, and the Coordinator applying them in order."""

from __future__ import annotations

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.coordinator import Coordinator
from geofed.orchestrator.driver.plan_stages import CALIBRATION_STEPS, Calibration, EvalMarks, Step, StepBudget
from geofed.orchestrator.driver.rundir import Clock

ALIVE = ["a", "b"]


def test_the_step_budget_gives_the_last_round_what_is_left_also_a_short_remainder():
    budget = StepBudget(100)
    assert budget.apply(Step(H=30, reason="p"), alive=ALIVE, steps_done=0) == Step(H=30, reason="p")
    # 40 left after 60: 30 would leave 10 < 15, so the round takes all 40
    assert budget.apply(Step(H=30, reason="p"), alive=ALIVE, steps_done=60) == \
        Step(H=40, reason="p | H 30->40: what is left of run.max_steps=100")
    assert budget.apply(Step(H=30, reason="p"), alive=ALIVE, steps_done=90).H == 10
    assert budget.apply(Step(H=10, reason="p"), alive=ALIVE, steps_done=90) == Step(H=10, reason="p")
    assert not budget.spent(99) and budget.spent(100)
    assert StepBudget(0).apply(Step(H=30, reason="p"), alive=ALIVE, steps_done=10**6).H == 30
    assert not StepBudget(0).spent(10**6)


def test_an_eval_mark_ends_the_round_on_it():
    marks = EvalMarks((50, 120))
    assert marks.apply(Step(H=30, reason="p"), alive=ALIVE, steps_done=30) == \
        Step(H=20, reason="p | H 30->20: run.eval_at_steps 50")
    assert marks.apply(Step(H=20, reason="p"), alive=ALIVE, steps_done=30).H == 20  # ends on it already
    assert marks.hit(50) and not marks.hit(51)


def test_calibration_cuts_while_a_region_has_no_step_time():
    times = {"a": 0.01}
    cal = Calibration(times.get)
    assert cal.apply(Step(H=50, reason="p"), alive=ALIVE, steps_done=0) == \
        Step(H=CALIBRATION_STEPS, reason=f"p | H 50->{CALIBRATION_STEPS}: time-budget calibration round")
    assert cal.apply(Step(H=5, reason="p"), alive=ALIVE, steps_done=0).H == 5
    times["b"] = 0.02
    assert cal.apply(Step(H=50, reason="p"), alive=ALIVE, steps_done=0).H == 50


def test_the_coordinator_applies_them_in_order_and_a_bench_can_end_the_budget():
    cfg = config_from_mapping({"run": {"rounds": 10, "max_steps": 70, "eval_at_steps": [45]},
                               "task": {"kind": "mlp-digits"},
                               "regions": {"names": ALIVE},
                               "sync": {"policy": {"kind": "fixed", "H": 30}}})
    c = Coordinator(cfg, model_numel=1000, clock=Clock())
    hs = []
    while not c.done:
        plans = c.plan(len(hs), alive=ALIVE, evaluate=False)
        hs.append(c.last_H)
        assert {p.H for p in plans.values()} == {c.last_H}
    assert hs == [30, 15, 25] and c.steps_done == 70  # the mark at 45 cuts round 1, the budget ends round 2
    assert plans["a"].final and "run.max_steps=70" in c.last_reason
    again = Coordinator(cfg, model_numel=1000, clock=Clock())
    again.plan(0, alive=ALIVE, evaluate=False)
    again.max_steps = again.steps_done  # what bench attack and soak do to end a run early
    assert again.done
