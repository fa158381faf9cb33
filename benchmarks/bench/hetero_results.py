"""What `geofed bench hetero` reads back from each run directory, and the medians and ratios of
its document. Times count from round 0 on the run's clock (set-up is left out)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geofed.orchestrator.driver.rundir import read_jsonl

MEASURES = ("time_to_target_s", "steps_to_target", "final_metric", "bytes_sent", "fast_idle_fraction", "wall_s")


def measure(run_dir: Path, *, target: float, slow: Sequence[str] = (), higher_is_better: bool = True) -> dict[str, Any]:
    """One run: time and steps (mean per region) to the first evaluation that reaches `target`
    (at or above it; at or below where lower is better: a loss),
    the final held-out metric, bytes sent, and the fast regions' idle fraction: 1 - their compute
    seconds / the training wall time (regions in `slow` are not fast)."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = read_jsonl(run_dir / "rounds.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    per_round: dict[int, list[int]] = defaultdict(list)
    compute: dict[str, float] = defaultdict(float)
    for m in metrics:
        per_round[int(m["round"])].append(int(m.get("steps") or 0))
        compute[m["region"]] += float(m.get("compute_s") or 0.0)
    def reached(r: dict) -> bool:
        value = (r.get("eval_avg") or {}).get("value")
        return value is not None and (value >= target if higher_is_better else value <= target)

    hit = next((r for r in rounds if reached(r)), None)
    time_to, steps_to = None, None
    if hit is not None:
        time_to = hit.get("eval_t", hit["t_end"])
        last = int(hit.get("eval_round", hit["round"]))
        steps_to = sum(statistics.mean(v) for r, v in per_round.items() if r <= last and v)
    wall = float(summary.get("wall_s") or 0.0)
    fast = [r for r in sorted(compute) if r not in slow]
    idle = [1.0 - compute[r] / wall for r in fast if wall > 0]
    return {"time_to_target_s": _r(time_to), "steps_to_target": _r(steps_to, 1),
            "final_metric": _r((summary.get("eval") or {}).get("value"), 4), "bytes_sent": summary.get("bytes_sent"),
            "fast_idle_fraction": _r(statistics.mean(idle) if idle else None), "wall_s": _r(wall),
            "pacing": summary.get("pacing"), "run_dir": str(run_dir)}


def document(rows: list[dict[str, Any]], *, reps: int, quick: bool, targets: dict[str, float],
             higher_is_better: bool = True) -> dict[str, Any]:
    """Per-arm medians with their spread, and the ratios: each computed per repetition, then the
    median (spread: min and max over repetitions). An arm's time in slow or flaky is divided by
    the same arm's in equal. The best arm of a scenario is the non-barrier arm with the smallest
    median time to target. The metric delta is the best arm's final metric in slow less its
    own in equal (accuracy points), or for a loss the fraction by which it is lower (negative:
    worse), so that in both a negative delta means the slow region cost quality."""
    cellsets: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        cellsets[(row["scenario"], row["arm"])].append(row)
    arms = [_arm_row(scenario, arm, rs) for (scenario, arm), rs in cellsets.items()]
    best = {s: _best(arms, s) for s in ("slow", "flaky")}
    per_rep: dict[str, list[float]] = defaultdict(list)
    for rep in sorted({r["rep"] for r in rows}):
        got = {(r["scenario"], r["arm"]): r for r in rows if r["rep"] == rep}
        for name, value in _ratios(got, best, higher_is_better).items():
            if value is not None:
                per_rep[name].append(value)
    names = ("slow_barrier_vs_equal", "slow_best_vs_equal", "flaky_best_vs_equal", "slow_best_metric_delta",
             "slow_fast_idle_fraction", "flaky_barrier_vs_equal")
    ratios = {n: _r(statistics.median(per_rep[n]), 4) if per_rep.get(n) else None for n in names}
    spread = {n: ({"min": _r(min(per_rep[n]), 4), "max": _r(max(per_rep[n]), 4)} if per_rep.get(n) else None)
              for n in names}
    # The arm fastest to the target need not be the one that keeps fast regions busiest: say which is.
    idle = [a for a in arms if a["scenario"] == "slow" and a["arm"] != "barrier" and a["fast_idle_fraction"] is not None]
    least = min(idle, key=lambda a: a["fast_idle_fraction"]) if idle else None
    ratios["slow_least_idle_fraction"] = None if least is None else least["fast_idle_fraction"]
    spread["slow_least_idle_fraction"] = None if least is None else least["spread"]["fast_idle_fraction"]
    best["slow_least_idle"] = None if least is None else least["arm"]
    met = {k: (None if ratios.get(k) is None else
               (ratios[k] >= v if k.endswith("delta") else ratios[k] <= v)) for k, v in targets.items()}
    return {"reps": reps, "quick": quick, "best_arm": best, "arms": arms, "ratios": ratios, "spread": spread,
            "targets": targets, "targets_met": met}


def _ratios(got: dict, best: dict[str, str | None], higher_is_better: bool = True) -> dict[str, float | None]:
    """One repetition's ratios: an arm's time in slow/flaky over the same arm's in equal."""
    def ratio(scenario: str, arm: str | None) -> float | None:
        row, ref = got.get((scenario, arm)), got.get(("equal", arm))
        if row is None or ref is None or row["time_to_target_s"] is None or not ref["time_to_target_s"]:
            return None
        return row["time_to_target_s"] / ref["time_to_target_s"]

    out: dict[str, float | None] = {}
    for scenario in ("slow", "flaky"):
        out[f"{scenario}_barrier_vs_equal"] = ratio(scenario, "barrier")
        out[f"{scenario}_best_vs_equal"] = ratio(scenario, best[scenario]) if best[scenario] else None
    slow_best = got.get(("slow", best["slow"])) if best["slow"] else None
    ref = got.get(("equal", best["slow"])) if best["slow"] else None
    if slow_best is not None and ref is not None and None not in (slow_best["final_metric"], ref["final_metric"]):
        a, b = slow_best["final_metric"], ref["final_metric"]
        out["slow_best_metric_delta"] = a - b if higher_is_better else (b - a) / b if b else None
    out["slow_fast_idle_fraction"] = None if slow_best is None else slow_best["fast_idle_fraction"]
    return out


def _best(arms: list[dict], scenario: str) -> str | None:
    cands = [a for a in arms if a["scenario"] == scenario and a["arm"] != "barrier" and a["time_to_target_s"] is not None]
    return min(cands, key=lambda a: a["time_to_target_s"])["arm"] if cands else None


def _arm_row(scenario: str, arm: str, rows: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": scenario, "arm": arm, "runs": len(rows), "spread": {}}
    for key in MEASURES:
        vals = [r[key] for r in rows if r.get(key) is not None]
        out[key] = _r(statistics.median(vals), 4) if vals else None
        out["spread"][key] = {"min": _r(min(vals), 4), "max": _r(max(vals), 4)} if vals else None
    out["reached"] = sum(r["time_to_target_s"] is not None for r in rows)
    return out


def _r(x, nd: int = 3):
    return None if x is None else round(float(x), nd)
