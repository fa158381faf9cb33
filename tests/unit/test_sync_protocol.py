"""The sync-algorithm seam: an algorithm needs only a SyncContext (params, an inner stepper, the
exchange), not a Region. Here the context is built from plain functions: a quadratic
loss as the stepper and an exchange that hands back what a second region sent."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.exchange import ExchangeResult
from geofed.regions.sync import ALGORITHMS, Algorithm, AllReduceSync, Diloco, DilocoSync, GossipSync, mix
from geofed.regions.sync.protocol import SyncAlgorithm, SyncContext
from geofed.regions.region import Region
from geofed.regions.messages import RoundPlan


class _Quadratic:
    """Inner steps of plain SGD on 0.5 * ||x - target||^2."""

    def __init__(self, params, target, lr):
        self.params, self.target, self.lr = params, target, lr

    def forward_backward(self) -> float:
        (x,) = self.params
        x.grad = (x.detach() - self.target).clone()
        return float(0.5 * (x.detach() - self.target).pow(2).sum())

    def optimizer_step(self, lr_scale: float) -> None:
        with torch.no_grad():
            self.params[0].sub_(self.lr * lr_scale * self.params[0].grad)

    def inner_steps(self, H, lr_scale, *, before_step=None, budget_s=None, max_steps=None):
        losses = []
        for k in range(H):
            losses.append(self.forward_backward())
            if before_step is not None:
                before_step(k)
            self.optimizer_step(lr_scale)
        return {"train_loss": sum(losses) / H, "compute_s": 0.0, "step_time_s": 0.0, "steps": H}


def _context(settings, params, stepper, peer_tensors):
    def exchange(plan, tensors, *, single_codec=False, send=True, stream=""):
        return ExchangeResult(received={"b": [t.clone() for t in peer_tensors]}, own_decoded={}, missing=[])

    return SyncContext(region="a", index=0, params=params, shapes=[tuple(p.shape) for p in params], settings=settings,
                       seed=0, stepper=stepper, exchange=exchange,
                       mix=lambda plan, own, res, **kw: mix(own, res.received, {"b": 0.5}, 0.5, **kw),
                       in_weights=lambda r: {"b": 0.5}, fetch_state=lambda peer, **kw: b"",
                       evaluate=lambda params, **kw: {"metric": "none", "value": 0.0, "higher_is_better": True})


def test_diloco_runs_on_a_context_alone():
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "sync": {"outer": {"lr": 1.0, "momentum": 0.0}}})
    x = torch.zeros(4, requires_grad=True)
    algo = DilocoSync(_context(cfg.sync, [x], _Quadratic([x], torch.ones(4), lr=0.5), [torch.full((4,), 0.25)]))
    plan = RoundPlan(round=0, H=1)
    metrics = algo.run_round(plan)
    # One step of lr 0.5 moves x from 0 to 0.5: delta = -0.5; the peer's delta is 0.25; the mix
    # is -0.125, and the outer SGD step (lr 1) leaves x at 0.125 on every coordinate.
    assert torch.allclose(x.detach(), torch.full((4,), 0.125)) and metrics["steps"] == 1
    assert torch.allclose(algo.eval_params()[0], torch.full((4,), 0.125))


def test_diloco_update_level_dp_clips_and_noises_what_is_sent():
    """DP is a round hook (regions/privacy/dp.py DpHook): DiLoCo's round calls the hooks' payload
    point (SyncContext.payload), which the region folds from its hooks."""
    from geofed.regions.privacy.dp import DpHook

    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "sync": {"outer": {"lr": 1.0, "momentum": 0.0}}})
    x = torch.zeros(4, requires_grad=True)
    sent = []
    ctx = _context(cfg.sync, [x], _Quadratic([x], torch.ones(4), lr=0.5), [torch.zeros(4)])
    inner_exchange = ctx.exchange

    def exchange(plan, tensors, **kw):
        sent.append([t.clone() for t in tensors])
        return inner_exchange(plan, tensors, **kw)

    algo = DilocoSync(SyncContext(**{**ctx.__dict__, "exchange": exchange, "payload": DpHook(seed=0, region=0).payload}))
    metrics = algo.run_round(RoundPlan(round=0, H=1, dp_mode="update", dp_clip=0.1, dp_noise=0.0))
    # delta = -0.5 per coordinate (norm 1.0), clipped to norm 0.1; noise 0 leaves it exact.
    assert torch.allclose(sent[0][0], torch.full((4,), -0.05)) and metrics["dp_update_norm"] == pytest.approx(1.0)
    assert metrics["dp_clip_scale"] == pytest.approx(0.1)
    algo.run_round(RoundPlan(round=1, H=1, dp_mode="update", dp_clip=0.1, dp_noise=10.0))
    assert float(sent[1][0].norm()) > 0.1  # noise of std 1 per coordinate on top of an update clipped to 0.1


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_has_the_protocol_and_takes_only_a_context(name):
    cls = ALGORITHMS[name]
    for member in ("run_round", "finish", "eval_params", "state_dict", "load_state_dict", "rolled_back", "close",
                   "wire_shapes", "evaluates_in_exchange"):
        assert hasattr(cls, member), f"{name} lacks {member}"
    assert list(inspect.signature(cls.__init__).parameters) == ["self", "ctx"]
    assert set(dir(SyncAlgorithm)) >= {"run_round", "wire_shapes"}


def test_wire_shapes_decide_what_the_worker_decodes():
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "sync": {"algorithm": "gossip", "topology": "ring", "gossip": {"tracking": True}},
                               "compression": {"error_feedback": False}})
    shapes = [(3, 2), (2,)]
    assert ALGORITHMS["gossip"].wire_shapes(cfg.sync, shapes) == shapes * 2
    assert ALGORITHMS["diloco"].wire_shapes(cfg.sync, shapes) == shapes
    # The context names only what an algorithm may use of its region, not the worker itself.
    assert "worker" not in {f.name for f in fields(SyncContext)}
    assert Region._sync_context.__doc__


@pytest.mark.parametrize("cls", [Diloco, AllReduceSync, GossipSync])
def test_diloco_allreduce_and_gossip_implement_the_algorithm_seam(cls):
    assert list(inspect.signature(cls.payload).parameters) == ["self", "plan", "params"]
    assert list(inspect.signature(cls.apply).parameters) == ["self", "plan", "own", "received"]
    assert callable(cls.state_dict) and callable(cls.load_state_dict)


def test_the_seam_round_trips_on_a_context_alone():
    # payload -> exchange -> apply, as DilocoSync's round does, with DiLoCo's part and all-reduce.
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "sync": {"outer": {"lr": 1.0, "momentum": 0.0}}})
    x = torch.zeros(4, requires_grad=True)
    ctx = _context(cfg.sync, [x], _Quadratic([x], torch.ones(4), lr=0.5), [torch.full((4,), 0.25)])
    part = DilocoSync(ctx).parts[0]
    assert isinstance(part, Algorithm) and isinstance(AllReduceSync(ctx), Algorithm)
    ctx.stepper.inner_steps(1, 1.0)
    own = part.payload(RoundPlan(round=0, H=1), part.live)
    assert torch.allclose(own[0], torch.full((4,), -0.5))
    part.apply(RoundPlan(round=0, H=1), own, ctx.exchange(RoundPlan(round=0, H=1), own))
    assert torch.allclose(x.detach(), torch.full((4,), 0.125))  # as test_diloco_runs_on_a_context_alone
    state = part.state_dict()
    part.load_state_dict({"global": [torch.zeros(4)], "outer": state["outer"]})
    assert torch.equal(part.global_params[0], torch.zeros(4))


def test_every_algorithm_says_its_traits_and_the_config_offers_exactly_those():
    import typing

    from geofed.orchestrator.config import SyncSection
    from geofed.regions.algorithm_traits import TRAITS

    assert {name: cls.traits for name, cls in ALGORITHMS.items()} == TRAITS
    assert set(typing.get_args(typing.get_type_hints(SyncSection)["algorithm"])) == set(TRAITS)
