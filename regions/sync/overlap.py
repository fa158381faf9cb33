"""sync.overlap: the exchange of round r runs in a background thread while round r+1 computes, and its
outer update is applied one round late (as overlapped/streaming DiLoCo do). It wraps DiLoCo's parts
(regions/sync/diloco.py: `Diloco`, the whole model or one fragment): the round hands over a part's
pseudo-gradient (`hand_over`) and the next round's end, right after its inner steps and before its own
pseudo-gradient is taken (`settle`), or `finish`, applies it (`flush`).

Delayed (``sync.overlap: true``): at the end of round r+1 the region waits (only if the network was
slower than the compute) for round r's exchange, applies it to the global model, hands round r+1's
exchange to the thread, and starts round r+2 from the new global model *plus its own round r+1
progress* (not yet synced): ``local = global - delta_{r+1}``. Restarting from the bare global model
instead (throwing that progress away until it comes back through the exchange) applies every
pseudo-gradient to a model one round staler than the one it was taken from; with DiLoCo's outer
Nesterov momentum 0.9 that diverged on digits (4 regions, H=50: train loss 0.14 -> 580 in 24
rounds), while keeping the progress converged (0.009; serial 0.0002). A one-round delay still
shrinks what momentum can take: with overlap an outer momentum of 0.5 was stable everywhere we
tried (geofed bench wan).

Eager (``sync.overlap: eager``, arXiv 2502.12996) changes only where the next round starts: not
from ``global - delta`` but from the global model stepped by the outer optimizer with the region's
own pseudo-gradient standing in for the mean still in flight, a preview (outer.preview_step steps a
copy of the real optimizer: global model and optimizer state stay untouched, whatever the
optimizer). When the mean arrives it is applied to the global model as in delayed overlap, which
corrects the estimate. The global model and its optimizer see only the means, in order, so every
region still holds one model; when every region's pseudo-gradient equals the mean, the rounds start
where DiLoCo without overlap starts them.

When the mean arrives, the part is rebased (`Diloco.rebase`): ``local = global - (start - local)``
keeps the steps the region took since it sent, as the start of its next pseudo-gradient.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from .common import exchange_metrics, no_exchange_metrics

if TYPE_CHECKING:
    from ..messages import RoundPlan
    from .algorithm import OuterPart
    from .protocol import SyncContext


class Overlap:
    """The exchange in flight: at most one, of one part, handed over at a round's end."""

    def __init__(self, ctx: SyncContext, *, eager: bool,
                 evaluate: Callable[[OuterPart, list[torch.Tensor]], dict[str, Any]]):
        self.ctx, self.eager, self.evaluate = ctx, eager, evaluate
        self.window = OverlapWindow(getattr(ctx.settings, "spread_sends", 0.0))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="geofed-overlap")
        self._pending: Future | None = None
        self._pending_of: tuple[OuterPart, int, dict[str, Any]] | None = None  # its part, round and extra metrics

    @property
    def in_flight(self) -> bool:
        """Whether an exchange waits to be applied."""
        return self._pending is not None

    def settle(self, part: OuterPart) -> dict[str, Any]:
        """At a round's end, before its pseudo-gradient is taken: apply the exchange in flight (flush),
        so that its mean and the new pseudo-gradient are never held at once (issue 39). `part` is the
        round's own, which hand_over restarts (live tensors and start) right after: it is not rebased
        (the restart's values are the same either way). The metrics of the exchange that completed
        (none in the first round)."""
        if self._pending is None or self._pending_of is None:
            return {**no_exchange_metrics(), "exchange_round": None, "overlap_wait_s": 0.0}
        return self.flush(rebase=self._pending_of[0] is not part)

    def hand_over(self, plan: RoundPlan, part: OuterPart, sent: list[torch.Tensor], delta: list[torch.Tensor],
                  metrics: Mapping[str, Any], *, extra: Mapping[str, Any]) -> None:
        """Send `sent` (this round's, of `part`) in the background, and restart `part` from its global
        copy plus its unsent progress `delta` (eager: its own outer step previewed). The exchange
        before it was applied by `settle`."""
        assert self._pending is None, "hand_over before the exchange in flight was settled"
        window_s, spread_s = self.window.note(plan, metrics)
        # The restart reads `sent` (eager) or `delta` (which `sent` may be) before the thread sums the
        # round's mean into `sent` (Diloco.mixed): restart first, then hand it over. Delayed overlap of
        # the whole model keeps `delta` as where its next pseudo-gradient starts (Diloco.behind): its
        # mean goes into a peer's update instead.
        if self.eager:
            part.set_live(part.preview(sent), start=True)
        else:
            part.restart_behind(delta)
        self._pending = self._pool.submit(self._exchange_and_mix, plan, part, sent, window_s, spread_s)
        self._pending_of = (part, plan.round, dict(extra))

    def _exchange_and_mix(self, plan: RoundPlan, part: OuterPart, sent: list[torch.Tensor], window_s: float,
                          spread_s: float) -> tuple[dict[str, Any], list[torch.Tensor], dict[str, Any], dict[str, Any] | None]:
        res = self.ctx.exchange(plan, sent, stream=part.stream, spread_s=spread_s, window_s=window_s)
        mixed, more = part.mixed(plan, sent, res)
        # The result keeps the exchange's metrics, not the exchange: its decoded updates (a model's
        # worth per peer) would otherwise live on through the next round's compute until flush.
        done = exchange_metrics(res)
        del res
        # The synchronised model of this round exists now, a round before it is applied: an eval
        # round evaluates it here, off the training thread, so time to target counts from when it
        # existed (the global copy and its optimizer stay untouched until flush has waited).
        ev = None
        if plan.evaluate:
            ev = {**self.evaluate(part, mixed), "round": plan.round, "t_done": time.monotonic()}
        return done, mixed, more, ev

    def flush(self, *, rebase: bool = True) -> dict[str, Any]:
        """Wait for the exchange in flight, step its part's global copy with the mean and rebase the
        part (unless its caller restarts it at once: `settle`); the exchange's metrics as the round
        that completes it reports them."""
        assert self._pending is not None and self._pending_of is not None, "flush with nothing in flight"
        self.ctx.hurry()  # the compute a spread push hid behind is over: what is left goes now
        t0 = time.monotonic()
        part, exchange_round, extra = self._pending_of
        try:
            done, mixed, more, ev = self._pending.result(timeout=self.ctx.settings.deadline.max_s * 2 + 60)
        finally:
            self._pending, self._pending_of = None, None
        waited = time.monotonic() - t0
        part.step(mixed)
        del mixed  # the step's gradient, and the round's own pseudo-gradient's storage: gone before the next one
        if rebase:
            part.rebase()
        out = {**done, **more, "exchange_round": exchange_round, "overlap_wait_s": round(waited, 6),
               **extra}
        if ev is not None:
            out["eval_pending"] = ev  # the worker reports it with its age
        return out

    def close(self) -> None:
        """Stop the thread without waiting: an exchange still in flight is abandoned."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class OverlapWindow:
    """How long an overlapped exchange has before the region needs its result, and the pace of its
    pushes (sync.spread_sends).

    The result is needed when the region's next round's compute ends: after the wait for the
    driver's barrier (the other regions finishing this round) and the next compute. A peer that
    arrives within that costs this region nothing to wait for; refused as late, its update is lost
    and the run pays a resync. So the receive deadline is at least the window: the median compute
    of the region's last few rounds plus the longest of its recent waits between rounds (on 2
    shared cores one region finished a round 1.7 s before the others, whose pushes then missed a
    window of its own compute alone). The spread is a share of the shortest recent compute, so a
    paced push ends before any next round does (a round's compute moves +-25% there; sized on the
    last round alone a spread made peers wait 0.1-0.4 s in most rounds). The final round has
    neither: its exchange is waited for at once."""

    def __init__(self, spread_fraction: float, rounds: int = 5):
        self.fraction = float(spread_fraction or 0.0)
        self._compute: deque[float] = deque(maxlen=rounds)
        self._gaps: deque[float] = deque(maxlen=rounds)
        self._ended: float | None = None

    def started(self) -> None:
        """A round starts: the wait since the last one ended is a gap between rounds."""
        if self._ended is not None:
            self._gaps.append(max(0.0, time.monotonic() - self._ended))
            self._ended = None

    def note(self, plan, metrics: Mapping[str, Any]) -> tuple[float, float]:
        """(window, spread) seconds for the exchange of the round `metrics` reports; the round ends."""
        self._compute.append(float(metrics.get("compute_s") or 0.0))
        self._ended = time.monotonic()
        if plan.final:
            return 0.0, 0.0
        window = statistics.median(self._compute) + max(self._gaps, default=0.0)
        return window, self.fraction * min(self._compute)
