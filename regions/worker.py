"""RegionWorker: one region's trainer. A plain class (tested without Ray); regions/actor.py wraps it.

It owns the region's model, data shard, inner optimizer, gRPC transport and codec states, and
runs one round at a time as the coordinator plans it (DESIGN.md, "One round").
"""

from __future__ import annotations

import copy
import io
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from geofed.compression import CodecError, CodecSpec, decode_update
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.rejoin import fetch_state_from_any
from geofed.p2p.robust import UpdateAdmission, robust_mix
from geofed.p2p.topology import make_topology

from . import checkpoint
from .emulation import Slowdown
from .device import Precision, device_name, move_received, resolve_device, to_device
from .export import result_state
from .sync import ALGORITHMS, mix
from .sync.common import merge_exchange_metrics
from .sync.protocol import SyncAlgorithm, SyncContext
from .exchange import Exchanger
from .limits import wire_limits
from .privacy.dp import dp_step, noise_generator
from .rollback import RoundGuard
from .secagg_round import make_secagg
from .sketch import count_sketch
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
    max_steps: int | None = None
    norm_steps: float | None = None
    quorum: int | None = None
    grace_s: float = 0.0
    # privacy.dp (regions/privacy/dp.py): the mechanism, its clip and the noise multiplier the driver's
    # PrivacyBudget chose; record: DP-SGD inner steps, update: DiLoCo's sent pseudo-gradient noised.
    dp_mode: str = "off"
    dp_clip: float = 1.0
    dp_noise: float | None = None


class RegionWorker:
    """`cfg` is the run config (geofed.orchestrator.config.RunConfig; duck-typed: regions must
    not import orchestrator)."""

    def __init__(self, cfg: Any, region: str, run_dir: str | Path, *, transport=None, tls=None,
                 advertised_host: str | None = None, task=None):
        self.cfg, self.region, self.run_dir = cfg, region, Path(run_dir)
        self.regions = list(cfg.regions.names)
        self.index = self.regions.index(region)
        torch.set_num_threads(cfg.regions.torch_threads)
        seed = cfg.run.seed
        # Workers of one process (regions/inprocess.py) may share one task built from cfg.task:
        # the data is loaded and partitioned once instead of once per region.
        # Gossip keeps its public copies in host memory: auto trains it on the CPU (the config
        # refuses an explicit cuda with gossip).
        spec = "cpu" if cfg.sync.algorithm == "gossip" and cfg.regions.device == "auto" else cfg.regions.device
        self.device = resolve_device(spec, region=region)
        self.precision = Precision(cfg.sync.inner.precision, self.device)
        self.slowdown = Slowdown(cfg.regions.emulation.slowdown.get(region, 1.0))
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
        self.topology = make_topology(cfg.sync.topology, len(self.regions), seed=seed)
        algorithm_cls = ALGORITHMS[cfg.sync.algorithm]
        # What one message holds (gossip with tracking: params + tracker): the receiver's decode
        # check and the size limits both follow the algorithm's word on it.
        self.wire_shapes = algorithm_cls.wire_shapes(cfg.sync, self.shapes)
        self.limits = wire_limits(cfg, self.wire_shapes)
        sec = cfg.security
        self.admission = UpdateAdmission(mode=sec.robust_aggregation, max_update_value=sec.max_update_value,
                                         norm_multiple=sec.norm_multiple)
        # An injected transport (the in-memory one) lets algorithm tests run without sockets.
        # `tls` (TlsMaterial) and `advertised_host` come from the actor on a multi-node cluster.
        self.transport = transport if transport is not None else make_transport(
            cfg, region, self.run_dir, limits=self.limits, tls=tls, advertised_host=advertised_host)
        self.transport.set_validator(self._validate)
        pacing = cfg.sync.pacing
        if pacing.mode == "quorum" and pacing.late_updates == "apply":
            self.transport.accept_stale(pacing.max_staleness)
        if pacing.mode == "quorum" and getattr(self.transport, "mailbox", None) is not None:
            self.transport.mailbox.expect_late = True
        self.transport.set_state_provider(self.state_bytes)
        d = cfg.sync.deadline
        self.exchanger = Exchanger(self.transport, error_feedback=cfg.compression.error_feedback,
                                   deadline=AdaptiveDeadline(d.initial_s, d.min_s, d.max_s, d.k),
                                   send_timeout_s=d.max_s, max_peers=len(self.regions) - 1)
        self.exchanger.observe_own = self.admission.observe_own
        self.secagg = make_secagg(cfg, region, self.transport, self.run_dir, deadline=self.exchanger.deadline,
                                  max_message_bytes=self.limits.max_message_bytes)
        self.algorithm: SyncAlgorithm = algorithm_cls(self._sync_context())
        self.guard = RoundGuard(self) if sec.rollback_on_nonfinite else None
        self.completed_round = -1
        self.dp_plan: RoundPlan | None = None
        self.dp_generator = noise_generator()
        self._eval_model: torch.nn.Module | None = None
        self._refusals_reported: dict[str, int] = {}
        self.model.train()

    def _sync_context(self) -> SyncContext:
        """The algorithm's view of this region (bound methods: a subclass's overrides apply)."""
        return SyncContext(region=self.region, index=self.index, params=self.params, shapes=self.shapes,
                           settings=self.cfg.sync, seed=self.cfg.run.seed, stepper=self, exchange=self.exchange,
                           mix=self.mix, in_weights=self.in_weights, fetch_state=self.transport.fetch_state,
                           evaluate=self.evaluate_params, secagg=self.secagg)

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
        return {"region": self.region, "transfers": records, "links": self.exchanger.link_estimates(self.region)}

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
        metrics = self._guarded_round(plan)
        self.completed_round = plan.round
        if plan.final:
            # Overlap: the round's own exchange is still in flight; its bytes add to this round's.
            merge_exchange_metrics(metrics, self.finish_pending())
        if plan.evaluate and not self.algorithm.evaluates_in_exchange:
            t_eval = time.monotonic()
            metrics["eval"] = {**self.evaluate_synced(), "round": plan.round}
            metrics["eval_s"] = round(time.monotonic() - t_eval, 6)
        if "eval_pending" in metrics:  # evaluated in the overlapped exchange, when its model existed
            ev = metrics.pop("eval_pending")
            metrics["eval_age_s"] = round(time.monotonic() - ev.pop("t_done"), 6)
            metrics["eval"] = ev
        if plan.sketch:
            metrics["sketch"] = self.sketch()  # the runner takes it out before metrics.jsonl
        wall = time.time() - t_start
        metrics.update({"round": plan.round, "region": self.region, "H": plan.H,
                        "codecs": {p: plan.codecs.get(p, self.cfg.compression.codec).key
                                   for p in self.out_peers(plan)},
                        "wall_s": wall, "utilization": min(1.0, metrics.get("compute_s", 0.0) / wall) if wall > 0 else 0.0,
                        "links": self.exchanger.link_estimates(self.region),
                        "refused": self.transport.stats().get("refused_total", 0), "refusals": self.take_refusals(),
                        "clipped": self.admission.take_clipped(), "rss_mb": rss_mb()})
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

    def inner_steps(self, H: int, lr_scale: float, *, before_step=None, budget_s: float | None = None,
                    max_steps: int | None = None) -> dict[str, Any]:
        """H local optimizer steps, or with `budget_s` as many as fit in that many seconds (at least
        one, at most `max_steps`); returns loss and timing (compute only, no network; an emulated
        slowdown's sleep counts as compute: it stands for a slower device). `before_step(k)`, when
        given, runs between the k-th backward and step (e.g. gradient tracking adds its drift
        correction to the gradients there)."""
        losses = []
        t0 = time.monotonic()
        limit = H if budget_s is None else max(1, max_steps or H)
        for k in range(limit):
            t_step = time.monotonic()
            losses.append(self.forward_backward())
            if before_step is not None:
                before_step(k)
            self.optimizer_step(lr_scale)
            self.slowdown.after_step(time.monotonic() - t_step)
            if budget_s is not None and time.monotonic() - t0 >= budget_s:
                break
        compute_s = time.monotonic() - t0
        loss = sum(losses) / len(losses)
        steps = len(losses)
        metrics = {"train_loss": loss, "compute_s": compute_s, "step_time_s": compute_s / steps, "steps": steps}
        if not math.isfinite(loss):
            exc = FloatingPointError(f"region {self.region}: train loss is {loss}")
            exc.metrics = metrics  # what the round's rollback reports (regions/rollback.py)
            raise exc
        return metrics

    def forward_backward(self) -> float:
        """One batch of the shard: gradients zeroed, then forward and backward; returns the loss."""
        self.inner.zero_grad(set_to_none=False)
        batch = to_device(next(self.batches), self.device)
        self.batches_drawn += 1
        if self.dp_plan is not None:  # record-level DP: clipped per-example gradients plus noise
            return dp_step(self.model, self.task.loss, batch, clip=self.dp_plan.dp_clip,
                           noise_multiplier=self.dp_plan.dp_noise, expected_batch=self.cfg.sync.inner.batch_size,
                           generator=self.dp_generator)
        with self.precision.autocast():
            loss = self.task.loss(self.model, batch)
        self.precision.backward(loss, self.inner)
        return float(loss.detach())

    def optimizer_step(self, lr_scale: float) -> None:
        """One inner optimizer step at sync.inner.lr x `lr_scale` (the plan's schedule)."""
        for group in self.inner.param_groups:
            group["lr"] = self.cfg.sync.inner.lr * lr_scale
        self.precision.step(self.inner)

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

    def exchange(self, plan: RoundPlan, tensors, *, single_codec: bool = False, send: bool = True):
        """Push `tensors` to this round's live out-neighbours (none with send=False: a rejoining
        gossip region only listens), collect from live in-neighbours (SyncContext.exchange)."""
        alive = set(plan.alive) if plan.alive is not None else None
        in_peers = [p for p in self.in_weights(plan.round) if alive is None or p in alive]
        codecs = {} if single_codec else plan.codecs
        out_peers = self.out_peers(plan) if send else []
        quorum = None if plan.quorum is None else max(0, min(plan.quorum - 1, len(in_peers)))
        res = self.exchanger.exchange(plan.round, tensors, out_peers=out_peers, in_peers=in_peers,
                                      codecs=codecs, default_codec=self.cfg.compression.codec,
                                      quorum=quorum, grace_s=plan.grace_s)
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
        if how in ("trimmed-mean", "median"):  # the config allows them for full-topology diloco/allreduce only
            return robust_mix(own, res.received, how=how, trim_fraction=self.cfg.security.trim_fraction)
        if self.cfg.sync.pacing.mode != "barrier":
            # Paced rounds leave slow or absent regions out on purpose: the mean of what is in (the
            # same set at every region of the round), not a missing peer's weight folded into self.
            w = 1.0 / (1 + len(res.received))
            return mix(own, res.received, {p: w for p in res.received}, w)
        return mix(own, res.received, self.in_weights(plan.round), self.topology.self_weight(self.index, plan.round))

    def _validate(self, sender: str, round_: int, payload: memoryview) -> list[torch.Tensor]:
        """Called by the transport for every incoming update: refuse (ValueError, or a Refusal
        with its own reason from admission) what is not sane."""
        try:
            tensors = decode_update(payload, max_bytes=self.limits.decode_bytes, expected_shapes=self.wire_shapes)
        except CodecError as exc:
            raise ValueError(f"undecodable update from {sender}: {exc}") from None
        return self.admission.admit(sender, tensors)

    # -- evaluation and state --------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """The task's metric of the region's live model as it stands (evaluate_synced: the synchronised one)."""
        r = self.task.evaluate(self.model)
        return {"metric": r.metric, "value": r.value, "higher_is_better": r.higher_is_better}

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
            r = self.task.evaluate(self._eval_model)
        finally:
            if rng is not None:
                torch.set_rng_state(rng)  # a task may sample while evaluating: training must not see it
        return {"metric": r.metric, "value": r.value, "higher_is_better": r.higher_is_better}

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

    def state_dict(self) -> dict[str, Any]:
        """Everything a restore needs to go on exactly: model, inner optimizer, algorithm, exchanger (codec
        and link state), the data stream's position and the global RNG.
        """
        return {"round": self.completed_round, "model": self.model.state_dict(), "inner": self.inner.state_dict(),
                "algorithm": self.algorithm.state_dict(), "exchanger": self.exchanger.state_dict(),
                "data": {"start": self._data_start, "drawn": self.batches_drawn},
                "torch_rng": torch.get_rng_state(), "precision": self.precision.state_dict()}  # dropout and other draws from the global generator

    def state_bytes(self) -> bytes:
        """What FetchState serves to a rejoining peer: the model and the algorithm's shared state."""
        buf = io.BytesIO()
        torch.save({"round": self.completed_round, "model": self.model.state_dict(),
                    "algorithm": self.algorithm.state_dict()}, buf)
        return buf.getvalue()

    def catch_up(self, peers: list[str], *, timeout_s: float | None = None,
                 before_round: int | None = None) -> tuple[str, int]:
        """Pull current parameters from one of `peers` (FetchState; each joiner tries the donors in
        its own order, so rejoins spread across peers); returns (donor, round of its state).

        The region's own inner optimizer, codec states and data position stay (they are its own,
        not the model's); the state is checked whole before any of it is loaded."""
        timeout_s = self.cfg.sync.deadline.max_s if timeout_s is None else timeout_s
        peer, data = fetch_state_from_any(self.transport, peers, timeout_s=timeout_s)
        # An overlapped exchange from before (the round before an absence) must not be applied on
        # top of the state taken now: finish it here; the donor's state then replaces its result.
        self.finish_pending()
        state = checkpoint.load_tensors(data, what=f"state from {peer}")  # refuses code, in our words
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

    def transport_stats(self) -> dict[str, Any]:
        """The transport's counters (see Transport.stats)."""
        return self.transport.stats()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state and take up the run after its round (the data stream replays to the
        same batch)."""
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.exchanger.load_state_dict(state.get("exchanger", {}))
        self._seek_data(state["data"]["start"], int(state["data"]["drawn"]))
        torch.set_rng_state(state["torch_rng"])
        self.precision.load_state_dict(state.get("precision") or {})
        self._set_completed(int(state["round"]))

    def _seek_data(self, start: torch.Tensor, drawn: int) -> None:
        """Replay the data stream to where the checkpoint was: the batches after a restore are the
        ones the region would have drawn had it not stopped (a shard's iterator holds its epoch's
        permutation, which the generator state alone does not give back)."""
        self.generator.set_state(start)
        self.batches = self._batch_stream()
        for _ in range(drawn):
            next(self.batches)
        self.batches_drawn = drawn

    def _batch_stream(self):
        """The shard's batches; with record-level DP Poisson-sampled at batch_size / shard size
        (expected batch_size) where the shard can, as the accountant assumes (docs/privacy.md)."""
        if self.cfg.privacy.dp.mode == "record":
            rate = min(1.0, self.cfg.sync.inner.batch_size / self.shard.num_examples)
            stream = self.shard.poisson_batches(self.generator, rate)
            if stream is not None:
                return stream
        return self.shard.batches(self.generator)

    def _set_completed(self, round_: int) -> None:
        """Take up the run at `round_`: the mailbox closes every round up to it, so peers pushing
        round_ + 1 are inside its window at once (a fresh mailbox would call them future rounds)."""
        self.completed_round = round_
        # Peers still finishing (or re-sending) the rounds around this one are refused `late`, and a
        # resumed run's first round runs cold: expected, so logged quietly on both sides.
        self.exchanger.quiet_late_upto = round_ + 1
        if getattr(self.transport, "mailbox", None) is not None:
            self.transport.mailbox.quiet_late_upto = round_ + 1
        closed = self.transport.stats().get("closed_upto", -1)
        if round_ > closed:
            self.transport.expect(round_, [])
            self.transport.receive(round_, 0.0)

    def save_checkpoint(self) -> str:
        """Write the state of the completed round atomically under RUN_DIR/checkpoints/<region>/ and keep
        the newest run.keep_checkpoints; returns the file's path.
        """
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

    def _make_inner_optimizer(self) -> torch.optim.Optimizer:
        inner = self.cfg.sync.inner
        if inner.kind == "adamw":
            return torch.optim.AdamW(self.params, lr=inner.lr, weight_decay=inner.weight_decay)
        return torch.optim.SGD(self.params, lr=inner.lr, momentum=inner.momentum, weight_decay=inner.weight_decay)


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux /proc; 0.0 where it is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        return 0.0
