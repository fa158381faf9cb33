"""The arms of `geofed bench cluster` and what each run reached: one run config per arm and seed.

Every arm is configs/multi-region.yaml (a real multi-node run: regions pinned by label, gRPC on
0.0.0.0 with each node's address advertised, emulation off: the namespaces' links are the WAN)
on issue 14's task, the digits MLP 64-256-256-10, four regions, evaluated every round, with a
few keys changed:

* ``H100-int8``: ``sync.policy: {kind: fixed, H: 100}``, int8 on every link;
* ``adaptive-overlap``: configs/bench-wan.yaml's sync settings (bandwidth policy, overlap, its
  outer optimiser) and compression (int4 and its ladder);
* ``multi-region``: configs/multi-region.yaml's own settings (overlap, bandwidth policy, int4).

Time to target counts from the start of round 0 (the run's clock: Ray start-up, placement and
connecting are left out, and reported apart as start-up) to the end of the first round whose
evaluation reaches the target. While `run.target` is not a config key, every round is evaluated
(`run.eval_every: 1`) and the time is read from rounds.jsonl; once it is, the run stops there
and summary.json says it (``time_to_target_s``), which is read first.
"""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .wan_arms import base_mapping
from geofed.orchestrator.config import config_from_mapping, to_mapping
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.config.strict import ConfigError

REGIONS = ("us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1")
ARMS = ("H100-int8", "adaptive-overlap", "multi-region")


@dataclass(frozen=True, kw_only=True)
class Target:
    """The metric value each arm's time to target is measured to."""

    metric: str = "accuracy"
    value: float = 0.95


def common_mapping(*, regions=REGIONS, max_steps: int = 1500, rounds: int = 60, seed: int = 0) -> dict[str, Any]:
    """configs/multi-region.yaml on issue 14's task and regions, every round evaluated."""
    m = base_mapping("multi-region.yaml")
    m["run"].update({"name": "bench-cluster", "rounds": rounds, "max_steps": max_steps, "seed": seed,
                     "eval_every": 1, "checkpoint_every": 0, "report": False})
    m["task"].update({"hidden": 256, "layers": 2})
    m["regions"]["names"] = list(regions)
    m["launch"]["head_region"] = regions[0]
    return m


def arm_mapping(arm: str, common: dict[str, Any]) -> dict[str, Any]:
    """The config mapping of `arm`: `common` (not modified) with the arm's keys changed; ValueError for an
    unknown arm."""
    m = copy.deepcopy(common)
    if arm == "H100-int8":
        m["sync"]["policy"] = {"kind": "fixed", "H": 100}
        m["compression"] = {"codec": "int8", "error_feedback": True}
    elif arm == "adaptive-overlap":
        wan = base_mapping("bench-wan.yaml")
        for key in ("overlap", "policy", "outer"):
            m["sync"][key] = copy.deepcopy(wan["sync"][key])
        m["compression"] = copy.deepcopy(wan["compression"])
    elif arm != "multi-region":
        raise ValueError(f"arms: unknown arm {arm!r} (known: {', '.join(ARMS)})")
    return m


def target_supported(common: dict[str, Any], target: Target) -> bool:
    """Whether this geofed has `run.target` (the run then stops at the target and says so)."""
    try:
        config_from_mapping(copy.deepcopy(common), [f"run.target={{metric: {target.metric}, value: {target.value}}}"])
    except ConfigError:
        return False
    return True


def write_config(mapping: dict[str, Any], path: Path, *, target: Target | None) -> Path:
    """The arm's config, checked here (a bad arm fails before the cluster is used), as YAML."""
    m = copy.deepcopy(mapping)
    if target is not None:
        m["run"]["target"] = {"metric": target.metric, "value": target.value}
    cfg = config_from_mapping(m, source=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_mapping(cfg), sort_keys=False))
    return path


@dataclass(frozen=True, kw_only=True)
class Reached:
    """What one run of an arm reached, and when: time, steps and MB per region to the target, plus the run's totals."""

    time_s: float | None       # from round 0's start; None: not reached
    steps: int | None          # inner steps per region by then
    mb_per_region: float | None  # geofed's bytes sent per region by then (mean over regions), MB
    rounds: int                # rounds the run ran
    total_steps: int
    H: list[int]
    final_eval: float | None
    source: str                # "summary" (run.target) or "rounds.jsonl"
    probe_mb_per_region: float | None = None  # set-up link probes (summary probe_bytes_sent), not in mb_per_region


def reached(run_dir: Path, target: Target) -> Reached:
    """When the run first reached `target`: from summary.json's run.target fields, else its evaluations."""
    run_dir = Path(run_dir)
    rounds = read_jsonl(run_dir / "rounds.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    H = [int(r["H"]) for r in rounds]
    ev = summary.get("eval") if isinstance(summary.get("eval"), dict) else {}
    n = max(1, len((summary.get("placement") or {})) or len({m["region"] for m in read_jsonl(run_dir / "metrics.jsonl")}))
    probes = summary.get("probe_bytes_sent")
    common = {"rounds": len(rounds), "total_steps": sum(H), "H": H, "final_eval": ev.get("value"),
              "probe_mb_per_region": None if probes is None else probes / n / 1e6}
    if "time_to_target_s" in summary:
        t, b = summary.get("time_to_target_s"), summary.get("bytes_to_target")
        return Reached(time_s=t, steps=summary.get("steps_to_target"),
                       mb_per_region=None if b is None else b / n / 1e6, source="summary", **common)
    sent, steps = 0.0, 0
    for r in rounds:
        sent += float(r.get("bytes_sent") or 0.0)
        steps += int(r["H"])
        value = _eval_value(r, target.metric)
        higher = True if value is None else _higher_is_better(r)
        if value is not None and (value >= target.value if higher else value <= target.value):
            return Reached(time_s=float(r["t_end"]), steps=steps, mb_per_region=sent / n / 1e6,
                           source="rounds.jsonl", **common)
    return Reached(time_s=None, steps=None, mb_per_region=None, source="rounds.jsonl", **common)


def _eval_value(rec: dict[str, Any], metric: str) -> float | None:
    ev = rec.get("eval_avg") or rec.get("eval")
    if isinstance(ev, dict) and ev.get("metric") == metric and ev.get("value") is not None:
        return float(ev["value"])
    return None


def _higher_is_better(rec: dict[str, Any]) -> bool:
    ev = rec.get("eval_avg") or rec.get("eval") or {}
    return bool(ev.get("higher_is_better", True))


def spread(values: list[float]) -> dict[str, float | None]:
    """Median and range of the seeds' values (None where a seed never reached the target)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "reached": 0, "seeds": len(values)}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "reached": len(got), "seeds": len(values)}
