"""TEST DATA: writes fake run directories in the docs/RUNDIR.md format for the report's unit tests.

Nothing here trains anything: the numbers are made up (a loss that decays, a link whose
bandwidth drops mid-run, a policy that raises H when it does) so that the report's edge cases
(one region, one round, no eval, no emulation, gossip, no summary) can be built in milliseconds.
The integration test tests/integration/test_report_run.py builds a report from a real run.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import yaml

REGIONS = ("us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1")
# (bandwidth Mbit/s, RTT ms) per unordered pair; roughly the shape of real inter-region links.
_LINK = {("us-east-1", "eu-west-1"): (50.0, 80.0), ("us-east-1", "ap-northeast-1"): (20.0, 160.0),
         ("us-east-1", "eu-central-1"): (40.0, 95.0), ("eu-west-1", "ap-northeast-1"): (15.0, 220.0),
         ("eu-west-1", "eu-central-1"): (100.0, 25.0), ("ap-northeast-1", "eu-central-1"): (18.0, 230.0)}


def _link(a: str, b: str) -> tuple[float, float]:
    return _LINK.get((a, b)) or _LINK.get((b, a)) or (30.0, 100.0)


def _round_links(regions, rng: random.Random, *, degraded: bool, emulated: bool,
                 update_bytes: float) -> tuple[dict[str, dict], list[float]]:
    """One round's measured links (the first one cut to 1/5 once degraded) and each link's transfer time."""
    links, t_round = {}, []
    for a in regions:
        for b in regions:
            if a == b:
                continue
            bw, rtt = _link(a, b)
            if degraded and {a, b} == set(regions[:2]):
                bw = bw / 5
            links[f"{a}->{b}"] = {"bandwidth_mbps": round(bw * rng.uniform(0.85, 1.0), 2),
                                  "rtt_ms": round(rtt * rng.uniform(1.0, 1.15), 1)}
            if emulated:
                links[f"{a}->{b}"].update(configured_bandwidth_mbps=bw, configured_rtt_ms=rtt)
            t_round.append(rtt / 1000 + update_bytes * 8 / (bw * 1e6))
    return links, t_round


def _write_events(root: Path, regions) -> None:
    _write_jsonl(root / "events.jsonl", [
        {"t": 1.5, "round": 1, "kind": "peer_left_out", "region": regions[0], "detail": "deadline passed"},
        {"t": 2.0, "round": 2, "kind": "refusal", "reason": "round_window"}])


def fake_run_dir(root: Path, *, regions=REGIONS, rounds: int = 12, eval_every: int | None = 4,
                 emulated: bool = True, algorithm: str = "diloco", policy: str = "bandwidth",
                 summary: bool = True, events: bool = True, seed: int = 0, name: str = "fake",
                 loss0: float = 2.3, loss_rate: float = 0.15, bytes_per_update: int = 400_000) -> Path:
    """Write a fake run directory under `root` and return it. eval_every=None: no eval at all."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    regions = tuple(regions)
    t, H, codec = 0.0, 20, "fp16"
    metrics, round_recs, h_hist = [], [], []
    sent_per_link: dict[str, int] = {}
    for rnd in range(rounds):
        # Mid-run the first link loses most of its bandwidth; the policy answers with more H and int8.
        degraded = policy != "fixed" and rounds > 2 and rnd >= rounds // 2
        if degraded and H == 20:
            H, codec = 60, "int8"
        h_hist.append({"round": rnd, "H": H, "t": round(t, 3)})
        compute = H * 0.011
        links, t_round = _round_links(regions, rng, degraded=degraded, emulated=emulated,
                                      update_bytes=bytes_per_update * (0.5 if codec == "int8" else 1))
        sync = max(t_round) if t_round else 0.0
        t0, t1 = t, t + compute + sync
        loss_mean = loss0 * math.exp(-loss_rate * (rnd + 1) * H / 20) + 0.05
        losses = []
        for i, reg in enumerate(regions):
            nbytes = int(bytes_per_update * (0.5 if codec == "int8" else 1))
            peers = [p for p in regions if p != reg]
            loss = loss_mean * (1 + 0.08 * (i - len(regions) / 2) / max(1, len(regions))) * rng.uniform(0.97, 1.03)
            losses.append(loss)
            m = {"round": rnd, "region": reg, "t_start": round(t0, 3), "t_end": round(t1, 3), "H": H,
                 "codecs": {p: codec for p in peers}, "train_loss": loss, "lr": 0.001,
                 "step_time_s": 0.011, "compute_s": compute, "sync_s": sync, "wait_s": sync * 0.2,
                 "utilization": compute / (t1 - t0), "bytes_sent": nbytes * len(peers),
                 "bytes_received": nbytes * len(peers),
                 "transfers": [{"peer": p, "direction": "send", "bytes": nbytes, "seconds": 0.1} for p in peers],
                 "peers_missing": [], "late_dropped": 0, "refused": 0}
            for p in peers:
                sent_per_link[f"{reg}->{p}"] = sent_per_link.get(f"{reg}->{p}", 0) + nbytes
            if eval_every and ((rnd + 1) % eval_every == 0 or rnd == rounds - 1):
                m["eval"] = {"metric": "accuracy", "value": min(0.99, 1.0 - loss / 2.5)}
            metrics.append(m)
        rec = {"round": rnd, "t_start": round(t0, 3), "t_end": round(t1, 3), "H": H,
               "codecs": {k: codec for k in links}, "reason": f"{policy}: round {rnd}",
               "links": links, "mean_train_loss": sum(losses) / len(losses),
               "utilization": compute / (t1 - t0), "bytes_sent": sum(m["bytes_sent"] for m in metrics[-len(regions):])}
        if algorithm == "gossip":
            rec["consensus_distance"] = 0.05 * math.exp(-0.3 * rnd)
        round_recs.append(rec)
        t = t1
    _write_jsonl(root / "metrics.jsonl", metrics)
    _write_jsonl(root / "rounds.jsonl", round_recs)
    cfg = {"run": {"name": name, "rounds": rounds}, "task": {"kind": "mlp-digits"},
           "regions": {"names": list(regions)},
           "sync": {"algorithm": algorithm, "topology": "full", "policy": {"kind": policy}},
           "compression": {"codec": "fp16"},
           "network": {"emulation": {"mode": "proxy" if emulated else "none"}}}
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    if events:
        _write_events(root, regions)
    if summary:
        _write_summary(root, name, regions, rounds, t, metrics, round_recs, sent_per_link, h_hist, algorithm, policy, emulated)
    return root


def _write_summary(root, name, regions, rounds, wall, metrics, round_recs, sent_per_link, h_hist, algorithm, policy, emulated):
    last = {m["region"]: m for m in metrics}
    evals = {r: m["eval"] for r, m in last.items() if "eval" in m}
    links = {k: {"bytes": sent_per_link.get(k, 0), **v} for k, v in (round_recs[-1]["links"] if round_recs else {}).items()}
    summary = {
        "run": f"{name}-20261129T200000Z", "rounds": rounds, "wall_s": round(wall, 3),
        "final_train_loss": round_recs[-1]["mean_train_loss"] if round_recs else None,
        "bytes_sent": sum(m["bytes_sent"] for m in metrics),
        "compute_utilization": sum(r["utilization"] for r in round_recs) / max(1, len(round_recs)),
        "utilization_per_region": {r: last[r]["utilization"] for r in last},
        "links": links, "H_history": h_hist,
        "placement": {r: {"node_ip": f"10.0.0.{i + 1}", "labels": {"ray.io/availability-region": r}} for i, r in enumerate(regions)},
        "faults": {"region_restarts": 0, "peers_left_out": 1, "late_dropped": 0},
        "refusals": {"total": 1, "by_reason": {"round_window": 1}},
        "config": {"task": "mlp-digits", "algorithm": algorithm, "policy": policy, "codec": "fp16",
                   "topology": "full", "regions": len(regions), "emulation": "proxy" if emulated else "none"},
    }
    if evals:
        summary["eval"] = {"metric": "accuracy", "value": sum(e["value"] for e in evals.values()) / len(evals)}
        summary["eval_per_region"] = evals
    (root / "summary.json").write_text(json.dumps(summary, indent=1))


def _write_jsonl(path: Path, records) -> None:
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_fake_run_dir_has_the_documented_files_and_keys(tmp_path):
    run = fake_run_dir(tmp_path / "r", rounds=3)
    for f in ("metrics.jsonl", "rounds.jsonl", "summary.json", "events.jsonl", "config.yaml"):
        assert (run / f).is_file(), f
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    # the keys of docs/RUNDIR.md's example line, so the fake stays honest to the format
    assert {"round", "region", "t_start", "t_end", "H", "codecs", "train_loss", "utilization",
            "bytes_sent", "bytes_received", "transfers"} <= set(m)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3 * len(REGIONS)
