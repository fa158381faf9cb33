"""docs/architecture.md's "Where to add things", followed literally: each recipe is done here as the
table says (the new piece defined in the test, or as a plug-in module in tmp_path where the recipe
says "outside the repo"), registered as the table says, then used through the public path it names:
a codec from a config's compression.codec through encode_update/decode_update and a run's exchange, a
topology by sync.topology, a sync policy by sync.policy.kind, a task and an outer optimizer by their
config keys, a round hook on a real Region. Every run is in process (regions/inprocess.py, the
in-memory transport), three regions, a tiny MLP, two rounds.

What a recipe registers into a global registry is taken out again after its test (the fixtures), so
no other test sees this file's codec, topology, policy or marks.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pytest
import torch
import yaml

from geofed.compression import base as codec_base
from geofed.compression import decode_update, encode_update, make_codec
from geofed.compression.base import Codec, Section, Shape, register, total_numel
from geofed.compression.params import PARAMS, CodecParams, register_params
from geofed.compression.state import CodecState
from geofed.orchestrator.config import config_from_mapping, load_config
from geofed.orchestrator.config.docs import config_docs_markdown
from geofed.orchestrator.driver.coordinator import Coordinator
from geofed.orchestrator.policies import Decision, PolicyContext, register_policy, registry
from geofed.p2p import topology as topology_module
from geofed.p2p.topology import Topology, make_topology
from geofed.regions.hooks import RoundHook
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan
from geofed.regions.sync import outer as outer_module
from geofed.regions.tasks import configs as task_configs

REGIONS = ["a", "b", "c"]


def _mapping(**sections) -> dict:
    m: dict = {"run": {"name": "recipe", "seed": 3, "rounds": 2, "checkpoint_every": 0},
               "task": {"kind": "mlp-digits", "hidden": 8},
               "regions": {"names": REGIONS},
               "network": {"emulation": {"mode": "none"}},
               "sync": {"policy": {"kind": "fixed", "H": 2}, "deadline": {"initial_s": 10.0, "max_s": 20.0}}}
    for section, values in sections.items():
        if section == "task":
            m[section] = values  # another kind has other keys
        else:
            m.setdefault(section, {}).update(values)
    return m


def _run(cfg, tmp_path: Path, rounds: int = 2, *, hooks=None) -> tuple[list[dict], InProcessRegions]:
    """`rounds` rounds of `cfg`'s regions in process, each planned by hand (H=2); the metrics of each
    round by region and the (closed) group, whose workers the caller may still read."""
    out = []
    with InProcessRegions(cfg, tmp_path / "run") as group:
        for region, hook in (hooks or {}).items():
            group.workers[region].add_hook(hook)
        for r in range(rounds):
            reports = group.run_round({reg: RoundPlan(round=r, H=2, final=r == rounds - 1) for reg in REGIONS})
            out.append({reg: m.to_record() for reg, m in reports.items()})
    return out, group


def _one_model(group: InProcessRegions) -> None:
    """Every region holds the same global model after a full topology's rounds, and it trained."""
    models = {r: torch.cat([g.flatten() for g in w.algorithm.eval_params()]) for r, w in group.workers.items()}
    assert all(torch.allclose(models["a"], m, atol=1e-6) for m in models.values())


# ---- a codec ---------------------------------------------------------------------------------------
@pytest.fixture
def codec_registries():
    """The codec registries (parameter classes and codecs) as they were, after the test."""
    codec_base.codec_names()  # the built-in codecs registered first: they are what is restored
    params, codecs = dict(PARAMS), dict(codec_base._REGISTRY)
    yield
    PARAMS.clear()
    PARAMS.update(params)
    codec_base._REGISTRY.clear()
    codec_base._REGISTRY.update(codecs)


def _define_codec() -> type[Codec]:
    """The recipe's two halves: the parameters (torch-free, params.py's way) and the codec subclassing them."""

    @register_params
    @dataclass(frozen=True, kw_only=True)
    class HalfScaleParams(CodecParams):
        """halfscale: fp16 of the values times `scale` (a codec only this test knows)."""

        kind: ClassVar[str] = "halfscale"
        linear: ClassVar[bool] = True
        scale: float = 4.0

        def __post_init__(self) -> None:
            if not self.scale > 0:
                raise ValueError(f"scale: must be > 0, got {self.scale}")

    @register
    @dataclass(frozen=True, kw_only=True)
    class HalfScale(HalfScaleParams, Codec):
        def layout(self, shapes: Sequence[Shape]) -> list[Section]:
            return [Section(torch.float16, total_numel(shapes))]

        def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor],
                        state: CodecState) -> None:
            out[0].copy_(x * self.scale)

        def decode_into(self, sections: list[torch.Tensor], shapes: Sequence[Shape], out: torch.Tensor) -> None:
            out.copy_(sections[0].float() / self.scale)

    return HalfScale


def test_a_codec_round_trips_loads_from_compression_codec_and_carries_a_run(tmp_path, codec_registries):
    codec_cls = _define_codec()
    cfg = config_from_mapping(_mapping(compression={"codec": {"kind": "halfscale", "scale": 2.0}}))
    assert cfg.compression.codec.key == "halfscale(scale=2.0)"
    codec = make_codec(cfg.compression.codec)
    assert type(codec) is codec_cls and codec.scale == 2.0
    x = [torch.randn(5, 3), torch.randn(7)]
    payload = encode_update(codec, x)
    back = decode_update(payload, max_bytes=1 << 20, expected_shapes=[(5, 3), (7,)])
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(x, back))
    assert "| `halfscale` |" in config_docs_markdown()  # geofed config-docs lists it with the codecs
    rounds, group = _run(cfg, tmp_path)
    for m in rounds[-1].values():
        assert m["bytes_received"] > 0 and set(m["codecs"].values()) == {"halfscale(scale=2.0)"}
    _one_model(group)
    with pytest.raises(ValueError, match="scale"):
        config_from_mapping(_mapping(compression={"codec": {"kind": "halfscale", "scale": -1.0}}))


def test_the_codec_registries_are_restored():
    assert "halfscale" not in PARAMS and "halfscale" not in codec_base.codec_names()


# ---- a topology ------------------------------------------------------------------------------------
class Star(Topology):
    """Region 0 the hub, linked to every other; Metropolis-Hastings weights (every edge 1/n)."""

    def in_weights(self, i: int, round: int) -> dict[int, float]:
        self._check(i)
        return {j: 1.0 / self.n for j in self.out_neighbours(i, round)}

    def out_neighbours(self, i: int, round: int) -> list[int]:
        self._check(i)
        return [j for j in range(1, self.n)] if i == 0 else [0]


@pytest.fixture
def star(monkeypatch):
    monkeypatch.setitem(topology_module._MAKERS, "star", lambda n, seed: Star(n))


def test_a_topology_is_chosen_by_sync_topology(tmp_path, star):
    w = make_topology("star", 4).matrix(0)
    assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1) and np.allclose(w, w.T)  # doubly stochastic
    cfg = config_from_mapping(_mapping(sync={"topology": "star", "policy": {"kind": "fixed", "H": 2}}))
    rounds, group = _run(cfg, tmp_path)
    assert all(isinstance(w.topology, Star) for w in group.workers.values())
    plan = RoundPlan(round=0, H=2)
    assert group.workers["a"].out_peers(plan) == ["b", "c"] and group.workers["b"].out_peers(plan) == ["a"]
    # a leaf hears only the hub: one update in, one out; the hub two of each
    assert [len(rounds[-1][r]["transfers"]) > 0 for r in REGIONS] == [True] * 3
    assert rounds[-1]["a"]["bytes_received"] == 2 * rounds[-1]["b"]["bytes_received"]


def test_an_unregistered_topology_is_refused_naming_the_key():
    with pytest.raises(Exception, match="sync.topology"):
        config_from_mapping(_mapping(sync={"topology": "star"}))


# ---- a sync policy ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CountdownPolicyConfig:
    """``sync.policy.kind: countdown``: H falls by one each round, to 1."""

    kind: Literal["countdown"] = "countdown"
    H: int = field(default=3, metadata={"doc": "H of round 0 (recipe test)"})


class CountdownPolicy:
    kind = "countdown"

    def __init__(self, cfg: CountdownPolicyConfig, ctx: PolicyContext):
        self.H, self.codec = cfg.H, ctx.codec

    def decide(self, m) -> Decision:
        H, self.H = self.H, max(1, self.H - 1)
        return Decision(H=H, codecs={link: self.codec for link in m.links}, default_codec=self.codec,
                        reason=f"countdown H={H}")

    def state_dict(self) -> dict:
        return {"kind": self.kind, "H": self.H}

    def load_state_dict(self, d) -> None:
        self.H = int(d["H"])


@pytest.fixture
def countdown(monkeypatch):
    monkeypatch.setattr(registry, "_POLICIES", dict(registry._POLICIES))
    register_policy("countdown", config=CountdownPolicyConfig, factory=CountdownPolicy)


class _Clock:
    def now(self) -> float:
        return 0.0


def test_a_sync_policy_is_chosen_by_sync_policy_kind(tmp_path, countdown):
    cfg = config_from_mapping(_mapping(sync={"policy": {"kind": "countdown", "H": 3}}))
    assert "H of round 0 (recipe test)" in config_docs_markdown()  # its keys appear in geofed config-docs
    coordinator = Coordinator(cfg, model_numel=1000, clock=_Clock())
    with InProcessRegions(cfg, tmp_path / "run") as group:
        steps = []
        for r in range(2):
            plans = coordinator.plan(r, alive=REGIONS, evaluate=False)
            metrics = group.run_round(plans)
            coordinator.observe(metrics)
            steps.append({m.steps.steps for m in metrics.values()})
    assert steps == [{3}, {2}] and coordinator.last_reason.startswith("countdown")


# ---- a task, outside the repo ------------------------------------------------------------------------
TASK_MODULE = '''
import torch
from torch import nn

from geofed.regions.tasks import EvalResult, Shard, Task, task_factory


class LineShard(Shard):
    def __init__(self, x, y, batch_size):
        self.x, self.y, self.batch_size = x, y, batch_size

    @property
    def num_examples(self):
        return len(self.x)

    def batches(self, generator):
        while True:
            idx = torch.randint(0, len(self.x), (self.batch_size,), generator=generator)
            yield self.x[idx], self.y[idx]


class LineTask(Task):
    kind = "python:recipe_line_task:make_task"

    def __init__(self, batch_size):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(96, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
        self.batch_size = batch_size

    def build_model(self, seed):
        torch.manual_seed(seed)
        return nn.Linear(4, 1)

    def shard(self, region_index, n_regions, seed):
        return LineShard(self.x[region_index::n_regions], self.y[region_index::n_regions], self.batch_size)

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x).squeeze(1), y)

    def evaluate(self, model):
        with torch.no_grad():
            return EvalResult(metric="mse", value=float(nn.functional.mse_loss(model(self.x).squeeze(1), self.y)),
                              higher_is_better=False)


@task_factory
def make_task(batch_size: int = 8) -> Task:
    return LineTask(batch_size)
'''

OUTER_MODULE = '''
import torch

from geofed.regions.sync import outer_optimizer


@outer_optimizer
class SignSGD(torch.optim.Optimizer):
    """The sign of the mixed pseudo-gradient, times lr."""

    def __init__(self, params, lr=0.01, damping=1.0):
        super().__init__(params, {"lr": lr, "damping": damping})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"] * group["damping"])
'''


@pytest.fixture
def plugin_folder(tmp_path, monkeypatch):
    """A folder outside the repo for plug-in modules; sys.path, sys.modules and geofed's marks of
    plug-ins as they were, after the test."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("recipe_line_task", "recipe_sign_sgd"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(task_configs, "_FACTORIES", dict(task_configs._FACTORIES))
    monkeypatch.setattr(outer_module, "_MARKED", dict(outer_module._MARKED))
    yield folder
    for name in ("recipe_line_task", "recipe_sign_sgd"):
        sys.modules.pop(name, None)


def _yaml_config(folder: Path, **sections) -> Path:
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(_mapping(**sections)))
    return path


def test_a_plug_in_task_is_chosen_by_task_kind(tmp_path, plugin_folder):
    (plugin_folder / "recipe_line_task.py").write_text(TASK_MODULE)
    cfg = load_config(_yaml_config(plugin_folder, task={"kind": "python:recipe_line_task:make_task", "path": ".",
                                                        "options": {"batch_size": 4}}))
    rounds, group = _run(cfg, tmp_path)
    task = group.workers["a"].task
    assert type(task).__module__ == "recipe_line_task" and task.batch_size == 4
    assert all(m["steps"] == 2 for m in rounds[-1].values())
    _one_model(group)


def test_a_plug_in_outer_optimizer_is_chosen_by_sync_outer_kind(tmp_path, plugin_folder):
    (plugin_folder / "recipe_sign_sgd.py").write_text(OUTER_MODULE)
    cfg = load_config(_yaml_config(plugin_folder, sync={
        "policy": {"kind": "fixed", "H": 2},
        "outer": {"kind": "python:recipe_sign_sgd:SignSGD", "path": ".", "lr": 0.05, "options": {"damping": 0.5}}}))
    with InProcessRegions(cfg, tmp_path / "run") as group:
        algo = group.workers["a"].algorithm
        start = [g.clone() for g in algo.eval_params()]
        group.run_round({reg: RoundPlan(round=0, H=2) for reg in REGIONS})
        opt = algo.parts[0].outer_opt
        assert type(opt).__name__ == "SignSGD" and type(opt).__module__ == "recipe_sign_sgd"
        assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["damping"] == 0.5
        # one step of sign SGD: every coordinate moved by lr * damping, or not at all
        moved = torch.cat([(g - s).abs().flatten() for g, s in zip(algo.eval_params(), start)])
        assert torch.all(torch.isclose(moved, torch.tensor(0.025)) | (moved == 0)) and moved.max() > 0
        _one_model(group)


# ---- a round hook ------------------------------------------------------------------------------------
class HalveSent(RoundHook):
    """A round hook (regions/hooks.py) that halves what its region sends and says so in the report."""

    def __init__(self):
        self.sent_to: list[list[str]] = []

    def before_send(self, round_, tensors, out_peers):
        self.sent_to.append(list(out_peers))
        return [t * 0.5 for t in tensors], out_peers

    def report(self, plan, metrics):
        metrics["halved"] = len(self.sent_to)


def test_a_round_hook_runs_on_a_real_region(tmp_path):
    cfg = config_from_mapping(_mapping(compression={"codec": "identity", "error_feedback": False},
                                       security={"robust_aggregation": "none"}))
    hook = HalveSent()
    rounds, group = _run(cfg, tmp_path, hooks={"a": hook})
    assert hook.sent_to == [["b", "c"], ["b", "c"]]
    assert rounds[-1]["a"]["halved"] == 2 and "halved" not in rounds[-1]["b"]
    # b and c mix the halved update a sent; a mixes its own update whole (its hook changes only what
    # leaves it): b and c keep one model, a another
    models = {r: torch.cat([g.flatten() for g in w.algorithm.eval_params()]) for r, w in group.workers.items()}
    assert torch.allclose(models["b"], models["c"], atol=1e-6) and not torch.allclose(models["a"], models["b"])



# ---- the doc itself ----------------------------------------------------------------------------------
DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
_PATH = re.compile(r"(?P<path>(?:[\w.-]+/)+(?:[\w.-]+\.(?:py|md|yaml|toml|json))?)(?::\s*(?P<name>[A-Za-z_]\w*)(?:\.\w+)*)?")


# Folders a tool makes when it runs (mypy's cache, which test_types.py builds): there only after it ran.
GENERATED = (".mypy_cache/",)


def test_every_path_the_doc_names_exists_and_holds_the_name_it_gives():
    """A `folder/file.py` (or `folder/file.py: Name`) in backticks in docs/architecture.md exists (and
    defines or mentions Name): a stale path there sends a new reader nowhere."""
    root, stale = DOC.parents[1], []
    for span in re.findall(r"`([^`\n]+)`", DOC.read_text()):
        m = _PATH.fullmatch(span.strip())
        if m is None or "NAME" in span or span.startswith(GENERATED):
            continue
        path = root / m["path"]
        if not path.exists():
            stale.append(span)
        elif m["name"] and path.is_file() and not re.search(rf"\b{m['name']}\b", path.read_text()):
            stale.append(span)
    assert not stale, f"docs/architecture.md names what is not there: {stale}"
