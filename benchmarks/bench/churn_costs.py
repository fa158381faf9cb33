"""Where `geofed bench churn`'s throughput goes: what each fault cost the churn arm, in seconds of
the undisturbed arm's steady rate (docs/reliability.md, "Churn").

    python -m geofed.bench.churn_costs OUT [--json]     (OUT: a `geofed bench churn --out` folder)

The bench's throughput is examples over the wall time from the first launch to the end, so a
fault costs the run in two ways, both counted here in seconds: the run's time that was not
turned into examples at the steady rate (R: examples per second over the undisturbed arm's
rounds, set-up left out). Per round r of the churn arm (rounds.jsonl and metrics.jsonl, each
round once: a resume truncates the rounds it does again):

    lost_r = (p_r - p) + (x - x_r) / R

with p_r the time from the previous round's end to this round's end, p the undisturbed median,
x_r the examples its regions reported and x a full round's (every region, H steps). The first
term (round time) goes to the last fault before the round, whatever it hit, except in a round
that a region joined or came back restarted in (the driver brings it in between rounds while the
others wait: that is the fault's that took it out, the leave or the kill); the second
(examples) goes region by region to the last fault that hit the missing region (a region-kill, a
leave, a stop of that region; a driver kill hits them all). A driver kill costs, besides its
rounds, the wall time that is in no round: from the end of the last round before the kill to
the resumed driver's first round (its set-up, the re-attach or restore, the round it killed and
those redone). Faults are placed on the run's clock by the drivers' launches: each launch's
`setup_done` says how old its process was at its first round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geofed.orchestrator.driver.rundir import read_jsonl

# The injector's records that are faults, and the kind each one is counted under.
FAULT_OF = {"region-kill": "region-kill", "region-stop": "region-stop", "link-outage": "link-outage",
            "leave": "leave-join", "driver-kill": "driver-kill"}
# Whom a fault takes out of rounds: the region it hit, or every region.
HITS_ALL = {"driver-kill"}


def _per_round(run_dir: Path, batch_size: int) -> tuple[list[dict[str, Any]], dict[int, dict[str, int]]]:
    rounds = sorted(read_jsonl(run_dir / "rounds.jsonl"), key=lambda x: x["round"])
    examples: dict[int, dict[str, int]] = {}
    for m in read_jsonl(run_dir / "metrics.jsonl"):
        examples.setdefault(int(m["round"]), {})[m["region"]] = int(m.get("steps") or 0) * batch_size
    return rounds, examples


def _launches(run_dir: Path) -> list[dict[str, Any]]:
    """Each driver launch's first round: its process age then (setup_done), and the round it started at."""
    out, start_round = [], 0
    for e in read_jsonl(run_dir / "events.jsonl"):
        if e.get("event") == "resumed":  # before its launch's setup_done
            start_round = int(e["from_checkpoint"]) + 1
        elif e.get("event") == "setup_done":
            out.append({"to_round0_s": float(e.get("process_to_round0_s") or e.get("setup_s") or 0.0),
                        "round": start_round, "setup_s": e.get("setup_s")})
    return out


def steady(undisturbed: Path, batch_size: int) -> dict[str, float]:
    """The undisturbed arm's median round period, full round's examples and their rate."""
    rounds, examples = _per_round(undisturbed, batch_size)
    periods = [b["t_end"] - a["t_end"] for a, b in zip(rounds, rounds[1:])]
    full = statistics.median(sum(v.values()) for v in examples.values())
    p = statistics.median(periods)
    launches = _launches(undisturbed)
    return {"period_s": p, "round_examples": full, "rate": full / p,
            "to_round0_s": launches[0]["to_round0_s"] if launches else 0.0}


def fault_costs(undisturbed: Path, churn: Path, actions: Sequence[dict[str, Any]], *, batch_size: int,
                regions: Sequence[str]) -> dict[str, Any]:
    """Each fault of the churn arm (the injector's `actions` that acted) with its cost (module
    docstring), the costs by kind, and the set-up difference between the arms."""
    ref = steady(undisturbed, batch_size)
    p, x, rate = ref["period_s"], ref["round_examples"], ref["rate"]
    per_region = x / len(regions)
    rounds, examples = _per_round(churn, batch_size)
    launches = _launches(churn)
    by_round = {r["round"]: r for r in rounds}
    # wall time (from the bench's t0) - run clock, per launch; a launch's rounds are from its first on
    offsets = []
    kills = [a for a in actions if a["kind"] == "driver-kill" and a.get("ok")]
    for i, launch in enumerate(launches):
        first = by_round.get(launch["round"])
        if first is None:
            continue
        launched_at = 0.0 if i == 0 else (kills[i - 1]["t_s"] if i - 1 < len(kills) else None)
        if launched_at is None:
            continue
        offsets.append((launch["round"], launched_at + launch["to_round0_s"] - first["t_start"]))
    faults = [{"kind": FAULT_OF[a["kind"]], "region": a.get("region"), "t_s": a["t_s"], "round_s": 0.0,
               "examples": 0.0, "gap_s": 0.0} for a in actions if a.get("ok") and a["kind"] in FAULT_OF]
    faults.sort(key=lambda f: f["t_s"])

    def offset_at(r: int) -> float:
        return next((off for start, off in reversed(offsets) if r >= start), offsets[0][1] if offsets else 0.0)

    def wall(r: int, t: float) -> float:
        return t + offset_at(r)

    def last_fault(at: float, region: str | None = None) -> dict[str, Any] | None:
        hit = [f for f in faults if f["t_s"] <= at and (region is None or f["region"] == region or f["kind"] in HITS_ALL)]
        return hit[-1] if hit else None

    # The driver brings a joiner or a restarted region in between rounds, the others waiting: that round's
    # time is the fault's that took the region out, whatever came in between.
    brought: dict[int, str] = {}
    for e in read_jsonl(churn / "events.jsonl"):
        if e.get("event") == "region_joined" or (e.get("event") == "region_rejoined" and e.get("after") == "restart"):
            brought.setdefault(int(e["round"]), e["region"])
    other = {"round_s": 0.0, "examples": 0.0}
    for r in rounds:
        n = r["round"]
        start_wall = wall(n, r["t_start"])
        if n - 1 in by_round:
            slow = wall(n, r["t_end"]) - wall(n - 1, by_round[n - 1]["t_end"]) - p
            if offset_at(n) != offset_at(n - 1):  # the first round after a resume: all of the gap is the kill's
                kill = next((f for f in reversed(faults) if f["kind"] == "driver-kill" and f["t_s"] <= start_wall), None)
                (kill or other)["gap_s" if kill else "round_s"] += slow
            elif n in brought:
                (last_fault(start_wall, brought[n]) or other)["round_s"] += slow
            else:
                (last_fault(start_wall) or other)["round_s"] += slow
        got = examples.get(n, {})
        for region in regions:
            short = per_region - got.get(region, 0)
            if short > 0.5:
                (last_fault(start_wall, region) or other)["examples"] += short
    for f in faults:
        f["examples_s"] = f["examples"] / rate
        f["seconds"] = round(f["round_s"] + f["examples_s"] + f["gap_s"], 2)
        for key in ("round_s", "examples_s", "gap_s"):
            f[key] = round(f[key], 2)
        f["examples"] = int(f["examples"])
    kinds: dict[str, dict[str, Any]] = {}
    for f in faults:
        k = kinds.setdefault(f["kind"], {"count": 0, "seconds_each": [], "round_s": 0.0, "examples_s": 0.0, "gap_s": 0.0})
        k["count"] += 1
        k["seconds_each"].append(f["seconds"])
        for key in ("round_s", "examples_s", "gap_s"):
            k[key] = round(k[key] + f[key], 2)
    for k in kinds.values():
        k["median_s"] = round(statistics.median(k["seconds_each"]), 2)
        k["total_s"] = round(sum(k["seconds_each"]), 2)
    return {"steady": {k: round(v, 4) for k, v in ref.items()}, "faults": faults, "by_kind": kinds,
            "unattributed_s": round(other["round_s"] + other["examples"] / rate, 2),
            "setup_s": {"undisturbed": ref["to_round0_s"], "churn": launches[0]["to_round0_s"] if launches else None}}


def costs_of(out: Path) -> list[dict[str, Any]]:
    """Each repetition's fault costs from a bench's folder (rows.jsonl and the run directories)."""
    from geofed.orchestrator.config import config_from_mapping
    from geofed.orchestrator.config.strict import parse_yaml_file

    rows: dict[int, dict[str, dict[str, Any]]] = {}
    for row in read_jsonl(out / "rows.jsonl"):
        rows.setdefault(int(row["rep"]), {})[row["arm"]] = row
    result = []
    for rep, arms in sorted(rows.items()):
        if not {"undisturbed", "churn"} <= set(arms):
            continue
        churn_dir = Path(arms["churn"]["run_dir"])
        cfg = config_from_mapping(parse_yaml_file(churn_dir.parent / "config.yaml"))
        costs = fault_costs(Path(arms["undisturbed"]["run_dir"]), churn_dir, arms["churn"]["actions"],
                            batch_size=cfg.sync.inner.batch_size, regions=list(cfg.regions.names))
        costs["wall_s"] = {arm: arms[arm]["wall_s"] for arm in ("undisturbed", "churn")}
        costs["examples"] = {arm: arms[arm]["examples"] for arm in ("undisturbed", "churn")}
        result.append({"rep": rep, **costs})
    return result


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m geofed.bench.churn_costs", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="a `geofed bench churn --out` folder")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    args = p.parse_args(list(argv))
    reps = costs_of(Path(args.out))
    if args.json:
        print(json.dumps(reps, indent=2))
        return 0
    for rep in reps:
        print(f"rep {rep['rep']}: steady round {rep['steady']['period_s']:.2f} s, {rep['steady']['rate']:.0f} examples/s; "
              f"unattributed {rep['unattributed_s']} s; set-up {rep['setup_s']}")
        print(f"{'kind':<12} {'count':>5} {'median s':>9} {'total s':>8} {'round s':>8} {'examples s':>10} {'gap s':>7}  each")
        for kind, k in sorted(rep["by_kind"].items(), key=lambda kv: -kv[1]["total_s"]):
            print(f"{kind:<12} {k['count']:>5} {k['median_s']:>9} {k['total_s']:>8} {k['round_s']:>8} "
                  f"{k['examples_s']:>10} {k['gap_s']:>7}  {k['seconds_each']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
