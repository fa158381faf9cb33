"""Many regions on one machine (regions.per_process, docs/many-regions.md): per-region bytes per round
and the driver's time per round as the number of regions grows, through the real transport (mutual-TLS
gRPC through the proxy WAN emulator), one `geofed run` per size and topology.

    python benchmarks/many_regions.py [--sizes 8 16 32 64] [--processes 4]
        [--topologies exponential one-peer-exponential] [--rounds 4] [--H 20] [--out DIR]

Each run: the default config (configs/local-wan.yaml: the MLP on digits, DiLoCo with overlap, fp16,
the AWS-shaped emulated links) with N regions named r00..r{N-1} packed into --processes processes
(regions.per_process N / processes), a fixed H (every region computes as much each round, whatever
N), no link probes (they measure every pair: N(N-1) links) and no report. Read from each run
directory: a region's bytes sent a round (metrics.jsonl: every region's bytes over the run, over
regions x rounds), the same per out-neighbour (the topology's out-degree, codecs of a report), the round's wall time on the driver (rounds.jsonl,
t_end - t_start, median over rounds from 1), and the driver's CPU seconds per round (the `geofed
run` process's CPU, less its set-up's: setup_done's process_cpu_s, over the rounds). Each run
starts and stops its own Ray, as `geofed run` does. Prints one row per run, then a JSON line of them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(n: int, processes: int, topology: str, rounds: int, H: int, out: Path) -> dict:
    """One `geofed run` of `n` regions; its row."""
    names = ",".join(f"r{i:02d}" for i in range(n))
    per_process = max(1, -(-n // processes))
    run_dir = out / f"{topology}-{n}"
    cmd = [str(BIN / "geofed"), "run", "--out", str(run_dir), "--no-report", "--quiet",
           "--set", f"regions.names=[{names}]", "--set", f"regions.per_process={per_process}",
           "--set", f"sync.topology={topology}", "--set", "network.probe_s=0",
           "--set", "sync.policy.kind=fixed", "--set", f"sync.policy.H={H}",
           "--set", f"run.rounds={rounds}", "--set", f"run.eval_every={rounds}",
           "--set", "regions.start_timeout_s=600"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{topology} {n} regions: geofed run exited {proc.returncode}\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    events = _read_jsonl(run_dir / "events.jsonl")
    setup = next(e for e in events if e.get("event") == "setup_done")
    started = next(e for e in events if e.get("event") == "started")
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    rounds_ = [r for r in _read_jsonl(run_dir / "rounds.jsonl") if r["round"] >= 1]
    # With overlap a round's update leaves during the next round (none in round 0) and the last
    # one with the run's flush (two in the last round): a round's bytes are the run's over its rounds.
    sent = sum(m["bytes_sent"] for m in metrics) / (n * rounds)
    peers = statistics.mean(len(m["codecs"]) for m in metrics)
    return {"topology": topology, "regions": n, "per_process": per_process,
            "processes": len({r["pid"] for r in started["regions"].values()}),
            "bytes_per_region_round": round(sent),
            "bytes_per_out_neighbour": round(sent / peers),
            "out_neighbours": round(peers, 2),
            "round_wall_s": round(statistics.median(r["t_end"] - r["t_start"] for r in rounds_), 2),
            "driver_cpu_s_per_round": round((cpu - setup["process_cpu_s"]) / max(1, rounds), 2),
            "setup_s": round(setup["setup_s"], 1), "wall_s": round(wall, 1),
            "peers_missing": sum(len(m["peers_missing"]) for m in metrics),
            "final_loss": rounds_[-1].get("mean_train_loss") if rounds_ else None,
            "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--processes", type=int, default=4, help="region processes of every run (default 4)")
    p.add_argument("--topologies", nargs="+", default=["exponential", "one-peer-exponential"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--H", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("runs/many-regions"))
    args = p.parse_args(argv)
    rows = []
    print(f"{'topology':22} {'N':>3} {'K':>3} {'procs':>5} {'B/region/round':>14} {'B/out-nbr':>9} {'nbrs':>5} "
          f"{'round s':>7} {'drv CPU/rnd':>11} {'setup s':>7} {'missed':>6} {'load':>5}", flush=True)
    for topology in args.topologies:
        for n in args.sizes:
            r = run_one(n, args.processes, topology, args.rounds, args.H, args.out)
            rows.append(r)
            print(f"{r['topology']:22} {r['regions']:>3} {r['per_process']:>3} {r['processes']:>5} "
                  f"{r['bytes_per_region_round']:>14} {r['bytes_per_out_neighbour']:>9} {r['out_neighbours']:>5} "
                  f"{r['round_wall_s']:>7} {r['driver_cpu_s_per_round']:>11} {r['setup_s']:>7} "
                  f"{r['peers_missing']:>6} {r['load']:>5.1f}", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
