"""The driver's privacy.dp bookkeeping (orchestrator/driver/privacy.py) and the record-level inner
step (regions/privacy/dp.py: dp_step), without Ray: the round loop's use of them is
tests/integration/test_privacy_rounds.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.privacy import DpBudget, budget_from_state, budget_state, planned_steps
from geofed.orchestrator.driver.recovery import RunFailed
from geofed.regions.privacy.dp import dp_step, noise_generator
from geofed.regions.messages import RoundPlan
from support.reports import report


def _cfg(dp: dict, **sync):
    return config_from_mapping({"run": {"rounds": 6}, "task": {"kind": "mlp-digits", "hidden": 8},
                                "regions": {"names": ["a", "b", "c"]},
                                "sync": {"policy": {"kind": "fixed", "H": 5}, **sync}, "privacy": {"dp": dp}})


class _Journal:
    """The events DpBudget writes, kept."""

    def __init__(self):
        self.round, self.events = 0, []

    def event(self, event, **fields):
        self.events.append({"event": event, "round": self.round, **fields})


def _budget(cfg, examples=600):
    """A DpBudget planned for `cfg` on regions of `examples` each."""
    d = DpBudget(cfg, _Journal())
    d.plan({r: {"examples": examples} for r in cfg.regions.names})
    return d


def _plans(r, H=5):
    return {reg: RoundPlan(round=r, H=H) for reg in ("a", "b", "c")}


@pytest.mark.parametrize("accountant, expected", [("rdp", [4.73, 7.08]), ("prv", [4.38, 6.57])])
def test_plans_carry_the_noise_and_epsilon_grows_then_the_budget_stops(accountant, expected):
    """Update level, noise 1: RDP's bound, and (prv) the exact Gaussian curve, mu 1 then sqrt 2."""
    d = _budget(_cfg({"mode": "update", "clip": 0.5, "noise_multiplier": 1.0, "target_epsilon": 8.0,
                      "accountant": accountant}))
    assert planned_steps(d.cfg) == (6, 5)
    eps = []
    for r in range(3):
        d.journal.round = r
        plans = d.plans(r, _plans(r))
        if plans is None:
            break
        assert {(p.dp_mode, p.dp_clip, p.dp_noise) for p in plans.values()} == {("update", 0.5, 1.0)}
        eps.append(d.spend({reg: report(steps=5) for reg in plans})["dp_epsilon"])
    assert [round(e, 2) for e in eps] == expected
    assert d.stopped["round"] == 2 and d.journal.events[-1]["event"] == "privacy_budget_reached"
    assert d.summary()["epsilon"] == pytest.approx(eps[-1])


def test_warn_goes_on_and_the_checkpoint_keeps_the_accountant(capsys):
    d = _budget(_cfg({"mode": "update", "noise_multiplier": 1.0, "target_epsilon": 5.0, "on_target": "warn"}))
    for r in range(3):
        assert d.plans(r, _plans(r)) is not None
        d.spend({"a": report(steps=5)})
    assert "past privacy.dp.target_epsilon" in capsys.readouterr().err
    assert [e["event"] for e in d.journal.events].count("privacy_budget_exceeded") == 2
    again = _budget(d.cfg)
    again.load_state_dict(d.state_dict())
    assert again.budget.epsilon() == d.budget.epsilon() and again.budget.accountant.steps == 3
    assert budget_from_state(budget_state(d.budget)).epsilon() == d.budget.epsilon()


def test_a_first_round_past_the_target_fails_the_run_and_off_changes_nothing():
    d = _budget(_cfg({"mode": "update", "noise_multiplier": 0.5, "target_epsilon": 1.0}))
    with pytest.raises(RunFailed, match="privacy.dp.target_epsilon"):
        d.plans(0, _plans(0))
    off = _budget(_cfg({}))
    plans = _plans(0)
    assert off.plans(0, plans) is plans and off.spend({"a": report(steps=5)}) == {}
    assert off.summary() is None and off.state_dict() == {}


def test_record_level_plans_the_rate_on_the_smallest_shard():
    d = _budget(_cfg({"mode": "record", "target_epsilon": 4.0}, inner={"batch_size": 32}), examples=320)
    assert d.budget.sample_rate == pytest.approx(0.1)
    for r in range(6):
        d.plans(r, _plans(r))
        d.spend({"a": report(steps=5), "b": report(steps=5)})
    assert 3.5 < d.budget.epsilon() <= 4.0 + 1e-6 and d.budget.accountant.steps == 30


def test_record_level_dp_refuses_fp16():
    with pytest.raises(ValueError, match="sync.inner.precision"):
        _cfg({"mode": "record", "noise_multiplier": 1.0}, inner={"precision": "fp16"})


def test_dp_step_returns_the_loss_and_writes_clipped_noised_gradients():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4) * 100, torch.randint(0, 3, (8,))

    def loss(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    value = dp_step(model, loss, (x, y), clip=0.1, noise_multiplier=0.0, expected_batch=8, generator=noise_generator())
    assert value == pytest.approx(float(loss(model, (x, y)).detach()))
    total = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float(total.norm()) <= 0.1 + 1e-6  # the mean of 8 gradients each clipped to 0.1
    a, b = noise_generator(), noise_generator()
    assert not torch.equal(torch.randn(4, generator=a), torch.randn(4, generator=b))  # not the run seed


def test_tensor_shards_poisson_sample_and_an_empty_batch_is_noise_alone():
    from geofed.regions.tasks.sharding import TensorShard

    shard = TensorShard(torch.randn(1000, 4), torch.randint(0, 3, (1000,)), batch_size=32)
    sizes = [len(x) for x, _ in (next(s) for s in [shard.poisson_batches(torch.Generator().manual_seed(1), 0.032)]
                                 for _ in range(200))]
    assert len(set(sizes)) > 5 and 28 < sum(sizes) / len(sizes) < 36  # Poisson, not fixed: mean 32
    model = nn.Linear(4, 3)

    def loss(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    empty = (torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    assert dp_step(model, loss, empty, clip=1.0, noise_multiplier=1.0, expected_batch=32,
                   generator=noise_generator()) == 0.0
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters())


def test_the_report_states_epsilon():
    from geofed.orchestrator.report.facts import privacy_text

    assert privacy_text(None) is None and privacy_text({"epsilon": None}) is None
    text = privacy_text({"mode": "record", "epsilon": 7.974, "delta": 1e-5, "noise_multiplier": 2.492, "clip": 1.0,
                         "target_epsilon": 8.0, "stopped_at_budget": {"round": 12}})
    assert text == ("record level: epsilon 7.97 at delta 1e-05 (noise multiplier 2.49, clip 1), target 8; "
                    "stopped before round 12 (the budget)")
