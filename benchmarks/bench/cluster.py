"""`geofed bench cluster`: geofed's arms to a time-to-target on a real multi-node Ray cluster over shaped links.

    geofed bench cluster [--seeds K] [--arms A ...] [--json] [--out DIR]

Brings up one Ray node per region, each in its own network namespace with a tbf-shaped egress
(``--egress-mbps``, shared by all the region's flows) and ``--latency-ms`` one way on every path
(netns_cluster.ShapedCluster; needs root and iproute2), then runs every arm (bench_cluster_arms)
as `geofed run --address` from the head's namespace, seed by seed with the arms interleaved, and
prints the median time to the target and MB per region with the seeds' range. Each run's link
report (estimates against the true rates, H against the H of the true rates, geofed's bytes
against the wire's, Ray's bytes between regions) goes into ``--out``/bench.json.
docs/bench-cluster.md has the set-up and measured tables.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .cluster_arms import (
    ARMS,
    REGIONS,
    Target,
    arm_mapping,
    common_mapping,
    reached,
    spread,
    target_supported,
    write_config,
)
from geofed.orchestrator.config import config_from_mapping

PROBE_ROUNDS = 3


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The shaped cluster of one bench: the regions, each region's egress, the one-way latency, namespace prefix,
    CPUs per node."""

    regions: tuple[str, ...] = REGIONS
    egress_mbps: float = 50.0      # each region's egress (tbf, IP bytes), shared by all its flows
    latency_ms: float = 40.0       # one way, every path
    prefix: str = "gfc"            # namespace names: <prefix><run id>-<i> (`geofed net cleanup --prefix`)
    node_cpus: int = 1             # `ray start --num-cpus` of each node (one region actor each)


def start_cluster(spec: ClusterSpec, mapping: dict[str, Any]):
    """The launch plan of `mapping` brought up on shaped namespaces (a started ShapedCluster)."""
    from .hub import RegionLinks

    from geofed.orchestrator.launch.plan import build_plan
    from .netns_cluster import ShapedCluster

    plan = build_plan(config_from_mapping(copy.deepcopy(mapping), source="bench cluster"))
    links = RegionLinks.uniform(spec.regions, egress_mbps=spec.egress_mbps, latency_ms=spec.latency_ms)
    return ShapedCluster(plan, links, prefix=spec.prefix, num_cpus=spec.node_cpus).start()


def probe_links(cluster, payload_bytes: int) -> dict[str, Any]:
    """hub_probe on the cluster's namespaces: RTT, cold and warm pushes, the egress share (plain TCP)."""
    from .hub_probe import probe

    return probe(cluster.net, payload_bytes=payload_bytes, rounds=PROBE_ROUNDS, gap_s=0.5)


def link_truth(cluster, probed: dict[str, Any]):
    """What the shaped links really give (egress, payload efficiency, measured RTTs, plain TCP's warm push
    and bulk rates), from the set-up probe."""
    from .cluster_checks import LinkTruth

    push = {link: round(probed["payload_bytes"] * 8 / max(1e-6, s - probed["rtt_ms"][link] / 1e3) / 1e6, 3)
            for link, s in probed["warm_push_s"].items()}
    return LinkTruth(egress_mbps=cluster.net.links.egress_mbps[cluster.net.regions[0]],
                     payload_efficiency=cluster.net.payload_efficiency, rtt_ms=probed["rtt_ms"], push_mbps=push,
                     bulk_mbps=probed.get("bulk_mbps", {}))


def link_report(cluster, run, truth) -> dict[str, Any]:
    """Everything issue 14 asks of a run on real links (cluster_checks), as one JSON-able dict."""
    from . import cluster_checks as cc

    addresses = dict(cluster.net.addresses)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    return {"startup_s": run.startup_s, "process_to_round0_s": (summary.get("startup") or {}).get("process_to_round0_s"),
            "setup_phases_s": (summary.get("startup") or {}).get("phases_s"),
            "estimator": cc.estimator_check(run.run_dir, truth),
            "H": cc.replay_H(run.run_dir, truth), "bytes": cc.bytes_check(run, cluster.plan, addresses),
            "ray": cc.ray_check(run, cluster.plan, addresses), "first_push": cc.first_push(run.run_dir),
            "estimates_by_round": cc.estimates(run.run_dir)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed bench cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm (medians over them; default 3)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="arms to run (default: all)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (progress on stderr)")
    p.add_argument("--out", help="folder for configs, run directories and bench.json "
                                 "(default runs/bench-cluster-<UTC time>)")
    p.add_argument("--egress-mbps", type=float, default=50.0, help="each region's shaped egress (default 50)")
    p.add_argument("--latency-ms", type=float, default=40.0, help="one-way latency of every path (default 40)")
    p.add_argument("--target", type=float, default=0.95, help="held-out accuracy to reach (default 0.95)")
    p.add_argument("--max-steps", type=int, default=1500, help="inner steps per region at most (run.max_steps)")
    p.add_argument("--timeout-s", type=float, default=600, help="each run's limit")
    p.add_argument("--shards", action="store_true",
                   help="instead of the arms: the sharded exchange's wall time, 2 regions x 2 nodes against 1 node "
                        "a region (bench/cluster_shards.py; --seeds pairs)")
    p.add_argument("--hidden", type=int, default=3072,
                   help="--shards: the width of the MLP's two hidden layers (default 3072: 9.7M parameters)")
    return p


def main(argv: Sequence[str]) -> int:
    """`geofed bench cluster ARGS`; returns the exit code (2: no shaped cluster possible here or bad
    arguments, 1: a run failed, 130: interrupted).
    """
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    from geofed.p2p.wan.kernel import kernel_unavailable

    reason = kernel_unavailable()
    if reason:
        print(f"geofed bench cluster: the shaped cluster {reason}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("geofed bench cluster: --seeds must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-cluster-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}").resolve()
    spec = ClusterSpec(egress_mbps=args.egress_mbps, latency_ms=args.latency_ms)
    if args.shards:
        from .cluster_shards import print_shard_table, run_shard_bench

        def bench() -> dict:
            return run_shard_bench(out, seeds=args.seeds, egress_mbps=args.egress_mbps, latency_ms=args.latency_ms,
                                   hidden=args.hidden, timeout_s=min(args.timeout_s, 300))
        show = print_shard_table
    else:
        def bench() -> dict:
            return run_bench(spec, args.arms, args.seeds, out, target=Target(value=args.target),
                             max_steps=args.max_steps, timeout_s=args.timeout_s)
        show = print_table
    previous = signal.signal(signal.SIGTERM, _interrupt)   # SIGTERM unwinds like Ctrl-C: everything is stopped
    try:
        doc = bench()
    except KeyboardInterrupt:
        print(f"geofed bench cluster: interrupted; cluster stopped (run directories so far: {out})", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"geofed bench cluster: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        show(doc)
        print(f"details: {out / 'bench.json'}")
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_bench(spec: ClusterSpec, arms: Sequence[str], seeds: int, out: Path, *, target: Target,
              max_steps: int, timeout_s: float) -> dict[str, Any]:
    """Every arm for seeds 0..seeds-1 on one cluster (arms interleaved seed by seed); the --json document."""
    common = common_mapping(regions=spec.regions, max_steps=max_steps)
    stop_at_target = target_supported(common, target)
    log = _Log()
    t0 = time.monotonic()
    cluster = start_cluster(spec, common)
    runs: list[dict[str, Any]] = []
    try:
        log(f"cluster of {len(spec.regions)} nodes up in {cluster.started_s:.1f} s (head {cluster.head_address})")
        from .cluster_checks import model_numel

        probed = probe_links(cluster, model_numel(config_from_mapping(copy.deepcopy(common))))
        truth = link_truth(cluster, probed)
        for seed in range(seeds):
            for arm in arms:
                runs.append(_one(cluster, truth, arm, seed, common, out, target if stop_at_target else None,
                                 target, timeout_s, log))
    finally:
        cluster.stop()
    doc = {"target": asdict(target), "stops_at_target": stop_at_target, "spec": asdict(spec),
           "links": probed, "arms": _aggregate(runs, arms), "runs": runs, "wall_s": round(time.monotonic() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    return doc


def _one(cluster, truth, arm: str, seed: int, common: dict[str, Any], out: Path, run_target: Target | None,
         target: Target, timeout_s: float, log) -> dict[str, Any]:
    mapping = arm_mapping(arm, common)
    mapping["run"]["seed"] = seed
    config = write_config(mapping, out / "configs" / f"{arm}-s{seed}.yaml", target=run_target)
    run = cluster.run(config, out / f"{arm}-s{seed}", timeout_s=timeout_s)
    run.check()
    got = reached(run.run_dir, target)
    report = link_report(cluster, run, truth)
    tt = "not reached" if got.time_s is None else f"{got.time_s:.2f} s, {got.mb_per_region:.2f} MB/region"
    log(f"{arm} seed {seed}: {tt}; {got.rounds} rounds, H {_H_span(got.H)}, start-up {run.startup_s or 0:.1f} s")
    return {"arm": arm, "seed": seed, "run_dir": str(run.run_dir), "reached": asdict(got), "report": report}


def _aggregate(runs: list[dict[str, Any]], arms: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        rows.append({"arm": arm, "time_to_target_s": spread([r["reached"]["time_s"] for r in mine]),
                     "mb_per_region": spread([r["reached"]["mb_per_region"] for r in mine]),
                     "probe_mb_per_region": spread([r["reached"].get("probe_mb_per_region") for r in mine]),
                     "steps_to_target": spread([r["reached"]["steps"] for r in mine]),
                     "startup_s": spread([r["report"]["startup_s"] for r in mine]),
                     "H": sorted({h for r in mine for h in r["reached"]["H"]})})
    return rows


def print_table(doc: dict[str, Any]) -> None:
    """The bench's table (medians and ranges per arm over the seeds), then its target checks."""
    from rich.console import Console
    from rich.table import Table

    spec, t = doc["spec"], doc["target"]
    table = Table(title=f"geofed bench cluster: {len(spec['regions'])} Ray nodes in shaped namespaces, "
                        f"{spec['egress_mbps']:g} Mbit/s egress per region, {spec['latency_ms']:g} ms one way; "
                        f"to {t['metric']} {t['value']:g}, medians of {_seeds(doc)} seed(s) [range]")
    for col in ("arm", f"time to {t['value']:g}", "MB per region", "steps", "H", "start-up", "probes MB/region"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for row in doc["arms"]:
        probes = row.get("probe_mb_per_region") or {"median": None}
        table.add_row(row["arm"], _cell(row["time_to_target_s"], "s"), _cell(row["mb_per_region"], ""),
                      _cell(row["steps_to_target"], "", 0), _H_span(row["H"]), _cell(row["startup_s"], "s", 1),
                      "-" if probes["median"] is None else f"{probes['median']:.2f}")
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)   # piped: the whole table, not 80 columns of it
    console.print(table)
    for line in check_lines(doc):
        console.print(line)


def check_lines(doc: dict[str, Any]) -> list[str]:
    """Issue 14's "done when": the adaptive arms reach the target no later than H=100 int8, with fewer bytes."""
    rows = {r["arm"]: r for r in doc["arms"]}
    base = rows.get("H100-int8")
    if base is None or base["time_to_target_s"]["median"] is None:
        return []
    out = []
    for arm in ("adaptive-overlap", "multi-region"):
        row = rows.get(arm)
        if row is None:
            continue
        t, mb = row["time_to_target_s"]["median"], row["mb_per_region"]["median"]
        t0, mb0 = base["time_to_target_s"]["median"], base["mb_per_region"]["median"]
        ok = t is not None and t <= t0 and mb < mb0
        got = "not reached" if t is None else f"{t:.2f} s, {mb:.2f} MB"
        out.append(f"{arm} vs H100-int8: {got} vs {t0:.2f} s, {mb0:.2f} MB per region: "
                   + ("[green]no later, fewer bytes[/green]" if ok else "[red]NOT (later or no fewer bytes)[/red]"))
    return out


def _seeds(doc: dict[str, Any]) -> int:
    return max((r["seed"] for r in doc["runs"]), default=-1) + 1


def _cell(s: dict[str, Any], unit: str, nd: int = 2) -> str:
    if s["median"] is None:
        return "not reached"
    f = f"{{:.{nd}f}}"
    rng = f" [{f.format(s['min'])}-{f.format(s['max'])}]" if s["seeds"] > 1 else ""
    miss = f" ({s['seeds'] - s['reached']} not reached)" if s["reached"] < s["seeds"] else ""
    return f"{f.format(s['median'])}{' ' + unit if unit else ''}{rng}{miss}"


def _H_span(hs: list[int]) -> str:
    if not hs:
        return "-"
    return str(hs[0]) if min(hs) == max(hs) else f"{min(hs)}-{max(hs)}"


class _Log:
    def __call__(self, text: str) -> None:
        print(f"[bench cluster] {text}", file=sys.stderr, flush=True)
