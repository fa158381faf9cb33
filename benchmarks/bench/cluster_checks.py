"""A run on the shaped cluster (netns_cluster.ShapedCluster) held against what its links really give.

Issue 14's targets, computed from the run directory and the router's flow counts:

* **true rate** of a link: the sender's egress (tbf rate of IP bytes) times the TCP payload per
  IP byte of a full segment (1448/1500), divided by the pushes that share the egress at once
  (``concurrent``: a region's out-links in a full-topology round); gRPC, HTTP/2 and TLS framing
  take another ~0.2% (a 31-byte frame and record per 16 KiB), left out;
* **estimates**: per round and link, the bandwidth the policy saw when it decided that round
  (rounds.jsonl ``policy.links``: the coordinator's LinkTracker) and p2p's own estimator
  (``links``); the estimate "by the end of round r" is the one the policy decides round r+1 with;
* **H with the true rates**: the run's policy replayed round by round on Measurements built from
  the true rates and RTTs and the run's own step time, overhead and last sync time;
* **bytes**: geofed's count per link (summary.json ``links``) against the TCP payload the router
  saw on geofed's flows of that link (the client-to-server direction of src's channel to dst:
  pushes, pings, TLS and HTTP/2), and each NIC's kernel counter against the router's total;
* **Ray**: bytes between regions on every flow that is not geofed's, by Ray port and by phase
  (start-up, training, the end of the run).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geofed.orchestrator.config import load_config
from geofed.orchestrator.launch.plan import LaunchPlan
from .netns_cluster import DriverRun
from geofed.orchestrator.policies import LinkEstimate, Measurements, make_policy
from geofed.orchestrator.driver.rundir import read_jsonl

FRAMING = 1.0   # gRPC/HTTP2/TLS framing (~0.998) is left out of the true rate: see the module docstring


@dataclass(frozen=True, kw_only=True)
class LinkTruth:
    """What the shaped links of a cluster really give, to hold a run's link estimates against."""

    egress_mbps: float          # each region's tbf rate (IP bytes)
    payload_efficiency: float   # TCP payload per IP byte of a full segment (hub.RegionNet.payload_efficiency)
    rtt_ms: Mapping[str, float]  # per link "a->b", measured (hub_probe.probe)
    # What plain TCP got per link for one update-sized push on a warm connection, all links at
    # once (hub_probe warm_push_s, less one RTT): the congestion control's answer, for comparison.
    push_mbps: Mapping[str, float] = field(default_factory=dict)
    # What plain TCP bulk flows got per link, all links at once (hub_probe bulk_mbps): below the
    # shaped share only when the host is too busy to carry it (11.5-13.3 for 16.1 with other work
    # on the 2 cores), which says a missed estimate is the host's, not the estimator's.
    bulk_mbps: Mapping[str, float] = field(default_factory=dict)

    def rate_mbps(self, concurrent: int) -> float:
        """Payload Mbit/s one of `concurrent` pushes gets from its region's egress."""
        return self.egress_mbps * self.payload_efficiency * FRAMING / max(1, concurrent)


def out_links(rounds: list[dict]) -> dict[str, int]:
    """Out-links per region in the run's rounds (the pushes that share a region's egress)."""
    links = {link for r in rounds for link in (r.get("policy", {}).get("links") or r.get("links") or {})}
    count: dict[str, int] = {}
    for link in links:
        src = link.split("->", 1)[0]
        count[src] = count.get(src, 0) + 1
    return count


def estimates(run_dir: Path) -> dict[int, dict[str, dict[str, float | None]]]:
    """round -> link -> what the policy saw deciding that round (``policy_mbps``) and p2p's estimate after it."""
    out: dict[int, dict[str, dict[str, float | None]]] = {}
    for rec in read_jsonl(Path(run_dir) / "rounds.jsonl"):
        pol = rec.get("policy", {}).get("links") or {}
        p2p = rec.get("links") or {}
        out[rec["round"]] = {link: {"policy_mbps": (pol.get(link) or {}).get("bandwidth_mbps"),
                                    "policy_rtt_ms": (pol.get(link) or {}).get("rtt_ms"),
                                    "p2p_mbps": (p2p.get(link) or {}).get("bandwidth_mbps"),
                                    "p2p_rtt_ms": (p2p.get(link) or {}).get("rtt_ms")}
                             for link in sorted(set(pol) | set(p2p))}
    return out


def push_times(run_dir: Path) -> dict[int, dict[str, tuple[int, float]]]:
    """round -> link -> (payload bytes, sender-timed seconds) of the pushes reported that round."""
    out: dict[int, dict[str, tuple[int, float]]] = {}
    for m in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        for t in m.get("transfers", []):
            if t.get("direction") == "send" and "late_round" not in t:
                out.setdefault(m["round"], {})[f"{m['region']}->{t['peer']}"] = (int(t["bytes"]), float(t["seconds"]))
    return out


def estimator_check(run_dir: Path, truth: LinkTruth, *, by_round: int = 1) -> dict[str, Any]:
    """Every link's estimate by the end of round `by_round` (what round by_round+1 is decided with) vs its true rate."""
    rounds = read_jsonl(Path(run_dir) / "rounds.jsonl")
    est = estimates(run_dir)
    fanout = out_links(rounds)
    seen = est.get(by_round + 1, {})
    links = {}
    for link in sorted(seen):
        true = truth.rate_mbps(fanout.get(link.split("->", 1)[0], 1))
        got = seen[link]["policy_mbps"]
        links[link] = {"estimate_mbps": got, "true_mbps": round(true, 3),
                       "ratio": None if got is None else round(got / true, 4),
                       "tcp_push_mbps": truth.push_mbps.get(link), "tcp_bulk_mbps": truth.bulk_mbps.get(link)}
    return {"by_round": by_round, "decides_round": by_round + 1, "links": links}


def replay_H(run_dir: Path, truth: LinkTruth) -> list[dict[str, Any]]:
    """The run's policy, decided again every round with the true links: H the run chose vs H it would have."""
    cfg = load_config(Path(run_dir) / "config.yaml")
    rounds = read_jsonl(Path(run_dir) / "rounds.jsonl")
    fanout = out_links(rounds)
    policy = make_policy(cfg.sync.policy, codec=cfg.compression.codec, ladder=cfg.compression.ladder)
    numel = model_numel(cfg)
    lr0 = cfg.sync.inner.lr
    out, loss = [], None
    for rec in rounds:
        d = rec.get("policy", {})
        links = {link: LinkEstimate(bandwidth_bps=truth.rate_mbps(fanout.get(link.split("->", 1)[0], 1)) * 1e6,
                                    rtt_s=truth.rtt_ms[link] / 1e3)
                 for link in (d.get("links") or {})}
        m = Measurements(now_s=rec["t_start"], round=rec["round"], step_time_s=d.get("step_time_s"), loss=loss,
                         lr=lr0, lr0=lr0, model_numel=numel, links=links, overlap=cfg.sync.overlap,
                         last_sync_s=d.get("last_sync_measured_s"), round_overhead_s=d.get("round_overhead_s"))
        true_H = policy.decide(m).H
        out.append({"round": rec["round"], "H": rec["H"], "H_true_rates": true_H,
                    "ratio": round(max(rec["H"], true_H) / min(rec["H"], true_H), 4)})
        loss = rec.get("mean_train_loss")
    return out


def model_numel(cfg) -> int:
    """Trainable parameters of the config's model (what one update carries), built here without Ray."""
    from geofed.regions.tasks import make_task

    task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed)
    return sum(p.numel() for p in task.build_model(cfg.run.seed).parameters() if p.requires_grad)


# -- bytes on the wire ---------------------------------------------------------------------------

def flow_class(key: tuple, geofed_ports: tuple[int, int], ray_ports: Mapping[int, str],
               worker_ports: tuple[int, int]) -> str:
    """"geofed" for a flow to or from geofed's gRPC ports, else "ray:<what>" by the Ray port it touches."""
    _, _, _, sport, dport = key
    lo, hi = geofed_ports
    if lo <= sport <= hi or lo <= dport <= hi:
        return "geofed"
    for port in (dport, sport):
        if port in ray_ports:
            return f"ray:{ray_ports[port]}"
    wlo, whi = worker_ports
    if wlo <= dport <= whi or wlo <= sport <= whi:
        return "ray:worker"
    return "other"


def ray_ports(plan: LaunchPlan) -> tuple[dict[int, str], tuple[int, int]]:
    """Ray's ports in `plan` by name (port -> name), and the range of its worker ports: how router flows
    are told apart as Ray's.
    """
    p = plan.ports["between_nodes"]
    named = {int(p["gcs (head only)"]): "gcs", int(p["node_manager"]): "raylet",
             int(p["object_manager"]): "object_manager", int(p["dashboard_agent_grpc"]): "agent"}
    for key, port in plan.ports["node_local"].items():
        named[int(port)] = key
    lo, hi = p["ray_workers"]
    return named, (int(lo), int(hi))


def traffic(run: DriverRun, plan: LaunchPlan, addresses: Mapping[str, str], start: str, end: str) -> dict[str, dict]:
    """"src->dst" -> class -> {ip, payload, packets} between two snapshots of the run."""
    region_of = {a: r for r, a in addresses.items()}
    named, workers = ray_ports(plan)
    geofed_ports = tuple(plan.ports["between_nodes"]["geofed_grpc"])
    a, b = run.snapshot(start).flows, run.snapshot(end).flows
    out: dict[str, dict] = {}
    for key, (pk, ip, pl) in b.items():
        pk0, ip0, pl0 = a.get(key, (0, 0, 0))
        if pk == pk0:
            continue
        src, dst = region_of.get(key[0]), region_of.get(key[1])
        if src is None or dst is None:
            continue
        cls = flow_class(key, geofed_ports, named, workers)
        if cls == "geofed":
            # pushes and pings travel client (src) -> server (dst's port); the rest is the reverse direction
            lo, hi = geofed_ports
            cls = "geofed" if lo <= key[4] <= hi else "geofed:replies"
        c = out.setdefault(f"{src}->{dst}", {}).setdefault(cls, {"ip": 0, "payload": 0, "packets": 0})
        c["ip"] += ip - ip0
        c["payload"] += pl - pl0
        c["packets"] += pk - pk0
    return out


def bytes_check(run: DriverRun, plan: LaunchPlan, addresses: Mapping[str, str]) -> dict[str, Any]:
    """geofed's count per link against the router's, and each NIC against the router, over the whole run."""
    import json

    summary = json.loads((Path(run.run_dir) / "summary.json").read_text())
    flows = traffic(run, plan, addresses, "launch", "end")
    probes = probe_bytes(run.run_dir)
    links = {}
    for link, s in sorted(summary.get("links", {}).items()):
        wire = flows.get(link, {}).get("geofed", {"ip": 0, "payload": 0})
        counted = int(s["bytes"]) + probes.get(link, 0)
        links[link] = {"counted": counted, "probes": probes.get(link, 0), "wire_payload": wire["payload"],
                       "wire_ip": wire["ip"], "ratio": None if not counted else round(wire["payload"] / counted, 4)}
    nics = {}
    for region in addresses:
        tx = run.nic_after[region]["tx_bytes"] - run.nic_before[region]["tx_bytes"]
        routed = sum(c["ip"] for link, by in flows.items() if link.startswith(region + "->") for c in by.values())
        sent = int(summary["transport"][region]["bytes_sent"])
        q0, q1 = run.nic_before[region].get("qdisc", {}), run.nic_after[region].get("qdisc", {})
        nics[region] = {"nic_tx": tx, "router_ip": routed, "geofed_counted": sent,
                        "nic_over_counted": None if not sent else round(tx / sent, 4),
                        "tbf_dropped": q1.get("dropped", 0) - q0.get("dropped", 0)}
    grpc = {r: p.get("grpc_address") for r, p in summary.get("placement", {}).items()}
    return {"links": links, "nics": nics, "grpc_addresses": grpc}


def probe_bytes(run_dir: Path) -> dict[str, int]:
    """Bytes of the set-up link probes per link (events.jsonl ``links_probed``; not in summary ``links``)."""
    out: dict[str, int] = {}
    for ev in read_jsonl(Path(run_dir) / "events.jsonl"):
        if ev.get("event") != "links_probed":
            continue
        for region, records in (ev.get("probes") or {}).items():
            for t in records:
                link = f"{region}->{t['peer']}"
                out[link] = out.get(link, 0) + int(t["bytes"])
    return out


def ray_check(run: DriverRun, plan: LaunchPlan, addresses: Mapping[str, str]) -> dict[str, Any]:
    """Bytes between regions that are not geofed's, by phase and by Ray port; rounds from rounds.jsonl."""
    rounds = sum(1 for s in run.snapshots if s.label.startswith("round "))
    last = f"round {rounds - 1}" if rounds else run.round0
    phases = {"startup": ("launch", run.round0), "training": (run.round0, last), "end": (last, "end")}
    evals = sum(1 for r in read_jsonl(Path(run.run_dir) / "rounds.jsonl") if "eval_avg" in r or "consensus_distance" in r)
    out: dict[str, Any] = {"rounds": rounds, "evaluations": evals, "regions": len(addresses), "phases": {}}
    for name, (a, b) in phases.items():
        by: dict[str, int] = {}
        for classes in traffic(run, plan, addresses, a, b).values():
            for cls, c in classes.items():
                by[cls] = by.get(cls, 0) + c["ip"]
        seconds = run.snapshot(b).t - run.snapshot(a).t
        ray = {k: v for k, v in by.items() if not k.startswith("geofed")}
        out["phases"][name] = {"seconds": round(seconds, 3), "geofed_ip": by.get("geofed", 0) + by.get("geofed:replies", 0),
                               "ray_ip": sum(ray.values()), "ray_by_port": dict(sorted(ray.items()))}
    return out


def first_push(run_dir: Path) -> dict[str, Any]:
    """Round 0's pushes (a fresh channel) against the median of later rounds', per link, in seconds."""
    pushes = push_times(run_dir)
    out = {}
    for link, (nbytes, s0) in sorted(pushes.get(0, {}).items()):
        later = [p[link][1] for r, p in pushes.items() if r > 0 and link in p]
        out[link] = {"bytes": nbytes, "round0_s": round(s0, 4),
                     "later_median_s": None if not later else round(statistics.median(later), 4)}
    return out
