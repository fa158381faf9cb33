"""Quality at equal examples of `geofed bench wan`'s sync variants, without the network: the held-out
loss of the synchronised model after N inner steps per region, for variants of configs/bench-wan.yaml.

    python benchmarks/wan_quality.py [--base char-lm|gpt] [--variants NAME,...] [--seeds 0,1] [--steps 800]
                                     [--evals 500] [--set KEY=VALUE ...] [--parallel 2] [--json]

Each variant runs the real Regions (sync algorithm, codecs with error feedback, fragments,
overlap) over the in-memory transport (regions/inprocess.py), with fixed-H plans: what `geofed bench wan`
runs minus the WAN, so only the algorithm moves the loss (a run repeats exactly for its seed). Each
variant is a fresh process; `--parallel` runs that many at once (each uses about one core: the regions'
steps take turns under one lock). Prints one row per variant and seed: the held-out loss at each
evaluation step and its ratio to per-step sync's of the same seed (the `allreduce` variant, always run).
docs/bench-wan.md ("Tuning the base") has the tables this prints.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

# name: (H per round, config overrides); H is each round's steps (with N fragments, H/N of the policy's H)
ALLREDUCE = (1, ["sync.algorithm=allreduce", "compression.codec=identity", "compression.error_feedback=false",
                 "compression.ladder=[]", "sync.overlap=false"])
VARIANTS: dict[str, tuple[int, list[str]]] = {
    "allreduce": ALLREDUCE,
    "serial-identity-H100": (100, ["sync.overlap=false", "compression.codec=identity", "compression.error_feedback=false"]),
    "serial-identity-H10": (10, ["sync.overlap=false", "compression.codec=identity", "compression.error_feedback=false"]),
    "serial-int3-H100": (100, ["sync.overlap=false"]),
    "delayed-identity-H100": (100, ["compression.codec=identity", "compression.error_feedback=false"]),
    "delayed-int3-H100": (100, []),
    "delayed-int3-H50": (50, []),
    "delayed-int3-H25": (25, []),
    "eager-int3-H100": (100, ["sync.overlap=eager"]),
    "frag3-eager-int3-H100": (34, ["sync.overlap=eager", "sync.fragments=3"]),
    "frag4-eager-int3-H100": (25, ["sync.overlap=eager", "sync.fragments=4"]),
    "frag4-delayed-int3-H100": (25, ["sync.fragments=4"]),
    "frag6-eager-int3-H100": (17, ["sync.overlap=eager", "sync.fragments=6"]),
    "frag8-eager-int3-H100": (13, ["sync.overlap=eager", "sync.fragments=8"]),
    "frag4-eager-int3-H132": (33, ["sync.overlap=eager", "sync.fragments=4"]),
    "frag4-eager-ternary-H100": (25, ["sync.overlap=eager", "sync.fragments=4", "compression.codec=ternary"]),
    "frag4-eager-ternary-H120": (30, ["sync.overlap=eager", "sync.fragments=4", "compression.codec=ternary"]),
    "frag4-eager-ternary-t0.5-H100": (25, ["sync.overlap=eager", "sync.fragments=4",
                                           "compression.codec=ternary(threshold=0.5)"]),
    "frag4-eager-ternary-t1.0-H100": (25, ["sync.overlap=eager", "sync.fragments=4",
                                           "compression.codec=ternary(threshold=1.0)"]),
    "frag4-eager-ternary-c256-H100": (25, ["sync.overlap=eager", "sync.fragments=4",
                                           "compression.codec=ternary(chunk=256)"]),
    "frag4-eager-sign-H100": (25, ["sync.overlap=eager", "sync.fragments=4", "compression.codec=sign"]),
    "frag4-eager-sparseloco5-H100": (25, ["sync.overlap=eager", "sync.fragments=4",
                                          "compression.codec=sparseloco(fraction=0.05)"]),
}
DEFAULT = ["delayed-int3-H100", "frag4-eager-int3-H100", "frag4-eager-ternary-H100"]

ONE_RUN = r'''
import json, sys, tempfile
import torch
torch.set_num_threads(1)
from geofed.bench.wan_arms import base_mapping
from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan

H, steps, evals, sets, config = json.loads(sys.argv[1])
base = base_mapping(config)
base["network"] = {"emulation": {"mode": "none"}}
base["sync"]["policy"] = {"kind": "fixed", "H": H}
cfg = config_from_mapping(base, sets, source="benchmarks/wan_quality.py")
regions = list(cfg.regions.names)
out = {}
with tempfile.TemporaryDirectory() as d, InProcessRegions(cfg, d) as c:
    done, r, stops = 0, 0, sorted({*evals, steps})
    while done < steps:
        h = min(H, min(s for s in stops if s > done) - done)
        at = done + h in stops  # a round that ends on an evaluation step: flushed and evaluated there
        res = c.run_round({g: RoundPlan(round=r, H=h, final=at, evaluate=at) for g in regions})
        done, r = done + h, r + 1
        if at:
            out[done] = next(m.evaluation.eval["value"] for m in res.values() if m.evaluation.eval is not None)
print(json.dumps(out))
'''


def run_variant(name: str, seed: int, steps: int, evals: list[int], extra: list[str],
                config: str = "bench-wan.yaml") -> dict[str, float]:
    H, sets = VARIANTS[name]
    arg = json.dumps([H, steps, evals, [*sets, *extra, f"run.seed={seed}"], config])
    proc = subprocess.run([sys.executable, "-c", ONE_RUN, arg], capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"wan_quality: variant {name} seed {seed} failed:\n{proc.stderr[-2000:]}")
    out = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    print(f"wan_quality: {name} seed {seed}: " + ", ".join(f"{v:.4f} at {k}" for k, v in sorted(out.items())),
          file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", choices=("char-lm", "gpt"), default="char-lm",
                   help="configs/bench-wan.yaml (char-lm) or configs/bench-wan-gpt.yaml (gpt)")
    p.add_argument("--variants", default=",".join(DEFAULT), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0", help="comma-separated run.seed values (default 0)")
    p.add_argument("--steps", type=int, default=800, help="inner steps per region (default 800: per-step sync's in the bench)")
    p.add_argument("--evals", default="", help="also evaluate at these steps, comma-separated")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key in every variant, e.g. sync.inner.lr=0.003 (the tuning sweep)")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    names = ["allreduce", *[v for v in a.variants.split(",") if v and v != "allreduce"]]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    seeds = [int(s) for s in a.seeds.split(",")]
    evals = sorted({int(e) for e in a.evals.split(",") if e} | {a.steps})
    jobs = [(n, s) for s in seeds for n in names]
    with ThreadPoolExecutor(max(1, a.parallel)) as pool:
        config = "bench-wan.yaml" if a.base == "char-lm" else "bench-wan-gpt.yaml"
        results = dict(zip(jobs, pool.map(lambda j: run_variant(j[0], j[1], a.steps, evals, a.sets, config), jobs)))
    rows = [{"variant": n, "seed": s, "held_out": results[(n, s)],
             "vs_allreduce": {k: round(v / results[("allreduce", s)][k], 4) for k, v in results[(n, s)].items()}}
            for n, s in jobs]
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'variant':32s} seed  " + "  ".join(f"held-out@{e:<5d} ratio " for e in evals))
    for row in rows:
        print(f"{row['variant']:32s} {row['seed']:4d}  " + "  ".join(
            f"{row['held_out'][e]:.4f}        {row['vs_allreduce'][e]:.4f}" for e in evals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
