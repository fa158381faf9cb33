"""sync.outer.kind (regions/sync/outer.py): outer Adam, plain SGD and a plug-in run through DiLoCo's one
code path, in process over the in-memory transport. Each outer step is checked against the same
torch optimizer applied by hand to the mixed pseudo-gradient (two regions, full topology, no robust
aggregation: the mix is the mean of the two pseudo-gradients, which an identity codec carries exactly)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from geofed.orchestrator.config import config_from_mapping, load_config
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.sync import Diloco, outer_optimizer
from geofed.regions.sync import outer as outer_module
from geofed.regions.sync.outer import load_outer_factory, make_outer_optimizer, preview_step
from geofed.regions.messages import RoundPlan

REGIONS = ["a", "b"]
DOC = Path(__file__).resolve().parents[2] / "docs" / "outer-optimizers.md"


def _cfg(outer: dict, *, overlap=False, fragments=1, regions=REGIONS):
    return config_from_mapping({
        "run": {"name": "t", "seed": 5},
        "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": regions},
        "sync": {"outer": outer, "overlap": overlap, "fragments": fragments, "inner": {"lr": 0.01}},
        "compression": {"codec": "identity", "error_feedback": False},
        "network": {"emulation": {"mode": "none"}},
        "security": {"robust_aggregation": "none"},  # the plain mean: no clipping at the mix
    })


def _run(tmp_path, cfg, rounds, monkeypatch, *, regions=REGIONS, name="run"):
    """Train `rounds` rounds; returns (the first global model, each round's pseudo-gradients by region,
    each region's final global model, region a's algorithm)."""
    sent: dict[tuple[str, int], list[torch.Tensor]] = {}
    payload = Diloco.payload

    def recording(self, plan, params):
        out = payload(self, plan, params)
        sent[(self.ctx.region, plan.round)] = [t.clone() for t in out]
        return out

    monkeypatch.setattr(Diloco, "payload", recording)
    with InProcessRegions(cfg, tmp_path / name) as c:
        first = [g.clone() for g in c.workers["a"].algorithm.eval_params()]
        for r in range(rounds):
            c.run_round({reg: RoundPlan(round=r, H=3, final=r == rounds - 1) for reg in regions})
        c.call(lambda r: r.finish_pending())
        final = {reg: [g.clone() for g in w.algorithm.eval_params()] for reg, w in c.workers.items()}
        return first, sent, final, c.workers["a"].algorithm


def _by_hand(first, sent, rounds, make):
    """The global model after `rounds` steps of the optimizer `make(params)` on the mean pseudo-gradient."""
    params = [g.clone() for g in first]
    opt = make(params)
    for r in range(rounds):
        for p, da, db in zip(params, sent[("a", r)], sent[("b", r)]):
            p.grad = 0.5 * da + 0.5 * db
        opt.step()
    return params


@pytest.mark.parametrize("outer, make", [
    ({"kind": "adam", "lr": 0.01}, lambda ps: torch.optim.Adam(ps, lr=0.01)),
    ({"kind": "sgd", "lr": 0.7, "momentum": 0.0}, lambda ps: torch.optim.SGD(ps, lr=0.7)),
    ({"kind": "sgd", "lr": 0.7, "momentum": 0.5}, lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.5)),
    ({}, lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)),  # the default: DiLoCo's
])
def test_each_outer_step_is_the_torch_optimizer_on_the_mean_pseudo_gradient(tmp_path, monkeypatch, outer, make):
    first, sent, final, algo = _run(tmp_path, _cfg(outer), 3, monkeypatch)
    want = _by_hand(first, sent, 3, make)
    for reg in REGIONS:
        assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-7) for g, w in zip(final[reg], want)), reg
    assert not all(torch.equal(g, f) for g, f in zip(final["a"], first))  # it trained
    assert type(algo.parts[0].outer_opt) is type(make([torch.zeros(1)]))


@pytest.mark.parametrize("overlap, fragments", [(True, 1), ("eager", 1), ("eager", 2), (True, 2)])
def test_overlap_and_fragments_wrap_adam(tmp_path, monkeypatch, overlap, fragments):
    outer = {"kind": "adam", "lr": 0.01}
    _, _, final, algo = _run(tmp_path, _cfg(outer, overlap=overlap, fragments=fragments), 4, monkeypatch)
    assert len(algo.parts) == fragments and all(type(p.outer_opt) is torch.optim.Adam for p in algo.parts)
    # every part's optimizer stepped: Adam counts its steps (4 rounds over the fragments)
    assert [int(next(iter(p.outer_opt.state.values()))["step"]) for p in algo.parts] == [4 // fragments] * fragments
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(final["a"], final["b"]))  # one model


def test_eager_adam_with_one_region_is_serial_adam(tmp_path, monkeypatch):
    # One region: the mean is its own pseudo-gradient, so the eager preview (a deep copy of the real
    # Adam, its moments and step count) starts each round where serial DiLoCo does.
    outer = {"kind": "adam", "lr": 0.01}
    _, _, eager, _ = _run(tmp_path, _cfg(outer, overlap="eager", regions=["a"]), 4, monkeypatch, regions=["a"], name="e")
    _, _, serial, _ = _run(tmp_path, _cfg(outer, regions=["a"]), 4, monkeypatch, regions=["a"], name="s")
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(eager["a"], serial["a"]))


def test_preview_steps_a_copy_and_changes_nothing():
    params = [torch.randn(3, 2), torch.randn(4)]
    opt = torch.optim.Adam(params, lr=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    before = [p.clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    grads = [torch.randn_like(p) for p in params]
    preview = preview_step(opt, params, grads)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(opt.state[p][k], v) for p in params for k, v in state[id(p)].items())
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    assert all(torch.equal(x, p) for x, p in zip(preview, params))


def _doc_blocks() -> tuple[str, dict]:
    text = DOC.read_text()
    python = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    return python, config


def test_the_docs_plug_in_outer_optimizer_runs(tmp_path, monkeypatch):
    python, config = _doc_blocks()
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "my_lion.py").write_text(python)
    # The YAML block as a file beside my_lion.py: its `path: .` is that folder.
    (folder / "run.yaml").write_text(yaml.safe_dump({**config, "task": {"kind": "mlp-digits", "hidden": 16}}))
    assert load_config(folder / "run.yaml").sync.outer.path == str(folder)
    outer = {**config["sync"]["outer"], "path": str(folder)}
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_lion", raising=False)
    first, sent, final, algo = _run(tmp_path, _cfg(outer), 3, monkeypatch)
    lion = type(algo.parts[0].outer_opt)
    assert str(folder) in sys.path
    assert lion.__name__ == "Lion" and lion.__module__ == "my_lion"
    want = _by_hand(first, sent, 3, lambda ps: lion(ps, lr=outer["lr"], **outer["options"]))
    for reg in REGIONS:
        assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-7) for g, w in zip(final[reg], want)), reg
    assert not all(torch.equal(g, f) for g, f in zip(final["a"], first))


def test_only_a_marked_plug_in_is_called(tmp_path, monkeypatch):
    (tmp_path / "unmarked_outer.py").write_text("import torch\nclass Plain(torch.optim.SGD):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="sync.outer.kind: .* is not marked"):
        load_outer_factory("python:unmarked_outer:Plain")
    with pytest.raises(ValueError, match="sync.outer.kind: .*'os'"):
        load_outer_factory("python:os:system")

    @outer_optimizer
    def not_an_optimizer(params, lr):
        return object()

    class Settings:
        kind, lr, momentum, beta2, eps, path, options = "python:m:f", 0.1, 0.0, 0.999, 1e-8, None, {}

    monkeypatch.setattr(outer_module, "load_outer_factory", lambda kind, path=None: not_an_optimizer)
    with pytest.raises(ValueError, match="sync.outer.kind: .*not a torch.optim.Optimizer"):
        make_outer_optimizer(Settings(), [torch.zeros(2)])


@pytest.mark.parametrize("outer, key", [
    ({"nesterov": False}, "sync.outer.nesterov"),          # today's meaning is kind sgd: said so
    ({"kind": "adam", "nesterov": True}, "sync.outer.nesterov"),
    ({"kind": "lion"}, "sync.outer.kind"),
    ({"kind": "adam", "options": {"x": 1}}, "sync.outer.options"),
    ({"kind": "sgd", "path": "plugins"}, "sync.outer.options"),
    ({"kind": "adam", "beta2": 1.0}, "sync.outer.beta2"),
])
def test_config_refuses_naming_the_key(outer, key):
    with pytest.raises(Exception, match=re.escape(key)):
        _cfg(outer)


def test_the_retired_nesterov_key_still_loads_where_it_agrees():
    assert _cfg({"nesterov": True}).sync.outer.kind == "nesterov"
    assert _cfg({"kind": "sgd", "nesterov": False}).sync.outer.kind == "sgd"


def test_the_config_refuses_an_unmarked_plug_in_when_it_loads(tmp_path):
    (tmp_path / "unmarked_outer2.py").write_text("import torch\nclass Plain(torch.optim.SGD):\n    pass\n")
    with pytest.raises(Exception, match="sync.outer.kind.*is not marked"):
        _cfg({"kind": "python:unmarked_outer2:Plain", "path": str(tmp_path)})
    with pytest.raises(Exception, match="sync.outer.kind.*cannot import"):
        _cfg({"kind": "python:no_such_outer_module:Opt", "path": str(tmp_path)})
