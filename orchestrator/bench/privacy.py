"""`geofed bench privacy`: what differential privacy costs on the real stack (issue 22).

    geofed bench privacy [--quick] [--rounds N] [--json] [--out DIR] [--emulation none|proxy]

Every arm is a real `geofed run` (Ray actors, mutual-TLS gRPC; with --emulation proxy the proxy
WAN emulator with the AWS preset) of 4 regions training the digits MLP with DiLoCo:

* ``plain``: no DP;
* ``dp_eps1``, ``dp_eps4``, ``dp_eps8``: record-level DP-SGD (privacy.dp.mode record, clip 1,
  delta 1e-5), the noise chosen by the accountant so the planned rounds end at that epsilon.

Reported per arm: accuracy, epsilon spent, noise multiplier, bytes sent, wall time; ratio
``dp_eps8_acc_ratio`` (issue target >= 0.95). A skeleton: the secure-aggregation arms (plain
secagg, secagg with a region dropping) and Cora come once secure aggregation is in the round
loop (docs/privacy.md, Integration).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..config import config_from_mapping

REGIONS = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1"]
ARMS: dict[str, float | None] = {"plain": None, "dp_eps1": 1.0, "dp_eps4": 4.0, "dp_eps8": 8.0}
TARGETS = {"dp_eps8_acc_ratio": 0.95}


def arm_config(epsilon: float | None, *, rounds: int, H: int, emulation: str):
    """The run config of one arm (the settings of docs/privacy.md's measured table)."""
    dp = {"mode": "off"} if epsilon is None else {"mode": "record", "clip": 1.0, "target_epsilon": epsilon,
                                                  "delta": 1e-5, "on_target": "stop"}
    net = {"mode": "none"} if emulation == "none" else {"mode": "proxy", "preset": "aws", "bandwidth_scale": 0.2}
    return config_from_mapping({
        "run": {"name": "bench-privacy", "rounds": rounds, "seed": 0, "eval_every": 0, "checkpoint_every": 0,
                "report": False},
        "task": {"kind": "mlp-digits", "hidden": 64, "partition": "iid"},
        "regions": {"names": REGIONS, "num_cpus": 0.5},
        "network": {"emulation": net},
        "sync": {"policy": {"kind": "fixed", "H": H}, "inner": {"kind": "adamw", "lr": 0.003, "batch_size": 32},
                 "outer": {"lr": 0.7, "momentum": 0.9}},
        "privacy": {"dp": dp},
    })


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="geofed bench privacy", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 rounds of H 20 (a smoke run, not the measurement)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--H", type=int, default=50)
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
    out = Path(args.out or f"runs/bench-privacy-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}")
    from ..driver.cluster import PlacementError
    from ..driver.recovery import RunFailed

    try:
        doc = run_bench(out, rounds=rounds, H=H, emulation=args.emulation)
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


def run_bench(out: Path, *, rounds: int, H: int, emulation: str) -> dict[str, Any]:
    """Every arm once, in order; returns the JSON document (also out/bench.json)."""
    from ..driver.rundir import new_run_dir
    from ..driver.runner import Runner, prepare_task

    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    for name, epsilon in ARMS.items():
        cfg = prepare_task(arm_config(epsilon, rounds=rounds, H=H, emulation=emulation), source="bench privacy")
        runner = Runner(cfg, new_run_dir(cfg, str(out / name)), show_progress=False)
        try:
            summary = runner.run()
        finally:
            runner.shutdown()
        rows[name] = row(summary)
        print(f"geofed bench privacy: {name}: {rows[name]}", file=sys.stderr, flush=True)
    doc = {"rounds": rounds, "H": H, "emulation": emulation, "arms": rows, "ratios": ratios(rows),
           "targets": TARGETS}
    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    return doc


def row(summary: dict[str, Any]) -> dict[str, Any]:
    """One arm's numbers from its summary.json."""
    p = summary.get("privacy") or {}
    return {"accuracy": round(summary["eval"]["value"], 4) if summary.get("eval") else None,
            "epsilon": None if p.get("epsilon") is None else round(p["epsilon"], 3),
            "noise_multiplier": None if not p else round(p["noise_multiplier"], 3),
            "rounds": summary["rounds"], "bytes_sent": summary["bytes_sent"], "wall_s": summary["wall_s"]}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """dp_eps8_acc_ratio: accuracy at epsilon 8 over the plain run's."""
    plain, eps8 = rows.get("plain", {}).get("accuracy"), rows.get("dp_eps8", {}).get("accuracy")
    return {"dp_eps8_acc_ratio": round(eps8 / plain, 4) if plain and eps8 is not None else None}


__all__ = ["ARMS", "arm_config", "main", "ratios", "row", "run_bench"]
