"""What a policy reports about a decision: the structured ``details`` and the one-line reason.

The report reads ``details`` from rounds.jsonl to show why H moved: the bottleneck link, its
estimate and codec, the predicted sync time against the budget, and whether hysteresis held
H back. Units in details: Mbit/s, ms for links (as rounds.jsonl's ``links``), seconds elsewhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from . import cost
from .config import BandwidthPolicyConfig
from .types import LinkEstimate, Measurements, measured_step_s


def mbps(bps: float | None) -> float | None:
    """bits/s -> Mbit/s, rounded for the details (None stays None)."""
    return None if bps is None else round(bps / 1e6, 4)


def ms(seconds: float | None) -> float | None:
    """seconds -> milliseconds, rounded for the details (None stays None)."""
    return None if seconds is None else round(seconds * 1e3, 3)


def _g(x: float) -> str:
    return f"{x:.3g}"


def describe_link(est: LinkEstimate, rung: cost.Rung | None = None, numel: int = 0, sync_s: float | None = None) -> dict:
    """One link in a decision's details: its estimate, and with a rung its codec, ratio, bytes and sync time."""
    out: dict[str, Any] = {"bandwidth_mbps": mbps(est.bandwidth_bps), "rtt_ms": ms(est.rtt_s)}
    if rung is not None:
        out.update(codec=rung.spec.key, ratio=round(rung.ratio, 4), bytes=int(cost.payload_bytes(numel, rung.ratio)),
                   sync_s=None if sync_s is None else round(sync_s, 6))
    return out


def exposed_fraction(D: float, H: int, step_s: float, overlap: bool) -> float:
    """Predicted share of a round's wall time spent waiting on the network."""
    compute = H * step_s
    wait = max(0.0, D - compute) if overlap else D
    return wait / (compute + wait)


def explain_bandwidth(cfg: BandwidthPolicyConfig, m: Measurements, measured: Mapping[str, LinkEstimate],
                      rungs: Sequence[cost.Rung], chosen: Mapping[str, int], D_of: Mapping[str, float], *,
                      bottleneck: str, H: int, H_prev: int, H_want: int, H_raw: float, need_link: str,
                      event: str, last_pred: float | None, since_change: int | None) -> tuple[dict, str]:
    """The bandwidth policy's decision details and its one-line reason."""
    D = D_of[bottleneck]
    step_s = measured_step_s(m)
    overhead = m.round_overhead_s or 0.0
    budget = cost.budget_for_H(H, step_s, overlap=m.overlap, comm_fraction=cfg.target_comm_fraction,
                               margin=cfg.overlap_margin, overhead=overhead)
    # Which constraint set H_raw: hiding the sync, or (overlap) keeping the control plane's share small.
    H_overhead = cost.compute_for_overhead(overhead, cfg.target_comm_fraction) / step_s
    by_overhead = m.overlap and overhead > 0 and H_overhead >= H_raw * (1 - 1e-9)
    links = {n: describe_link(e, rungs[chosen[n]], m.model_numel, D_of[n]) if n in chosen else describe_link(e)
             for n, e in m.links.items()}
    details = {
        "kind": "bandwidth", "event": event, "mode": "overlap" if m.overlap else "serial",
        "H": H, "H_prev": H_prev, "H_wanted": H_want, "H_raw": round(H_raw, 3), "need_link": need_link,
        "step_time_s": m.step_time_s, "bottleneck": bottleneck, "sync_s": round(D, 6), "budget_s": round(budget, 6),
        "comm_fraction": round(exposed_fraction(D, H, step_s, m.overlap), 6),
        "round_overhead_s": m.round_overhead_s, "bound_by": "overhead" if by_overhead else "sync",
        "rounds_since_change": since_change, "unmeasured": sorted(set(m.links) - set(measured)),
        "rtt_only": sorted(n for n, e in measured.items() if e.bandwidth_bps is None),
        "last_sync_predicted_s": last_pred, "last_sync_measured_s": m.last_sync_s, "links": links,
    }
    return details, _reason(cfg, m, measured, rungs, chosen, D, details)


def _reason(cfg: BandwidthPolicyConfig, m: Measurements, measured: Mapping[str, LinkEstimate],
            rungs: Sequence[cost.Rung], chosen: Mapping[str, int], D: float, d: Mapping[str, Any]) -> str:
    H, H_prev, H_want = d["H"], d["H_prev"], d["H_wanted"]
    if d["event"] == "changed":
        head = f"H {H_prev}->{H}" if H != H_prev else f"H stays {H}, codecs changed"
    elif d["event"] == "held-hold":
        head = f"H stays {H} (wants {H_want}; last change {d['rounds_since_change']} round(s) ago, hold {cfg.hold_rounds})"
    elif d["event"] == "held-band":
        head = f"H stays {H} (wants {H_want}, within {cfg.hysteresis:.0%})"
    else:
        head = f"H stays {H}"
    step_s = measured_step_s(m)
    b = d["bottleneck"]
    est = measured[b]
    bw = "bandwidth unknown" if est.bandwidth_bps is None else f"{_g(est.bandwidth_bps / 1e6)} Mbit/s"
    link = f"bottleneck {b} {bw}, {_g((est.rtt_s or 0) * 1e3)} ms RTT, {rungs[chosen[b]].spec.key}: sync {_g(D)} s"
    if m.overlap and d["bound_by"] == "overhead":
        need = (f"control plane {_g((m.round_overhead_s or 0.0) * 1e3)} ms/round <= {cfg.target_comm_fraction:.0%} at "
                f"{_g(step_s * 1e3)} ms/step needs H>={cost.ceil_H(d['H_raw'])}")
    elif m.overlap:
        need = f"hiding it ({cfg.overlap_margin:g}x) behind {_g(step_s * 1e3)} ms steps needs H>={cost.ceil_H(d['H_raw'])}"
    else:
        need = (f"comm <= {cfg.target_comm_fraction:.0%} at {_g(step_s * 1e3)} ms/step "
                f"needs H>={cost.ceil_H(d['H_raw'])}")
    if d["H_raw"] > cfg.H_max and H == cfg.H_max:
        need += f", capped at H_max={cfg.H_max}"
    elif d["H_raw"] < cfg.H_min and H == cfg.H_min:
        need += f", raised to H_min={cfg.H_min}"
    parts = [head, link, need]
    if len(rungs) > 1:
        counts = Counter(rungs[i].spec.key for i in chosen.values())
        parts.append("codecs " + ", ".join(f"{label} x{counts[label]}" for label in
                                           [g.spec.key for g in rungs] if label in counts))
    if d["rtt_only"]:
        parts.append(f"{len(d['rtt_only'])} link(s) RTT only (no bandwidth estimate: latency-bound)")
    if d["unmeasured"]:
        parts.append(f"{len(d['unmeasured'])} link(s) unmeasured")
    return "; ".join(parts)
