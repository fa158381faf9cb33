"""`geofed bench plan`'s shipped-config rows: `geofed plan CONFIG` against `geofed run CONFIG`.

The matrix cells (plan.py) give each run its own measured step time, so they test the round and
link model. These rows test what a user sees (issue 37: the plan said 24% at H 150 where the
default run had 96% at H 55-146): the config as it ships, planned exactly as `geofed plan CONFIG`
plans it (the step timed with the regions' co-location, the run's policy simulated to its steady
decision), then run as `geofed run CONFIG` runs it (report off), one after the other on the same
machine. Side by side: utilisation, and H (the policy's pick against the H its rounds used).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geofed.orchestrator.driver.rundir import read_jsonl

SHIPPED = ("local-wan.yaml",)   # in configs/: the default run
UTILIZATION_TARGET = 0.15       # issue 37: within 15% of the run's utilisation (relative)


def shipped_path(name: str) -> Path:
    """A shipped config's file (configs/ as installed)."""
    from geofed.orchestrator.config import default_config_path

    return default_config_path().parent / name


def shipped_config(name: str, overrides: Sequence[str] = ()):
    """The config as it ships, with no report (the run's rounds are the same without it)."""
    from geofed.orchestrator.config import load_config

    return load_config(shipped_path(name), ["run.report=false", *overrides])


def predict_shipped(cfg) -> dict[str, Any]:
    """What `geofed plan CONFIG` predicts for the run: its policy's steady (H, codec) and utilisation."""
    from geofed.orchestrator.plan import plan

    doc = plan(cfg)
    pol = doc["policy"]
    pred = pol["prediction"]
    return {"pred_H": pol["H"], "pred_codec": pol["codec"], "pred_utilization": pred["utilization"],
            "pred_round_s": pred["round_s"], "pred_step_s": doc["step_time_s"], "contention": doc["contention"],
            "probe_alone_s": doc["step_probe"]["alone_s"], "policy": pol["kind"], "H_min": pol["H_min"],
            "H_max": pol["H_max"], "ladder": pol["ladder"], "pred_settled_round": pol["settled_round"]}


def measure_policy_run(run_dir: Path) -> dict[str, Any]:
    """Utilisation, round and step time (bench plan's `measure`: rounds 1..end) and the H and codecs
    the run's policy used in those rounds (rounds.jsonl)."""
    from .plan_results import measure

    m = measure(run_dir)
    later = [r for r in read_jsonl(run_dir / "rounds.jsonl") if r["round"] >= 1]
    Hs = [int(r["H"]) for r in later]
    codecs = sorted({c for r in later for c in (r.get("codecs") or {}).values()})
    return {"utilization": m["utilization"], "round_s": m["round_s"], "step_s": m["step_s"],
            "H_median": statistics.median(Hs), "H_lo": min(Hs), "H_hi": max(Hs), "H_per_round": Hs,
            "codecs": codecs, "run_dir": str(run_dir)}


def shipped_row(name: str, predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """One side-by-side row with its checks: utilisation within UTILIZATION_TARGET of the run's (relative),
    the predicted H inside the policy's range, and where it falls among the H the run used."""
    util_err = (predicted["pred_utilization"] - measured["utilization"]) / measured["utilization"]
    return {"config": f"configs/{name}", **predicted, **measured,
            "utilization_rel_err": util_err, "utilization_ok": abs(util_err) <= UTILIZATION_TARGET,
            "pred_H_in_policy_range": predicted["H_min"] <= predicted["pred_H"] <= predicted["H_max"],
            "pred_H_in_run_span": measured["H_lo"] <= predicted["pred_H"] <= measured["H_hi"],
            "pred_H_over_run_median": predicted["pred_H"] / measured["H_median"],
            "pred_codec_used": predicted["pred_codec"] in measured["codecs"]}


def run_shipped(out: Path, *, names: Sequence[str] = SHIPPED, overrides: Sequence[str] = (), console=None) -> list[dict]:
    """Plan, then run, each shipped config (its own local Ray: ray.num_cpus as shipped); rows also
    appended to out/shipped.jsonl as they finish."""
    from .runs import bench_ray, run_to_end

    rows = []
    for name in names:
        cfg = shipped_config(name, overrides)
        predicted = predict_shipped(cfg)
        with bench_ray(cfg):
            run_dir, _ = run_to_end(cfg, out / "shipped" / Path(name).stem, source=str(shipped_path(name)))
        row = shipped_row(name, predicted, measure_policy_run(Path(run_dir)))
        rows.append(row)
        with (out / "shipped.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        if console is not None:
            console.print(f"configs/{name}: utilisation {row['utilization']:.0%} (predicted {row['pred_utilization']:.0%}), "
                          f"H {row['H_lo']}-{row['H_hi']} median {row['H_median']:g} (predicted {row['pred_H']})")
    return rows


def print_shipped(console, rows: Sequence[dict[str, Any]]) -> None:
    """The shipped configs' rows: predicted against measured utilisation and H."""
    from rich.table import Table

    t = Table(title="geofed plan CONFIG against geofed run CONFIG (shipped configs)")
    for col in ("config", "util", "predicted", "err", "H used (median)", "H predicted", "policy range", "codec",
                "step ms", "predicted", "K"):
        t.add_column(col, justify="left" if col in ("config", "codec") else "right")
    for r in rows:
        t.add_row(r["config"], f"{r['utilization']:.0%}", f"{r['pred_utilization']:.0%}", f"{r['utilization_rel_err']:+.0%}",
                  f"{r['H_lo']}-{r['H_hi']} ({r['H_median']:g})", str(r["pred_H"]), f"{r['H_min']}-{r['H_max']}",
                  f"{'/'.join(r['codecs'])} ({r['pred_codec']})", f"{r['step_s'] * 1e3:.3g}",
                  f"{r['pred_step_s'] * 1e3:.3g}", f"{r['contention']:.3g}")
    console.print(t)
