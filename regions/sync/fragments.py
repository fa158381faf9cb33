"""Streaming DiLoCo (arXiv 2501.18512): the model's parameters in N fragments, one synced per round.

``sync.fragments: N`` splits the parameters, in model order, into N contiguous groups balanced
by element count (`split_fragments`: a fragment is a run of whole layers). Round r runs the
plan's H inner steps and then exchanges fragment ``r % N`` only: its pseudo-gradient is taken
against that fragment's own last-synchronised copy, mixed, and stepped by that fragment's own
outer optimizer (SGD + Nesterov, its own momentum). Fragment f therefore syncs at rounds f,
f + N, ...: the coordinator plans rounds of H/N steps (orchestrator/driver/coordinator.py), so
every parameter still syncs every H inner steps, as in DiLoCo, with the offsets f*H/N of the
paper, one fragment on the wire at a time and 1/N of the model's bytes per exchange.

Between two syncs of a fragment the region keeps training it; a fragment's progress that was
not yet sent is never thrown away. With overlap (delayed or eager) fragment f's exchange runs
during the next round; when its mean arrives the fragment is rebased: ``local = global -
(start - local)`` keeps the steps the region took meanwhile, and ``start = global`` makes them
part of the fragment's next pseudo-gradient. With N = 1 every step is DiLoCo's own
(`DilocoSync`), bit for bit (tests/unit/test_fragments.py).

Per-fragment state: the global copy and the outer optimizer state of each fragment, and with
overlap where each fragment's unsent progress starts; the live model carries the rest (its
fragments' unsent progress), so a checkpoint resumes mid-schedule exactly. A donor's state
(rejoin) restarts every fragment from the donor's global model. Codec streams (error feedback)
are per fragment too: the exchange's codec state is keyed by the fragment.

The result (`eval_params`) is the global model: each fragment as of its last sync. Progress a
fragment made after its last sync of the run is not in it (the paper's evaluation does the same).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ..pacing import fednova_scale
from .common import exchange_metrics, no_exchange_metrics
from .diloco import DilocoSync
from .protocol import Shapes, SyncContext

if TYPE_CHECKING:
    from ..worker import RoundPlan


def split_fragments(shapes: Shapes, n: int) -> list[list[int]]:
    """Parameter indices of each of `n` fragments: contiguous in model order, every parameter in exactly
    one, as even in element count as whole parameters allow (a cut goes where the running total is
    nearest a multiple of total/n). Refuses more fragments than parameters."""
    if not 1 <= n <= len(shapes):
        raise ValueError(f"sync.fragments: {n} fragments of a model of {len(shapes)} parameter tensors "
                         f"(at most one fragment per tensor)")
    sizes = [max(1, _numel(s)) for s in shapes]
    total = sum(sizes)
    cuts, running, k = [], 0, 1
    for i, size in enumerate(sizes[:-1]):
        running += size
        left_tensors, left_cuts = len(sizes) - 1 - i, n - k
        # Cut after tensor i when the running total passed k*total/n (whichever side is nearer), or
        # when every remaining tensor must start a fragment of its own.
        goal = k * total / n
        nearer = running >= goal or (running + sizes[i + 1] - goal > goal - running)
        if left_cuts > 0 and (nearer or left_tensors == left_cuts):
            cuts.append(i + 1)
            k += 1
    bounds = [0, *cuts, len(sizes)]
    out = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    assert len(out) == n and sorted(i for f in out for i in f) == list(range(len(shapes))), out
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class FragmentedDilocoSync(DilocoSync):
    """DiLoCo with one fragment of the model exchanged per round (module docstring)."""

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        outer = ctx.settings.outer
        self.n = int(ctx.settings.fragments)
        self.fragments = split_fragments(ctx.shapes, self.n)
        nesterov = outer.nesterov and outer.momentum > 0
        self.outer_opts = [torch.optim.SGD([self.global_params[i] for i in f], lr=outer.lr, momentum=outer.momentum,
                                           nesterov=nesterov) for f in self.fragments]
        self.outer_opt = None  # per fragment: outer_opts
        self._pending_fragment: int | None = None

    @classmethod
    def wire_shapes(cls, settings: Any, shapes: Shapes) -> Shapes:
        """The whole model's shapes: the size limits' bound (each round's message is one fragment:
        `round_wire_shapes`)."""
        return list(shapes)

    def fragment_of(self, round_: int) -> int:
        """The fragment round `round_` exchanges."""
        return round_ % self.n

    def round_wire_shapes(self, round_: int) -> Shapes:
        """What one message of round `round_` holds: that round's fragment's shapes (the receiver's check)."""
        return [self.ctx.shapes[i] for i in self.fragments[self.fragment_of(round_)]]

    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """H inner steps, then fragment round % N's pseudo-gradient exchanged, mixed and stepped by its own
        outer optimizer; with overlap the previous round's fragment is applied instead (module docstring)."""
        ctx = self.ctx
        f = self.fragment_of(plan.round)
        idx = self.fragments[f]
        metrics = ctx.stepper.inner_steps(plan.H, plan.lr_scale, budget_s=plan.budget_s, max_steps=plan.max_steps)
        metrics["fragment"] = f
        start = self._start if self.overlap else self.global_params
        delta = [start[i].detach() - ctx.params[i].detach() for i in idx]
        scale = fednova_scale(metrics["steps"], plan.norm_steps, limit=ctx.settings.pacing.max_steps_factor)
        sent = delta if scale == 1.0 else [d * scale for d in delta]
        if scale != 1.0:
            metrics["fednova_scale"] = round(scale, 4)
        t0 = time.monotonic()
        if not self.overlap:
            res = ctx.exchange(plan, sent, stream=f"frag{f}")
            self._outer_step(f, ctx.mix(plan, sent, res))
            self._set_local(idx, [self.global_params[i] for i in idx])
            metrics.update(exchange_metrics(res))
        else:
            metrics.update(self._finish_pending() if self._pending is not None else
                           {**no_exchange_metrics(), "exchange_round": None, "overlap_wait_s": 0.0})
            self._pending = self._pool.submit(self._exchange_and_mix, plan, sent)
            self._pending_round, self._pending_fragment = plan.round, f
            if self.eager:
                self._set_local(idx, self._preview(f, sent), start=True)
            else:
                self._set_local(idx, [self.global_params[i] - d for i, d in zip(idx, delta)], start=True)
        metrics["sync_s"] = time.monotonic() - t0
        return metrics

    def _exchange_and_mix(self, plan, delta):
        f = self.fragment_of(plan.round)
        res = self.ctx.exchange(plan, delta, stream=f"frag{f}")
        mixed = self.ctx.mix(plan, delta, res)
        ev = None
        if plan.evaluate:  # the global model with this fragment's outer step previewed (DilocoSync's reason)
            model = list(self.global_params)
            for i, p in zip(self.fragments[f], self._preview(f, mixed)):
                model[i] = p
            ev = {**self.ctx.evaluate(model, restore_rng=False), "round": plan.round, "t_done": time.monotonic()}
        return res, mixed, ev

    def _finish_pending(self) -> dict[str, Any]:
        """Wait for the fragment in flight, apply its mean to its global copy, then rebase that fragment
        of the live model: the steps taken since it was sent stay, as its next pseudo-gradient's start."""
        t0 = time.monotonic()
        f = self._pending_fragment
        try:
            res, mixed, ev = self._pending.result(timeout=self.ctx.settings.deadline.max_s * 2 + 60)
        finally:
            self._pending, exchange_round, self._pending_round, self._pending_fragment = None, self._pending_round, None, None
        waited = time.monotonic() - t0
        self._outer_step(f, mixed)
        idx = self.fragments[f]
        unsent = [self._start[i] - self.ctx.params[i].detach() for i in idx]
        self._set_local(idx, [self.global_params[i] - u for i, u in zip(idx, unsent)])
        for i in idx:
            self._start[i] = self.global_params[i].detach().clone()
        out = {**exchange_metrics(res), "exchange_round": exchange_round, "overlap_wait_s": round(waited, 6),
               "exchange_fragment": f}
        if ev is not None:
            out["eval_pending"] = ev
        return out

    def finish(self) -> dict[str, Any]:
        """Apply the fragment still in flight (overlap); the other fragments keep their unsent progress."""
        return {} if self._pending is None else self._finish_pending()

    def _preview(self, f: int, mixed: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fragment f's global copy after its outer step with `mixed`, on copies (DilocoSync._preview_outer_step)."""
        opt = self.outer_opts[f]
        group = opt.param_groups[0]
        lr, mom, nesterov = group["lr"], group["momentum"], group["nesterov"]
        out = []
        for i, d in zip(self.fragments[f], mixed):
            g, step = self.global_params[i], d
            if mom:
                buf = opt.state.get(g, {}).get("momentum_buffer")
                buf = d.clone() if buf is None else buf * mom + d
                step = d + mom * buf if nesterov else buf
            out.append(g.detach() - lr * step)
        return out

    def _outer_step(self, f: int, mixed: list[torch.Tensor]) -> None:  # type: ignore[override]
        for i, m in zip(self.fragments[f], mixed):
            self.global_params[i].grad.copy_(m)
        self.outer_opts[f].step()

    def _set_local(self, idx: list[int], values: list[torch.Tensor], *, start: bool = False) -> None:
        """Live parameters `idx` = `values`; with start, also where their next pseudo-gradient starts."""
        with torch.no_grad():
            for i, v in zip(idx, values):
                self.ctx.params[i].copy_(v)
        if start:
            for i in idx:
                self._start[i] = self.ctx.params[i].detach().clone()

    def state_dict(self) -> dict:
        """Every fragment's global copy and outer optimizer state, the fragment count, whose state it is,
        and (overlap) where each fragment's unsent progress starts; the live model is the worker's."""
        d = {"global": [g.detach().clone() for g in self.global_params], "fragments": self.n,
             "outer": [opt.state_dict() for opt in self.outer_opts], "region": self.ctx.region}
        if self.overlap:
            d["start"] = [s.detach().clone() for s in self._start]
        return d

    def load_state_dict(self, d: dict) -> None:
        """Own state (checkpoint, rollback): global copies, outer states and starts; the live model was
        restored by the worker, unsent progress and all. A donor's (rejoin): every fragment restarts from
        the donor's global model. Refuses a state of another fragment count."""
        if int(d.get("fragments", 1)) != self.n:
            raise ValueError(f"sync.fragments: the state has {d.get('fragments', 1)} fragments, this run {self.n}")
        with torch.no_grad():
            for g, s in zip(self.global_params, d["global"]):
                g.copy_(s)
        for opt, sd in zip(self.outer_opts, d["outer"]):
            opt.load_state_dict(sd)
        if d.get("region") == self.ctx.region and (not self.overlap or "start" in d):
            if self.overlap:
                self._start = [s.detach().clone() for s in d["start"]]
            return
        every = list(range(len(self.global_params)))
        self._set_local(every, self.global_params, start=self.overlap)
