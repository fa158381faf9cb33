"""diloco: H inner steps, pseudo-gradient delta = start - local, mixed over the topology, then the
outer optimizer (any torch optimizer, regions/sync/outer.py; SGD + Nesterov by default) on the
global copy (DiLoCo, arXiv 2311.08105).

Two classes. `Diloco` is the algorithm on a list of live tensors (the Algorithm seam,
regions/sync/algorithm.py): the global copy of those tensors and their outer optimizer, what a round
sends (`payload`) and what it makes of the mix (`apply`, or `step` then `rebase` when the exchange
was overlapped). `DilocoSync` is the region's round, read top to bottom: inner steps, the payload of
this round's part, the round hooks' `payload` point on it (SyncContext.payload: pacing's step weight,
update-level DP; regions/hooks.py), then one of three ways to exchange it: a hook's `aggregate`
(SyncContext.aggregate: secure aggregation's masked sum), the plain exchange and `apply`, or the
overlapped exchange (regions/sync/overlap.py). The parts are the whole model, one `Diloco`, or with
``sync.fragments: N`` one `Diloco` per fragment, fragment ``round % N`` synced per round
(regions/sync/fragments.py, Streaming DiLoCo).

Overlap (``sync.overlap``: true delayed, or eager) is explained in overlap.py: the region starts the
next round from the global model plus its own unsent progress (or, eager, from its own outer step
previewed), and applies the mean a round late.

Metrics: a round reports the exchange that *completed* in it (overlap: the previous round's,
`exchange_round` says which; none in the first round), `overlap_wait_s` the time the region sat
blocked on it, and `sync_s` everything between the end of its compute and the end of the round.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..algorithm_traits import algorithm_traits
from .common import before_outer_step_during, exchange_metrics
from .fragments import Layout, fragment_state, load_fragment_state
from .offload import outer_placement, placed_clone, pseudo_gradient_into, rebase_into, restart_behind_into
from .outer import make_outer_optimizer, preview_step
from .overlap import Overlap
from .protocol import Shapes, SyncContext

if TYPE_CHECKING:
    from ..exchange import ExchangeResult
    from ..messages import RoundPlan


class Diloco:
    """DiLoCo on `live` (views of the model's parameters: all of them, or one fragment's pieces):
    their global copy, its outer optimizer, and where the next pseudo-gradient starts. With
    ``sync.outer.offload`` these live on the host while `live` is on a GPU (regions/sync/offload.py):
    `split` says so, and the steps that cross the two go through offload's chunked copies.

    `behind` (delayed overlap of the whole model, not split): overlap's start is not copied. The
    restart sets live = global - delta and keeps `delta` (the round's pseudo-gradient, which the
    exchange in flight only reads: the mix is written into a peer's update, `mixed`) as `behind`, so
    start == global - behind bitwise, made a tensor at a time where it is read, and made whole only
    when the global copy is about to step (`_pin_start`), into behind's own storage: 4 B/param less
    from the restart to the mix, while a peer's decoded update arrives (issue 39)."""

    def __init__(self, ctx: SyncContext, live: list[torch.Tensor], *, stream: str = "", behind: bool = False):
        self.ctx, self.live, self.stream = ctx, live, stream
        model_device = live[0].device if live else torch.device("cpu")
        self.placement = outer_placement(model_device, bool(getattr(ctx.settings.outer, "offload", False)))
        # Only a placement off the model's device takes offload's paths: on a CPU model the same code
        # (and bits) as without offload.
        self.split = self.placement.device != model_device
        self.global_params = [placed_clone(v, self.placement) for v in live] if self.split \
            else [v.detach().clone() for v in live]
        # No .grad between steps: `step` lends the mix as the gradient (a model's worth less).
        self.outer_opt = make_outer_optimizer(ctx.settings.outer, self.global_params)
        # With overlap the next pseudo-gradient starts where the region last restarted its model, not
        # at the global copy (None: at the global copy, or global - behind while `behind` is set).
        self.start: list[torch.Tensor] | None = None
        self._behind_wanted = behind
        self.behind: list[torch.Tensor] | None = None

    @property
    def keeps_behind(self) -> bool:
        """Whether overlap's start is derived from `behind` (delayed, whole model); offload's split
        paths keep their start, in host memory."""
        return self._behind_wanted and not self.split

    @keeps_behind.setter
    def keeps_behind(self, value: bool) -> None:
        self._behind_wanted = value

    def payload(self, plan: RoundPlan, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The pseudo-gradient: start - params. Where the start is `behind`'s pinned storage (delayed
        overlap; it is read by nobody after this: the restart makes the next), in place."""
        if self.keeps_behind:
            return self._payload_behind(params)
        start = self.global_params if self.start is None else self.start
        if self.split:
            return pseudo_gradient_into(start, params)
        return [s.detach() - p.detach() for s, p in zip(start, params)]

    def _payload_behind(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """payload with `keeps_behind`: the same subtraction from the same start values."""
        with torch.no_grad():
            if self.start is not None:
                out = [torch.sub(s, p.detach(), out=s) for s, p in zip(self.start, params)]
                self.start = None  # now the pseudo-gradient: the restart sets where the next one starts
                return out
            if self.behind is not None:  # start = global - behind, a tensor at a time
                return [torch.sub(g, b).sub_(p.detach()) for g, b, p in zip(self.global_params, self.behind, params)]
            return [g.detach() - p.detach() for g, p in zip(self.global_params, params)]

    def apply(self, plan: RoundPlan, own: Sequence[torch.Tensor], received: ExchangeResult) -> dict[str, Any]:
        """The mix of `own` and what was received, stepped by the outer optimizer; the live tensors
        restart from the new global copy. `own` is used up (the mix is summed into it)."""
        mixed, metrics = self.mixed(plan, own, received)
        self.step(mixed)
        self.set_live(self.global_params)
        return metrics

    def mixed(self, plan: RoundPlan, own: Sequence[torch.Tensor], res: ExchangeResult) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The round's mean pseudo-gradient (less what the gauntlet refuses), then the round hooks' `mix`
        point on it (quorum's late updates, pacing.StaleMix), and the metrics that say so. `own` is
        used up: the mean is summed into it."""
        ctx, metrics = self.ctx, {}
        plan, res = self._screened(plan, res)
        # `own` is the round's pseudo-gradient, read by nobody after the mix: the mean is summed into it
        # (overlap restarts the model from it before the exchange starts), a model's worth less (issue 39).
        # With `behind` it is where the next pseudo-gradient starts from: kept, the mean written into the
        # first peer's decoded update instead (which is alive until the mix anyway).
        keep = self.keeps_behind
        mixed = ctx.mix_hooks(plan, ctx.mix(plan, own, res, consume_own=not keep, into_received=keep), res, metrics)
        return mixed, metrics

    def _screened(self, plan: RoundPlan, res: ExchangeResult) -> tuple[RoundPlan, ExchangeResult]:
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

    def step(self, mixed: Sequence[torch.Tensor]) -> None:
        """The outer optimizer's step on the global copy, `mixed` as its gradient (lent, not copied:
        the mix is the round's own and is dropped after the step)."""
        self._pin_start()
        for g, m in zip(self.global_params, mixed):
            m = m.detach()
            g.grad = m if (m.dtype, m.device) == (g.dtype, g.device) else m.to(g)
        try:
            self.outer_opt.step()
        finally:
            for g in self.global_params:
                g.grad = None

    def preview(self, mixed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What `step(mixed)` would make of the global copy; nothing changes (outer.preview_step)."""
        return preview_step(self.outer_opt, self.global_params, mixed)

    def set_live(self, values: Sequence[torch.Tensor], *, start: bool = False) -> None:
        """Live tensors = `values`; with `start`, the next pseudo-gradient starts from them too."""
        with torch.no_grad():
            for v, x in zip(self.live, values):
                v.copy_(x)
        if start and self.keeps_behind and values is self.global_params:
            self.start = self.behind = None  # the start is the global copy (pinned before it steps)
        elif start:
            self.mark_start()

    def _pin_start(self) -> None:
        """With `keeps_behind`, before the global copy changes: the start it implies made whole, into
        behind's storage (the exchange that read it has mixed), or a copy of the global copy where
        the start is the global copy itself (a restart from it while an exchange was in flight)."""
        if not self.keeps_behind or self.start is not None:
            return
        with torch.no_grad():
            if self.behind is None:
                self.start = [g.detach().clone() for g in self.global_params]
                return
            for g, b in zip(self.global_params, self.behind):
                torch.sub(g, b, out=b)
        self.start, self.behind = self.behind, None

    def mark_start(self) -> None:
        """The next pseudo-gradient starts from the live tensors as they are now (copied into the
        start buffers where there are some: nothing else holds them, fragment_state copies)."""
        if self.start is None:
            self.start = [placed_clone(v, self.placement) if self.split else v.detach().clone() for v in self.live]
            return
        with torch.no_grad():
            for s, v in zip(self.start, self.live):
                s.copy_(v)

    def restart_behind(self, delta: Sequence[torch.Tensor]) -> None:
        """Delayed overlap's restart: live = global - delta (the progress not yet synced), in place,
        and the next pseudo-gradient starts there (with `keeps_behind`: start = global - delta, kept as
        `delta` itself, which nobody may change until the global copy steps)."""
        if self.keeps_behind:
            with torch.no_grad():
                for v, g, d in zip(self.live, self.global_params, delta):
                    torch.sub(g, d, out=v)
            self.start, self.behind = None, list(delta)
            return
        if self.split and self.start is not None:
            restart_behind_into(self.live, self.start, self.global_params, delta)
            return
        with torch.no_grad():
            for v, g, d in zip(self.live, self.global_params, delta):
                torch.sub(g, d, out=v)
        self.mark_start()

    def rebase(self) -> None:
        """After an overlapped step: live = global - the progress not yet sent (start - live), kept as
        the next pseudo-gradient's, which now starts at the global copy."""
        assert self.start is not None, "rebase without overlap (or, with `behind`, before the step pinned it)"
        if self.split:
            rebase_into(self.live, self.start, self.global_params)
            return
        with torch.no_grad():  # in place, the same two subtractions: no model-sized temporaries
            for v, s, g in zip(self.live, self.start, self.global_params):
                torch.sub(s, v, out=v)
                torch.sub(g, v, out=v)
                s.copy_(g)

    def outer_buffers(self) -> dict[str, list[torch.Tensor]]:
        """The model-sized tensors of the outer state, by name: where `placement` puts them
        (sync.outer.offload; tests/unit/test_outer_offload.py, benchmarks' gpu check)."""
        momentum = [t for st in self.outer_opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0]
        return {"global": list(self.global_params), "outer state": momentum, "start": list(self.start or [])}

    def state_dict(self) -> dict[str, Any]:
        """The global copy and the outer optimizer's state_dict (its momentum, moments): references,
        as torch's own state_dicts are. Whoever keeps one copies it (rollback's copy_state); a
        checkpoint and FetchState write it at once. A copy here cost a model's worth at every round
        start, on top of rollback's own (issue 39)."""
        return {"global": [g.detach() for g in self.global_params], "outer": self.outer_opt.state_dict()}

    def load_state_dict(self, d: Any) -> None:
        """Restore the global copy and the outer optimizer's state; the live tensors are the caller's."""
        with torch.no_grad():
            for g, s in zip(self.global_params, d["global"]):
                g.copy_(s)
        self.outer_opt.load_state_dict(d["outer"])


class DilocoSync:
    """The region's DiLoCo round over its parts (the model, or its fragments), optionally overlapped."""

    traits = algorithm_traits("diloco")
    # Its state (global copies, outer optimizer, overlap's start) changes only at the round's end,
    # after run_round calls ctx.before_outer_step(): a rollback copies it there (regions/rollback.py).
    announces_outer_step = True

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        settings = ctx.settings
        self.layout = Layout(ctx.shapes, int(getattr(settings, "fragments", 1)))
        many = self.layout.n > 1  # a fragment's codec stream (its layout, its error feedback) is its own
        # Delayed overlap of the whole model derives overlap's start from the global copy (Diloco's `behind`).
        behind = bool(settings.overlap) and settings.overlap != "eager" and self.layout.n == 1
        self.parts = [Diloco(ctx, self.layout.views(ctx.params, f), stream=f"frag{f}" if many else "", behind=behind)
                      for f in range(self.layout.n)]
        self.overlap = Overlap(ctx, eager=settings.overlap == "eager", evaluate=self._evaluate_preview) \
            if settings.overlap else None
        if self.overlap is not None:
            for part in self.parts:
                if not part.keeps_behind:  # with it, a start of None is the global copy, the live tensors' equal
                    part.mark_start()  # a copy of the live tensors, where the outer state lives

    @classmethod
    def wire_shapes(cls, settings: Any, shapes: Shapes) -> Shapes:
        """The parameters' shapes: one message's (whole model), the size limits' bound (fragments:
        a round's message holds one fragment, `round_wire_shapes`)."""
        return list(shapes)

    def round_wire_shapes(self, round_: int) -> Shapes:
        """What one message of round `round_` holds: its part's shapes (the receiver's check)."""
        return [tuple(v.shape) for v in self.parts[round_ % self.layout.n].live]

    @property
    def restores_live(self) -> bool:
        """Whether load_state_dict of its own state sets the live tensors: the whole model restarts
        from its global copy; fragments keep the live model the worker restores (unsent progress)."""
        return self.layout.n == 1

    @property
    def evaluates_in_exchange(self) -> bool:
        """With overlap, an eval round's model is evaluated when its exchange completes."""
        return self.overlap is not None

    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """H inner steps, then this round's part's pseudo-gradient sent, mixed and applied by its outer
        optimizer; with overlap the previous round's exchange is applied instead (module docstring)."""
        ctx, f = self.ctx, plan.round % self.layout.n
        part = self.parts[f]
        if self.overlap is not None:
            self.overlap.window.started()
        metrics = ctx.stepper.inner_steps(plan.H, plan.lr_scale, budget_s=plan.budget_s, max_steps=plan.max_steps)
        # Nothing reads the inner steps' gradients again before the next round's first backward: they
        # go for the exchange and the outer step, the round's other peak (a model's worth, issue 39).
        for p in ctx.params:
            p.grad = None
        if self.layout.n > 1:
            metrics["fragment"] = f
        t0 = time.monotonic()
        # ctx.before_outer_step() before the first change of this algorithm's own state (the outer
        # step, overlap's restart), not before the exchange: the exchange is no change (rollback).
        done = None
        if self.overlap is not None:
            # The last round's mean is applied before this round's pseudo-gradient exists: the step
            # reads neither start nor the live tensors, which the pseudo-gradient is taken from.
            ctx.before_outer_step()
            done = self.overlap.settle(part)
        delta = part.payload(plan, part.live)
        sent = ctx.payload(plan, delta, metrics)  # new tensors if a hook changes them (overlap keeps `delta`)
        aggregated = ctx.aggregate(plan, sent)  # secure aggregation's mean (SyncContext.aggregate)
        if aggregated is not None:
            ctx.before_outer_step()
            metrics.update(self._apply_mean(part, *aggregated))
        elif self.overlap is None:
            # the rollback copy is taken while the exchange waits on the WAN (common.before_outer_step_during)
            res = before_outer_step_during(ctx.before_outer_step,
                                           lambda: ctx.exchange(plan, sent, stream=part.stream))
            metrics.update(part.apply(plan, sent, res))
            metrics.update(exchange_metrics(res))
        else:
            extra = {"exchange_fragment": f} if self.layout.n > 1 else {}
            self.overlap.hand_over(plan, part, sent, delta, metrics, extra=extra)
            metrics.update(done or {})
        metrics["sync_s"] = time.monotonic() - t0
        return metrics

    def _apply_mean(self, part: Diloco, mixed: list[torch.Tensor], metrics: dict[str, Any]) -> dict[str, Any]:
        """A hook's aggregate (secure aggregation's masked sum gives the mean itself) applied as a mix is."""
        part.step(mixed)
        part.set_live(part.global_params)
        return metrics

    def _evaluate_preview(self, part: Diloco, mixed: list[torch.Tensor]) -> dict[str, Any]:
        """The synchronised model of an overlapped exchange, before it is applied: the global model
        with `part`'s outer step previewed (called in the exchange thread)."""
        pieces = [p.preview(mixed) if p is part else p.global_params for p in self.parts]
        return self.ctx.evaluate(self.layout.assemble([t for ts in pieces for t in ts]), restore_rng=False)

    def finish(self) -> dict[str, Any]:
        """Apply the exchange still in flight (overlap), so the final model includes every round. The
        whole model restarts from the global one; fragments keep their unsent progress."""
        if self.overlap is None or not self.overlap.in_flight:
            return {}
        metrics = self.overlap.flush()
        if self.layout.n == 1:
            self.parts[0].set_live(self.parts[0].global_params, start=True)
        return metrics

    def eval_params(self) -> list[torch.Tensor]:
        """The global model (each fragment as of its last sync): what every region of a full topology
        holds alike, and what the run's result is."""
        if self.layout.n == 1:
            return self.parts[0].global_params
        return self.layout.assemble([g for p in self.parts for g in p.global_params])

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The global model (`eval_params`): the whole model's own tensors, or the fragments' assembled."""
        return self.eval_params()

    def state_dict(self) -> dict[str, Any]:
        """The whole model: its global copy and outer optimizer state. Fragments: fragments.fragment_state."""
        if self.layout.n == 1:
            return self.parts[0].state_dict()
        return fragment_state(self.parts, region=self.ctx.region, overlap=self.overlap is not None)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore the global model and outer state (a checkpoint's, or a donor's on rejoin). The whole
        model restarts from it; fragments: fragments.load_fragment_state."""
        if self.layout.n > 1:
            load_fragment_state(self.parts, d, region=self.ctx.region, overlap=self.overlap is not None)
            return
        part = self.parts[0]
        part.load_state_dict(d)
        part.set_live(part.global_params, start=self.overlap is not None)

    def rolled_back(self) -> None:
        """Nothing left to undo: the worker restored our state_dict (global model, outer state) with the round's start."""

    def close(self) -> None:
        """Stop the overlap thread without waiting for it: an exchange still in flight is abandoned
        (finish() first applies it)."""
        if self.overlap is not None:
            self.overlap.close()
