"""summary.json: built from the run directory's own logs, so it always agrees with them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from geofed.regions.tasks import make_task

from ..config import RunConfig
from .egress import add_egress
from .emulation import configured_link
from .linkrate import WINDOW_S, busiest, link_peak_to_mean
from .rundir import read_jsonl


def evaluate_average(cfg: RunConfig, params: dict[str, list[torch.Tensor]]) -> tuple[dict | None, float | None]:
    """Eval of the average of the regions' models, and their consensus distance.

    Consensus distance = sqrt(mean_i ||x_i - mean||^2) / ||mean||: 0 when every region holds the
    same model (DiLoCo over a full topology), larger while gossip has not converged.
    """
    if not params:
        return None, None
    stacks = list(params.values())
    mean = [torch.stack([p[k] for p in stacks]).mean(0) for k in range(len(stacks[0]))]
    norm = torch.sqrt(sum((m.double() ** 2).sum() for m in mean))
    spread = sum(sum(((p[k] - mean[k]).double() ** 2).sum() for k in range(len(mean))) for p in stacks) / len(stacks)
    consensus = float(torch.sqrt(spread) / norm) if norm > 0 else 0.0
    task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed)
    model = task.build_model(cfg.run.seed)
    with torch.no_grad():
        for p, m in zip([p for p in model.parameters() if p.requires_grad], mean):
            p.copy_(m)
    r = task.evaluate(model)
    return {"metric": r.metric, "value": r.value, "higher_is_better": r.higher_is_better}, consensus


def build_summary(cfg: RunConfig, run_dir: Path, *, eval_avg, eval_per_region, consensus, transport_stats,
                  faults, placement, emulator, wall_s: float,
                  refusals_since_last_round: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """summary.json's content, built from the run's logs and what the driver passes in."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    rounds = read_jsonl(run_dir / "rounds.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    last_round = max((m["round"] for m in metrics), default=-1)
    final_losses = [m["train_loss"] for m in metrics if m["round"] == last_round and m.get("train_loss") is not None]
    util = _utilization(metrics)
    refusals = _refusals(metrics, refusals_since_last_round or {})
    links = _links(metrics, rounds, emulator)
    busiest_link, busiest_ratio = busiest(links)
    egress = add_egress(cfg, links, transport_stats)
    return {
        "run": run_dir.name, "rounds": last_round + 1, "wall_s": round(wall_s, 3),
        "final_train_loss": sum(final_losses) / len(final_losses) if final_losses else None,
        "eval": eval_avg, "eval_per_region": eval_per_region, "consensus_distance": consensus,
        "bytes_sent": sum(m.get("bytes_sent", 0) for m in metrics),
        "bytes_received": sum(m.get("bytes_received", 0) for m in metrics),
        # The set-up probes that warmed and measured every connection (not in bytes_sent).
        "probe_bytes_sent": sum(sum((s.get("probe_bytes_sent") or {}).values()) for s in transport_stats.values()),
        "compute_utilization": sum(util.values()) / len(util) if util else None,
        "utilization_per_region": util,
        "links": links, **egress,
        "peak_to_mean": {"link": busiest_link, "ratio": busiest_ratio, "window_s": WINDOW_S},
        "H_history": [{"round": r["round"], "H": r["H"], "t": r["t_start"], "codecs": r.get("codecs", {})} for r in rounds],
        "placement": {reg: {k: info.get(k) for k in ("node_ip", "node_id", "labels", "pid", "host", "grpc_address",
                                                  "device", "device_name", "precision")}
                      for reg, info in placement.items()},
        "transport": _transport(transport_stats),
        "faults": {**faults, "late_dropped": sum(s.get("late_dropped", 0) for s in transport_stats.values()),
                   "region_rounds_out": _rounds_out(cfg, rounds, events), "by_region": _by_region(cfg, rounds, events)},
        "live_regions": _live_regions(cfg, rounds, events),
        "refusals": refusals,
        "config": {"task": cfg.task.kind, "algorithm": cfg.sync.algorithm, "policy": cfg.sync.policy.kind,
                   "codec": cfg.compression.codec.key, "topology": cfg.sync.topology,
                   "regions": len(cfg.regions.names), "emulation": cfg.network.emulation.mode,
                   "overlap": cfg.sync.overlap, "fragments": cfg.sync.fragments, "tls": cfg.security.tls},
    }


def _rounds_out(cfg: RunConfig, rounds: list[dict], events: list[dict]) -> int:
    """Region-rounds a region was out of the run (failed or stalled: not in the round's ``alive``).
    peers_left_out counts only updates a participant missed; a stalled region is no participant,
    so a 10 s stall showed as nothing there. A region that left the run (``members_out``,
    driver/membership.py) is no fault; one that joined under a new name counts from its first round."""
    members = _members(cfg, events)
    return sum(len(members(r["round"]) - set(r["alive"]) - set(r.get("members_out") or ()))
               for r in rounds if isinstance(r.get("alive"), list))


def _members(cfg: RunConfig, events: list[dict]) -> Callable[[Any], set[str]]:
    """round -> the run's members then: regions.names and every region that joined under a new name
    (`geofed join`, events.jsonl's region_joined with new) from its first round on."""
    joined = {e["region"]: int(e.get("first_round", 0)) for e in events
              if e.get("event") == "region_joined" and e.get("new") and isinstance(e.get("region"), str)}
    names = set(cfg.regions.names)
    return lambda r: names | {g for g, first in joined.items() if isinstance(r, int) and r >= first}


def _by_region(cfg: RunConfig, rounds: list[dict], events: list[dict]) -> dict[str, dict[str, Any]]:
    """faults.by_region: each region that failed, stalled or sat rounds out, named. failures,
    restarts and stalls as the aggregate keys count them (events.jsonl's region_failed,
    region_rejoined after a restart, region_stalled); causes: one short reason a failure
    (driver/failures.py: OOM, process died, timeout, ...), failed_in the round of each; stalled_in
    the round of each stall; rounds_out the rounds it missed as [first, last] ranges, counted as
    region_rounds_out counts them (a region that left is no fault). events.jsonl outlives a resume
    whole, so a failure in a round that a resume ran again still counts here."""
    out: dict[str, dict[str, Any]] = {}

    def entry(region: str) -> dict[str, Any]:
        return out.setdefault(region, {"failures": 0, "restarts": 0, "stalls": 0, "rounds_out": [], "causes": [],
                                       "failed_in": [], "stalled_in": []})

    for e in events:
        region, kind = e.get("region"), e.get("event")
        if not isinstance(region, str):
            continue
        if kind == "region_failed":
            ent = entry(region)
            ent["failures"] += 1
            ent["causes"].append(e.get("cause") or "unknown")
            ent["failed_in"].append(e.get("round"))
        elif kind == "region_stalled":
            entry(region)["stalls"] += 1
            entry(region)["stalled_in"].append(e.get("round"))
        elif kind == "region_rejoined" and e.get("after") == "restart":
            entry(region)["restarts"] += 1
    names = list(cfg.regions.names)
    members = _members(cfg, events)
    missed: dict[str, list[int]] = {}
    for r in rounds:
        if isinstance(r.get("alive"), list):
            for region in members(r["round"]) - set(r["alive"]) - set(r.get("members_out") or ()):
                missed.setdefault(region, []).append(r["round"])
    for region, rs in missed.items():
        entry(region)["rounds_out"] = round_ranges(rs)
    order = {name: i for i, name in enumerate(names)}
    return {region: out[region] for region in sorted(out, key=lambda reg: (order.get(reg, len(order)), reg))}


def round_ranges(rounds: list[int]) -> list[list[int]]:
    """[3, 4, 7] -> [[3, 4], [7, 7]]: consecutive rounds as [first, last]."""
    ranges: list[list[int]] = []
    for r in sorted(set(rounds)):
        if ranges and r == ranges[-1][1] + 1:
            ranges[-1][1] = r
        else:
            ranges.append([r, r])
    return ranges


def _live_regions(cfg: RunConfig, rounds: list[dict], events: list[dict]) -> dict[str, list[str]]:
    """The regions the run started with (regions.names) and those alive at its end: the last round's
    `alive`, less any region that failed, stalled or left after that round was logged (a resync,
    the final checkpoint or evaluation), for the run's last line (progress.end_line)."""
    recorded = [r for r in rounds if isinstance(r.get("alive"), list)]
    alive = list(recorded[-1]["alive"]) if recorded else list(cfg.regions.names)
    after = recorded[-1]["round"] if recorded else -1
    gone = {e["region"] for e in events if e.get("event") in ("region_failed", "region_stalled", "region_left")
            and isinstance(e.get("round"), int) and e["round"] > after and isinstance(e.get("region"), str)}
    return {"started": list(cfg.regions.names), "ended": [reg for reg in alive if reg not in gone]}


def _utilization(metrics: list[dict]) -> dict[str, float]:
    compute: dict[str, float] = {}
    wall: dict[str, float] = {}
    for m in metrics:
        compute[m["region"]] = compute.get(m["region"], 0.0) + m.get("compute_s", 0.0)
        wall[m["region"]] = wall.get(m["region"], 0.0) + m.get("wall_s", 0.0)
    return {r: min(1.0, compute[r] / wall[r]) for r in compute if wall[r] > 0}


def _links(metrics: list[dict], rounds: list[dict], emulator) -> dict[str, dict]:
    links: dict[str, dict] = {}
    for m in metrics:
        for t in m.get("transfers", []):
            if t["direction"] != "send":
                continue
            entry = links.setdefault(f"{m['region']}->{t['peer']}", {"bytes": 0, "transfers": 0})
            entry["bytes"] += t["bytes"]
            entry["transfers"] += 1
    for link, ratio in link_peak_to_mean(metrics).items():
        # bytes per window of WINDOW_S: the busiest over the mean (orchestrator/driver/linkrate.py)
        links.setdefault(link, {"bytes": 0, "transfers": 0}).update(peak_to_mean=ratio, peak_window_s=WINDOW_S)
    last_est: dict[str, dict] = {}
    for r in rounds:
        last_est.update(r.get("links", {}))
    for link, entry in links.items():
        est = last_est.get(link, {})
        entry["bandwidth_mbps"] = est.get("bandwidth_mbps")
        entry["rtt_ms"] = est.get("rtt_ms")
        if emulator is not None:
            entry.update(configured_link(emulator, *link.split("->", 1)))
    return links


def _transport(transport_stats: dict[str, dict]) -> dict[str, dict]:
    """Each region's own gRPC counters (the transport's, not the driver's): what crossed geofed's
    gossip service, as opposed to Ray's control plane."""
    return {reg: {"tls": s.get("tls"),
                  "bytes_sent": sum((s.get("bytes_sent") or {}).values()),
                  "messages_sent": sum((s.get("messages_sent") or {}).values()),
                  "bytes_received": sum((s.get("bytes_received") or {}).values()),
                  "messages_received": sum((s.get("messages_received") or {}).values()),
                  "probe_bytes_sent": sum((s.get("probe_bytes_sent") or {}).values())}
            for reg, s in transport_stats.items()}


def _refusals(metrics: list[dict], tail: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Refusals by reason over the whole run: each round's (metrics.jsonl, kept across region
    restarts and resumes) plus what each region refused after its last round."""
    by_reason: dict[str, int] = {}
    by_region: dict[str, int] = {}
    for region, counts in [(m.get("region"), m.get("refusals") or {}) for m in metrics] + list(tail.items()):
        for reason, n in counts.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
            by_region[region] = by_region.get(region, 0) + n
    return {"total": sum(by_reason.values()), "by_reason": by_reason, "by_region": by_region,
            "clipped": _clipped(metrics), "harmful": _clipped(metrics, key="harmful"),
            "quarantined": _clipped(metrics, key="quarantined")}


def _clipped(metrics: list[dict], *, key: str = "clipped") -> dict[str, Any]:
    """Updates scaled down rather than refused (security.robust_aggregation clip: at the mix to the
    round's median norm, honest ones above it too; secure aggregation's mean as `secagg-mean`): by
    the region that clipped them and by sender. A hostile member shows as one sender clipped by
    every region, round after round. key="harmful": updates refused by the gauntlet (regions/gauntlet.py),
    by region and by sender the same way (by_reason has their total, every sender's)."""
    by_region: dict[str, int] = {}
    by_sender: dict[str, int] = {}
    for m in metrics:
        for sender, n in (m.get(key) or {}).items():
            by_region[m.get("region")] = by_region.get(m.get("region"), 0) + n
            by_sender[sender] = by_sender.get(sender, 0) + n
    return {"total": sum(by_region.values()), "by_region": by_region, "by_sender": by_sender}
