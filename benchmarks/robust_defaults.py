"""What each aggregation default costs and what it keeps under one hostile member (issue 36, N4).

Four real Regions (digits MLP, DiLoCo over the full topology) in this process over the
in-memory transport (the gRPC transport's twin: same mailbox, admission, exchanger and mix), one of
them hostile by benchmarks/bench/adversary.py's hooks. For each aggregation setting and attack it prints the
honest regions' final accuracy (the synchronised model of region a), the lowest accuracy after
round 3 (a dip), the wall time and the updates clipped / refused by the honest regions.

Settings: ``old`` (clip at 10x a window's median on arrival: security.clip_multiple 0, the default
before issue 36), ``fair`` (clip at the round's median norm at the mix: clip_multiple 1, the
default now), ``trimmed`` (security.robust_aggregation trimmed-mean).

    python benchmarks/robust_defaults.py [--rounds 20] [--H 50] [--reps 2] [--settings old,fair,trimmed]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from geofed.bench.adversary import Adversary
from geofed.orchestrator.config import config_from_mapping
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions.messages import RoundPlan
from geofed.regions.region import Region

REGIONS = ["a", "b", "c", "d"]  # d turns hostile
SETTINGS = {"old": {"robust_aggregation": "clip", "clip_multiple": 0.0},
            "fair": {"robust_aggregation": "clip", "clip_multiple": 1.0},
            "trimmed": {"robust_aggregation": "trimmed-mean"}}
ATTACKS = {"none": None,
           "flip_bound": Adversary(kind="bound", factor=-1.0),  # sign-flipped at norm_multiple x its median norm
           "x-1000": Adversary(kind="scale", factor=-1000.0),
           "x-9": Adversary(kind="scale", factor=-9.0),
           "x+9": Adversary(kind="scale", factor=9.0)}


def _cfg(security: dict, seed: int):
    return config_from_mapping({
        "run": {"name": "robust-defaults", "seed": seed},
        "task": {"kind": "mlp-digits", "hidden": 64},
        "regions": {"names": REGIONS},
        "network": {"emulation": {"mode": "none"}},
        "compression": {"codec": "fp16"},
        "security": security,
        "sync": {"policy": {"kind": "fixed", "H": 50}, "inner": {"lr": 0.003},
                 "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
                 "deadline": {"initial_s": 5.0, "min_s": 1.0, "max_s": 10.0}},
    })


def run_one(setting: str, attack: str, *, rounds: int, H: int, seed: int) -> dict:
    """One run: the honest regions' accuracies by round, wall time, clipped and refused counts."""
    cfg = _cfg(SETTINGS[setting], seed)
    hub = InMemoryHub()
    with tempfile.TemporaryDirectory() as tmp:
        workers = {r: Region(cfg, r, Path(tmp), transport=InMemoryTransport(r, hub),
                                   plugin=ATTACKS[attack] if r == "d" else None) for r in REGIONS}
        for w in workers.values():
            w.start()
        for w in workers.values():
            w.connect({r: "inmem" for r in REGIONS})
        accs, clipped, refused = [], 0, 0
        t0 = time.monotonic()
        try:
            with ThreadPoolExecutor(len(REGIONS)) as pool:
                for r in range(rounds):
                    plan = RoundPlan(round=r, H=H)
                    res = dict(zip(REGIONS, pool.map(lambda reg, p=plan: workers[reg].run_round(p), REGIONS)))
                    for reg in ("a", "b", "c"):
                        clipped += sum(res[reg].security.clipped.values())
                        refused += sum(res[reg].security.refusals.values())
                    accs.append(workers["a"].evaluate_synced()["value"])
            wall = time.monotonic() - t0
        finally:
            for w in workers.values():
                w.close()
    return {"setting": setting, "attack": attack, "seed": seed, "final": accs[-1], "min_after_3": min(accs[3:]),
            "wall_s": round(wall, 2), "clipped": clipped, "refused": refused,
            "round_to_0.95": next((i for i, a in enumerate(accs) if a >= 0.95), None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--json", action="store_true", help="one JSON line per run")
    args = ap.parse_args(argv)
    settings, attacks = args.settings.split(","), args.attacks.split(",")
    rows = []
    for rep in range(args.reps):  # interleaved: every setting and attack once per repetition
        for attack in attacks:
            for setting in settings:
                row = run_one(setting, attack, rounds=args.rounds, H=args.H, seed=rep)
                rows.append(row)
                print(json.dumps(row) if args.json else
                      f"rep {rep} {attack:10s} {setting:8s} final {row['final']:.4f} min>r3 {row['min_after_3']:.4f} "
                      f"r95 {row['round_to_0.95']} wall {row['wall_s']:.1f}s clipped {row['clipped']} "
                      f"refused {row['refused']}", flush=True)
    print("\nmedians over repetitions (final accuracy / lowest after round 3 / wall s / clipped / refused)",
          file=sys.stderr)
    for attack in attacks:
        cells = []
        for setting in settings:
            rs = [r for r in rows if r["attack"] == attack and r["setting"] == setting]
            cells.append(f"{setting} {statistics.median(r['final'] for r in rs):.3f} / "
                         f"{statistics.median(r['min_after_3'] for r in rs):.3f} / "
                         f"{statistics.median(r['wall_s'] for r in rs):.1f} / "
                         f"{statistics.median(r['clipped'] for r in rs):g} / {statistics.median(r['refused'] for r in rs):g}")
        print(f"{attack:10s} " + " | ".join(cells), file=sys.stderr)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
