"""The round guard's state copy: what copy.deepcopy gave, for a fraction of its cost."""

from __future__ import annotations

import torch
from geofed.regions.rollback import copy_state


def test_copy_state_is_a_deep_copy_that_keeps_types_and_state_dict_metadata():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "inner": opt.state_dict(), "algorithm": {"global": [torch.ones(2)],
                                                                                   "pair": (torch.zeros(1), 5), "n": 3}}
    got = copy_state(state)
    assert type(got["model"]) is type(state["model"]) and got["model"]._metadata == state["model"]._metadata
    assert isinstance(got["algorithm"]["pair"], tuple) and got["algorithm"]["n"] == 3
    for key, t in state["model"].items():
        assert torch.equal(got["model"][key], t) and got["model"][key].data_ptr() != t.data_ptr()
    before = {k: v.clone() for k, v in got["model"].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the live model moves on; the copy does not
    opt.step()
    assert all(torch.equal(got["model"][k], v) for k, v in before.items())
    model.load_state_dict(got["model"])
    opt.load_state_dict(got["inner"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_rounds_copy_is_made_after_the_last_one_is_dropped(monkeypatch):
    """Two copies of the round's start at once cost a model's state twice at every round's start
    (issue 39): plan lets the last copy go before it makes the next."""
    import types

    from geofed.regions import rollback

    model = torch.nn.Linear(3, 2)
    w = types.SimpleNamespace(model=model, inner=torch.optim.SGD(model.parameters(), lr=0.1),
                              algorithm=types.SimpleNamespace(state_dict=lambda: {}), task=None)
    hook = rollback.Rollback(w)
    held_while_copying = []

    def spy(obj):
        if isinstance(obj, dict) and "model" in obj:  # the round's copy, not its recursion
            held_while_copying.append(hook._state)
        return copy_state(obj)

    monkeypatch.setattr(rollback, "copy_state", spy)
    hook.plan(None)
    hook.plan(None)
    assert held_while_copying == [None, None] and hook._state is not None
