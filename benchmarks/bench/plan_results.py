"""`geofed bench plan`'s measurements of one run, the planner's prediction of it, and the document."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geofed.orchestrator.driver.rundir import read_jsonl


def measure(run_dir: Path) -> dict[str, Any]:
    """Round time, step time, utilisation and bytes per round of a finished run (round 0 left out:
    with overlap it sends nothing yet, and it pays the first pushes' connection warm-up)."""
    rounds = {r["round"]: r for r in read_jsonl(run_dir / "rounds.jsonl")}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    per: dict[int, list[dict]] = {}
    for m in metrics:
        per.setdefault(m["round"], []).append(m)
    later = [r for r in sorted(rounds) if r >= 1 and r in per]
    wall = [rounds[r]["t_end"] - rounds[r]["t_start"] for r in later]
    # The policy's step time: the slowest region's, per round (the round waits for it).
    step = [max(m["compute_s"] / max(1, m["steps"]) for m in per[r]) for r in later]
    compute = [max(m["compute_s"] for m in per[r]) for r in later]
    sent = [sum(m.get("bytes_sent", 0) for m in per[r]) for r in sorted(per)]
    sent = [b for b in sent if b > 0]
    median_compute = statistics.median(compute)
    return {"compute_spread": [round(c / median_compute, 4) for c in compute] if median_compute > 0 else [1.0],
            "round_s": statistics.mean(wall), "round_s_per_round": [round(w, 4) for w in wall],
            "step_s": statistics.median(step), "utilization": sum(compute) / sum(wall),
            "bytes_per_round": int(statistics.median(sent)) if sent else 0,
            "bytes_per_round_min": min(sent, default=0), "bytes_per_round_max": max(sent, default=0),
            "run_dir": str(run_dir)}


def predict_cell(cfg, step_s: float, compute_spread: Sequence[float] = (1.0,), *,
                 alone_step_s: float | None = None) -> dict[str, Any]:
    """The planner's prediction of the rounds `measure` averages (1..end), given the measured step time
    and the spread of the rounds' compute (measure's compute_spread: the machine's load, an input as
    the step time is; the model turns it into round time). With `alone_step_s` (the probe's step time
    on this machine alone), contention = step_s / it (at least 1) stretches the codec and control plane."""
    from geofed.p2p.wan.prices import EgressPricer

    from geofed.orchestrator.plan import build_setup
    from geofed.orchestrator.plan.inputs import codec_facts, probe_task
    from geofed.orchestrator.plan.model import Candidate, mean_spread, predict, round_times

    regions = list(cfg.regions.names)
    pricer = EgressPricer(cfg.network.egress)
    setup, _ = build_setup(cfg, regions=regions, step_s=step_s, links_path=None, pricer=pricer)
    contention = 1.0 if alone_step_s is None else max(1.0, step_s / alone_step_s)
    setup = dataclasses.replace(setup, compute_spread=tuple(compute_spread), contention=contention)
    facts = probe_task(cfg, probe=False)
    spec = cfg.compression.codec
    wire, codec_s = codec_facts(spec, facts.shapes, chunk_bytes=cfg.network.chunk_kb * 1024, sender=regions[0],
                                in_peers=len(regions) - 1)
    c = Candidate(H=cfg.sync.policy.H, codec=spec.key, wire_bytes=wire, codec_s=codec_s)
    p = predict(setup, c)
    times = round_times(setup, c)[1:]
    pred_round = statistics.mean(times)
    return {"pred_round_s": pred_round, "pred_utilization": min(1.0, c.H * step_s * mean_spread(setup) / pred_round),
            "pred_bytes_per_round": p.bytes_per_round, "pred_bottleneck": p.bottleneck, "pred_sync_s": p.sync_s,
            "pred_codec_s": codec_s, "contention": contention, "pred_egress_usd_per_hour": p.egress_usd_per_hour,
            "pred_egress_usd_per_step": None if p.egress_usd_per_run is None else p.egress_usd_per_run / p.steps}


def _err(measured: float, predicted: float) -> float:
    return (predicted - measured) / measured if measured else 0.0


def document(rows: list[dict[str, Any]], *, probe_step_s: float, floor: float, targets: dict[str, float],
             rounds: int) -> dict[str, Any]:
    """Errors per row and overall, and the recommendation check per matrix."""
    for r in rows:
        r["round_time_err"] = _err(r["round_s"], r["pred_round_s"])
        r["utilization_err"] = r["pred_utilization"] - r["utilization"]
        r["bytes_err"] = _err(r["bytes_per_round"], r["pred_bytes_per_round"])
    rt = [abs(r["round_time_err"]) for r in rows]
    rec = recommendation_check(rows, floor)
    return {
        "rounds": rounds, "configurations": len(rows),
        "round_time_median_abs_err": statistics.median(rt), "round_time_worst_abs_err": max(rt),
        "utilization_worst_abs_err": max(abs(r["utilization_err"]) for r in rows),
        "bytes_worst_abs_err": max(abs(r["bytes_err"]) for r in rows),
        # The worst matrix; every matrix has a best (the rule's second branch where no run met the floor).
        "recommended_vs_best": max(v["ratio"] for v in rec.values()),
        "recommended_vs_best_where_a_run_met_floor": max((v["ratio"] for v in rec.values() if v["best_met_floor"]),
                                                         default=None),
        "recommendation": rec, "utilization_floor": floor,
        "probe_step_s": probe_step_s, "probe_step_ratio": probe_step_s / statistics.median(r["step_s"] for r in rows),
        "targets": targets, "rows": rows,
    }


def recommendation_check(rows: list[dict[str, Any]], floor: float) -> dict[str, dict[str, Any]]:
    """Per matrix: the pick of `geofed plan`'s rule (plan.model.choose) over the runs tried, applied
    to their predictions, against the best: the fastest measured s/step among the runs measured to
    meet the floor, or of all runs where none did (so every matrix has a ratio). ratio = the pick's
    measured s/step / the best's. `rule_on_measured` is the rule applied to the measurements (what a
    perfect model would pick; dollars per step are the predicted ones, the bytes being exact)."""
    from geofed.orchestrator.plan.model import choose

    def usd(r: dict[str, Any]) -> float:
        return r.get("pred_egress_usd_per_step") or math.inf

    def s_step(r: dict[str, Any]) -> float:
        return r["round_s"] / r["H"]

    out = {}
    for m in dict.fromkeys(r["matrix"] for r in rows):
        rs = [r for r in rows if r["matrix"] == m]
        pick, pred_met = choose(rs, floor=floor, utilization=lambda r: r["pred_utilization"],
                                s_per_step=lambda r: r["pred_round_s"] / r["H"], usd_per_step=usd)
        ideal, _ = choose(rs, floor=floor, utilization=lambda r: r["utilization"], s_per_step=s_step, usd_per_step=usd)
        meeting = [r for r in rs if r["utilization"] >= floor]
        best = min(meeting or rs, key=s_step)
        out[m] = {"recommended": _name(pick), "recommended_predicted_to_meet_floor": pred_met,
                  "recommended_met_floor": pick["utilization"] >= floor, "best": _name(best),
                  "best_met_floor": bool(meeting), "rule_on_measured": _name(ideal),
                  "ratio": s_step(pick) / s_step(best)}
    return out


def _name(r: dict[str, Any]) -> str:
    return f"H={r['H']} {r['codec']}"
