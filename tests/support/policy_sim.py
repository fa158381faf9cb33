"""An in-process link model to run a policy against: regions, links, step time, a toy loss.

No Ray, no sockets, no clock: a round is ``H`` steps of ``step_time_s`` each, then (serial) the
exchange, whose time is the slowest link's ``k*RTT + bits/bandwidth(t)`` integrated over a
bandwidth schedule (so a drop mid-transfer slows the rest of that transfer). With overlap the
exchange of round r runs during round r+1's compute and round r+1 ends when both are done (the
outer update is applied one round late). The policy sees what p2p's estimator would: the goodput
and RTT of each link's last transfer (optionally with noise), the slowest step time, the loss.

The loss model is a toy, there only so that arms can be compared by time to a target loss:
``loss = L_inf + (L0 - L_inf) * exp(-progress / scale)``, where a round adds ``H`` steps of
progress discounted for large H (``1 / (1 + h_penalty*ln H)``: local steps drift apart, as
DiLoCo's H sweeps show a mild loss), for compression (``1 - codec_penalty*log2(ratio)`` averaged
over links) and for overlap's one-round-late update. Its numbers are assumptions, not results;
what the simulator shows is the *direction* of a policy's choices and time/bytes arithmetic.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from geofed.compression import CodecSpec

from geofed.orchestrator.policies.cost import RatioFn, payload_bytes
from geofed.orchestrator.policies.types import LinkEstimate, Measurements, Policy


def table_ratio(ratios: Mapping[str, float]) -> RatioFn:
    """A RatioFn from a table ``{codec key or kind: ratio}`` (fixed ratios, whatever the model size)."""
    def ratio(spec: CodecSpec, numel: int) -> float:
        return ratios[spec.key] if spec.key in ratios else ratios[spec.kind]
    return ratio


@dataclass(frozen=True, kw_only=True)
class Scenario:
    regions: int = 4
    bandwidth_bps: float = 50e6           # every link, unless link_bandwidth_bps names it
    rtt_s: float = 0.08
    link_bandwidth_bps: Mapping[str, float] = field(default_factory=dict)
    drop_at_s: float | None = None        # bandwidth of every link falls by drop_factor at this time
    drop_factor: float = 10.0
    step_time_s: float = 0.01
    model_numel: int = 100_000
    overlap: bool = False
    estimate_noise: float = 0.0           # estimates are off by a uniform factor in [1-noise, 1+noise]
    estimator_window: int = 1             # bandwidth = max goodput of the last N transfers (p2p's estimator: 3)
    rtt_factor: float = 1.0               # k: RTTs per transfer (a warm gRPC stream: ~1)
    seed: int = 0

    def links(self) -> list[str]:
        names = [f"r{i}" for i in range(self.regions)]
        return [f"{a}->{b}" for a in names for b in names if a != b]

    def bandwidth(self, link: str, t: float) -> float:
        bw = self.link_bandwidth_bps.get(link, self.bandwidth_bps)
        return bw / self.drop_factor if self.drop_at_s is not None and t >= self.drop_at_s else bw

    def transfer_s(self, link: str, nbytes: float, t0: float) -> float:
        """Seconds to move ``nbytes`` over ``link`` starting at ``t0``, following the schedule."""
        bits, t = nbytes * 8.0, t0
        if self.drop_at_s is not None and t < self.drop_at_s:
            before = self.bandwidth(link, t) * (self.drop_at_s - t)
            if bits <= before:
                return self.rtt_factor * self.rtt_s + bits / self.bandwidth(link, t)
            bits -= before
            t = self.drop_at_s
        return self.rtt_factor * self.rtt_s + (t - t0) + bits / self.bandwidth(link, t)


@dataclass(frozen=True, kw_only=True)
class LossModel:
    L0: float = 2.3
    L_inf: float = 0.1
    scale_steps: float = 400.0     # progress (in ideal steps) per e-fold of the loss gap
    h_penalty: float = 0.1
    codec_penalty: float = 0.01
    overlap_penalty: float = 0.02

    def loss(self, progress: float) -> float:
        return self.L_inf + (self.L0 - self.L_inf) * math.exp(-progress / self.scale_steps)

    def round_progress(self, H: int, ratios: list[float], overlap: bool) -> float:
        eff = 1.0 / (1.0 + self.h_penalty * math.log(H))
        fid = sum(1.0 - self.codec_penalty * math.log2(max(r, 1.0)) for r in ratios) / len(ratios)
        return H * eff * max(fid, 0.0) * ((1.0 - self.overlap_penalty) if overlap else 1.0)


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    round: int
    t_start: float
    t_end: float
    H: int
    codecs: dict[str, CodecSpec]
    sync_s: float       # the exchange's duration
    wait_s: float       # the part of it nobody computed through
    loss: float
    bytes: float
    reason: str
    details: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class SimResult:
    rounds: list[RoundRecord]
    time_to_target_s: float | None
    bytes_to_target: float | None
    final_loss: float
    utilization: float   # compute time / wall time

    def H_before(self, t: float) -> list[int]:
        return [r.H for r in self.rounds if r.t_end <= t]

    def H_after(self, t: float) -> list[int]:
        return [r.H for r in self.rounds if r.t_start >= t]


def simulate(policy: Policy, scenario: Scenario, *, ratio: RatioFn, loss_model: LossModel = LossModel(),
             target_loss: float, max_time_s: float = 1e5, max_rounds: int = 1_000_000,
             lr: Callable[[float], float] = lambda t: 1.0) -> SimResult:
    """Run ``policy`` until the loss reaches ``target_loss`` (or time/rounds run out)."""
    rng = random.Random(scenario.seed)
    links = scenario.links()
    estimates = {name: LinkEstimate() for name in links}
    history: dict[str, deque[float]] = {name: deque(maxlen=scenario.estimator_window) for name in links}
    t, progress, total_bytes, compute_s, pending_done = 0.0, 0.0, 0.0, 0.0, 0.0
    step_seen: float | None = None
    last_sync: float | None = None
    records: list[RoundRecord] = []
    hit_t = hit_bytes = None
    for r in range(max_rounds):
        loss = loss_model.loss(progress)
        m = Measurements(now_s=t, round=r, step_time_s=step_seen, loss=loss if r else None, lr=lr(t), lr0=lr(0.0),
                         model_numel=scenario.model_numel, links=dict(estimates), overlap=scenario.overlap,
                         last_sync_s=last_sync)
        d = policy.decide(m)
        t0 = t
        t += d.H * scenario.step_time_s
        compute_s += d.H * scenario.step_time_s
        wait = 0.0
        if scenario.overlap:  # round r-1's exchange must land before round r's outer step
            wait = max(0.0, pending_done - t)
            t += wait
        sizes = {n: payload_bytes(scenario.model_numel, ratio(d.codec_for(n), scenario.model_numel)) for n in links}
        durations = {n: scenario.transfer_s(n, sizes[n], t) for n in links}
        sync = max(durations.values())
        if scenario.overlap:
            pending_done = t + sync
        else:
            wait, t = sync, t + sync
        estimates = _observe(scenario, sizes, durations, history, rng)
        step_seen, last_sync = scenario.step_time_s, wait
        ratios = [scenario.model_numel * 4 / sizes[n] for n in links]
        progress += loss_model.round_progress(d.H, ratios, scenario.overlap)
        total_bytes += sum(sizes.values())
        records.append(RoundRecord(round=r, t_start=t0, t_end=t, H=d.H, codecs=dict(d.codecs), sync_s=sync, wait_s=wait,
                                   loss=loss_model.loss(progress), bytes=total_bytes, reason=d.reason,
                                   details=d.details))
        if hit_t is None and loss_model.loss(progress) <= target_loss:
            hit_t, hit_bytes = t, total_bytes
            break
        if t >= max_time_s:
            break
    return SimResult(rounds=records, time_to_target_s=hit_t, bytes_to_target=hit_bytes,
                     final_loss=loss_model.loss(progress), utilization=compute_s / t if t else 0.0)


def _observe(scenario: Scenario, sizes: Mapping[str, float], durations: Mapping[str, float],
             history: Mapping[str, deque[float]], rng: random.Random) -> dict[str, LinkEstimate]:
    """What p2p's estimator reports after a transfer: the windowed max goodput (BBR), the RTT."""
    out = {}
    for name, nbytes in sizes.items():
        serial = max(durations[name] - scenario.rtt_factor * scenario.rtt_s, 1e-9)
        noise = 1.0 + rng.uniform(-scenario.estimate_noise, scenario.estimate_noise)
        history[name].append(nbytes * 8.0 / serial * noise)
        out[name] = LinkEstimate(bandwidth_bps=max(history[name]), rtt_s=scenario.rtt_s)
    return out
