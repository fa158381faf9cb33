"""The round guard's state copy: what copy.deepcopy gave, for a fraction of its cost."""

from __future__ import annotations

import pytest
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
        held_while_copying.append(hook._state)
        return copy_state(obj)

    monkeypatch.setattr(rollback, "copy_state", spy)
    hook.plan(None)
    hook.plan(None)
    assert held_while_copying and all(s is None for s in held_while_copying) and hook._state is not None


def _overlap_region(tmp_path, copy="disk"):
    from geofed.orchestrator.config import config_from_mapping
    from geofed.p2p.memory import InMemoryHub, InMemoryTransport
    from geofed.regions.region import Region

    cfg = config_from_mapping({
        "run": {"seed": 0, "checkpoint_every": 0}, "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["a"]}, "network": {"emulation": {"mode": "none"}},
        "security": {"rollback_copy": copy}, "sync": {"overlap": True, "deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 5.0}}})
    return Region(cfg, "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()))


@pytest.mark.parametrize("copy", ["memory", "disk"])
def test_diloco_rollback_copies_no_parameters_and_the_outer_state_only_at_the_outer_step(tmp_path, copy):
    """Issue 39: through the inner steps the copy holds the inner optimizer and the model's buffers
    only (whole-model DiLoCo restarts its parameters from the global copy; its outer state changes
    only at the outer step, copied then), and none once the round stands. The guarantee is unchanged:
    a round that fails in its inner steps (no outer copy made) or after its outer step goes back to
    its start bitwise: global model, outer momentum, AdamW moments, and the model restarted there.
    With rollback_copy disk every part of the copy is a file while it is held (not a tensor of the
    process), and the files are gone once the round stands or has been restored."""
    from geofed.regions.hooks import RoundHook
    from geofed.regions.messages import RoundPlan
    from geofed.regions.rollback import OnDisk, Rollback

    region = _overlap_region(tmp_path, copy)
    files = tmp_path / "rollback"
    try:
        rb = next(h for h in region.hooks if isinstance(h, Rollback))
        held: list[dict] = []
        loss, nan = region.task.loss, [False]

        def training_loss(model, batch):  # the inner steps' (the probe runs without grad): what is held then
            if not torch.is_grad_enabled():
                return loss(model, batch)
            parts = dict(rb._state)
            if copy == "disk":
                assert all(isinstance(p, OnDisk) and p.path.parent == files and p.path.stat().st_size > 0
                           for p in parts.values())
                parts = {k: p.load() for k, p in parts.items()}
            held.append(parts)
            return loss(model, batch) * (float("nan") if nan[0] else 1.0)  # NaN: AdamW's moments turn NaN too

        region.task.loss = training_loss

        class Spy(RoundHook):
            fail_after = False

            def after_round(self, plan, metrics):
                if self.fail_after:
                    raise FloatingPointError("rejected after the outer step")
                return metrics

        spy = Spy()
        region.add_hook(spy)
        for r in range(3):
            region.run_round(RoundPlan(round=r, H=2))
        assert rb._state is None  # released once the round stood
        assert not files.exists() or not any(files.iterdir())
        params = {n for n, _ in region.model.named_parameters()}
        assert set(held[-1]) == {"model", "inner"} and not set(held[-1]["model"]) & params

        def start_of_round():
            algo = region.algorithm.state_dict()
            return ([g.clone() for g in algo["global"]],
                    [s["momentum_buffer"].clone() for s in algo["outer"]["state"].values()],
                    [s["exp_avg_sq"].clone() for s in region.inner.state.values()])

        def assert_restored(start):
            glob, momentum, moments = start
            now = start_of_round()
            assert all(torch.equal(a, b) for a, b in zip(now[0], glob))
            assert all(torch.equal(a, b) for a, b in zip(now[1], momentum))
            assert all(torch.equal(a, b) for a, b in zip(now[2], moments))
            assert all(torch.equal(p, g) for p, g in zip(region.params, glob))  # restarted from the global copy

        start = start_of_round()
        nan[0] = True
        m = region.run_round(RoundPlan(round=3, H=2))
        nan[0] = False
        assert m.security.rolled_back and "algorithm" not in held[-1] and rb._state is None
        assert_restored(start)

        spy.fail_after = True
        m = region.run_round(RoundPlan(round=4, H=2))  # the outer step applied round 2's mean, then failed
        assert m.security.rolled_back["why"] == "rejected after the outer step"
        assert_restored(start)
        assert not files.exists() or not any(files.iterdir())
    finally:
        region.close()


def test_a_dead_processs_copies_are_cleared_and_a_live_ones_kept(tmp_path):
    """A region killed mid-round leaves its copy (8-16 B/param) in rollback/; the next Rollback on the
    folder (the restarted region, a worker) deletes the files of this host's dead processes only."""
    import os
    import subprocess
    import sys

    from geofed.regions.rollback import OnDisk, drop_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    mine = OnDisk({"x": torch.ones(3)}, tmp_path)
    left = tmp_path / mine.path.name.replace(f"-{os.getpid()}-", f"-{pid}-", 1)
    left.write_bytes(mine.path.read_bytes())
    other_host = tmp_path / f"elsewhere.invalid-{pid}-x.pt"
    other_host.write_bytes(b"")
    assert drop_stale(tmp_path) == 1
    assert not left.exists() and mine.path.exists() and other_host.exists()
    assert torch.equal(mine.load()["x"], torch.ones(3))
