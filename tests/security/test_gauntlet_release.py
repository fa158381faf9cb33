"""Issue 36, "every hostile act counted": a quarantined member is released only by harmless updates
whose reading could have told them from their sign flip (regions/gauntlet.py, Quarantine).

A real Gauntlet on a real torch model, screening real ExchangeResults in process (no Regions: the
readings are chosen by scaling the loss gradient, so each round's verdict is known in advance).
"""

from __future__ import annotations

import torch
from geofed.regions.exchange import ExchangeResult
from geofed.regions.gauntlet import Gauntlet
from geofed.regions.messages import RoundPlan


def _linear_gauntlet():
    """A real Gauntlet on a 4-input linear model with squared loss on two fixed batches, its theta
    and the loss gradient there (an update `c x grad` descends for c > 0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    batches = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(2)]

    def loss(m, b):
        return (m(b[0]) - b[1]).pow(2).mean()

    theta = [p.detach().clone() for p in model.parameters()]
    model.zero_grad()
    sum(loss(model, b) for b in batches).backward()
    grad = [p.grad.detach().clone() for p in model.parameters()]
    return Gauntlet(model=model, loss=loss, batches=batches, margin=0.5), theta, grad


def test_a_quarantined_member_is_not_released_by_updates_too_small_to_read():
    """bench attack's flip_x-9 and scale_x+9 left 3-9 of 60 acts uncounted: once the member's own
    update had shrunk to ~0 (its loss 0), x-9 of it read harmless, 8 such readings released it, and
    its later acts passed unread until it was caught again. A harmless reading now counts toward
    release only where the update and its reverse read more than the margin apart (Gauntlet.telling):
    here d, quarantined after two flips, sends 12 flips of ~0 and every one is refused as quarantined
    (before: rounds 10-13 admitted); then 8 updates that read apart from their reverse release it."""
    g, theta, grad = _linear_gauntlet()

    def round_(r, d_scale):
        updates = {"a": [0.05 * x for x in grad], "b": [0.05 * x for x in grad], "d": [d_scale * x for x in grad]}
        res = ExchangeResult(received=updates, own_decoded={}, missing=[])
        return set(g.screen(RoundPlan(round=r, H=1), theta, res).received)

    assert round_(0, -5.0) == {"a", "b"} and round_(1, -5.0) == {"a", "b"}
    assert g.in_quarantine("d") and g.take() == {"d": 2}
    for r in range(2, 14):
        assert round_(r, -1e-4) == {"a", "b"}, r
    assert g.take_quarantined() == {"d": 12} and g.take() == {}
    assert g.last[-1].power is not None and g.last[-1].power < g.margin
    for r in range(14, 22):  # a small descent step: harmless, and its reverse reads clearly worse
        assert g.in_quarantine("d") and round_(r, 0.3) == {"a", "b"}, r
        assert g.telling(g.last[-1]), (r, g.last[-1])
    assert not g.in_quarantine("d") and round_(22, 0.3) == {"a", "b", "d"}
