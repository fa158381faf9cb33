"""The four arms of ``geofed bench dfgl`` (issue 7), computed in-process on one partition.

centralized (one process, whole graph), local_only (no exchange), gossip_uncompressed (fp32
CHOCO gossip after every epoch) and geofed (int8 CHOCO gossip after every 5 local epochs);
the last two track gradients (see tracking.py). This is the in-process variant (fast, for
exploring settings: ``python -m geofed.regions.graph.bench``); ``geofed bench dfgl``
(geofed.orchestrator.bench_dfgl) runs the two gossip arms through the real runtime instead.
"""

from __future__ import annotations

from typing import Any

import torch

from geofed.p2p.topology import make_topology
from geofed.regions.tasks.base import Task

from .simulate import DfglConfig, DfglResult, centralized, local_only, simulate_dfgl


# Found with the in-process simulation on Cora
# and CiteSeer, 4 louvain regions (docs/graph.md has the table and the search).
UNCOMPRESSED = dict(local_epochs=1, codec="identity", tracking=True, gamma=1.0)
GEOFED = dict(local_epochs=5, codec="int8", tracking=True, gamma=1.0)


def dfgl_arms(task: Task, *, n_regions: int = 4, seeds: tuple[int, ...] = (0, 1, 2), epochs: int = 200,
              topology: str = "ring", lr: float = 0.01, geofed: dict[str, Any] | None = None,
              link_latency_s: float = 0.04, link_mbps: float = 50.0) -> dict[str, Any]:
    """Accuracy mean/std over seeds, bytes per region and time of the four arms, on one partition.

    ``wall_s`` is measured compute in this process plus a modelled network time per gossip
    round (``link_latency_s + message_bytes / link_mbps``, links in parallel); the runtime's
    bench measures the emulated WAN instead.
    """
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("centralized", "local_only", "gossip_uncompressed", "geofed")}
    for seed in seeds:
        runs["centralized"].append(centralized(task, epochs=epochs, lr=lr, seed=seed))
        runs["local_only"].append(local_only(task, n_regions, epochs=epochs, lr=lr, seed=seed))
        for arm, opts in (("gossip_uncompressed", UNCOMPRESSED), ("geofed", geofed or GEOFED)):
            cfg = DfglConfig(n_regions=n_regions, topology=topology, lr=lr,
                             rounds=max(1, epochs // opts["local_epochs"]), **opts)
            res = simulate_dfgl(task, cfg, seed=seed)
            comm = _modelled_comm_s(res, cfg, topology, link_latency_s, link_mbps)
            runs[arm].append({"acc": res.avg_model_acc, "region_acc_mean": res.mean_acc,
                              "consensus_distance": res.consensus_distance,
                              "bytes_per_region": res.bytes_per_region, "wall_s": res.wall_s + comm})
    return {"dataset": task.describe().get("dataset"), "regions": n_regions, "seeds": len(seeds),
            "arms": {arm: _summarise(rs) for arm, rs in runs.items()}}


def _modelled_comm_s(res: DfglResult, cfg: DfglConfig, topology: str, latency: float, mbps: float) -> float:
    topo = make_topology(topology, cfg.n_regions)
    fanout = max(1, max(len(topo.out_neighbours(i, 0)) for i in range(cfg.n_regions)))
    per_message = res.gossip_bytes_per_region / fanout / (cfg.rounds * cfg.gossip_steps)
    return cfg.rounds * cfg.gossip_steps * (latency + per_message * 8 / (mbps * 1e6))


def _summarise(rs: list[dict[str, Any]]) -> dict[str, Any]:
    accs = torch.tensor([r["acc"] for r in rs], dtype=torch.float64)
    out = {"acc_mean": float(accs.mean()), "acc_std": float(accs.std(unbiased=False)),
           "bytes_per_region": sum(r["bytes_per_region"] for r in rs) / len(rs),
           "wall_s": sum(r["wall_s"] for r in rs) / len(rs)}
    if "consensus_distance" in rs[0]:
        out["consensus_distance"] = sum(r["consensus_distance"] for r in rs) / len(rs)
    return out


def _parse(argv):
    import argparse

    p = argparse.ArgumentParser(prog="python -m geofed.regions.graph.bench", description=(
        "Decentralized federated graph learning on one partition, all in process (geofed bench dfgl runs "
        "the gossip arms through the runtime): centralized, local-only, uncompressed per-epoch gossip "
        "and geofed's default (int8 CHOCO, 5 local epochs per round)."))
    p.add_argument("--dataset", default="cora", help="cora, citeseer, or a path to a graph .npz")
    p.add_argument("--data-dir", default="../shared/datasets/planetoid", help="where cora.npz / citeseer.npz live")
    p.add_argument("--regions", type=int, default=4)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=200, help="local epochs per region in every arm")
    p.add_argument("--topology", default="ring")
    p.add_argument("--partition", default="louvain", choices=("louvain", "label-dirichlet", "random"))
    p.add_argument("--model", default="gcn", choices=("gcn", "sage"))
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """``python -m geofed.regions.graph.bench [--json] [--dataset cora|citeseer] [--regions N] [--seeds K]``."""
    import json
    from pathlib import Path

    from geofed.regions.tasks.graph import GcnPlanetoidConfig, GcnPlanetoidTask

    args = _parse(argv)
    torch.set_num_threads(1)
    path = args.dataset if args.dataset.endswith(".npz") else str(Path(args.data_dir) / f"{args.dataset}.npz")
    try:
        task = GcnPlanetoidTask(GcnPlanetoidConfig(path=path, partition=args.partition, model=args.model))
    except ValueError as exc:
        print(f"geofed bench dfgl: {exc}")
        return 2
    doc = dfgl_arms(task, n_regions=args.regions, seeds=tuple(range(args.seeds)), epochs=args.epochs,
                    topology=args.topology)
    doc["dataset"] = args.dataset
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{args.dataset}: {args.regions} regions ({args.partition}, {args.topology}), {args.seeds} seeds, {args.model}")
    print(f"{'arm':22s} {'accuracy %':>14s} {'MB/region':>10s} {'wall s':>8s}")
    for arm, v in doc["arms"].items():
        acc = f"{100 * v['acc_mean']:.2f} ± {100 * v['acc_std']:.2f}"
        print(f"{arm:22s} {acc:>14s} {v['bytes_per_region'] / 1e6:10.2f} {v['wall_s']:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
