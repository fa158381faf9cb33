"""RegionWorker: one region's trainer. A plain class (tested without Ray); regions/actor.py wraps it.

It owns the region's model, data shard, inner optimizer, gRPC transport and codec states, and
runs one round at a time as the coordinator plans it (DESIGN.md, "One round").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geofed.compression import CodecError, CodecSpec, decode_update
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.robust import AdmissionPerLayout, UpdateAdmission, fair_share_clip, robust_mix
from geofed.p2p.topology import make_topology

from .emulation import Slowdown
from .device import Precision, device_name, move_received, resolve_device
from .sync import algorithm_class, mix
from .sync.common import merge_exchange_metrics
from .sync.protocol import SyncAlgorithm, SyncContext
from .adversary import attach
from .exchange import Exchanger
from .gapfill import GapFiller, pausing
from .gauntlet import Gauntlet, harmful_refusals
from .limits import wire_limits
from .privacy.dp import dp_noise_seed, noise_generator
from .rollback import RoundGuard
from .stepper import LocalSteps
from .worker_state import RegionState
from .tasks import make_task
from .transport_factory import make_transport

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """What the coordinator asks of a region for one round: H local steps, the codec of each
    out-link, the lr scale, evaluation and sketch flags, whether it is the last round, and which
    regions it believes are up.
    """

    round: int
    H: int
    codecs: dict[str, CodecSpec] = field(default_factory=dict)  # peer -> codec of my link to it
    lr_scale: float = 1.0
    evaluate: bool = False
    alive: tuple[str, ...] | None = None  # regions the coordinator believes are up (None: all)
    final: bool = False  # the run's last round: apply an exchange still in flight (overlap) before returning
    sketch: bool = False  # report a count sketch of the synchronised model (the driver's consensus distance)
    # sync.pacing (regions/pacing.py): time-budget rounds step until budget_s (at most max_steps) and
    # scale their pseudo-gradient by norm_steps / steps; quorum rounds close a receive at `quorum`.
    budget_s: float | None = None
    budget_until: float | None = None  # time.time() when the budget ends, whenever the round starts
    max_steps: int | None = None
    norm_steps: float | None = None
    quorum: int | None = None
    grace_s: float = 0.0
    # privacy.dp (regions/privacy/dp.py): the mechanism, its clip and the noise multiplier the driver's
    # PrivacyBudget chose; record: DP-SGD inner steps, update: DiLoCo's sent pseudo-gradient noised.
    dp_mode: str = "off"
    dp_clip: float = 1.0
    dp_noise: float | None = None
    # sync.pacing.fill_gaps (regions/gapfill.py): after returning, step until the next call arrives.
    fill: bool = False
    # In-neighbours on probation (a member muted for withholding, tried again: recovery.WithholdWatch):
    # their update is taken if it comes with the others, and nobody waits for it (p2p/mailbox.py).
    optional: tuple[str, ...] = ()


@pausing
class RegionWorker(LocalSteps, RegionState):
    """`cfg` is the run config (geofed.orchestrator.config.RunConfig; duck-typed: regions must
    not import orchestrator)."""

    def __init__(self, cfg: Any, region: str, run_dir: str | Path, *, transport=None, tls=None,
                 advertised_host: str | None = None, task=None, hostile=None):
        self.cfg, self.region, self.run_dir = cfg, region, Path(run_dir)
        self.regions = list(cfg.regions.names)
        self.index = self.regions.index(region)
        torch.set_num_threads(cfg.regions.torch_threads)
        seed = cfg.run.seed
        self._build_model_and_data(task, seed)
        self.topology = make_topology(cfg.sync.topology, len(self.regions), seed=seed)
        algorithm_cls = algorithm_class(cfg.sync)
        # What one message holds (gossip with tracking: params + tracker): the receiver's decode
        # check and the size limits both follow the algorithm's word on it.
        self.wire_shapes = algorithm_cls.wire_shapes(cfg.sync, self.shapes)
        self.limits = wire_limits(cfg, self.wire_shapes)
        sec = cfg.security
        admission_cls = AdmissionPerLayout if cfg.sync.fragments > 1 else UpdateAdmission  # a norm per fragment
        self.admission = admission_cls(mode=sec.robust_aggregation, max_update_value=sec.max_update_value,
                                       norm_multiple=sec.norm_multiple, clip=not self._clips_at_mix())
        self._open_transport(transport, tls=tls, advertised_host=advertised_host)
        self._make_exchanger()
        self.gauntlet = Gauntlet.for_worker(self)  # security.score_updates: None where it does not apply
        self.algorithm: SyncAlgorithm = algorithm_cls(self._sync_context())
        self.guard = RoundGuard(self) if sec.rollback_on_nonfinite else None
        self.completed_round = -1
        self.dp_plan: RoundPlan | None = None
        self.dp_generator = noise_generator(dp_noise_seed(cfg), region=self.index, stream="record")
        self._eval_model: torch.nn.Module | None = None
        self._refusals_reported: dict[str, int] = {}
        self.model.train()
        # `hostile` (an Adversary): geofed bench attack's member whose own code lies; no config sets it.
        self.hostile = None if hostile is None else attach(hostile, self)

    def _build_model_and_data(self, task, seed: int) -> None:
        """The device, the task, the model (one init everywhere), this region's shard and data
        stream, and the inner optimizer: __init__'s first part, in this order (it draws seeds)."""
        cfg, region = self.cfg, self.region
        # Workers of one process (regions/inprocess.py) may share one task built from cfg.task:
        # the data is loaded and partitioned once instead of once per region.
        # Gossip keeps its public copies in host memory: auto trains it on the CPU (the config
        # refuses an explicit cuda with gossip).
        spec = "cpu" if cfg.sync.algorithm == "gossip" and cfg.regions.device == "auto" else cfg.regions.device
        self.device = resolve_device(spec, region=region)
        self.precision = Precision(cfg.sync.inner.precision, self.device)
        self.slowdown = Slowdown(cfg.regions.emulation.slowdown.get(region, 1.0))
        self.filler = GapFiller(self)
        self.task = task if task is not None else make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=seed,
                                                            device=str(self.device))
        # Same init everywhere (seed, not seed + index): DiLoCo starts every region from one model.
        self.model = self.task.build_model(seed).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.shard = self.task.shard(self.index, len(self.regions), seed)
        self.generator = torch.Generator().manual_seed(seed * 1000 + self.index)
        self._data_start = self.generator.get_state()
        self.batches = self._batch_stream()
        self.batches_drawn = 0  # where the data stream is, so a restore resumes it exactly
        self.inner = self._make_inner_optimizer()

    def _open_transport(self, transport, *, tls, advertised_host: str | None) -> None:
        """The transport (built here unless injected), wired to this worker's validator, pacing and state."""
        cfg = self.cfg
        # An injected transport (the in-memory one) lets algorithm tests run without sockets.
        # `tls` (TlsMaterial) and `advertised_host` come from the actor on a multi-node cluster.
        self.transport = transport if transport is not None else make_transport(
            cfg, self.region, self.run_dir, limits=self.limits, tls=tls, advertised_host=advertised_host)
        self.transport.mailbox.set_validator(self._validate)
        pacing = cfg.sync.pacing
        if pacing.mode == "quorum" and pacing.late_updates == "apply":
            self.transport.mailbox.accept_stale(pacing.max_staleness)
        if pacing.mode == "quorum" and getattr(self.transport, "mailbox", None) is not None:
            self.transport.mailbox.expect_late = True
        self.transport.state_provider = self.state_bytes

    def _make_exchanger(self) -> None:
        """The Exchanger over the transport (adaptive deadline, error feedback) and secure aggregation's state."""
        cfg = self.cfg
        d = cfg.sync.deadline
        self.exchanger = Exchanger(self.transport, error_feedback=cfg.compression.error_feedback,
                                   deadline=AdaptiveDeadline(d.initial_s, d.min_s, d.max_s, d.k),
                                   send_timeout_s=d.max_s, max_peers=len(self.regions) - 1)
        self.exchanger.observe_own = self.admission.observe_own
        self.secagg = None
        if cfg.security.secure_aggregation:  # its modules (key agreement, cryptography) cost every actor's start ~0.3 s
            from .secagg.round import make_secagg

            self.secagg = make_secagg(cfg, self.region, self.transport, self.run_dir, deadline=self.exchanger.deadline,
                                      admission=self.admission,
                                      max_message_bytes=self.limits.max_message_bytes)

    def _sync_context(self) -> SyncContext:
        """The algorithm's view of this region (bound methods: a subclass's overrides apply)."""
        return SyncContext(region=self.region, index=self.index, params=self.params, shapes=self.shapes,
                           settings=self.cfg.sync, seed=self.cfg.run.seed, stepper=self, exchange=self.exchange,
                           mix=self.mix, in_weights=self.in_weights, fetch_state=self.transport.fetch_state,
                           evaluate=self.evaluate_params, secagg=self.secagg, hurry=lambda: self.exchanger.hurry(),
                           dp_noise_seed=dp_noise_seed(self.cfg),
                           screen=None if self.gauntlet is None else self.gauntlet.screen)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> str:
        """Start the transport's server; returns the address peers dial."""
        return self.transport.start()

    def connect(self, peers: dict[str, str]) -> None:
        """Dial every other region at its address (region -> address; this region's own entry is skipped)."""
        self.transport.connect({r: a for r, a in peers.items() if r != self.region})

    def probe(self) -> dict[str, Any]:
        """Before round 0: every connection warmed and measured (network.probe_s)."""
        net = self.cfg.network
        peers = [p for p in self.regions if p != self.region]
        records = (self.exchanger.probe_links(peers, duration_s=net.probe_s, max_bytes=net.probe_max_mb << 20)
                   if net.probe_s > 0 and peers else [])
        out = {"region": self.region, "transfers": records, "links": self.exchanger.link_estimates(self.region)}
        if self.cfg.sync.pacing.mode == "time-budget":
            out["warm_step_s"] = self._warm_compute()
        return out

    def close(self) -> None:
        """Stop the algorithm's background work, the send pool and the transport, in that order."""
        self.algorithm.close()
        if self.secagg is not None:
            self.secagg.close()
        self.exchanger.close()
        self.transport.close()

    def info(self) -> dict[str, Any]:
        """Identity and size facts for the driver: pid, host, parameter and example counts, round, RSS."""
        import socket

        return {"region": self.region, "pid": os.getpid(), "host": socket.gethostname(),
                "device": str(self.device), "device_name": device_name(self.device),
                "precision": self.precision.name,
                "params": sum(p.numel() for p in self.params), "examples": self.shard.num_examples,
                "completed_round": self.completed_round, "rss_mb": rss_mb()}

    # -- one round -------------------------------------------------------------------------
    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """Run one planned round (a non-finite one is rolled back if configured), evaluate if planned,
        and return the region's metrics record for it (losses, exchange, links, codecs, refusals).
        """
        t_start = time.time()
        self.dp_plan = plan if plan.dp_mode == "record" and plan.dp_noise is not None else None
        late_s = 0.0
        if plan.budget_s is not None and plan.budget_until is not None:
            # A region that starts late (a catch-up queued ahead of its round, a slow dispatch)
            # ends with the others instead of stretching the round by its delay.
            late_s = max(0.0, plan.budget_s - (plan.budget_until - t_start))
            if late_s > 0:
                plan = dataclasses.replace(plan, budget_s=max(0.0, plan.budget_s - late_s))
        metrics = self._guarded_round(plan)
        if late_s > 0:
            metrics["budget_late_s"] = round(late_s, 6)
        self.completed_round = plan.round
        if plan.final:
            # Overlap: the round's own exchange is still in flight; its bytes add to this round's.
            merge_exchange_metrics(metrics, self.finish_pending())
        if plan.evaluate and not self.algorithm.evaluates_in_exchange:
            t_eval = time.monotonic()
            metrics["eval"] = {**self.evaluate_synced(), "round": plan.round}
            metrics["eval_s"] = round(time.monotonic() - t_eval, 6)
        _take_pending_eval(metrics)
        if plan.sketch:
            metrics["sketch"] = self.sketch()  # the runner takes it out before metrics.jsonl
        fill = plan.fill and not plan.final
        harmful = self.gauntlet.take() if self.gauntlet is not None else {}
        quarantined = self.gauntlet.take_quarantined() if self.gauntlet is not None else {}
        wall = time.time() - t_start
        metrics.update({"round": plan.round, "region": self.region, "H": plan.H,
                        "codecs": {p: plan.codecs.get(p, self.cfg.compression.codec).key
                                   for p in self.out_peers(plan)},
                        "wall_s": wall, "utilization": min(1.0, metrics.get("compute_s", 0.0) / wall) if wall > 0 else 0.0,
                        "links": self.exchanger.link_estimates(self.region),
                        "refused": self.transport.stats().get("refused_total", 0),
                        "refusals": _summed(self.take_refusals(), metrics.get("refusals"), harmful_refusals(harmful, quarantined)),
                        "harmful": harmful, "quarantined": quarantined,
                        "clipped": self.admission.take_clipped(), "rss_mb": rss_mb()})
        if self.hostile is not None:
            metrics["hostile"] = self.hostile.take_acts()
        done = self.__dict__.get("_pushes_done")
        if done is not None and done[0] == plan.round:
            metrics["pushes_done"] = {"round": done[0], "peers": done[1]}
        if fill:  # last: any call into the worker (even its own) stops the filler
            # At most a nominal round's steps: a long gap (a peer back from an absence fetching the
            # model) must not turn into several rounds of unsynchronised drift.
            self.filler.start(lr_scale=plan.lr_scale, max_steps=max(1, plan.H), max_s=max(1.0, 4 * (plan.budget_s or 0.0)))
        return metrics

    def _guarded_round(self, plan: RoundPlan) -> dict[str, Any]:
        """The algorithm's round; with security.rollback_on_nonfinite, a round that leaves the
        model non-finite is undone (regions/rollback.py) and the run goes on."""
        if self.guard is None:
            return self.algorithm.run_round(plan)
        self.guard.snapshot()
        metrics = None
        try:
            metrics = self.algorithm.run_round(plan)
            self.guard.check(metrics)
        except FloatingPointError as exc:
            return self.guard.roll_back(plan, exc, metrics)
        return metrics

    def take_refusals(self) -> dict[str, int]:
        """Refusals by reason since the last call: metrics.jsonl sums to the run's total even
        across region restarts and driver resumes (the transport's counters start at zero)."""
        now = dict(self.transport.stats().get("refused", {}))
        delta = {k: n - self._refusals_reported.get(k, 0) for k, n in now.items() if n > self._refusals_reported.get(k, 0)}
        self._refusals_reported = now
        return delta

    def finish_pending(self) -> dict[str, Any]:
        """Apply an exchange still in flight (overlap) so the model includes every round; its metrics."""
        return self.algorithm.finish()

    def flush_exchange(self) -> dict[str, Any]:
        """finish_pending between rounds, its metrics as a round reports them (an evaluation made in
        the exchange included): the driver's resync under overlap starts from every region's model
        with the in-flight exchange applied (orchestrator/driver/faults.py)."""
        return _take_pending_eval(self.finish_pending())

    # -- exchange helpers used by the algorithms ------------------------------------------
    def out_peers(self, plan: RoundPlan) -> list[str]:
        """This round's out-neighbours in the topology, less those the coordinator believes are down."""
        alive = set(plan.alive) if plan.alive is not None else None
        return [self.regions[j] for j in self.topology.out_neighbours(self.index, plan.round)
                if alive is None or self.regions[j] in alive]

    def in_weights(self, round_: int) -> dict[str, float]:
        """The topology's in-neighbours of this region in `round_`, by name, with their mixing weights
        (down or not: the mix folds a missing peer's weight into this region's own).
        """
        return {self.regions[j]: w for j, w in self.topology.in_weights(self.index, round_).items()}

    def exchange(self, plan: RoundPlan, tensors, *, single_codec: bool = False, send: bool = True, stream: str = "",
                 spread_s: float = 0.0, window_s: float = 0.0):
        """Push `tensors` to this round's live out-neighbours (none with send=False: a rejoining
        gossip region only listens), collect from live in-neighbours (SyncContext.exchange)."""
        alive = set(plan.alive) if plan.alive is not None else None
        in_peers = [p for p in self.in_weights(plan.round) if alive is None or p in alive]
        codecs = {} if single_codec else plan.codecs
        out_peers = self.out_peers(plan) if send else []
        quorum = None if plan.quorum is None else max(0, min(plan.quorum - 1, len(in_peers)))
        res = self.exchanger.exchange(plan.round, tensors, out_peers=out_peers, in_peers=in_peers,
                                      codecs=codecs, default_codec=self.cfg.compression.codec,
                                      quorum=quorum, grace_s=plan.grace_s, stream=stream, spread_s=spread_s,
                                      window_s=window_s, optional=plan.optional)
        # What the driver tells peers still waiting once this region reported the round (senders_done):
        # the pushes it made that were delivered, and those it never made.
        self._pushes_done = (plan.round, res.finished_pushes(
            [self.regions[j] for j in self.topology.out_neighbours(self.index, plan.round)]))
        res.received = move_received(res.received, self.device)
        if res.stale:
            moved = move_received({f"{s}@{r}": t for s, r, t in res.stale}, self.device)
            res.stale = [(s, r, moved[f"{s}@{r}"]) for s, r, _ in res.stale]
        return res

    def mix(self, plan: RoundPlan, own, res) -> list[torch.Tensor]:
        """The round's aggregate of `own` and what `res` received: the topology's weighted mix, or the
        robust coordinate-wise one that security.robust_aggregation selects (full-topology runs only).
        """
        how = self.cfg.security.robust_aggregation
        if self._clips_at_mix() and res.received:
            own, received, clipped = fair_share_clip(own, res.received, multiple=self.cfg.security.clip_multiple)
            self.admission.note_clipped(clipped)
            res = dataclasses.replace(res, received=received)
        if how in ("trimmed-mean", "median"):  # the config allows them for full-topology diloco/allreduce only
            return robust_mix(own, res.received, how=how, trim_fraction=self.cfg.security.trim_fraction)
        if self.cfg.sync.pacing.mode != "barrier":
            # Paced rounds leave slow or absent regions out on purpose: the mean of what is in (the
            # same set at every region of the round), not a missing peer's weight folded into self.
            w = 1.0 / (1 + len(res.received))
            return mix(own, res.received, {p: w for p in res.received}, w)
        weights, self_w = self.in_weights(plan.round), self.topology.self_weight(self.index, plan.round)
        if self.cfg.sync.topology == "full" and plan.alive is not None:
            # Regions left out of the round (dead, stalled) are no miss: their weight goes to every
            # region of the round alike, not each into its own, so the survivors keep one model
            # (folded into self, each drifted its own way with no miss to resync it).
            live = {p: w for p, w in weights.items() if p in plan.alive}
            total = self_w + sum(live.values())
            weights, self_w = {p: w / total for p, w in live.items()}, self_w / total
        return mix(own, res.received, weights, self_w)

    def _clips_at_mix(self) -> bool:
        """security.robust_aggregation clip with clip_multiple on: each round's mix scales every peer
        update to the round's median norm (gossip mixes models, not updates: it clips on arrival)."""
        sec = self.cfg.security
        return sec.robust_aggregation == "clip" and sec.clip_multiple > 0 and self.cfg.sync.algorithm != "gossip"

    def _validate(self, sender: str, round_: int, payload: memoryview) -> list[torch.Tensor]:
        """Called by the transport for every incoming update: refuse (ValueError, or a Refusal
        with its own reason from admission) what is not sane."""
        try:
            # sync.fragments: a round's message holds that round's fragment (regions/sync/fragments.py).
            per_round = getattr(getattr(self, "algorithm", None), "round_wire_shapes", None)
            shapes = self.wire_shapes if per_round is None else per_round(round_)
            tensors = decode_update(payload, max_bytes=self.limits.decode_bytes, expected_shapes=shapes)
        except CodecError as exc:
            raise ValueError(f"undecodable update from {sender}: {exc}") from None
        return self.admission.admit(sender, tensors)

    def senders_done(self, round_: int, senders: list[str]) -> None:
        """The driver's notice, mid-round: `senders` reported `round_` and push nothing more of it here
        (Transport.senders_done); a receive waiting for them stops after a short grace."""
        self.transport.mailbox.senders_done(round_, senders)

    def transport_stats(self) -> dict[str, Any]:
        """The transport's counters (see Transport.stats)."""
        return self.transport.stats()

def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux /proc; 0.0 where it is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def _take_pending_eval(metrics: dict[str, Any]) -> dict[str, Any]:
    """An evaluation made in the overlapped exchange, when its model existed, reported as the
    round's `eval` with its age (seconds since it was made)."""
    if "eval_pending" in metrics:
        ev = metrics.pop("eval_pending")
        metrics["eval_age_s"] = round(time.monotonic() - ev.pop("t_done"), 6)
        metrics["eval"] = ev
    return metrics


def _summed(*counts: dict[str, int] | None) -> dict[str, int]:
    """Refusal counts by reason added up (the transport's and the round's own, secure aggregation's)."""
    out: dict[str, int] = {}
    for c in counts:
        for reason, n in (c or {}).items():
            out[reason] = out.get(reason, 0) + n
    return out
