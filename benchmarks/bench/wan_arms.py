"""The scenarios and arms of `geofed bench wan`: one run config per arm, all from one base.

Every arm is the base config (configs/bench-wan.yaml: task, data, seed, regions, links) with a
few keys changed, so arms differ only in how they synchronise:

* ``allreduce``: per-step fp32 gradient averaging (``sync.algorithm: allreduce``, H=1, codec
  identity), the data-parallel baseline;
* ``fixed-H<h>``: DiLoCo with overlap, ``sync.policy: {kind: fixed, H: h}`` and the base's
  ``compression.codec`` on every link (a ladder is ignored by the fixed policy);
* ``adaptive``: the base as written (bandwidth policy, delayed overlap, the codec ladder);
* the communication frontier (issue 21; scenarios with ``frontier``): ``adaptive-eager``
  (``sync.overlap: eager``), ``adaptive-frag-eager`` (and ``sync.fragments``: one fragment of the
  model a round, Streaming DiLoCo), ``adaptive-frag-eager-spread`` (and ``sync.spread_sends``:
  each fragment's push paced over most of the next round) and ``adaptive-frag-eager-sparseloco``
  (fragments and the sparseloco codec: a ladder of sparseloco fractions in place of int3 and top-k) and
  ``adaptive-frag-eager-ternary`` (fragments and the ternary codec: 1.6 bits a value, ~19.6x, first in
  the ladder).

With ``target_on="eval"`` (steady) every arm evaluates its synchronised model as it trains (per-step
sync every ``eval_stride`` steps, the others every round) and at per-step sync's step count
(``run.eval_at_steps``): time and bytes to target and the loss at equal examples are held-out losses of
the model a user would get, not the train loss of a region's replica in the middle of a round.

Every arm runs the same number of inner steps (``run.max_steps``) on the same data and seed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from geofed.orchestrator.config import RunConfig, config_from_mapping, default_config_path
from geofed.orchestrator.config.strict import parse_yaml_file

BASE_CONFIG = "bench-wan.yaml"
BASES = {"char-lm": BASE_CONFIG, "gpt": "bench-wan-gpt.yaml"}  # --base: the task every arm trains


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One `geofed bench wan` scenario: the links, the optional bandwidth drop, the target loss, the step budget
    and the arms to run."""

    name: str
    base: str = BASE_CONFIG          # the config file of configs/ every arm is built from
    bandwidth_mbps: float = 50.0     # every link, as issue 6 gives it (before bandwidth_scale)
    rtt_ms: float = 80.0
    bandwidth_scale: float = 1.0     # network.emulation.bandwidth_scale (docs/bench-wan.md: why)
    drop_at_s: float | None = None   # every link's bandwidth falls drop_factor x at this emulator time
    drop_factor: float = 10.0
    target_loss: float = 0.1
    max_steps: int = 1200
    fixed_H: tuple[int, ...] = (25, 50, 100)
    allreduce: bool = True
    allreduce_steps: int | None = None   # None: max_steps
    regions: tuple[str, ...] | None = None  # None: the base config's
    overrides: tuple[str, ...] = ()  # --set style KEY=VALUE applied to every arm
    frontier: bool = False           # also the eager, fragments, sparseloco and ternary arms (issue 21)
    fragments: int = 4               # sync.fragments of the fragment arms (docs/bench-wan.md: 4 beat 3, 6 and 8)
    target_on: Literal["eval", "train"] = "train"  # the target is on the held-out loss of the synced model, or on train loss
    eval_stride: int = 10            # target_on eval: per-step sync evaluates every this many steps
    spread: float = 0.9              # sync.spread_sends of the spread arm: a push over 90% of the next round
    sparse_ladder: tuple[str, ...] = ("sparseloco(fraction=0.05)", "sparseloco(fraction=0.02)",
                                      "sparseloco(fraction=0.01)")
    ternary_ladder: tuple[str, ...] = ("ternary", "sparseloco(fraction=0.05)", "sparseloco(fraction=0.01)")

    def __post_init__(self):
        if self.name not in ("steady", "drop"):
            raise ValueError(f"name: a scenario is steady or drop, got {self.name!r}")
        if (self.drop_at_s is None) != (self.name == "steady"):
            raise ValueError("drop_at_s: the drop scenario needs drop_at_s, steady must not have it")
        if self.drop_at_s is not None and not self.drop_at_s > 0:
            raise ValueError(f"drop_at_s: must be > 0, got {self.drop_at_s}")
        if not self.drop_factor > 1:
            raise ValueError(f"drop_factor: must be > 1, got {self.drop_factor}")
        if not 0 < self.bandwidth_scale <= 1000:
            raise ValueError(f"bandwidth_scale: must be in (0, 1000], got {self.bandwidth_scale}")
        if not self.target_loss > 0:
            raise ValueError(f"target_loss: must be > 0, got {self.target_loss}")
        if self.max_steps < 1 or any(h < 1 for h in self.fixed_H):
            raise ValueError("max_steps: max_steps and every fixed H must be >= 1")
        if self.target_on not in ("eval", "train") or self.eval_stride < 1:
            raise ValueError(f"target_on: eval or train (eval_stride >= 1), got {self.target_on!r}, {self.eval_stride}")

    @property
    def baseline_steps(self) -> int | None:
        """Per-step sync's step count (equal examples for every arm), None without a per-step arm."""
        return (self.allreduce_steps or self.max_steps) if self.allreduce else None

    @property
    def link_mbps(self) -> float:
        """What the emulator enforces on every link before a drop."""
        return self.bandwidth_mbps * self.bandwidth_scale


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One arm of a scenario: its name, kind (allreduce, fixed or adaptive), fixed H and its run config."""

    name: str
    kind: str            # allreduce | fixed | adaptive
    H: int | None        # fixed H (allreduce: 1; adaptive: None, the policy's)
    cfg: RunConfig = field(repr=False)


# The full bench (docs/bench-wan.md): char-lm, about 17 minutes a repetition for steady, 6 for drop on 2
# shared cores. steady's 1.25 Mbit/s makes a per-step sync ~50 compute steps long here, still under the ~90
# of a GPU per region at the unscaled 50 Mbit/s (so the bench stays conservative for per-step sync). Its
# target is the held-out loss 1.70 nats, which per-step sync reaches after ~600 of its 800 steps. drop runs 0.5
# Mbit/s so that the 10x drop makes the int3 sync outlast a round of 100 steps of this small model.
SCENARIOS = {
    "steady": Scenario(name="steady", bandwidth_scale=0.025, target_loss=1.70, max_steps=1500, allreduce_steps=800,
                       fixed_H=(50, 100, 200), frontier=True, target_on="eval"),
    "drop": Scenario(name="drop", bandwidth_scale=0.01, drop_at_s=5.0, target_loss=1.75, max_steps=3000,
                     fixed_H=(50, 100, 200, 400), allreduce=False),
}
# --quick: the same shape, smaller (a few minutes).
QUICK = {
    "steady": Scenario(name="steady", bandwidth_scale=0.1, target_loss=1.85, max_steps=800, allreduce_steps=400,
                       fixed_H=(100,), frontier=True, target_on="eval"),
    "drop": Scenario(name="drop", bandwidth_scale=0.01, drop_at_s=3.0, target_loss=2.0, max_steps=1500,
                     fixed_H=(50, 200), allreduce=False),
}


# The transformer base (configs/bench-wan-gpt.yaml: 2 blocks, width 64, byte tokens; 121k parameters, 482 KB
# fp32): steady only. Its step is ~5x the GRU's, so a per-step sync of as many compute steps as the GRU
# base's would make the per-step arm run ~40 minutes a repetition; its links are faster instead (4 Mbit/s:
# ~1 s a per-step sync), and per-step sync runs 400 steps (docs/bench-wan.md, "The transformer base").
GPT_SCENARIOS = {
    "steady": Scenario(name="steady", base=BASES["gpt"], bandwidth_scale=0.08, target_loss=2.1, max_steps=1000,
                       allreduce_steps=400, fixed_H=(100,), frontier=True, target_on="eval"),
}
GPT_QUICK = {
    "steady": Scenario(name="steady", base=BASES["gpt"], bandwidth_scale=0.2, target_loss=2.4, max_steps=400,
                       allreduce_steps=200, fixed_H=(100,), frontier=True, target_on="eval"),
}


def scenarios(base: str = "char-lm", *, quick: bool = False) -> dict[str, Scenario]:
    """The scenarios of `geofed bench wan --base BASE` (full size or --quick); ValueError for an unknown base."""
    if base not in BASES:
        raise ValueError(f"--base: unknown base {base!r} (known: {', '.join(BASES)})")
    return (QUICK if quick else SCENARIOS) if base == "char-lm" else (GPT_QUICK if quick else GPT_SCENARIOS)


def base_mapping(name: str = BASE_CONFIG) -> dict[str, Any]:
    """A config of configs/ as a mapping (default the bench's base, configs/bench-wan.yaml)."""
    path = default_config_path().parent / name
    return parse_yaml_file(path)


def build_arms(scenario: Scenario, base: dict[str, Any] | None = None) -> list[Arm]:
    """The run config of every arm of ``scenario`` (allreduce first, adaptive last)."""
    base = copy.deepcopy(base if base is not None else base_mapping(scenario.base))
    _apply_scenario(base, scenario)
    arms = []
    if scenario.allreduce:
        steps = scenario.allreduce_steps or scenario.max_steps
        evals = [f"run.eval_every={scenario.eval_stride}", "run.eval_at_steps=[]"] if scenario.target_on == "eval" else []
        arms.append(Arm(name="allreduce", kind="allreduce", H=1, cfg=_config(base, scenario, [
            "sync.algorithm=allreduce", "compression.codec=identity", "compression.error_feedback=false",
            "compression.ladder=[]", "sync.overlap=false", f"run.rounds={steps}", f"run.max_steps={steps}", *evals])))
    for h in scenario.fixed_H:
        arms.append(Arm(name=f"fixed-H{h}", kind="fixed", H=h, cfg=_config(base, scenario, [
            f"sync.policy={{kind: fixed, H: {h}}}", f"run.rounds={math.ceil(scenario.max_steps / h) + 1}"])))
    arms.append(Arm(name="adaptive", kind="adaptive", H=None, cfg=_config(base, scenario, [])))
    if scenario.frontier:
        arms.extend(frontier_arms(base, scenario))
    return arms


def frontier_arms(base: dict[str, Any], sc: Scenario) -> list[Arm]:
    """Issue 21's arms: adaptive with eager overlap, then fragments, then spread sends or the sparseloco codec."""
    eager = ["sync.overlap=eager"]
    frag = [*eager, f"sync.fragments={sc.fragments}"]
    ladder = ", ".join(sc.sparse_ladder)
    spread = [*frag, f"sync.spread_sends={sc.spread}"]
    sparse = [*frag, f"compression.codec={sc.sparse_ladder[0]}", f"compression.ladder=[{ladder}]"]
    ternary = [*frag, f"compression.codec={sc.ternary_ladder[0]}", f"compression.ladder=[{', '.join(sc.ternary_ladder)}]"]
    return [Arm(name=name, kind="adaptive", H=None, cfg=_config(base, sc, keys)) for name, keys in
            (("adaptive-eager", eager), ("adaptive-frag-eager", frag), ("adaptive-frag-eager-spread", spread),
             ("adaptive-frag-eager-sparseloco", sparse), ("adaptive-frag-eager-ternary", ternary))]


def _apply_scenario(base: dict[str, Any], sc: Scenario) -> None:
    run = base.setdefault("run", {})
    run.update({"max_steps": sc.max_steps, "rounds": max(int(run.get("rounds", 0) or 0), sc.max_steps),
                "report": False, "checkpoint_every": 0})
    if sc.target_on == "eval":  # every round's synchronised model, and per-step sync's step count for all
        run["eval_every"] = 1
        if sc.baseline_steps is not None and sc.baseline_steps < sc.max_steps:
            run["eval_at_steps"] = [sc.baseline_steps]
    if sc.regions is not None:
        base.setdefault("regions", {})["names"] = list(sc.regions)
    em = base.setdefault("network", {}).setdefault("emulation", {})
    em.update({"mode": "proxy", "preset": None, "bandwidth_scale": sc.bandwidth_scale,
               "default": {"latency_ms": sc.rtt_ms / 2, "bandwidth_mbps": sc.bandwidth_mbps,
                           "jitter_ms": 0.0, "loss": 0.0}, "links": {}})
    em["schedule"] = ([] if sc.drop_at_s is None else
                      [{"link": "*", "at_s": sc.drop_at_s, "set": {"bandwidth_mbps": sc.bandwidth_mbps / sc.drop_factor}}])


def _config(base: dict[str, Any], sc: Scenario, overrides: list[str]) -> RunConfig:
    return config_from_mapping(copy.deepcopy(base), [*sc.overrides, *overrides], source=f"bench wan {sc.name}")
