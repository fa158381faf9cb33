"""The default run (`geofed run`) against the same model trained centrally on the same data.

    python benchmarks/default_vs_central.py [--seeds 3]

Central training sees the same number of examples: every region's inner steps (the policy's H,
round by round, from the run's summary), at the same batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from geofed.orchestrator.cli import main as geofed
from geofed.orchestrator.config import load_config
from geofed.regions.tasks import make_task
from geofed.bench.central import train_centrally


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    cfg = load_config()
    central, fed, util, wall = [], [], [], []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            assert geofed(["run", "--set", f"run.seed={seed}", "--out", str(out), "--no-report", "--quiet"]) == 0
            summary = json.loads((out / "summary.json").read_text())
        fed.append(summary["eval"]["value"])
        util.append(summary["compute_utilization"])
        wall.append(summary.get("setup_s", 0.0) + summary["wall_s"])
        steps = len(cfg.regions.names) * sum(h["H"] for h in summary["H_history"])
        task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=seed)
        central.append(train_centrally(task, steps=steps, lr=cfg.sync.inner.lr, seed=seed).value)
    print("| | accuracy (mean of seeds) | per seed |\n| --- | --- | --- |")
    print(f"| central, the same examples ({steps} steps in the last seed) | {100 * statistics.mean(central):.1f}% | {', '.join(f'{100 * v:.1f}' for v in central)} |")
    print(f"| geofed run (default config) | {100 * statistics.mean(fed):.1f}% | {', '.join(f'{100 * v:.1f}' for v in fed)} |")
    print(f"\ncompute utilisation {', '.join(f'{u:.2f}' for u in util)}; set-up + training {', '.join(f'{w:.0f} s' for w in wall)}")


if __name__ == "__main__":
    main()
