"""`geofed bench hetero` of two commits, cell by cell, each old run and its new run back to back.

    python benchmarks/hetero_paired.py OLD NEW [--reps 3] [--cells equal/barrier,slow/barrier] [--out DIR]
    python benchmarks/hetero_paired.py --compare DIR

The bench's ratios divide one arm's time to target by another's, measured a minute apart; on a
shared 2-core host the step time of the same arm moves 2-4x between such minutes, so two commits'
ratios differ by more than any code change explains. Here every (scenario, arm) cell runs at OLD
and at NEW one right after the other (the order alternating), so both see the same host. Each run
is the bench's own: its `arm_config` and `run_to_end` from the commit under test, in a process of
its own with its own local Ray, the commit's tree first on PYTHONPATH (made with `git archive` under
DIR/trees; the `geofed` namespace is linked to its folders). Rows go to DIR/rows.jsonl as they
finish; `--compare DIR` prints each commit's ratios (the bench's `document`) and, per cell, the
new/old ratio of time to target, steps to target and training wall time, median [min-max].
The commits must have the bench at `geofed.bench` (benchmarks/bench) or `geofed.orchestrator.bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOMS = ("orchestrator", "regions", "p2p", "compression", "configs")
ALL_CELLS = [f"{s}/{a}" for s in ("equal", "slow", "flaky") for a in ("barrier", "drop", "time-budget", "quorum")]


def tree(repo: Path, commit: str, out: Path) -> Path:
    """A `geofed` namespace for `commit`: its files under out/trees/<commit>/src, linked as geofed.<room>."""
    src, ns = out / "trees" / commit / "src", out / "trees" / commit / "ns" / "geofed"
    if not src.is_dir():
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(repo), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    ns.mkdir(parents=True, exist_ok=True)
    for room in ROOMS:
        (ns / room).unlink(missing_ok=True)
        (ns / room).symlink_to(src / room)
    if (src / "benchmarks" / "bench").is_dir():
        (ns / "bench").unlink(missing_ok=True)
        (ns / "bench").symlink_to(src / "benchmarks" / "bench")
    return ns.parent


def run_cell(cell: str, commit: str, rep: int, out: Path) -> None:
    """One run (this process's imports come from the commit's tree); appends its row."""
    try:  # before the bench moved to benchmarks/
        from geofed.orchestrator.bench import hetero as bench
        from geofed.orchestrator.bench.hetero_results import measure
        from geofed.orchestrator.bench.runs import bench_ray, run_to_end
    except ImportError:
        from geofed.bench import hetero as bench
        from geofed.bench.hetero_results import measure
        from geofed.bench.runs import bench_ray, run_to_end
    scenario, arm = cell.split("/")
    cfg = bench.arm_config(bench.Cell(scenario, arm), quick=False)
    with bench_ray(cfg):
        run_dir, _ = run_to_end(cfg, out / f"rep{rep}" / commit / scenario / arm, source="bench hetero")
    base = bench.BASES["digits"]
    row = {"rep": rep, "commit": commit, "scenario": scenario, "arm": arm, "bench": bench.__file__,
           **measure(run_dir, target=base.target, higher_is_better=base.higher_is_better,
                     slow=[bench.SLOW_REGION] if scenario == "slow" else [])}
    with (out / "rows.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def campaign(repo: Path, old: str, new: str, cells: list[str], reps: int, out: Path) -> None:
    paths = {c: tree(repo, c, out) for c in (old, new)}
    k, total = 0, len(cells) * reps * 2
    for rep in range(reps):
        for cell in cells:
            for commit in ((old, new) if (rep * len(cells) + cells.index(cell)) % 2 == 0 else (new, old)):
                env = {**os.environ, "PYTHONPATH": str(paths[commit])}
                t0 = time.monotonic()
                done = subprocess.run([sys.executable, __file__, "--cell", cell, "--commit", commit, "--rep", str(rep),
                                       "--out", str(out)], env=env, cwd=out, timeout=900,
                                      stdout=subprocess.DEVNULL, stderr=(out / "runs.log").open("a"))
                k += 1
                load = os.getloadavg()[0]
                print(f"[{k}/{total}] rep {rep} {cell} {commit}: rc {done.returncode}, "
                      f"{time.monotonic() - t0:.0f} s, load {load:.1f}", file=sys.stderr, flush=True)


def _f(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]" if xs else "-"


def compare(out: Path) -> None:
    from geofed.bench.hetero import TARGETS
    from geofed.bench.hetero_results import document

    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    old, new = sorted({r["commit"] for r in rows}, key=[r["commit"] for r in rows].index)[:2]
    docs = {c: document([r for r in rows if r["commit"] == c], reps=0, quick=False, targets=TARGETS) for c in (old, new)}
    print(f"| ratio | target | before {old} | after {new} | after's median |\n| --- | --- | --- | --- | --- |")
    for k in ("slow_barrier_vs_equal", "slow_best_vs_equal", "flaky_best_vs_equal", "flaky_barrier_vs_equal",
              "slow_best_metric_delta", "slow_fast_idle_fraction", "slow_least_idle_fraction"):
        got = {c: (docs[c]["ratios"][k], docs[c]["spread"].get(k)) for c in (old, new)}
        (_, s), (v, _) = got[old], got[new]
        where = "-" if not s or v is None else "inside" if s["min"] <= v <= s["max"] else "above" if v > s["max"] else "below"
        cols = [f"{m} [{sp['min']}-{sp['max']}]" if sp else str(m) for m, sp in got.values()]
        print(f"| `{k}` | {TARGETS.get(k, '')} | {cols[0]} | {cols[1]} | {where} |")
    print(f"\nbest arms: before {docs[old]['best_arm']}, after {docs[new]['best_arm']}\n")
    cells: dict[tuple[str, str], dict[int, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        cells[(r["scenario"], r["arm"])][r["rep"]][r["commit"]] = r
    print("| cell | pairs | training wall new/old | time to target new/old | steps to target new/old | final metric before / after |")
    print("| --- | --- | --- | --- | --- | --- |")
    walls: list[float] = []
    for (scenario, arm), per in cells.items():
        pairs = [(p[old], p[new]) for p in per.values() if old in p and new in p]
        def ratio(key: str, pairs=pairs) -> list[float]:
            return [b[key] / a[key] for a, b in pairs if a[key] and b[key]]
        walls += ratio("wall_s")
        metric = [statistics.median(x[i]["final_metric"] for x in pairs) if pairs else None for i in (0, 1)]
        print(f"| {scenario}/{arm} | {len(pairs)} | {_f(ratio('wall_s'))} | {_f(ratio('time_to_target_s'))} | "
              f"{_f(ratio('steps_to_target'))} | {metric[0]} / {metric[1]} |")
    print(f"\nevery pair: training wall new/old {_f(walls)} over {len(walls)} pairs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", nargs="?")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cells", default=",".join(ALL_CELLS), help="comma-separated scenario/arm (default: all 12)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", metavar="DIR", help="print the tables of a finished (or partial) campaign")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    ap.add_argument("--commit", help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        return run_cell(args.cell, args.commit, args.rep, Path(args.out))
    if args.compare:
        return compare(Path(args.compare))
    if not (args.old and args.new):
        ap.error("give OLD and NEW commits, or --compare DIR")
    cells = args.cells.split(",")
    unknown = [c for c in cells if c not in ALL_CELLS]
    if unknown:
        ap.error(f"--cells: unknown {unknown}; choose from {ALL_CELLS}")
    out = Path(args.out or f"runs/hetero-paired-{args.old}-{args.new}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    campaign(Path(__file__).resolve().parent.parent, args.old, args.new, cells, args.reps, out)
    compare(out)


if __name__ == "__main__":
    main()
