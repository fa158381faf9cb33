"""Set-up time by phase: the default config as a user starts it, and launch to round 0 on an existing
Ray cluster, read from each run's setup_done event (phases_s, setup_s, process_to_round0_s).

    python benchmarks/startup.py --arms default [--reps 3] [--out DIR]
    python benchmarks/startup.py [--reps 3] [--regions 4] [--arms cold warm] [--out DIR]

default: `geofed run --set run.rounds=1 --no-report --quiet` of the default config (configs/local-wan.yaml:
4 regions, the proxy WAN emulator, mutual TLS, link probes), each run starting and stopping its own
Ray as `geofed run` does; prints every run's phases, then the median of each phase with min - max:
wall seconds, the driver's CPU seconds (setup_done's phases_cpu_s), and the CPU seconds every process
under the run spent up to round 0 (the driver, Ray's own processes, the region actors: /proc sampled
while it sets up). On a shared host the wall times say how busy the others were; the CPU seconds
what set-up costs (over 2 cores, half the CPU total is the least wall time it can take).

Starts one Ray head of its own (`ray start --head --temp-dir DIR`, so no other session joins it),
runs the arms interleaved (cold: the default, every run starts its actors; warm: ray.warm_pool_s
60, the actors of the run before are reused: each warm run follows an uncounted one that fills the
pool, since a cold run ends the idle pooled actors), prints each run's set-up phases and a table of medians, and ends the processes it
started, by pid. Every run: configs/bench-wan-digits.yaml, 2 rounds of 20 steps, no emulation.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Token auth, as geofed's launch plans use it: the head and every driver read this bench's own
# token (written in main(), under the head's temp dir), so a machine without ~/.ray/auth_token runs it.
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
BIN = Path(sys.executable).parent
NAMES = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1", "ap-southeast-2", "sa-east-1"]


def ray_pids(temp_dir: str) -> list[int]:
    """The processes of our Ray head: those whose command line names its temp dir (or the
    session under it), plus their worker processes (children of our raylet)."""
    mine: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmd:
            mine.add(int(proc.name))
    children = True
    while children:
        children = False
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in mine:
                continue
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid in mine:
                mine.add(int(proc.name))
                children = True
    return sorted(mine)


def start_head(temp_dir: str) -> str:
    port = 36000 + os.getpid() % 2000
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--num-cpus", "2", "--disable-usage-stats",
                    "--include-dashboard", "false", "--port", str(port), "--temp-dir", temp_dir],
                   check=True, capture_output=True, env=ENV)
    return f"127.0.0.1:{port}"


def one_run(address: str, out: Path, regions: int, warm_s: float) -> dict:
    names = json.dumps(NAMES[:regions])
    # RAY_ADDRESS, not --address: one node carries no region labels, and --address pins regions to them.
    cmd = [str(BIN / "geofed"), "run", str(REPO / "configs/bench-wan-digits.yaml"),
           "--out", str(out), "--quiet", "--no-report", "--set", f"regions.names={names}",
           "--set", "run.rounds=2", "--set", "run.max_steps=40", "--set", "sync.policy.initial_H=20",
           "--set", "sync.policy.H_min=20", "--set", "network.emulation.mode=none",
           "--set", "network.probe_s=0", "--set", "ray.num_cpus=null", "--set", "regions.num_cpus=0.25"]
    if warm_s:
        cmd += ["--set", f"ray.warm_pool_s={warm_s:g}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**ENV, "RAY_ADDRESS": address})
    if proc.returncode:
        raise RuntimeError(f"geofed run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    total = time.monotonic() - t0
    ev = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    done = next(e for e in ev if e["event"] == "setup_done")
    started = next(e for e in ev if e["event"] == "started")
    pids = sorted(r["pid"] for r in started["regions"].values())
    start = [r.get("start") for r in started["regions"].values()]
    return {"round0_s": done["process_to_round0_s"], "setup_s": done["setup_s"], "phases": done["phases_s"],
            "total_s": round(total, 2), "pids": pids, "start": start}


def _descendants_cpu(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds so far) of `root` and every process below it (Ray's gcs_server,
    raylet, agents and workers are the driver's descendants when it starts its own Ray)."""
    hz = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    cpu: dict[int, tuple[str, float]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            head, rest = (proc / "stat").read_text().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        f = rest.split()
        try:  # Ray retitles its processes (ray::IDLE, ray::DashboardAgent): the command line, not the 15-char comm
            name = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")[:60]
        except OSError:
            name = head.split("(", 1)[-1]
        kids.setdefault(int(f[1]), []).append(int(proc.name))
        cpu[int(proc.name)] = (name, (int(f[11]) + int(f[12])) / hz)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in cpu:
            out[pid] = cpu[pid]
        todo.extend(kids.get(pid, []))
    return out


def _process_kind(name: str, pid: int, actors: set[int], driver: int) -> str:
    if pid == driver:
        return "driver (geofed run)"
    if pid in actors:
        return "region actors"
    if name.startswith("ray::") and "Agent" not in name:
        return "other Ray workers (idle, prestarted)"
    return "Ray's own processes (gcs, raylet, dashboard, agents, monitors)"


def default_run(out: Path) -> dict:
    """One `geofed run` of the default config, one round: its own Ray, as a user's first command.
    While it sets up, /proc is sampled every 0.25 s for the CPU of every process under it, so the
    CPU spent up to round 0 is known per process, not only the driver's (setup_done) and the actors'."""
    cmd = [str(BIN / "geofed"), "run", "--out", str(out), "--quiet", "--no-report", "--set", "run.rounds=1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"}
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: dict[int, tuple[str, float]] = {}
    events = out / "events.jsonl"
    # Until round 0: the last CPU reading of each process (one that ended keeps its last one).
    while proc.poll() is None and not (events.is_file() and '"setup_done"' in events.read_text()):
        seen.update(_descendants_cpu(proc.pid))
        time.sleep(0.25)
    seen.update(_descendants_cpu(proc.pid))
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError("geofed run did not end within 600 s") from None
    if proc.returncode:
        raise RuntimeError(f"geofed run failed ({proc.returncode}): {stderr[-3000:]}")
    ev = [json.loads(x) for x in events.read_text().splitlines()]
    done = next(e for e in ev if e["event"] == "setup_done")
    started = next(e for e in ev if e["event"] == "started")["regions"].values()
    # Where the actors phase goes, per actor: process start to __init__ (Python, Ray's worker, the
    # imports: torch) and __init__ itself (task, model, optimizers: torch._dynamo, gRPC server).
    starts = [r["start"] for r in started if r.get("start")]
    actors = {r["pid"] for r in started}
    by_kind: dict[str, float] = {}
    for pid, (name, cpu) in seen.items():
        kind = _process_kind(name, pid, actors, proc.pid)
        by_kind[kind] = by_kind.get(kind, 0.0) + cpu
    return {"round0_s": done["process_to_round0_s"], "setup_s": done["setup_s"], "phases": done["phases_s"],
            "phases_cpu": done.get("phases_cpu_s") or {}, "total_s": round(time.monotonic() - t0, 2), "load": load,
            "actor_process_s": statistics.median(s["process_s"] for s in starts if s.get("process_s") is not None),
            "actor_init_s": statistics.median(s["init_s"] for s in starts),
            "actor_cpu_s": statistics.median(s.get("cpu_s", float("nan")) for s in starts),
            "cpu_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items())},
            "cpu_to_round0": round(sum(by_kind.values()), 2), "nproc": len(seen)}


def phase_table(runs: list[dict]) -> None:
    """Median and min - max of every phase (wall, and the driver's CPU), of each kind of
    process's CPU up to round 0, set-up and launch to round 0, over `runs`."""
    def cell(ts: list[float]) -> str:
        return f"{statistics.median(ts):.2f} s ({min(ts):.2f} - {max(ts):.2f})"

    rows = {name: ([r["phases"].get(name, 0.0) for r in runs], [r["phases_cpu"].get(name, 0.0) for r in runs])
            for name in runs[0]["phases"]}
    rows["  of actors: an actor's process start -> __init__ (median of 4)"] = ([r["actor_process_s"] for r in runs], None)
    rows["  of actors: an actor's __init__ (median of 4)"] = ([r["actor_init_s"] for r in runs], None)
    rows["set-up (setup_s)"] = ([r["setup_s"] for r in runs], [sum(r["phases_cpu"].values()) for r in runs])
    rows["launch -> round 0"] = ([r["round0_s"] for r in runs], None)
    rows["whole command (1 round)"] = ([r["total_s"] for r in runs], None)
    loads = [r["load"] for r in runs]
    print(f"\n{len(runs)} runs; load average (1 min) at each run's start {min(loads):.1f} - {max(loads):.1f}, now "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min)\n")
    print("| phase | wall, median (min - max) | driver CPU, median (min - max) |")
    print("| --- | --- | --- |")
    for name, (wall, cpu) in rows.items():
        print(f"| {name} | {cell(wall)} | {cell(cpu) if cpu else ''} |")
    print("\nCPU seconds up to round 0, by process (sampled from /proc every 0.25 s):\n")
    print("| processes | CPU, median (min - max) |")
    print("| --- | --- |")
    kinds = sorted({k for r in runs for k in r["cpu_by_kind"]})
    for kind in kinds:
        print(f"| {kind} | {cell([r['cpu_by_kind'].get(kind, 0.0) for r in runs])} |")
    print(f"|   one region actor, from its process start to the end of __init__ (median of 4) | "
          f"{cell([r['actor_cpu_s'] for r in runs])} |")
    print(f"| all | {cell([r['cpu_to_round0'] for r in runs])} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--regions", type=int, default=4)
    ap.add_argument("--arms", nargs="+", default=["cold", "warm"], choices=["default", "cold", "warm"],
                    help="default: the default config on its own Ray (not with cold/warm); cold/warm: an existing cluster")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="geofed-startup-"))
    if "default" in args.arms:
        if len(args.arms) > 1:
            ap.error("--arms: default runs alone (it starts its own Ray each run)")
        runs = []
        for rep in range(args.reps):
            try:
                r = default_run(out / f"default-{rep}")
            except RuntimeError as exc:  # e.g. Ray's own start timing out on a starved host: say so, go on
                print(f"default {rep}  failed: {str(exc).strip().splitlines()[-1]}", flush=True)
                continue
            runs.append(r)
            print(f"default {rep}  load {r['load']:.1f}  set-up {r['setup_s']:.2f}s  launch->round0 {r['round0_s']:.2f}s  "
                  f"phases {r['phases']}  driver CPU {r['phases_cpu']}  actor process {r['actor_process_s']:.2f}s "
                  f"init {r['actor_init_s']:.2f}s cpu {r['actor_cpu_s']:.2f}s  CPU to round 0 {r['cpu_to_round0']:.2f}s "
                  f"{r['cpu_by_kind']} ({r['nproc']} processes)", flush=True)
        if not runs:
            return 1
        phase_table(runs)
        return 0
    temp_dir = tempfile.mkdtemp(prefix="gfst", dir="/tmp")
    token = Path(temp_dir) / "auth_token"
    token.write_text(secrets.token_hex(24))
    token.chmod(0o600)
    ENV["RAY_AUTH_TOKEN_PATH"] = str(token)
    address = start_head(temp_dir)
    results: dict[str, list[dict]] = {a: [] for a in args.arms}
    try:
        for rep in range(args.reps):
            for arm in args.arms:
                if arm == "warm":  # fills the pool (a cold run ends idle pooled actors): not counted
                    r = one_run(address, out / f"fill-{rep}", args.regions, 60)
                    print(f"fill  {rep}  {r['round0_s']:.2f}s phases {r['phases']} pids {r['pids']}", flush=True)
                r = one_run(address, out / f"{arm}-{rep}", args.regions, 60 if arm == "warm" else 0)
                results[arm].append(r)
                print(f"{arm:5} {rep}  {r['round0_s']:.2f}s (set-up {r['setup_s']:.2f}s) phases {r['phases']} "
                      f"pids {r['pids']} start {r['start']}", flush=True)
    finally:
        for pid in ray_pids(temp_dir):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(2)
        for pid in ray_pids(temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print("\n| arm | launch -> round 0 (median) | min - max | set-up (median) | actors phase (median) |")
    print("| --- | --- | --- | --- | --- |")
    for arm, rs in results.items():
        t = [r["round0_s"] for r in rs]
        print(f"| {arm} | {statistics.median(t):.2f} s | {min(t):.2f} - {max(t):.2f} s | "
              f"{statistics.median(r['setup_s'] for r in rs):.2f} s | "
              f"{statistics.median(r['phases']['actors'] for r in rs):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
