"""diloco: H inner steps, pseudo-gradient delta = start - local, mixed over the topology, outer
SGD+Nesterov on the global copy (DiLoCo, arXiv 2311.08105).

With overlap (streaming, as overlapped/streaming DiLoCo do) the exchange of round r runs in a
background thread while round r+1 computes, and its outer update is applied one round late. At
the end of round r+1 the region waits (only if the network was slower than the compute) for
round r's exchange, applies it to the global model, hands round r+1's exchange to the thread, and
starts round r+2 from the new global model *plus its own round r+1 progress* (not yet synced):
``local = global - delta_{r+1}``. Restarting from the bare global model instead (throwing that
progress away until it comes back through the exchange) applies every pseudo-gradient to a
model one round staler than the one it was taken from; with DiLoCo's outer Nesterov momentum 0.9
that diverged on digits (4 regions, H=50: train loss 0.14 -> 580 in 24 rounds), while keeping the
progress converged (0.009; serial 0.0002). A one-round delay still shrinks what momentum can
take: with overlap an outer momentum of 0.5 was stable everywhere we tried (geofed bench wan).
`finish()` applies the last exchange, so the final model includes every round.

Eager overlap (``sync.overlap: eager``, arXiv 2502.12996) changes only where the next round
starts: not from ``global - delta`` (the region's progress added raw) but from the global model
stepped by the outer optimizer with the region's own pseudo-gradient standing in for the mean
still in flight (a preview: global model and momentum stay untouched). When the mean arrives it
is applied to the global model as in delayed overlap, which corrects the estimate. The global
model and its momentum see only the means, in order, so every region still holds one model; when
every region's pseudo-gradient equals the mean, the rounds start where DiLoCo without overlap
starts them.

Metrics: a round reports the exchange that *completed* in it (overlap: the previous round's,
`exchange_round` says which; none in the first round), `overlap_wait_s` the time the region sat
blocked on it, and `sync_s` everything between the end of its compute and the end of the round.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ..pacing import mix_stale, update_scale
from ..privacy.dp import clip_and_noise_update, noise_generator
from .common import OverlapWindow, exchange_metrics, no_exchange_metrics
from .protocol import Shapes, SyncContext

if TYPE_CHECKING:
    from ..worker import RoundPlan


class DilocoSync:
    """H inner steps, then an outer step on the mixed pseudo-gradients (optionally overlapped)."""

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        outer = ctx.settings.outer
        self.global_params = [p.detach().clone() for p in ctx.params]
        for g in self.global_params:
            g.grad = torch.zeros_like(g)
        self.outer_opt = torch.optim.SGD(self.global_params, lr=outer.lr, momentum=outer.momentum,
                                         nesterov=outer.nesterov and outer.momentum > 0)
        self.overlap = bool(ctx.settings.overlap)
        # Eager (arXiv 2502.12996): the next round starts from the global model stepped by the outer
        # optimizer with this region's own pseudo-gradient standing in for the mean still in flight.
        self.eager = ctx.settings.overlap == "eager"
        self._pending: Future | None = None
        self._pending_round: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="geofed-overlap") if self.overlap else None
        self._window = OverlapWindow(getattr(ctx.settings, "spread_sends", 0.0))
        self._start = [p.detach().clone() for p in ctx.params] if self.overlap else None  # where this round began
        self._dp_generator: torch.Generator | None = None  # privacy.dp.mode update, made on first use

    @classmethod
    def wire_shapes(cls, settings: Any, shapes: Shapes) -> Shapes:
        """One message is the pseudo-gradient: the parameters' shapes."""
        return list(shapes)

    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """H inner steps, then the pseudo-gradient (round start - local) exchanged and mixed and the outer
        step applied; with overlap, this round's exchange is handed to the background thread and the
        previous round's is applied instead (see the module docstring).
        """
        ctx = self.ctx
        self._window.started()
        metrics = ctx.stepper.inner_steps(plan.H, plan.lr_scale, budget_s=plan.budget_s, max_steps=plan.max_steps)
        start = self._start if self.overlap else self.global_params
        delta = [s.detach() - p.detach() for s, p in zip(start, ctx.params)]
        # Time-budget rounds: the step weight (or FedNova's factor) on what is sent
        # (regions/pacing.py); the region's own unsynced progress (overlap) stays what it trained.
        key, scale = update_scale(ctx.settings.pacing, metrics["steps"], plan.norm_steps,
                                  filled=metrics.get("fill_steps", 0))
        sent = delta if scale == 1.0 else [d * scale for d in delta]
        if key is not None:
            metrics[key] = round(scale, 4)
        if plan.dp_mode == "update" and plan.dp_noise is not None:
            sent = self._dp_noised(plan, sent, metrics)
        t0 = time.monotonic()
        if ctx.secagg is not None:  # the config refuses overlap with it
            mixed, secagg_metrics = ctx.secagg.exchange(plan.round, sent, plan.alive)
            self._outer_step(mixed)
            self._load_global()
            metrics.update(secagg_metrics)
        elif not self.overlap:
            plan, res = self._screened(plan, ctx.exchange(plan, sent))
            mixed = ctx.mix(plan, sent, res)
            if res.stale:
                mixed, weights = mix_stale(mixed, [(r, t) for _, r, t in res.stale], round_=plan.round,
                                           n_regions=1 + len(res.received),
                                           exponent=ctx.settings.pacing.staleness_exponent)
                metrics["stale_applied"] = [{"peer": p, "round": r, "weight": round(w, 4)}
                                            for (p, r, _), w in zip(res.stale, weights)]
            self._outer_step(mixed)
            self._load_global()
            metrics.update(exchange_metrics(res))
        else:
            metrics.update(self._finish_pending() if self._pending is not None else
                           {**no_exchange_metrics(), "exchange_round": None, "overlap_wait_s": 0.0})
            self._pending = self._pool.submit(self._exchange_and_mix, plan, sent, *self._window.note(plan, metrics))
            self._pending_round = plan.round
            if self.eager:
                self._load_params(self._preview_outer_step(sent))
            else:
                self._load_global(unsynced=delta)
        metrics["sync_s"] = time.monotonic() - t0
        return metrics

    def _dp_noised(self, plan: RoundPlan, sent: list[torch.Tensor], metrics: dict) -> list[torch.Tensor]:
        """Update-level DP on what leaves the region: clipped to plan.dp_clip, Gaussian noise of
        plan.dp_noise x clip (local DP: secure aggregation's 1/n noise share is not wired). A copy:
        with overlap, `delta` stays the region's own unsynced progress."""
        if self._dp_generator is None:
            self._dp_generator = noise_generator(self.ctx.dp_noise_seed, region=self.ctx.index, stream="update")
        noised = [t.clone() for t in sent]
        out = clip_and_noise_update(noised, clip=plan.dp_clip, noise_multiplier=plan.dp_noise,
                                    generator=self._dp_generator)
        metrics["dp_update_norm"], metrics["dp_clip_scale"] = round(out["update_norm"], 6), round(out["clip_scale"], 6)
        return noised

    def finish(self) -> dict[str, Any]:
        """Apply the last in-flight exchange (overlap), so the final model includes every round."""
        if self._pending is None:
            return {}
        metrics = self._finish_pending()
        self._load_global()
        return metrics

    def _exchange_and_mix(self, plan, delta, window_s: float = 0.0, spread_s: float = 0.0):
        plan, res = self._screened(plan, self.ctx.exchange(plan, delta, spread_s=spread_s, window_s=window_s))
        mixed = self.ctx.mix(plan, delta, res)
        # The synchronised model of this round exists now, a round before it is applied: an eval
        # round evaluates it here, off the training thread, so time to target counts from when it
        # existed (global params and momentum stay untouched until _finish_pending has waited).
        ev = None
        if plan.evaluate:
            ev = {**self.ctx.evaluate(self._preview_outer_step(mixed), restore_rng=False),
                  "round": plan.round, "t_done": time.monotonic()}
        return res, mixed, ev

    def _screened(self, plan, res):
        """(plan, res) less the updates the gauntlet refuses (security.score_updates), each scored
        against the global model this exchange's outer step starts from (with overlap the previous
        step is applied before this exchange is handed to the thread, and the next waits for it). A
        refused sender is left out of the plan's `alive` for the mix, as a region left out of the
        round is: a full topology's mix then gives its weight to every region alike, and regions that
        refused the same update keep one model (folded into each one's own weight, as a network miss
        is, the bench's honest regions drifted apart: resync donors 15-26 apart, refused)."""
        if self.ctx.screen is None or not res.received:
            return plan, res
        screened = self.ctx.screen(plan, self.global_params, res)
        refused = set(res.received) - set(screened.received)
        if not refused:
            return plan, screened
        alive = plan.alive if plan.alive is not None else (self.ctx.region, *self.ctx.in_weights(plan.round))
        return dataclasses.replace(plan, alive=tuple(r for r in alive if r not in refused)), screened

    def _preview_outer_step(self, mixed: list[torch.Tensor]) -> list[torch.Tensor]:
        """What _outer_step will make of the global model, computed on copies: torch's SGD update
        (no dampening, no weight decay), momentum buffers read, not written."""
        group = self.outer_opt.param_groups[0]
        lr, mom, nesterov = group["lr"], group["momentum"], group["nesterov"]
        out = []
        for g, d in zip(self.global_params, mixed):
            step = d
            if mom:
                buf = self.outer_opt.state.get(g, {}).get("momentum_buffer")
                buf = d.clone() if buf is None else buf * mom + d
                step = d + mom * buf if nesterov else buf
            out.append(g.detach() - lr * step)
        return out

    def _finish_pending(self) -> dict[str, Any]:
        self.ctx.hurry()  # the compute a spread push hid behind is over: what is left goes now
        t0 = time.monotonic()
        try:
            res, mixed, ev = self._pending.result(timeout=self.ctx.settings.deadline.max_s * 2 + 60)
        finally:
            self._pending, exchange_round, self._pending_round = None, self._pending_round, None
        waited = time.monotonic() - t0
        self._outer_step(mixed)
        out = {**exchange_metrics(res), "exchange_round": exchange_round, "overlap_wait_s": round(waited, 6)}
        if ev is not None:
            out["eval_pending"] = ev  # the worker reports it with its age
        return out

    @property
    def evaluates_in_exchange(self) -> bool:
        """With overlap, an eval round's model is evaluated when its exchange completes."""
        return self.overlap

    def rolled_back(self) -> None:
        """Nothing left to undo: the worker's restore covered this object's state_dict too."""
        pass  # the worker restored our state_dict (global model, outer momentum) with the round's start

    def _outer_step(self, mixed: list[torch.Tensor]) -> None:
        for g, m in zip(self.global_params, mixed):
            g.grad.copy_(m)
        self.outer_opt.step()

    def _load_global(self, unsynced: list[torch.Tensor] | None = None) -> None:
        """Local model = global model (minus the region's own progress still in flight)."""
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(self.ctx.params, self.global_params)):
                if unsynced is None:
                    p.copy_(g)
                else:
                    torch.sub(g, unsynced[i], out=p)
        if self.overlap:
            self._start = [p.detach().clone() for p in self.ctx.params]

    def _load_params(self, params: list[torch.Tensor]) -> None:
        """Local model = `params` (eager overlap: the global model with the region's own outer step previewed)."""
        with torch.no_grad():
            for p, v in zip(self.ctx.params, params):
                p.copy_(v)
        self._start = [p.detach().clone() for p in self.ctx.params]

    def eval_params(self) -> list[torch.Tensor]:
        """The global model (after the last applied outer step): what every region of a full
        topology holds alike, and what the run's result is."""
        return self.global_params

    def state_dict(self) -> dict:
        """The global model (copied) and the outer optimizer's state_dict (its momentum buffers)."""
        return {"global": [g.detach().clone() for g in self.global_params], "outer": self.outer_opt.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        """Restore the global model and outer momentum (a checkpoint's, or a donor's on rejoin) and restart
        the local model from it.
        """
        with torch.no_grad():
            for g, s in zip(self.global_params, d["global"]):
                g.copy_(s)
        self.outer_opt.load_state_dict(d["outer"])
        self._load_global()

    def close(self) -> None:
        """Stop the overlap thread without waiting for it: an exchange still in flight is abandoned
        (finish() first applies it).
        """
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
