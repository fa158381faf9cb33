"""`geofed bench cluster --shards`: the sharded exchange's wall time on shaped multi-node links (issue 39).

One cluster of 2 regions x 2 Ray nodes, every node in its own network namespace with a tbf on its
egress to the other region's nodes and `--latency-ms` one way between regions (through the router);
a region's own nodes talk over a veth of their own, unshaped and past the router, as on a LAN
(netns_cluster.ShapedNodesCluster, `lan_unshaped`).
Two arms on it, the same model, codec and H, run alternately `--seeds` times each (interleaved, so a
slow minute of the host falls on both):

- `sharded`: regions.workers 2 with regions.shard_exchange, one worker a node: each node sends its
  shard (half the update) to its peer node;
- `one-node`: regions.workers 1: one node a region sends the whole update.

The model is the digits MLP with two hidden layers of `--hidden` (3072 by default: 9.7M parameters,
9.7 MB of int8 a round, about 1.6 s of a 50 Mbit/s egress, so that the exchange is the bandwidth's,
which is what sharding spreads; at 1024, 1.1M parameters, the 40 ms latency and the round trips of
the exchange weigh as much as its bytes).

A run's exchange time is the median over its rounds after the first of worker 0's `sync_s` (from the
end of the inner steps to the outer step taken: the exchange, the mix, and for the sharded arm the
gather inside the region), the slower region's each round. The ratio sharded / one-node of each pair
of runs, and its median and range, are the result (issue 39's target: at most 0.6).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .cluster_arms import common_mapping, write_config

REGIONS = ("us-east-1", "eu-west-1")
ARMS = ("sharded", "one-node")


def shard_mapping(arm: str, *, rounds: int, hidden: int, H: int) -> dict[str, Any]:
    """The arm's config mapping: DiLoCo without overlap, fixed H, int8 + error feedback, no set-up probe."""
    m = common_mapping(regions=REGIONS, max_steps=0, rounds=rounds)
    m["run"]["eval_every"] = rounds
    m["task"].update({"hidden": hidden, "layers": 2})
    m["regions"].update({"workers": 2 if arm == "sharded" else 1, "shard_exchange": arm == "sharded", "num_cpus": 1})
    m["network"]["probe_s"] = 0
    m["security"]["score_updates"] = False
    m["sync"]["overlap"] = False
    m["sync"]["policy"] = {"kind": "fixed", "H": H}
    m["sync"]["deadline"] = {"initial_s": 60, "min_s": 30, "max_s": 120}
    m["compression"] = {"codec": "int8", "error_feedback": True}
    return m


def exchange_s(run_dir: Path) -> float:
    """The median over rounds 1.. of the slower region's `sync_s` (module docstring)."""
    by_round: dict[int, float] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m["round"] >= 1:
            by_round[m["round"]] = max(by_round.get(m["round"], 0.0), float(m["sync_s"]))
    if not by_round:
        raise RuntimeError(f"{run_dir}: no round after the first")
    return statistics.median(by_round.values())


def run_shard_bench(out: Path, *, seeds: int, egress_mbps: float, latency_ms: float, rounds: int = 6,
                    hidden: int = 3072, H: int = 5, timeout_s: float = 300) -> dict[str, Any]:
    """Both arms `seeds` times, interleaved, on one ShapedNodesCluster; the --json document."""
    from geofed.orchestrator.config import config_from_mapping
    from geofed.orchestrator.launch.plan import build_plan

    from .netns_cluster import ShapedNodesCluster

    t0 = time.monotonic()
    base = shard_mapping("sharded", rounds=rounds, hidden=hidden, H=H)
    plan = build_plan(config_from_mapping(copy.deepcopy(base), source="bench cluster --shards"))
    cluster = ShapedNodesCluster(plan, egress_mbps=egress_mbps, latency_ms=latency_ms, lan_unshaped=True,
                                 prefix="gfb")
    runs: list[dict[str, Any]] = []
    with cluster:
        _log(f"2 regions x 2 nodes up in {cluster.started_s:.1f} s (head {cluster.head_address})")
        for seed in range(seeds):
            for arm in (ARMS if seed % 2 == 0 else ARMS[::-1]):
                m = shard_mapping(arm, rounds=rounds, hidden=hidden, H=H)
                m["run"]["seed"] = seed
                config = write_config(m, out / "configs" / f"{arm}-s{seed}.yaml", target=None)
                run = cluster.run(config, out / f"{arm}-s{seed}", timeout_s=timeout_s)
                run.check()
                sent = cluster.wan_bytes_by_node(run)
                got = {"arm": arm, "seed": seed, "exchange_s": round(exchange_s(run.run_dir), 4),
                       "wan_payload_by_node": sent}
                runs.append(got)
                _log(f"{arm} seed {seed}: exchange {got['exchange_s']:.3f} s; WAN payload by node {sent}")
    ratios = []
    for seed in range(seeds):
        pair = {r["arm"]: r["exchange_s"] for r in runs if r["seed"] == seed}
        ratios.append(round(pair["sharded"] / pair["one-node"], 4))
    doc = {"spec": {"regions": list(REGIONS), "nodes_per_region": 2, "egress_mbps": egress_mbps,
                    "latency_ms": latency_ms, "lan": "unshaped", "rounds": rounds, "H": H, "hidden": hidden,
                    "codec": "int8+EF"},
           "runs": runs, "ratios": ratios,
           "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "pairs": len(ratios)},
           "exchange_s": {arm: statistics.median(r["exchange_s"] for r in runs if r["arm"] == arm) for arm in ARMS},
           "target": 0.6, "wall_s": round(time.monotonic() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    return doc


def print_shard_table(doc: dict[str, Any]) -> None:
    r, e = doc["ratio"], doc["exchange_s"]
    print(f"sharded exchange: {e['sharded']:.3f} s, one node a region: {e['one-node']:.3f} s (medians); "
          f"ratio median {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}] over {r['pairs']} pairs "
          f"(target <= {doc['target']})")


def _log(text: str) -> None:
    print(f"[bench cluster --shards] {text}", file=sys.stderr, flush=True)
