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

from ..pacing import update_scale
from .common import exchange_metrics, no_exchange_metrics
from .diloco import DilocoSync
from .protocol import Shapes, SyncContext

if TYPE_CHECKING:
    from ..worker import RoundPlan


Piece = tuple[int, int, int]  # (parameter index, first row, end row) of a fragment's slice of a tensor


def split_fragments(shapes: Shapes, n: int) -> list[list[Piece]]:
    """The `n` fragments of a model of `shapes`, each a list of pieces (parameter index, rows [a, b)
    along dim 0): contiguous in model order, every element in exactly one piece, and as even in element
    count as whole rows allow. A fragment takes whole tensors while they fit its share (total/n) and cuts
    the tensor that crosses the boundary between rows: a model whose size sits in one matrix (char-lm's
    GRU: 59% in one weight) still splits evenly. Scalars are never cut. Refuses more fragments than rows."""
    rows = [s[0] if len(s) else 1 for s in shapes]
    if not 1 <= n <= sum(rows):
        raise ValueError(f"sync.fragments: {n} fragments of a model of {sum(rows)} rows (at most one fragment per row)")
    row_size = [max(1, _numel(s) // max(1, r)) for s, r in zip(shapes, rows)]
    total = sum(r * w for r, w in zip(rows, row_size))
    out: list[list[Piece]] = [[] for _ in range(n)]
    f, filled = 0, 0.0
    for i, (nrows, w) in enumerate(zip(rows, row_size)):
        a = 0
        while a < nrows:
            goal = (f + 1) * total / n
            take = nrows - a if f == n - 1 else max(0, min(nrows - a, round((goal - filled) / w)))
            # at least one row a fragment, and leave at least one row for each fragment still to come
            rows_left = sum(rows[i + 1:]) + nrows - a
            take = min(take, rows_left - (n - 1 - f)) if f < n - 1 else take
            if take == 0 and not out[f]:
                take = 1
            if take:
                out[f].append((i, a, a + take))
                a, filled = a + take, filled + take * w
            if f < n - 1 and (take == 0 or filled >= goal - w / 2):
                f += 1
    assert all(out) and sum(b - a for frag in out for _, a, b in frag) == sum(rows), out
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

class FragmentedDilocoSync(DilocoSync):
    """DiLoCo with one fragment of the model exchanged per round (module docstring). Works on pieces:
    row slices of the parameters (views of the live model, own leaf copies for the global model)."""

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        outer = ctx.settings.outer
        self.n = int(ctx.settings.fragments)
        layout = split_fragments(ctx.shapes, self.n)
        self.pieces: list[Piece] = [p for frag in layout for p in frag]
        ids = iter(range(len(self.pieces)))
        self.fragments = [[next(ids) for _ in frag] for frag in layout]  # piece indices of each fragment
        self.local = [self._view(k) for k in range(len(self.pieces))]   # live model, in place
        self.gp = [v.clone() for v in self.local]                        # global model, per piece
        for g in self.gp:
            g.grad = torch.zeros_like(g)
        self.sp = [v.clone() for v in self.local] if self.overlap else None  # where unsent progress starts
        self.global_params, self._start, self.outer_opt = None, None, None  # DilocoSync's, per piece here
        nesterov = outer.nesterov and outer.momentum > 0
        self.outer_opts = [torch.optim.SGD([self.gp[k] for k in f], lr=outer.lr, momentum=outer.momentum,
                                           nesterov=nesterov) for f in self.fragments]
        self._pending_fragment: int | None = None

    def _view(self, k: int) -> torch.Tensor:
        i, a, b = self.pieces[k]
        p = self.ctx.params[i].detach()
        return p if p.dim() == 0 or (a == 0 and b == p.shape[0]) else p[a:b]

    @classmethod
    def wire_shapes(cls, settings: Any, shapes: Shapes) -> Shapes:
        """The whole model's shapes: the size limits' bound (each round's message is one fragment:
        `round_wire_shapes`)."""
        return list(shapes)

    def fragment_of(self, round_: int) -> int:
        """The fragment round `round_` exchanges."""
        return round_ % self.n

    def round_wire_shapes(self, round_: int) -> Shapes:
        """What one message of round `round_` holds: its fragment's pieces' shapes (the receiver's check)."""
        return [tuple(self.local[k].shape) for k in self.fragments[self.fragment_of(round_)]]

    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """H inner steps, then fragment round % N's pseudo-gradient exchanged, mixed and stepped by its own
        outer optimizer; with overlap the previous round's fragment is applied instead (module docstring)."""
        ctx = self.ctx
        f = self.fragment_of(plan.round)
        idx = self.fragments[f]
        self._window.started()
        metrics = ctx.stepper.inner_steps(plan.H, plan.lr_scale, budget_s=plan.budget_s, max_steps=plan.max_steps)
        metrics["fragment"] = f
        start = self.sp if self.overlap else self.gp
        delta = [start[k].detach() - self.local[k] for k in idx]
        key, scale = update_scale(ctx.settings.pacing, metrics["steps"], plan.norm_steps,
                                  filled=metrics.get("fill_steps", 0))
        sent = delta if scale == 1.0 else [d * scale for d in delta]
        if key is not None:
            metrics[key] = round(scale, 4)
        t0 = time.monotonic()
        if not self.overlap:
            res = ctx.exchange(plan, sent, stream=f"frag{f}")
            self._outer_step(f, ctx.mix(plan, sent, res))
            self._set_local(idx, [self.gp[k] for k in idx])
            metrics.update(exchange_metrics(res))
        else:
            metrics.update(self._finish_pending() if self._pending is not None else
                           {**no_exchange_metrics(), "exchange_round": None, "overlap_wait_s": 0.0})
            self._pending = self._pool.submit(self._exchange_and_mix, plan, sent, *self._window.note(plan, metrics))
            self._pending_round, self._pending_fragment = plan.round, f
            if self.eager:
                self._set_local(idx, self._preview(f, sent), start=True)
            else:
                self._set_local(idx, [self.gp[k] - d for k, d in zip(idx, delta)], start=True)
        metrics["sync_s"] = time.monotonic() - t0
        return metrics

    def _exchange_and_mix(self, plan, delta, window_s: float = 0.0, spread_s: float = 0.0):
        f = self.fragment_of(plan.round)
        res = self.ctx.exchange(plan, delta, stream=f"frag{f}", spread_s=spread_s, window_s=window_s)
        mixed = self.ctx.mix(plan, delta, res)
        ev = None
        if plan.evaluate:  # the global model with this fragment's outer step previewed (DilocoSync's reason)
            pieces = list(self.gp)
            for k, p in zip(self.fragments[f], self._preview(f, mixed)):
                pieces[k] = p
            ev = {**self.ctx.evaluate(self._assemble(pieces), restore_rng=False), "round": plan.round,
                  "t_done": time.monotonic()}
        return res, mixed, ev

    def _finish_pending(self) -> dict[str, Any]:
        """Wait for the fragment in flight, apply its mean to its global copy, then rebase that fragment
        of the live model: the steps taken since it was sent stay, as its next pseudo-gradient's start."""
        self.ctx.hurry()  # as DilocoSync's: a spread push's remaining chunks go now
        t0 = time.monotonic()
        f = self._pending_fragment
        try:
            res, mixed, ev = self._pending.result(timeout=self.ctx.settings.deadline.max_s * 2 + 60)
        finally:
            self._pending, exchange_round, self._pending_round, self._pending_fragment = None, self._pending_round, None, None
        waited = time.monotonic() - t0
        self._outer_step(f, mixed)
        idx = self.fragments[f]
        unsent = [self.sp[k] - self.local[k] for k in idx]
        self._set_local(idx, [self.gp[k] - u for k, u in zip(idx, unsent)])
        for k in idx:
            self.sp[k] = self.gp[k].detach().clone()
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
        for k, d in zip(self.fragments[f], mixed):
            g, step = self.gp[k], d
            if mom:
                buf = opt.state.get(g, {}).get("momentum_buffer")
                buf = d.clone() if buf is None else buf * mom + d
                step = d + mom * buf if nesterov else buf
            out.append(g.detach() - lr * step)
        return out

    def _outer_step(self, f: int, mixed: list[torch.Tensor]) -> None:  # type: ignore[override]
        for k, m in zip(self.fragments[f], mixed):
            self.gp[k].grad.copy_(m)
        self.outer_opts[f].step()

    def _set_local(self, idx: list[int], values: list[torch.Tensor], *, start: bool = False) -> None:
        """Live pieces `idx` = `values`; with start, also where their next pseudo-gradient starts."""
        with torch.no_grad():
            for k, v in zip(idx, values):
                self.local[k].copy_(v)
        if start:
            for k in idx:
                self.sp[k] = self.local[k].clone()

    def _assemble(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole parameters (model order) from per-piece tensors."""
        by_param: dict[int, list[torch.Tensor]] = {}
        for (i, _, _), t in zip(self.pieces, pieces):
            by_param.setdefault(i, []).append(t.detach())
        return [ts[0] if len(ts) == 1 else torch.cat(ts) for _, ts in sorted(by_param.items())]

    def eval_params(self) -> list[torch.Tensor]:
        """The global model: every fragment as of its last sync (whole parameters, assembled from the pieces)."""
        return self._assemble(self.gp)

    def state_dict(self) -> dict:
        """Every piece's global copy and every fragment's outer optimizer state, the fragment count, whose state
        it is, and (overlap) where each piece's unsent progress starts; the live model is the worker's."""
        d = {"global": [g.detach().clone() for g in self.gp], "fragments": self.n,
             "outer": [opt.state_dict() for opt in self.outer_opts], "region": self.ctx.region}
        if self.overlap:
            d["start"] = [s.detach().clone() for s in self.sp]
        return d

    def load_state_dict(self, d: dict) -> None:
        """Own state (checkpoint, rollback): global copies, outer states and starts; the live model was
        restored by the worker, unsent progress and all. A donor's (rejoin): every fragment restarts from
        the donor's global model. Refuses a state of another fragment count."""
        if int(d.get("fragments", 1)) != self.n or len(d["global"]) != len(self.gp):
            raise ValueError(f"sync.fragments: the state has {d.get('fragments', 1)} fragments, this run {self.n}")
        with torch.no_grad():
            for g, s in zip(self.gp, d["global"]):
                g.copy_(s)
        for opt, sd in zip(self.outer_opts, d["outer"]):
            opt.load_state_dict(sd)
        if d.get("region") == self.ctx.region and (not self.overlap or "start" in d):
            if self.overlap:
                self.sp = [s.detach().clone() for s in d["start"]]
            return
        self._set_local(list(range(len(self.gp))), self.gp, start=self.overlap)
