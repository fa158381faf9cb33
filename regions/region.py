"""Region: one region's trainer. A plain class (tested without Ray); regions/actor.py wraps it.

It owns the region's model, data shard, inner optimizer, transport and codec states, and runs one
round at a time as the coordinator plans it (DESIGN.md, "One round"). `run_round` reads top to
bottom: the hooks' plan, the sync algorithm's round (inner steps -> payload -> exchange -> outer
step, regions/sync/), the hooks' after_round (or recover), the region's report, the hooks' report
(regions/hooks.py). Below it, in the order a round uses them: the local steps, the exchange and
the mix the algorithm calls back (SyncContext), evaluation, and the region's state (checkpoints,
restore, catch-up from a peer).

Cross-cutting features are hooks, each whole in its module: gap filling (regions/gapfill.py, which
also stops its thread at the actor's boundary) and rollback (regions/rollback.py). A plug-in
(`plugin`, no config key) reaches the round only through add_hook, serve_state and secure
aggregation's contribution_hooks: geofed bench attack's member (benchmarks/bench/adversary.py).

Loop mode (the loop API, regions/loop.py): `model=` and `optimizer=` are the user's, `stepper=` (a
LoopStepper) takes the inner steps in the user's loop, `evaluate=` is the user's metric, and
`user_state=` the user's objects that checkpoints keep under "user". There is then no task and no
shard: the data is the user's (the built-in data stream is neither drawn nor checkpointed).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from geofed.compression import CodecError, decode_update
from geofed.p2p.admission import Refusal
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.rejoin import STATE_DONORS, check_state, combine_states, fetch_checked_states
from geofed.p2p.robust import AdmissionPerLayout, UpdateAdmission, fair_share_clip, fair_share_clip_received, robust_mix
from geofed.p2p.topology import make_topology

from . import checkpoint
from .algorithm_traits import algorithm_traits
from .backward_step import BackwardStep
from .device import Precision, device_name, move_received, resolve_device, to_device
from .emulation import Slowdown
from .exchange import Exchanger
from .export import result_state
from .gapfill import GapFill
from .gauntlet import Gauntlet, harmful_refusals
from .hooks import BeforeSend, RoundHook, overrides
from .limits import wire_limits
from .loop import eval_result, gap_fill_skipped, refuse_in_loop_mode
from .pacing import StaleMix, StepWeight, budget_over
from .privacy.dp import DpHook, dp_noise_seed
from .rollback import Rollback
from .sketch import count_sketch
from .sync import algorithm_class, mix
from .sync.common import merge_exchange_metrics
from .sync.protocol import SyncAlgorithm, SyncContext
from .tasks import make_task
from .transport_factory import make_transport
from .messages import RoundPlan, RoundReport, rss_mb

if TYPE_CHECKING:
    from .workers import WorkerGroup

log = logging.getLogger(__name__)


class Region:
    """`cfg` is the run config (geofed.orchestrator.config.RunConfig; duck-typed: regions must
    not import orchestrator)."""

    def __init__(self, cfg: Any, region: str, run_dir: str | Path, *, transport=None, tls=None,
                 advertised_host: str | None = None, task=None, plugin=None, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, stepper: Any = None,
                 evaluate: Callable[[torch.nn.Module], Any] | None = None, user_state: dict[str, Any] | None = None,
                 examples: int | None = None, workers: WorkerGroup | None = None):
        self.cfg, self.region, self.run_dir = cfg, region, Path(run_dir)
        # regions.workers > 1: this worker's side of the region's process group (regions/workers.py);
        # None: the region is this one process, as it always was.
        self.workers = workers
        if workers is None and getattr(cfg.regions, "workers", 1) > 1:
            raise ValueError(f"regions.workers: {cfg.regions.workers} workers a region run as Ray actors "
                             f"(geofed run), not in one process")
        self.loop_mode = model is not None  # the loop API (module docstring)
        self.connected: set[str] = set()  # the peers of the last connect (the driver's regions in the run)
        if self.loop_mode:
            if optimizer is None:
                raise ValueError("Region: model= needs the optimizer= that steps it")
            refuse_in_loop_mode(cfg, examples=examples)
        self.user_state = dict(user_state or {})
        self._user_evaluate, self._examples = evaluate, examples
        self.regions = list(cfg.regions.names)
        self.index = self.regions.index(region)
        torch.set_num_threads(cfg.regions.torch_threads)
        seed = cfg.run.seed
        self.traits = algorithm_traits(cfg.sync.algorithm)  # what the algorithm does, asked instead of its name
        self.hooks: list[RoundHook] = []
        if self.loop_mode:
            self._adopt_model(model, optimizer)
        else:
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
        self.gauntlet = None if self.loop_mode else Gauntlet.for_worker(self)  # None where it does not apply
        if self.loop_mode and cfg.security.score_updates:
            log.info("region %s: security.score_updates is off with the loop API (it scores updates with the "
                     "task's loss on the region's data, which are the user's)", region)
        self.stepper = self if stepper is None else stepper  # SyncContext.stepper
        self.algorithm: SyncAlgorithm = self._make_algorithm(algorithm_cls, workers)
        if sec.rollback_on_nonfinite:
            self.add_hook(Rollback(self, directory=self.run_dir / "rollback" if sec.rollback_copy == "disk" else None))
        self.completed_round = -1
        self.add_hook(StepWeight(cfg.sync.pacing))  # before DP: the weighted update is the one clipped
        if cfg.sync.pacing.mode == "quorum" and cfg.sync.pacing.late_updates == "apply":
            self.add_hook(StaleMix(cfg.sync.pacing))  # the mailbox keeps late updates only then
        self.dp = DpHook(seed=dp_noise_seed(cfg), region=self.index)
        self.add_hook(self.dp)
        self._eval_model: torch.nn.Module | None = None
        self._refusals_reported: dict[str, int] = {}
        self._pushes_done: tuple[int, list[str]] | None = None
        self._failed_resyncs = 0
        self.model.train()
        if stepper is not None:  # an InnerStepper that is a round hook too (LoopStepper)
            self.add_hook(stepper)  # last: it sees the plan the round runs (Sync.round, .H, .lr_scale)
        # `plugin(region)`: called on the built region, its result kept (a bench's hook factory).
        self.plugin = None if plugin is None else plugin(self)

    def _make_algorithm(self, algorithm_cls: Any, workers: WorkerGroup | None) -> SyncAlgorithm:
        """The round's algorithm over this region's sync context; with regions.shard_exchange, the
        sharded DiLoCo (worker k exchanges shard k, regions/shards.py)."""
        if workers is not None and workers.sharded:
            from .shards import ShardedDiloco

            return ShardedDiloco(self._sync_context(), workers)
        return algorithm_cls(self._sync_context())

    def _build_model_and_data(self, task, seed: int) -> None:
        """The device, the task, the model (one init everywhere), this region's shard and data
        stream, and the inner optimizer: __init__'s first part, in this order (it draws seeds)."""
        cfg = self.cfg
        self._place()
        self.add_hook(self.gap_fill)
        # Regions of one process (regions/inprocess.py) may share one task built from cfg.task:
        # the data is loaded and partitioned once instead of once per region.
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
        self.backward_step = BackwardStep(self.params, self.inner) if cfg.sync.inner.step_in_backward else None

    def _place(self) -> None:
        """Where and how the region computes: its device, precision, emulated slowdown and gap filler."""
        cfg = self.cfg
        # An algorithm that keeps its state in host memory (gossip's public copies): auto trains it on
        # the CPU (the config refuses an explicit cuda with it).
        spec = "cpu" if self.traits.cpu_only and cfg.regions.device == "auto" else cfg.regions.device
        self.device = resolve_device(spec, region=self.region)
        self.precision = Precision(cfg.sync.inner.precision, self.device)
        self.slowdown = Slowdown(cfg.regions.emulation.slowdown.get(self.region, 1.0))
        self.gap_fill = GapFill(self)
        self._carried: tuple[list[float], list[float]] = ([], [])  # steps taken for the next round (gap fill)

    def _adopt_model(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Loop mode's first part in place of _build_model_and_data: the user's model and optimizer,
        no task, shard or data stream (the user's loop draws its own batches)."""
        self._place()  # its gap filler is no hook: never armed (regions/loop.py); the actor pauses it around calls
        gap_fill_skipped(self.cfg, self.region)
        self.task, self.shard = None, None
        self.model = model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.batches_drawn = 0
        self.inner = optimizer
        self.backward_step = None  # the user's loop steps its own optimizer

    def _open_transport(self, transport, *, tls, advertised_host: str | None) -> None:
        """The transport (built here unless injected), wired to this region's validator, pacing and state."""
        cfg = self.cfg
        # An injected transport (the in-memory one) lets algorithm tests run without sockets.
        # `tls` (TlsMaterial) and `advertised_host` come from the actor on a multi-node cluster.
        self.transport = transport if transport is not None else make_transport(
            cfg, self.region, self.run_dir, limits=self.limits, tls=tls, advertised_host=advertised_host)
        self.transport.mailbox.set_validator(self._validate)
        pacing = cfg.sync.pacing
        if pacing.mode == "quorum" and pacing.late_updates == "apply":
            self.transport.mailbox.accept_stale(pacing.max_staleness)
        if pacing.mode == "quorum":
            self.transport.mailbox.expect_late = True
        self.serve_state(self.state_bytes)

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
            from .secagg.round import SecureAggregation, make_secagg

            self.secagg = make_secagg(cfg, self.region, self.transport, self.run_dir, deadline=self.exchanger.deadline,
                                      admission=self.admission,
                                      max_message_bytes=self.limits.max_message_bytes)
            if self.secagg is not None:
                self.add_hook(SecureAggregation(self.secagg))

    def _sync_context(self) -> SyncContext:
        """The algorithm's view of this region (bound methods: a subclass's overrides apply)."""
        return SyncContext(region=self.region, index=self.index, params=self.params, shapes=self.shapes,
                           settings=self.cfg.sync, seed=self.cfg.run.seed, stepper=self.stepper, exchange=self.exchange,
                           mix=self.mix, in_weights=self.in_weights, fetch_state=self.transport.fetch_state,
                           evaluate=self.evaluate_params, hurry=lambda: self.exchanger.hurry(),
                           payload=self.payload_hooks, aggregate=self.aggregate_hooks, mix_hooks=self.mix_hooks,
                           screen=None if self.gauntlet is None else self.gauntlet.screen,
                           before_outer_step=self.before_outer_step_hooks)

    def add_hook(self, hook: RoundHook) -> None:
        """Run `hook` at its points of every round from now on, after the hooks added before it."""
        self.hooks.append(hook)
        if overrides(hook, "before_send"):
            self.exchanger.before_send = BeforeSend([h for h in self.hooks if overrides(h, "before_send")])

    def payload_hooks(self, plan: RoundPlan, tensors: list[torch.Tensor], metrics: dict[str, Any]) -> list[torch.Tensor]:
        """The hooks' `payload` point, in order (SyncContext.payload)."""
        for hook in self.hooks:
            tensors = hook.payload(plan, tensors, metrics)
        return tensors

    def mix_hooks(self, plan: RoundPlan, mixed: list[torch.Tensor], res: Any, metrics: dict[str, Any]) -> list[torch.Tensor]:
        """The hooks' `mix` point, in order (SyncContext.mix_hooks)."""
        for hook in self.hooks:
            mixed = hook.mix(plan, mixed, res, metrics)
        return mixed

    def before_outer_step_hooks(self) -> None:
        """The hooks' `before_outer_step` point, in order (SyncContext.before_outer_step)."""
        for hook in self.hooks:
            hook.before_outer_step()

    def aggregate_hooks(self, plan: RoundPlan, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, Any]] | None:
        """The first hook's `aggregate` that gives one (SyncContext.aggregate), else None."""
        for hook in self.hooks:
            out = hook.aggregate(plan, tensors)
            if out is not None:
                return out
        return None

    def serve_state(self, provider) -> None:
        """What FetchState serves a rejoining peer: `provider()` (state_bytes, unless a hook lies)."""
        self.transport.state_provider = provider

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> str:
        """Start the transport's server; returns the address peers dial."""
        return self.transport.start()

    def connect(self, peers: dict[str, str]) -> None:
        """Dial every other region at its address (region -> address; this region's own entry is skipped).
        The driver names the regions in the run: those are the ones `probe` measures."""
        self.transport.connect({r: a for r, a in peers.items() if r != self.region})
        self.connected = set(peers) - {self.region}

    def set_members(self, names: Sequence[str]) -> None:
        """The run's regions in topology order (RoundPlan.members): after a region joined under a new
        name, the topology and mixing weights are over them from this round on. Names only grow at
        the end (the driver appends a joiner), so every index, and this region's shard, stays."""
        names = list(names)
        if names == self.regions:
            return
        if names[:len(self.regions)] != self.regions or len(set(names)) != len(names):
            raise ValueError(f"members: {names} does not extend this region's {self.regions}")
        self.regions = names
        self.topology = make_topology(self.cfg.sync.topology, len(names), seed=self.cfg.run.seed)

    def probe(self) -> dict[str, Any]:
        """Before round 0, and after a join: every connection warmed and measured (network.probe_s).
        Only the regions of the last `connect`: one that left the run (geofed leave) is no peer to probe."""
        net = self.cfg.network
        # A region that joined under a new name is connected before this region's first plan names it.
        peers = [p for p in self.regions if p != self.region and p in self.connected]
        peers += sorted(self.connected - set(self.regions))
        records = (self.exchanger.probe_links(peers, duration_s=net.probe_s, max_bytes=net.probe_max_mb << 20)
                   if net.probe_s > 0 and peers else [])
        out = {"region": self.region, "transfers": records, "links": self.exchanger.link_estimates(self.region)}
        if self.cfg.sync.pacing.mode == "time-budget" and not self.loop_mode:  # the loop's batches are the user's
            out["warm_step_s"] = self.warm_compute()
        return out

    def close(self) -> None:
        """Stop the gap filler, the algorithm's background work, the send pool and the transport, in that order."""
        self.gap_fill.stop()
        self.algorithm.close()
        if self.secagg is not None:
            self.secagg.close()
        self.exchanger.close()
        self.transport.close()
        for hook in self.hooks:
            if isinstance(hook, Rollback):  # its copy's file, where it went to disk
                hook.release()
        if self.workers is not None:  # worker 0 stops the region's other workers; each leaves the group
            self.workers.close()

    def info(self) -> dict[str, Any]:
        """Identity and size facts for the driver: pid, host, parameter and example counts, round, RSS."""
        import socket

        return {"region": self.region, "pid": os.getpid(), "host": socket.gethostname(),
                "device": str(self.device), "device_name": device_name(self.device),
                "precision": self.precision.name,
                "params": sum(p.numel() for p in self.params),
                "examples": self.shard.num_examples if self.shard is not None else self._examples,
                "completed_round": self.completed_round, "rss_mb": rss_mb()}

    # -- one round -------------------------------------------------------------------------
    def run_round(self, plan: RoundPlan) -> RoundReport:
        """Run one planned round (hooks: regions/hooks.py), evaluate if planned, and return the
        region's report of it (regions/messages.py: losses, exchange, links, codecs, refusals; its
        to_record() is the round's metrics.jsonl record). Inside the round the algorithm and the hooks
        fill a metrics dict; the report is made of it last."""
        t_start = time.time()
        if plan.members is not None:
            self.set_members(plan.members)
        for hook in self.hooks:
            plan = hook.plan(plan)
        late_s = 0.0
        if plan.budget_s is not None and plan.budget_until is not None:
            # A region that starts late (a catch-up queued ahead of its round, a slow dispatch)
            # ends with the others instead of stretching the round by its delay.
            late_s = max(0.0, plan.budget_s - (plan.budget_until - t_start))
            if late_s > 0:
                plan = dataclasses.replace(plan, budget_s=max(0.0, plan.budget_s - late_s))
        metrics = self._round(plan)
        if late_s > 0:
            metrics["budget_late_s"] = round(late_s, 6)
        self.completed_round = plan.round
        if plan.final:
            # Overlap: the round's own exchange is still in flight; its bytes add to this round's.
            merge_exchange_metrics(metrics, self.finish_pending())
        if self.workers is not None:  # the round's outer step was this worker's alone: the others take its model
            self.workers.lead_sync(self)
        if plan.evaluate and not self.algorithm.evaluates_in_exchange:
            t_eval = time.monotonic()
            metrics["eval"] = {**self.evaluate_synced(), "round": plan.round}
            metrics["eval_s"] = round(time.monotonic() - t_eval, 6)
        _take_pending_eval(metrics)
        if plan.sketch:
            metrics["sketch"] = self.sketch()  # the report's `sketch`, never in its record
        self._report(plan, metrics, wall=time.time() - t_start)
        for hook in self.hooks:
            hook.report(plan, metrics)
        return RoundReport.from_metrics(metrics)

    def _round(self, plan: RoundPlan) -> dict[str, Any]:
        """The algorithm's round (inner steps -> payload -> exchange -> outer step) and the hooks'
        after_round; a FloatingPointError from either goes to the hooks' recover (rollback)."""
        metrics = None
        try:
            metrics = self.algorithm.run_round(plan)
            for hook in self.hooks:
                metrics = hook.after_round(plan, metrics)
        except FloatingPointError as exc:
            if self.workers is not None:  # a rollback restores more than the model
                self.workers.mark_stale()
            for hook in self.hooks:
                recovered = hook.recover(plan, exc, metrics)
                if recovered is not None:
                    return recovered
            raise
        return metrics

    def _report(self, plan: RoundPlan, metrics: dict[str, Any], *, wall: float) -> None:
        """The region's own keys of the round's record: plan, codecs, time, links and refusals."""
        harmful = self.gauntlet.take() if self.gauntlet is not None else {}
        quarantined = self.gauntlet.take_quarantined() if self.gauntlet is not None else {}
        metrics.update({"round": plan.round, "region": self.region, "H": plan.H,
                        "codecs": {p: plan.codecs.get(p, self.cfg.compression.codec).key
                                   for p in self.out_peers(plan)},
                        "wall_s": wall, "utilization": min(1.0, metrics.get("compute_s", 0.0) / wall) if wall > 0 else 0.0,
                        "links": self.exchanger.link_estimates(self.region),
                        "refused": self.transport.stats().get("refused_total", 0),
                        "refusals": _summed(self.take_refusals(), metrics.get("refusals"), harmful_refusals(harmful, quarantined)),
                        "harmful": harmful, "quarantined": quarantined,
                        "clipped": self.admission.take_clipped(), "rss_mb": rss_mb()})
        done = self._pushes_done
        if done is not None and done[0] == plan.round:
            metrics["pushes_done"] = {"round": done[0], "peers": done[1]}

    def take_refusals(self) -> dict[str, int]:
        """Refusals by reason since the last call: metrics.jsonl sums to the run's total even
        across region restarts and driver resumes (the transport's counters start at zero)."""
        now = dict(self.transport.stats().get("refused", {}))
        delta = {k: n - self._refusals_reported.get(k, 0) for k, n in now.items() if n > self._refusals_reported.get(k, 0)}
        self._refusals_reported = now
        return delta

    def finish_pending(self) -> dict[str, Any]:
        """Apply an exchange still in flight (overlap) so the model includes every round; its metrics."""
        if self.workers is not None:  # called between rounds too: the region's other workers take it before their next step
            self.workers.mark_stale()
        return self.algorithm.finish()

    def flush_exchange(self) -> dict[str, Any]:
        """finish_pending between rounds, its metrics as a round reports them (an evaluation made in
        the exchange included): the driver's resync under overlap starts from every region's model
        with the in-flight exchange applied (orchestrator/driver/faults.py)."""
        return _take_pending_eval(self.finish_pending())

    # -- local steps (SyncContext.stepper) ----------------------------------------------------
    def carry_steps(self, losses: list[float], durations: list[float]) -> None:
        """Steps taken for the next round before it started (gap filling): its inner steps count them as their first."""
        self._carried = (self._carried[0] + losses, self._carried[1] + durations)

    def inner_steps(self, H: int, lr_scale: float, *, before_step=None, budget_s: float | None = None,
                    max_steps: int | None = None) -> dict[str, Any]:
        """H local optimizer steps, or with `budget_s` as many as fit in that many seconds (at least
        one, at most `max_steps`); returns loss and timing (compute only, no network; an emulated
        slowdown's sleep counts as compute: it stands for a slower device). `before_step(k)`, when
        given, runs between the k-th backward and step (e.g. gradient tracking adds its drift
        correction to the gradients there)."""
        (filled_losses, filled), self._carried = self._carried, ([], [])
        losses, durations = [], []
        t0 = time.monotonic()
        limit = H if budget_s is None else max(1, (max_steps or H) - len(filled))
        in_backward = self._steps_in_backward(before_step)
        for k in range(limit):
            t_step = time.monotonic()
            if self.workers is not None:
                self.workers.lead_step(self, lr_scale)  # the region's other workers take this step with it
            if in_backward:
                losses.append(self.forward_backward_step(lr_scale))
            else:
                losses.append(self.forward_backward())
                if before_step is not None:
                    before_step(k)
                self.optimizer_step(lr_scale)
            self.slowdown.after_step(time.monotonic() - t_step)
            durations.append(time.monotonic() - t_step)
            if budget_s is not None and budget_over(time.monotonic() - t0, durations, budget_s):
                break
        # Steps carried in (taken between rounds) are this round's first.
        compute_s = time.monotonic() - t0 + sum(filled)
        losses, durations = filled_losses + losses, filled + durations
        loss = sum(losses) / len(losses)
        steps = len(losses)
        # A round's first step reads several of the rest (a new round's data, allocation); a time
        # budget sized on a 10-step round's mean made the next rounds 2-3x too long.
        steady = durations[1:] if len(durations) >= 3 else durations
        metrics = {"train_loss": loss, "compute_s": compute_s, "step_time_s": compute_s / steps, "steps": steps,
                   "step_time_steady_s": sum(steady) / len(steady)}
        if filled:
            metrics["fill_steps"], metrics["fill_s"] = len(filled), round(sum(filled), 6)
        if not math.isfinite(loss):
            exc = FloatingPointError(f"region {self.region}: train loss is {loss}")
            exc.metrics = metrics  # what the round's rollback reports (regions/rollback.py)
            raise exc
        return metrics

    def _steps_in_backward(self, before_step) -> bool:
        """Whether this round's inner steps step in the backward pass (sync.inner.step_in_backward, and
        nothing that needs every gradient before the step: regions/backward_step.py)."""
        return (self.backward_step is not None and before_step is None and self.workers is None
                and self.dp.recording is None and self.precision.scaler is None)

    def forward_backward(self) -> float:
        """One batch of the shard: gradients let go, then forward and backward; returns the loss."""
        return self._forward_backward(None)

    def forward_backward_step(self, lr_scale: float) -> float:
        """forward_backward with the inner optimizer's step (at `lr_scale`) taken in the backward pass
        (sync.inner.step_in_backward; Region._steps_in_backward says when it may be); no gradient is
        left behind. Returns the loss."""
        return self._forward_backward(lr_scale)

    def _forward_backward(self, step_lr_scale: float | None) -> float:
        # None, not zeros: the forward pass's activations then never share memory with a model's worth
        # of gradients (the backward makes them as it frees activations; issue 39).
        self.inner.zero_grad(set_to_none=True)
        batch = to_device(next(self.batches), self.device)
        self.batches_drawn += 1
        if self.dp.recording is not None:  # record-level DP: clipped per-example gradients plus noise
            return self.dp.record_step(self.model, self.task.loss, batch, expected_batch=self.cfg.sync.inner.batch_size)
        with self.precision.autocast():
            loss = self.task.loss(self.model, batch)
        if step_lr_scale is not None:
            if self.backward_step is None:
                raise RuntimeError(f"region {self.region}: a step in the backward pass without sync.inner.step_in_backward")
            self._set_lr(step_lr_scale)
            self.backward_step.run(loss.backward)
            return float(loss.detach())
        self.precision.backward(loss, self.inner)
        for p in self.params:  # a parameter the batch did not reach steps on zeros, as before (issue 39)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.workers is not None:  # DDP-style: gradients (and loss) averaged over the region's workers
            return self.workers.average_grads(self.params, loss)
        return float(loss.detach())

    def optimizer_step(self, lr_scale: float) -> None:
        """One inner optimizer step at sync.inner.lr x `lr_scale` (the plan's schedule)."""
        self._set_lr(lr_scale)
        self.precision.step(self.inner)

    def _set_lr(self, lr_scale: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = self.cfg.sync.inner.lr * lr_scale

    def warm_compute(self, passes: int = 3) -> float:
        """Forward and backward passes on one batch of the shard, before round 0 and outside the
        training clock, changing nothing the run sees (data stream, random state, weights and
        optimiser are as before); returns the median pass time after the first, stretched by the
        emulated slowdown. A region's first steps (allocation, lazy init) take several of its later
        ones, and time-budget rounds start with a calibration round that waits for the slowest
        region. The pass time reads 5-20x below a real step (no data, no optimiser step, a hot
        cache), alike for every region: the coordinator uses only the ratios between regions, to
        give a slow region fewer calibration steps."""
        saved = self.generator.get_state()
        batch = to_device(next(self._batch_stream()), self.device)
        self.generator.set_state(saved)
        times = []
        with torch.random.fork_rng(devices=[]):
            for _ in range(passes + 1):
                t0 = time.monotonic()
                with self.precision.autocast():
                    loss = self.task.loss(self.model, batch)
                loss.backward()
                times.append(time.monotonic() - t0)
        self.inner.zero_grad(set_to_none=False)
        return statistics.median(times[1:]) * max(1.0, self.slowdown.factor)

    def _seek_data(self, start: torch.Tensor, drawn: int) -> None:
        """Replay the data stream to where the checkpoint was: the batches after a restore are the
        ones the region would have drawn had it not stopped (a shard's iterator holds its epoch's
        permutation, which the generator state alone does not give back)."""
        self.generator.set_state(start)
        self.batches = self._batch_stream()
        for _ in range(drawn):
            next(self.batches)
        self.batches_drawn = drawn

    def _batch_stream(self) -> Iterator[Any]:
        """The shard's batches; with record-level DP Poisson-sampled at batch_size / shard size
        (expected batch_size) where the shard can, as the accountant assumes (docs/privacy.md)."""
        if self.cfg.privacy.dp.mode == "record":
            rate = min(1.0, self.cfg.sync.inner.batch_size / self.shard.num_examples)
            stream = self.shard.poisson_batches(self.generator, rate)
            if stream is not None:
                return stream
        if self.workers is not None:  # this worker's part of the region's stream
            return self.workers.split(self.shard.batches(self.generator))
        return self.shard.batches(self.generator)

    def _make_inner_optimizer(self) -> torch.optim.Optimizer:
        inner = self.cfg.sync.inner
        if inner.kind == "adamw":
            return torch.optim.AdamW(self.params, lr=inner.lr, weight_decay=inner.weight_decay)
        return torch.optim.SGD(self.params, lr=inner.lr, momentum=inner.momentum, weight_decay=inner.weight_decay)

    # -- the exchange and the mix (SyncContext.exchange, .mix, .in_weights) -------------------
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
        gossip region only listens), collect from live in-neighbours (SyncContext.exchange); a
        hook's exchange, where one gives it, in place of the Exchanger's."""
        for hook in self.hooks:
            replaced = hook.exchange(plan, tensors, stream=stream)
            if replaced is not None:
                return replaced
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
        # Where the sent pseudo-gradient is, which the mix sums them with: the model's device, or the
        # host with sync.outer.offload (a peer's update then never takes a model's worth of GPU memory).
        where = tensors[0].device if tensors and isinstance(tensors[0], torch.Tensor) else self.device
        res.received = move_received(res.received, where)
        if res.stale:
            moved = move_received({f"{s}@{r}": t for s, r, t in res.stale}, where)
            res.stale = [(s, r, moved[f"{s}@{r}"]) for s, r, _ in res.stale]
        return res

    def mix(self, plan: RoundPlan, own, res, *, consume_own: bool = False, into_received: bool = False) -> list[torch.Tensor]:
        """The round's aggregate of `own` and what `res` received: the topology's weighted mix, or the
        robust coordinate-wise one that security.robust_aggregation selects (full-topology runs only).
        `consume_own`: the caller gives `own` up and the weighted mix is summed into it (p2p mix).
        `into_received`: `own` stays as it is and the received updates are given up: the weighted mix is
        written into the first peer's (p2p mix's into_received; delayed overlap's DiLoCo).
        """
        how, own_scale = self.cfg.security.robust_aggregation, None
        if self._clips_at_mix() and res.received:
            if into_received:  # the own update's scale is applied where the mix reads it
                own_scale, received, clipped = fair_share_clip_received(
                    own, res.received, multiple=self.cfg.security.clip_multiple)
            else:
                own, received, clipped = fair_share_clip(own, res.received, multiple=self.cfg.security.clip_multiple,
                                                         in_place=consume_own)  # DiLoCo gives its updates up
            self.admission.note_clipped(clipped)
            res = dataclasses.replace(res, received=received)
        gives = {"consume_own": consume_own, "into_received": into_received, "own_scale": own_scale}
        if how in ("trimmed-mean", "median"):  # the config allows them for full-topology diloco/allreduce only
            return robust_mix(own, res.received, how=how, trim_fraction=self.cfg.security.trim_fraction)
        if self.cfg.sync.pacing.mode != "barrier":
            # Paced rounds leave slow or absent regions out on purpose: the mean of what is in (the
            # same set at every region of the round), not a missing peer's weight folded into self.
            w = 1.0 / (1 + len(res.received))
            return mix(own, res.received, {p: w for p in res.received}, w, **gives)
        weights, self_w = self.in_weights(plan.round), self.topology.self_weight(self.index, plan.round)
        if self.cfg.sync.topology == "full" and plan.alive is not None:
            # Regions left out of the round (dead, stalled) are no miss: their weight goes to every
            # region of the round alike, not each into its own, so the survivors keep one model
            # (folded into self, each drifted its own way with no miss to resync it).
            live = {p: w for p, w in weights.items() if p in plan.alive}
            total = self_w + sum(live.values())
            weights, self_w = {p: w / total for p, w in live.items()}, self_w / total
        return mix(own, res.received, weights, self_w, **gives)

    def _clips_at_mix(self) -> bool:
        """security.robust_aggregation clip with clip_multiple on: each round's mix scales every peer
        update to the round's median norm (gossip mixes models, not updates: it clips on arrival)."""
        sec = self.cfg.security
        return sec.robust_aggregation == "clip" and sec.clip_multiple > 0 and not self.traits.mixes_models

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
        (the mailbox's senders_done); a receive waiting for them stops after a short grace."""
        self.transport.mailbox.senders_done(round_, senders)

    def transport_stats(self) -> dict[str, Any]:
        """The transport's counters (see Transport.stats)."""
        return self.transport.stats()

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """The task's metric of the region's live model as it stands (evaluate_synced: the synchronised one)."""
        return self._evaluate_model(self.model)

    def evaluate_synced(self) -> dict[str, Any]:
        """The metric of the algorithm's synchronised model (DiLoCo: the global model after the
        last outer step) on a scratch copy: training state, RNG and an overlapped exchange in
        flight are left untouched, so a run trains the same model with or without evaluation."""
        return self.evaluate_params(self.algorithm.eval_params())

    def evaluate_params(self, params, *, restore_rng: bool = True) -> dict[str, Any]:
        """Evaluate `params` (in the model's parameter order) on a scratch copy of the model. Off
        the training thread pass restore_rng=False: the generator is shared with training, so a
        task's evaluate must draw nothing from it (the built-in tasks draw nothing)."""
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(self.model)  # deepcopy draws no random numbers
        with torch.no_grad():
            for dst, src in zip([p for p in self._eval_model.parameters() if p.requires_grad], params):
                dst.copy_(src)
            for dst, src in zip(self._eval_model.buffers(), self.model.buffers()):
                dst.copy_(src)  # running statistics are the region's own (they are not synced)
        rng = torch.get_rng_state() if restore_rng else None
        try:
            return self._evaluate_model(self._eval_model)
        finally:
            if rng is not None:
                torch.set_rng_state(rng)  # a task may sample while evaluating: training must not see it

    def _evaluate_model(self, model: torch.nn.Module) -> dict[str, Any]:
        """The task's metric of `model`; in loop mode the user's evaluate(model), or without one the
        last round's train_loss (lower is better)."""
        if not self.loop_mode:
            r = self.task.evaluate(model)
            return {"metric": r.metric, "value": r.value, "higher_is_better": r.higher_is_better}
        if self._user_evaluate is not None:
            return eval_result(self._user_evaluate(model))
        loss = getattr(self.stepper, "last_loss", None)
        return {"metric": "train_loss", "value": math.nan if loss is None else loss, "higher_is_better": False}

    def sketch(self) -> torch.Tensor:
        """A count sketch of the synchronised model (regions/sketch.py): 32 KiB, whatever its size."""
        return count_sketch(self.algorithm.eval_params(), seed=self.cfg.run.seed)

    def result_state(self) -> dict[str, torch.Tensor]:
        """The region's result as a state_dict: the algorithm's eval_params (DiLoCo: the global
        model) over the model's buffers (regions/export.py)."""
        return result_state(self.model, self.algorithm.eval_params())

    def get_params(self) -> list[torch.Tensor]:
        """Detached copies of the trainable parameters, in host memory (the driver may have no GPU)."""
        return [p.detach().to("cpu", copy=True) for p in self.params]

    # -- state: checkpoints, restore, catch-up --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a restore needs to go on exactly: model, inner optimizer, algorithm, exchanger (codec
        and link state), the data stream's position and the global RNG. Loop mode: the user's objects
        (`user_state`, by name) in place of the data stream's position.
        """
        state = {"round": self.completed_round, "model": self.model.state_dict(), "inner": self.inner.state_dict(),
                 "algorithm": self.algorithm.state_dict(), "exchanger": self.exchanger.state_dict(),
                 "torch_rng": torch.get_rng_state(), "precision": self.precision.state_dict()}  # dropout and other draws from the global generator
        if self.loop_mode:  # the data is the user's: its position is in the user's objects, if registered
            state["user"] = {name: obj.state_dict() for name, obj in self.user_state.items()}
        else:
            state["data"] = {"start": self._data_start, "drawn": self.batches_drawn}
        return state

    def state_bytes(self) -> bytes:
        """What FetchState serves to a rejoining peer: the model and the algorithm's shared state."""
        buf = io.BytesIO()
        torch.save(self._shared_state(), buf)
        return buf.getvalue()

    def catch_up(self, peers: list[str], *, timeout_s: float | None = None,
                 before_round: int | None = None, rounds_apart: int | None = None) -> tuple[str, int]:
        """Pull current parameters from `peers` (FetchState; each joiner tries the donors in its own
        order, so rejoins spread across peers); returns (donor, round of its state).

        A donor is one member and may be hostile (issue 36, N1): each state is checked like an
        update (p2p/rejoin.py check_state: layout, finite, security.max_update_value, distance to
        this region's own state within the norm rule, per round apart); a refused one is counted
        (`bad_state`) and the next donor asked. Where regions share one model (DiLoCo, all-reduce)
        up to three donors are asked and their coordinate-wise median taken (the donor reported is
        the one closest to it). `rounds_apart`: how many rounds this region's state may lag the
        donors' (default: the rounds between its completed round and theirs, at least 1); the
        distance bound is the norm rule's x (rounds apart + 1 + resyncs failed since the last good one).

        The region's own inner optimizer, codec states and data position stay (they are its own,
        not the model's); the state is checked whole before any of it is loaded."""
        timeout_s = self.cfg.sync.deadline.max_s if timeout_s is None else timeout_s
        if before_round is not None:
            self.transport.mailbox.look_ahead(before_round)  # its peers push that round while this fetch runs
        own = self._shared_state()
        want = STATE_DONORS if not self.traits.mixes_models else 1
        try:
            got = fetch_checked_states(self.transport, peers, timeout_s=timeout_s, want=want,
                                       check=lambda peer, data: self._checked_state(peer, data, own, rounds_apart),
                                       on_refused=self._count_bad_state)
        except ValueError:
            # The region goes on drifting from the donors while its resyncs fail: the next check
            # allows one round more per failure (reset by a resync that succeeds).
            self._failed_resyncs += 1
            raise
        self._failed_resyncs = 0
        index, state = combine_states([s for _, s in got], own)
        peer = got[index][0]
        # An overlapped exchange from before (the round before an absence) must not be applied on
        # top of the state taken now: finish it here; the donor's state then replaces its result.
        self.finish_pending()
        try:
            round_ = int(state["round"])
            self.model.load_state_dict(state["model"])
            self.algorithm.load_state_dict(state["algorithm"])
        except Exception as exc:  # noqa: BLE001 - a bad donor must not take the region down with it
            raise ValueError(f"state from {peer} is unusable: {exc}") from None
        # Queued ahead of round `before_round`, the donor may have finished that round meanwhile: the
        # region still runs it (its mailbox stays open for it), from the newer model.
        self._set_completed(round_ if before_round is None else min(round_, before_round - 1))
        return peer, self.completed_round

    def _shared_state(self) -> dict[str, Any]:
        """The model and the algorithm's shared state (what state_bytes serves), for the donor check too."""
        return {"round": self.completed_round, "model": self.model.state_dict(), "algorithm": self.algorithm.state_dict()}

    def _checked_state(self, peer: str, data: bytes, own: dict[str, Any], rounds_apart: int | None) -> dict[str, Any]:
        """A donor's FetchState bytes loaded (tensors only) and checked against `own`; Refusal `bad_state` if not fit."""
        try:
            state = checkpoint.load_tensors(data, what=f"state from {peer}")  # refuses code, in our words
        except checkpoint.CheckpointError as exc:
            raise Refusal("bad_state", str(exc)) from None
        try:
            donor_round = int(state["round"])
        except (TypeError, KeyError, ValueError):
            raise Refusal("bad_state", f"the state from {peer} has no round") from None
        bound = self.admission.bound()
        apart = rounds_apart if rounds_apart is not None else donor_round - self.completed_round
        if bound is not None:
            # An honest region that missed an update in the round it resyncs after drifted by that
            # round's mix, and its outer step and momentum carry the difference on: one round more
            # than the rounds it lags (x1 refused an honest donor at 1.31 x it in bench attack),
            # and every resync that failed since the last good one a round more. Twice that: both
            # sides move while they are apart (an outage, a round alone), so their honest distance is
            # up to two updates a round (the short soak refused honest donors at 1.06x the one-sided
            # bound and left a region on its own model); a random state still lies far beyond it.
            bound *= 2 * (max(1, apart) + 1 + self._failed_resyncs)
        check_state(state, own, max_value=self.cfg.security.max_update_value, bound=bound, donor=peer)
        return state

    def _count_bad_state(self, peer: str, refusal: Refusal) -> None:
        """A refused donor state, counted with the region's refusals (metrics.jsonl, summary.json)."""
        self.transport.mailbox.count_refusal(refusal, peer, self.completed_round)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state and take up the run after its round (the data stream replays to the
        same batch)."""
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.exchanger.load_state_dict(state.get("exchanger", {}))
        if self.loop_mode:
            saved = state.get("user", {})
            missing = sorted(set(self.user_state) - set(saved))
            if missing:
                raise ValueError(f"region {self.region}: the checkpoint holds no state for {missing} (ctx.sync state=)")
            for name, obj in self.user_state.items():
                obj.load_state_dict(saved[name])
        else:
            self._seek_data(state["data"]["start"], int(state["data"]["drawn"]))
        torch.set_rng_state(state["torch_rng"])
        self.precision.load_state_dict(state.get("precision") or {})
        self._set_completed(int(state["round"]))
        if self.workers is not None:
            self.workers.mark_stale()

    def take_up(self, round_: int) -> None:
        """Take up the run after `round_` (`_set_completed`): a worker of the region that did not run the
        rounds before, whose mailbox must take peers' next round (regions.shard_exchange's followers)."""
        self._set_completed(round_)

    def _set_completed(self, round_: int) -> None:
        """Take up the run at `round_`: the mailbox closes every round up to it, so peers pushing
        round_ + 1 are inside its window at once (a fresh mailbox would call them future rounds)."""
        self.completed_round = round_
        # Peers still finishing (or re-sending) the rounds around this one are refused `late`, and a
        # resumed run's first round runs cold: expected, so logged quietly on both sides.
        self.exchanger.quiet_late_upto = round_ + 1
        self.transport.mailbox.quiet_late_upto = round_ + 1
        closed = self.transport.stats().get("closed_upto", -1)
        if round_ > closed:
            self.transport.mailbox.expect(round_, [])
            self.transport.receive(round_, 0.0)

    def save_checkpoint(self) -> str:
        """Write the state of the completed round atomically under RUN_DIR/checkpoints/<region>/ and keep
        the newest run.keep_checkpoints; returns the file's path.
        """
        if self.workers is not None:  # the checkpoint stands for every worker: they must hold its model
            self.workers.check(self)
        d = self.run_dir / "checkpoints" / self.region
        path = checkpoint.checkpoint_path(d, self.completed_round)
        checkpoint.save_atomic(path, self.state_dict())
        checkpoint.prune(d, self.cfg.run.keep_checkpoints)
        return str(path)

    def restore_checkpoint(self, at_most: int | None = None) -> dict[str, Any]:
        """Load the newest verified checkpoint (<= at_most). Returns {"round": its round, or -1
        when there is none, "skipped": [why, ...] for newer files that failed verification}."""
        skipped: list[str] = []
        found = checkpoint.load_latest(self.run_dir / "checkpoints" / self.region, at_most=at_most,
                                       on_skip=lambda path, why: skipped.append(why))
        if found is None:
            return {"round": -1, "skipped": skipped}
        self.load_state_dict(found[1])
        return {"round": found[0], "skipped": skipped}


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


__all__ = ["Region"]
