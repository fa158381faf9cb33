"""`geofed bench hetero`: regions of unequal speed and flaky participation (issue 20).

    geofed bench hetero [--task digits|char-lm] [--quick] [--reps N] [--json] [--out DIR] [--set KEY=VALUE]

Every run is a real `geofed run` (Ray actors, mutual-TLS gRPC, the proxy WAN emulator with the
AWS preset) of the task's base (configs/bench-hetero.yaml: the digits MLP, target accuracy 0.96;
configs/bench-hetero-lm.yaml: the character GRU on tinyshakespeare, target held-out loss 2.1)
with a scenario (regions.emulation) and an arm (sync.pacing) laid over it:

* scenarios: ``equal`` (the reference, barrier rounds), ``slow`` (eu-west-1 4x slower),
  ``flaky`` (each region absent with probability 0.25 per round);
* arms: ``barrier`` (today's rounds, with overlap), ``drop`` (quorum rounds that discard late
  updates: deadline-and-drop), ``time-budget`` (with overlap), ``quorum`` (late updates applied
  with a staleness weight).

Runs are interleaved: repetition i runs every (scenario, arm) pair once, in an order rotated by
i, so load that comes and goes on a shared machine spreads over the arms. Ratios are computed per
repetition, then their median is reported with the min and max. docs/heterogeneity.md has the
measured table and what each arm does wrong.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from geofed.orchestrator.config import config_from_mapping, default_config_path
from geofed.orchestrator.config.strict import parse_yaml_file

SLOW_REGION, SLOW_FACTOR, ABSENT_P = "eu-west-1", 4.0, 0.25
# Every region is emulated 2x slower than its share of this machine, the slow one 4x that: a
# region that sleeps leaves the cores to the others, and without the common factor the three fast
# regions of `slow` would run faster than the four of `equal` (2 cores, 4 regions time-sharing).
BASE_SLOWDOWN = 2.0
SCENARIOS: dict[str, dict[str, Any]] = {
    "equal": {},
    "slow": {"slowdown": {SLOW_REGION: SLOW_FACTOR}},
    "flaky": {"availability": {"absent_p": ABSENT_P, "seed": 1}},
}
ARMS: dict[str, dict[str, Any]] = {
    "barrier": {"overlap": True, "pacing": {"mode": "barrier"}},
    "drop": {"overlap": False, "pacing": {"mode": "quorum", "late_updates": "drop"}},
    "time-budget": {"overlap": True, "pacing": {"mode": "time-budget"}},
    "quorum": {"overlap": False, "pacing": {"mode": "quorum", "late_updates": "apply"}},
}


@dataclass(frozen=True, kw_only=True)
class Base:
    """A task the bench runs on: its config file, the held-out metric's target and direction, and
    how far the best arm's final metric may fall behind the same arm's in `equal` (accuracy:
    points; loss: a fraction of it)."""

    config: str
    metric: str
    target: float
    higher_is_better: bool
    metric_tolerance: float

    def targets(self) -> dict[str, float]:
        return {"slow_best_vs_equal": 1.3, "flaky_best_vs_equal": 1.3, "slow_best_metric_delta": -self.metric_tolerance,
                "slow_fast_idle_fraction": 0.1, "slow_least_idle_fraction": 0.1}


BASES = {
    "digits": Base(config="bench-hetero.yaml", metric="accuracy", target=0.96, higher_is_better=True,
                   metric_tolerance=0.01),
    "char-lm": Base(config="bench-hetero-lm.yaml", metric="loss", target=2.1, higher_is_better=False,
                    metric_tolerance=0.02),
}
TARGETS = BASES["digits"].targets()


@dataclass(frozen=True)
class Cell:
    """One (scenario, arm) pair of the bench."""

    scenario: str
    arm: str

    @property
    def name(self) -> str:
        return f"{self.scenario}/{self.arm}"


def cells() -> list[Cell]:
    """Every arm in every scenario: an arm's time in `slow` or `flaky` is compared with its own in `equal`."""
    return [Cell(s, a) for s in SCENARIOS for a in ARMS]


def interleaved(items: Sequence[Cell], reps: int) -> list[tuple[int, Cell]]:
    """The run order: repetition i runs every item once, starting at item i mod n (a rotation), so
    no item always runs first or last."""
    n = len(items)
    return [(i, items[(i + j) % n]) for i in range(reps) for j in range(n)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed bench hetero", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(BASES), default="digits",
                   help="digits (the MLP, target accuracy 0.96) or char-lm (the GRU on tinyshakespeare, target loss 2.1)")
    p.add_argument("--quick", action="store_true", help="one repetition of shorter runs (10 rounds), said so in the output")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every run, interleaved (default 3)")
    p.add_argument("--json", action="store_true", help="print the JSON document on stdout")
    p.add_argument("--out", help="folder for the run directories (default runs/bench-hetero-<UTC time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key in every run (e.g. --set run.seed=1)")
    return p


def arm_config(cell: Cell, *, quick: bool, overrides: Sequence[str] = (), base: dict | None = None,
               task: str = "digits"):
    """The RunConfig of one cell: the base file, the scenario's emulation, the arm's pacing."""
    m = copy.deepcopy(base if base is not None else parse_yaml_file(default_config_path().parent / BASES[task].config))
    emulation = copy.deepcopy(SCENARIOS[cell.scenario])
    slowdown = {r: BASE_SLOWDOWN for r in m["regions"]["names"]}
    slowdown.update({r: f * BASE_SLOWDOWN for r, f in emulation.get("slowdown", {}).items()})
    m["regions"]["emulation"] = {**emulation, "slowdown": slowdown}
    arm = ARMS[cell.arm]
    m.setdefault("sync", {}).update({"overlap": arm["overlap"], "pacing": copy.deepcopy(arm["pacing"])})
    if quick:
        m["run"]["rounds"] = 10
    return config_from_mapping(m, list(overrides), source=f"bench hetero {cell.name}")


def main(argv: Sequence[str]) -> int:
    """`geofed bench hetero ARGS`; returns the exit code (1: a run failed)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    reps = 1 if args.quick else args.reps
    if reps < 1:
        print("geofed bench hetero: --reps: must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-hetero-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}")
    console = Console(stderr=True)
    from geofed.orchestrator.driver.cluster import PlacementError
    from geofed.orchestrator.driver.recovery import RunFailed

    try:
        doc = run_bench(out, reps=reps, quick=args.quick, overrides=args.overrides, console=console, task=args.task)
    except (PlacementError, RunFailed) as exc:
        print(f"geofed bench hetero: {exc} (run directories so far: {out})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_table(Console(), doc)
        print(f"run directories: {out}")
    return 0


def run_bench(out: Path, *, reps: int, quick: bool, overrides: Sequence[str] = (),
              console: Console | None = None, task: str = "digits") -> dict[str, Any]:
    """Run every cell `reps` times, interleaved; returns the JSON document (also out/bench.json)."""
    from .hetero_results import document, measure
    from .runs import bench_ray, run_to_end

    console = console or Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    order = interleaved(cells(), reps)
    base = BASES[task]
    configs = {c: arm_config(c, quick=quick, overrides=overrides, task=task) for c in cells()}
    rows: list[dict[str, Any]] = []
    console.rule(f"geofed bench hetero: {len(order)} runs ({reps} interleaved repetition{'s' * (reps > 1)}"
                 f"{', --quick' if quick else ''}), {task}, target {base.metric} {base.target}")
    with bench_ray(next(iter(configs.values()))):
        for k, (rep, cell) in enumerate(order):
            where = out / f"rep{rep}" / cell.scenario / cell.arm
            run_dir, _ = run_to_end(configs[cell], where, source="bench hetero")
            row = {"rep": rep, "scenario": cell.scenario, "arm": cell.arm,
                   **measure(run_dir, target=base.target, higher_is_better=base.higher_is_better,
                             slow=[SLOW_REGION] if cell.scenario == "slow" else [])}
            rows.append(row)
            with (out / "rows.jsonl").open("a") as f:  # a bench cut short keeps its runs
                f.write(json.dumps(row) + "\n")
            tt = row["time_to_target_s"]
            console.print(f"[{k + 1}/{len(order)}] rep {rep} {cell.name}: "
                          f"{'not reached' if tt is None else f'{tt:.2f} s'} to {base.metric} {base.target}, "
                          f"final {row['final_metric']}, idle {row['fast_idle_fraction']}")
    doc = {"task": task, "metric": base.metric, "target": base.target,
           **document(rows, reps=reps, quick=quick, targets=base.targets(), higher_is_better=base.higher_is_better)}
    (out / "bench.json").write_text(json.dumps({**doc, "rows": rows}, indent=2))
    return doc


def print_table(console: Console, doc: dict[str, Any]) -> None:
    """The per-arm medians and the ratios against their targets."""
    t = Table(title=f"geofed bench hetero ({doc['reps']} rep{'s' * (doc['reps'] > 1)}{', quick' if doc['quick'] else ''};"
                    " medians, [min-max])")
    metric = doc.get("metric", "accuracy")
    for col in ("scenario", "arm", "time to target s", "steps to target", f"final {metric}", "MB sent", "fast idle"):
        t.add_column(col)
    for a in doc["arms"]:
        t.add_row(a["scenario"], a["arm"], _spread(a, "time_to_target_s"), _fmt(a["steps_to_target"]),
                  _fmt(a["final_metric"], 4), _fmt(None if a["bytes_sent"] is None else a["bytes_sent"] / 1e6),
                  _fmt(a["fast_idle_fraction"]))
    console.print(t)
    for key, value in doc["ratios"].items():
        sp = doc["spread"].get(key) or {}
        target = doc.get("targets", TARGETS).get(key)
        console.print(f"{key}: {_fmt(value)} [{_fmt(sp.get('min'))}-{_fmt(sp.get('max'))}]"
                      + ("" if target is None else f" (target {'>=' if key.endswith('delta') else '<='} {target:g})"))


def _spread(a: dict[str, Any], key: str) -> str:
    sp = a.get("spread", {}).get(key) or {}
    return f"{_fmt(a[key])} [{_fmt(sp.get('min'))}-{_fmt(sp.get('max'))}]"


def _fmt(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


__all__ = ["ARMS", "SCENARIOS", "Cell", "cells", "interleaved", "main", "run_bench"]
