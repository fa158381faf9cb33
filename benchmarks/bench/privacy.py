"""`geofed bench privacy`: what differential privacy and secure aggregation cost on the real stack (issue 22).

    geofed bench privacy [--quick] [--rounds N] [--reps N] [--arms a,b] [--json] [--out DIR]
                         [--emulation none|proxy]

Every arm is a real `geofed run` (Ray actors, mutual-TLS gRPC; with --emulation proxy the proxy
WAN emulator with the AWS preset) of 4 regions training the digits MLP with DiLoCo:

* ``plain``: no DP, fp16 updates (the default codec);
* ``int8``: int8 updates (the reference of the secure-aggregation arms);
* ``secagg``: int8-grid updates under security.secure_aggregation (8-bit mask ring);
* ``secagg_drop``: the same, with one region (eu-west-1) leaving mid-round in the middle round
  (regions.emulation.availability.mid_round: it sends its scales if the round agrees them, then nothing more);
* ``dp_eps1``, ``dp_eps4``, ``dp_eps8``: record-level DP-SGD (privacy.dp.mode record, clip 1,
  delta 1e-5), the noise chosen by the PRV accountant so the planned rounds end at that epsilon,
  drawn from a generator seeded by run.seed (seeded_noise: reproducible, for benchmarking only).

Every arm's MLP has tanh hidden units; repetition k runs at run.seed k (every arm alike), so the
same command gives the same accuracies.

Reported per arm: accuracy, epsilon spent, noise multiplier, bytes sent, wall time (with --reps,
the median of each, repetitions interleaved arm by arm, and every repetition's values); ratios
``secagg_bytes`` and ``secagg_time`` (secagg over int8; targets <= 1.05 and <= 1.10),
``dropout_acc_delta_points`` (secagg_drop minus secagg, in points) and ``dp_eps8_acc_ratio``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from geofed.orchestrator.config import config_from_mapping

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"]
# arm -> (epsilon of record-level DP or None, codec, secure aggregation, a region dropping mid-round)
ARMS: dict[str, tuple[float | None, str, bool, bool]] = {
    "plain": (None, "fp16", False, False), "int8": (None, "int8", False, False),
    "secagg": (None, "int8", True, False), "secagg_drop": (None, "int8", True, True),
    "dp_eps1": (1.0, "fp16", False, False), "dp_eps4": (4.0, "fp16", False, False), "dp_eps8": (8.0, "fp16", False, False),
}
TARGETS = {"secagg_bytes": 1.05, "secagg_time": 1.10, "dropout_acc_delta_points": -0.3, "dp_eps8_acc_ratio": 0.95}
DROPPER = "eu-west-1"


def arm_config(arm: str, *, rounds: int, H: int, emulation: str, seed: int = 0):
    """The run config of one arm (the settings of docs/privacy.md's measured tables). Every arm's
    MLP has tanh units (DP-SGD's accuracy gains 1.5 points from them at epsilon 8, the plain run's
    none is lost); DP uses the PRV accountant and noise seeded by run.seed (`seed`, the repetition),
    so a repetition repeats and the repetitions differ in data split, init and noise alike."""
    epsilon, codec, secagg, drop = ARMS[arm]
    dp = {"mode": "off"} if epsilon is None else {"mode": "record", "clip": 1.0, "target_epsilon": epsilon,
                                                  "delta": 1e-5, "on_target": "stop", "accountant": "prv",
                                                  "seeded_noise": True}
    net = {"mode": "none"} if emulation == "none" else {"mode": "proxy", "preset": "aws", "bandwidth_scale": 0.2}
    regions: dict[str, Any] = {"names": REGIONS, "num_cpus": 0.5}
    if drop:
        mid = rounds // 2
        regions["emulation"] = {"availability": {"mid_round": True, "schedule": [
            {"region": DROPPER, "from_round": mid, "to_round": mid}]}}
    return config_from_mapping({
        "run": {"name": "bench-privacy", "rounds": rounds, "seed": seed, "eval_every": 0, "checkpoint_every": 0,
                "report": False},
        "task": {"kind": "mlp-digits", "hidden": 64, "partition": "iid", "activation": "tanh"},
        "regions": regions,
        "network": {"emulation": net},
        "compression": {"codec": codec},
        "security": {"secure_aggregation": secagg, **({"secagg_bits": 8} if secagg else {})},
        "sync": {"policy": {"kind": "fixed", "H": H}, "inner": {"kind": "adamw", "lr": 0.003, "batch_size": 32},
                 "outer": {"lr": 0.7, "momentum": 0.9}},
        "privacy": {"dp": dp},
    })


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="geofed bench privacy", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 rounds of H 20 (a smoke run, not the measurement)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--reps", type=int, default=1, help="repetitions, interleaved arm by arm (medians reported)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    ap.add_argument("--emulation", choices=("none", "proxy"), default="proxy")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="run directories (default runs/bench-privacy-<UTC time>)")
    return ap


def main(argv: Sequence[str]) -> int:
    """`geofed bench privacy ARGS`; returns the exit code (1: a run failed)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    rounds, H = (6, 20) if args.quick else (args.rounds, args.H)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or args.reps < 1:
        print(f"geofed bench privacy: --arms: unknown {unknown} (known: {', '.join(ARMS)}) or --reps < 1",
              file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-privacy-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}")
    from geofed.orchestrator.driver.cluster import PlacementError
    from geofed.orchestrator.driver.recovery import RunFailed

    try:
        doc = run_bench(out, rounds=rounds, H=H, emulation=args.emulation, arms=arms, reps=args.reps)
    except (PlacementError, RunFailed) as exc:
        print(f"geofed bench privacy: {exc} (run directories so far: {out})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for name, row in doc["arms"].items():
            print(f"{name:8s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
        print("ratios", doc["ratios"], "targets", doc["targets"])
        print(f"run directories: {out}")
    return 0


def run_bench(out: Path, *, rounds: int, H: int, emulation: str, arms: Sequence[str] = tuple(ARMS),
              reps: int = 1) -> dict[str, Any]:
    """Every arm `reps` times (repetition by repetition, so a loaded moment hits every arm alike;
    repetition k at run.seed k); returns the JSON document (also out/bench.json)."""
    from .runs import run_to_end

    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for rep in range(reps):
        for name in arms:
            cfg = arm_config(name, rounds=rounds, H=H, emulation=emulation, seed=rep)
            _, summary = run_to_end(cfg, out / (name if reps == 1 else f"{name}-rep{rep}"), source="bench privacy")
            runs[name].append(row(summary))
            print(f"geofed bench privacy: {name} (rep {rep}): {runs[name][-1]}", file=sys.stderr, flush=True)
    rows = {name: median_row(r) for name, r in runs.items()}
    doc = {"rounds": rounds, "H": H, "emulation": emulation, "reps": reps, "arms": rows, "ratios": ratios(rows),
           "targets": TARGETS}
    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    return doc


def median_row(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's row over its repetitions: the median of every number, and each repetition's
    accuracy, bytes and wall time (one repetition: its row as it is)."""
    if len(reps) == 1:
        return reps[0]
    out = {}
    for key in reps[0]:
        values = [r[key] for r in reps if r[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    out["reps"] = {k: [r[k] for r in reps] for k in ("accuracy", "bytes_sent", "wall_s")}
    return out


def row(summary: dict[str, Any]) -> dict[str, Any]:
    """One arm's numbers from its summary.json."""
    p = summary.get("privacy") or {}
    return {"accuracy": round(summary["eval"]["value"], 4) if summary.get("eval") else None,
            "epsilon": None if p.get("epsilon") is None else round(p["epsilon"], 3),
            "noise_multiplier": None if not p else round(p["noise_multiplier"], 3),
            "rounds": summary["rounds"], "bytes_sent": summary["bytes_sent"], "wall_s": summary["wall_s"]}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """secagg over int8 (bytes, wall time), secagg_drop minus secagg (accuracy points), and
    dp_eps8's accuracy over the plain run's; None where an arm did not run."""
    def get(arm, key):
        return rows.get(arm, {}).get(key)

    def over(a, b, key):
        x, y = get(a, key), get(b, key)
        return round(x / y, 4) if x is not None and y else None

    drop, sec = get("secagg_drop", "accuracy"), get("secagg", "accuracy")
    return {"secagg_bytes": over("secagg", "int8", "bytes_sent"), "secagg_time": over("secagg", "int8", "wall_s"),
            "dropout_acc_delta_points": round(100 * (drop - sec), 2) if drop is not None and sec is not None else None,
            "dp_eps8_acc_ratio": over("dp_eps8", "plain", "accuracy")}


__all__ = ["ARMS", "arm_config", "main", "median_row", "ratios", "row", "run_bench"]
