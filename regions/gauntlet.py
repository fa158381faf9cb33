"""The gauntlet: a peer's update is scored on this region's own data before it counts (issue 36).

Covenant's Gauntlet idea, as an admission stage of its own. A DiLoCo pseudo-gradient is
``theta_global - theta_local``, so ``theta - update`` is the model its sender claims to have
trained from the global model ``theta`` that the round's outer step starts from. The receiver
evaluates its task loss at both on a few fixed batches of its own shard (data the sender never
saw) and refuses, under ``harmful``, an update whose claimed model is worse on those batches by
more than a bar (below). A refused update leaves the mix as if its sender had missed the round,
but it is counted as a refusal, not as a network miss (the exchange recorded it as received).

The bar is ``max(security.score_margin, SPREAD_MULTIPLE x the median increase of the round's
received updates)`` (increases below 0 read as 0). What separates honest from hostile updates is not
the estimate's noise (the paired per-batch standard error of honest readings was below 0.03) but
honest heterogeneity: a peer's local model is worse on this region's data than the global model,
by little on IID data and by a lot early in a non-IID run. Measured in process (4 Regions,
digits MLP, DiLoCo H 100, AdamW 0.003, outer 0.7/0.9, 20 rounds, 8 batches x 32, step 1,
one repetition, seed 0), loss increases:

- honest peers: IID at most +0.11; Dirichlet alpha 0.3 up to +3.7 in rounds 0-2 and +0.33 after;
- hostile, IID: x-9 and x+9 at least +2.1 and a flip at the 10x bound at least +5.2, except the
  rounds where the member's own update was ~0 (x-9 of it read -0.006..+0.0: harmless, admitted);
  non-IID: x+9 at least +28, x-9 +1.4..+95 until its update shrank to ~0 (round 14 on: +0.0..+0.28);
- a flip at the median norm (x-1): -0.04..+0.38, inside the honest range: not caught here (the clip
  at the median bounds it to its 1/n share).

Under the bar with score_margin 0.5 and SPREAD_MULTIPLE 8, no honest update of those runs was
refused (0 of 180 IID, 0 of 180 non-IID undisturbed; 4: 3 of 180 non-IID), every bound flip and x+9
was (60 of 60 each), x-9 57 of 60 (IID) and 39 of 60 (non-IID; the others were the ~0 updates).

What does not hold (bench attack, docs/reliability.md): once the loss on the region's own shard is
about 0 (digits memorised by round 5 at H 300) the readings lose their power: a member quarantined
before stays so (below), but one that starts lying only then falls back to the clip (counted only
where clipped); each region judges alone, so a borderline update refused by some regions and
admitted by others sets their models apart.

Where it applies: DiLoCo (overlap modes included), unless security.robust_aggregation is ``none``
(admission off: the value bound only) or secure aggregation is on (whose sum hides
each update) and without fragments (a fragment's update says nothing about the loss alone).
Stale updates of quorum rounds (sync.pacing late_updates apply) are not scored.

Quarantine: a sender refused as harmful in ``QUARANTINE_AFTER`` of its last ``QUARANTINE_WINDOW``
scored rounds at this region is quarantined there: its updates are still scored but refused whatever
they score, counted as ``quarantined`` (or ``harmful``, when they are), until it has sent
``RELEASE_AFTER`` harmless updates that *tell* (below) with no harmful one between (doubled at each
new quarantine, at most ``RELEASE_MAX``). Release asks for good behaviour, not for time: a member
that has shown itself hostile is not trusted again by waiting out rounds where its lie is too small
to read. A harmless reading tells only where the update and its reverse (``theta + update``, read
for a quarantined sender's update alone) are more than ``score_margin`` apart: a reading that cannot
tell an update from its own sign flip is no evidence that it was not flipped. Late in a run both
read alike: in process (4 Regions, the bench's config: H 300, 4 batches, IID, seed 1) the x-9
member's readings from round 5 on were 0.00-0.29 apart, while in rounds 0-3 it read 0.7-12 apart
and harmful; honest updates on IID data read 0.00-0.29 apart from round 1 on, and 0.04-4.1 on a
Dirichlet (alpha 0.3) partition (both ways: there an honest update often reads worse than its
reverse on another region's data, so the test is the distance, not its sign). Before, 8 harmless
readings of any kind released the member, and its later acts passed unread and uncounted until it
was caught again (bench attack flip_x-9 57, 51, 60 and scale_x+9 60, 54, 60 of 60 acts counted;
with this rule 60, 60, 60 and 59, 58, 60, the 3 missing ones pushes that arrived late, unscored).
The quarantine is this region's alone, like every refusal, and is not kept across a resume. Its
cost is the false one: bench attack's undisturbed runs refused an honest sender as harmful 2-3
times late in a run (each region's loss on its own batches is then about 0 and a rise of 0.5 is a
single batch), enough once to quarantine it at one receiver, and late in an IID run it then stays
quarantined to the end. Requiring a rise of 2 standard errors of its paired per-batch differences
as well (a rise one batch of four carries reads 1.0) was tried and dropped: it let tests'
x-9 at round 0 through at one receiver.

Cost: one forward pass of ``score_batches`` batches at theta and one per received update, per
round, and one more per update of a quarantined sender (its reverse); no backward pass, no draw
from the training data stream (the batches are drawn once, at start, with a generator of their
own), and the training model is untouched (a scratch copy of its structure, lent theta and
theta - update for each reading: no model-sized buffer held between rounds).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .algorithm_traits import algorithm_traits
from .device import to_device

log = logging.getLogger(__name__)

_SEED_OFFSET = 7_919  # the scoring batches' generator is not any stream the region trains on
# The bar's multiple of the round's median increase: 4 refused 3 of 180 honest non-IID updates, 6 one,
# 8 none (module docstring); one hostile update among three received moves that median by one position.
SPREAD_MULTIPLE = 8.0
# Quarantine (module docstring): 2 harmful refusals within a sender's last 3 scored rounds.
QUARANTINE_AFTER, QUARANTINE_WINDOW = 2, 3
RELEASE_AFTER, RELEASE_MAX = 8, 32


@dataclass(frozen=True, kw_only=True)
class Score:
    """One update's reading: the mean loss over the scoring batches at theta and at theta - step x
    update, and the standard error of the paired per-batch differences (0 for one batch)."""

    sender: str
    round: int
    loss_before: float
    loss_after: float
    spread: float
    loss_reversed: float | None = None  # at theta + step x update; read for a quarantined sender only

    @property
    def harm(self) -> float:
        """How much worse the update makes this region's loss (negative: it helps)."""
        return self.loss_after - self.loss_before

    @property
    def power(self) -> float | None:
        """How far apart the update and its reverse read (None: the reverse was not read): a reading
        that cannot tell an update from its sign flip cannot tell an honest update from a flipped one."""
        return None if self.loss_reversed is None else abs(self.loss_reversed - self.loss_after)


class Gauntlet:
    """Scores received updates on fixed batches of the region's own data; thread-safe counts.

    `model`: the region's model (its structure copied without its parameters' values: the scratch the
    scores are computed on, lent the parameters each reading scores),
    `loss`: the task's loss(model, batch), `batches`: the scoring batches (on the model's device),
    `margin`: the least loss increase that makes an update harmful (the bar's floor), `step`: the multiple of the update
    subtracted from theta (1: the sender's claimed local model)."""

    def __init__(self, *, model: torch.nn.Module, loss, batches: Sequence[Any], margin: float, step: float = 1.0):
        if not batches:
            raise ValueError("batches: the gauntlet needs at least one scoring batch")
        if not margin > 0 or not math.isfinite(margin):
            raise ValueError(f"margin: must be a finite number > 0, got {margin}")
        self._source = model
        # The scratch is the model's structure without its parameters' values: each reading lends it
        # the parameters it scores (theta itself, theta - update) and takes them back after, so
        # between rounds the gauntlet holds no model-sized buffer (a full copy kept for good cost
        # 4 B/param, issue 39). Its buffers (masks, norms' statistics) and frozen parameters (never
        # lent: theta holds the trained ones only) are its own, copied.
        self._scratch = copy.deepcopy(model, memo={id(p): _placeholder(p) for p in model.parameters() if p.requires_grad})
        self._scratch.eval()  # no dropout noise in a score
        self._params = [p for p in self._scratch.parameters() if p.requires_grad]
        # Where its forward passes run: theta may be on the host (sync.outer.offload), lent here.
        self._devices = [p.device for p in self._params]
        # A claimed model (theta -/+ update) is made one module at a time, as the forward pass reaches
        # it, and let go when that module returns: a module's parameters at a time, not a model's
        # worth beside the update (issue 39). `_making` is the reading's maker (None: lent whole).
        self._making: Callable[[int], torch.Tensor] | None = None
        self._layerwise: bool | None = None  # None until the first reading compared both ways
        index = {id(p): i for i, p in enumerate(self._params)}
        for module in self._scratch.modules():
            own = [(p, index[id(p)]) for p in module.parameters(recurse=False) if id(p) in index]
            if own:
                module.register_forward_pre_hook(lambda m, args, own=own: self._make(own))
                module.register_forward_hook(lambda m, args, out, own=own: self._made(own))
        self._loss, self._batches = loss, list(batches)
        self.margin, self.step = float(margin), float(step)
        self._lock = threading.Lock()
        self._harmful: Counter[str] = Counter()
        self._quarantined: Counter[str] = Counter()
        self._history: dict[str, deque[bool]] = {}  # sender -> harmful? in its last scored rounds
        self._clean: dict[str, int] = {}  # quarantined sender -> harmless updates in a row since
        self._quarantines: Counter[str] = Counter()  # how often each sender was quarantined
        self.last: list[Score] = []  # the last screen's readings (tests and benchmarks read them)

    @classmethod
    def for_worker(cls, worker: Any) -> Gauntlet | None:
        """The gauntlet of a Region where security.score_updates applies (module docstring),
        else None."""
        cfg = worker.cfg
        sec = cfg.security
        if (not sec.score_updates or sec.robust_aggregation == "none" or not algorithm_traits(cfg.sync.algorithm).outer_step or sec.secure_aggregation
                or getattr(cfg.sync, "fragments", 1) > 1):
            return None
        generator = torch.Generator().manual_seed(cfg.run.seed * 1000 + worker.index + _SEED_OFFSET)
        stream = worker.shard.batches(generator)
        batches = [to_device(next(stream), worker.device) for _ in range(sec.score_batches)]
        return cls(model=worker.model, loss=worker.task.loss, batches=batches, margin=sec.score_margin)

    def _mean_losses(self, params: Sequence[torch.Tensor] | Callable[[int], torch.Tensor]) -> list[float]:
        """The loss on each scoring batch with the scratch's parameters = `params`, lent (not copied:
        the forward passes only read them, and theta does not change while a screen reads it, the
        outer step waiting for the exchange that screens), then taken back. `params` may be a maker
        of parameter i instead, called as the forward pass reaches each module (the module hooks)."""
        with torch.no_grad():
            for dst, src in zip(self._scratch.buffers(), self._source.buffers()):
                dst.copy_(src)
            layerwise = None
            if callable(params) and self._layerwise is not False:
                layerwise = self._layerwise_losses(params)
                if self._layerwise and layerwise is not None:
                    return layerwise
            made = [params(i) for i in range(len(self._params))] if callable(params) else params
            try:
                for dst, src, device in zip(self._params, made, self._devices):
                    dst.data = _on_device(src.detach(), device)
                losses = [float(self._loss(self._scratch, b)) for b in self._batches]
            finally:
                _empty(self._params)
            if callable(params) and self._layerwise is None:
                # The first layer-wise reading is checked against the whole one: a model whose forward
                # reads a parameter outside its own module's call (made only there) is read whole.
                self._layerwise = layerwise is not None and _same(layerwise, losses)
                if not self._layerwise:
                    log.info("the gauntlet reads this model with all its parameters made at once (4 B/param "
                             "during a reading): its forward reads a parameter outside its module's call")
            return losses

    def _layerwise_losses(self, make: Callable[[int], torch.Tensor]) -> list[float] | None:
        """The losses with each module's parameters made by `make` as its forward pass starts and let go
        as it returns (None: the forward failed with a parameter let go)."""
        self._making = make
        try:
            return [float(self._loss(self._scratch, b)) for b in self._batches]
        except Exception as exc:  # noqa: BLE001 -- any error of a forward pass missing a parameter
            log.debug("a layer-wise reading failed: %s: %s", type(exc).__name__, exc)
            return None
        finally:
            self._making = None
            _empty(self._params)

    def _make(self, own: Sequence[tuple[torch.nn.Parameter, int]]) -> None:
        """A module's forward pass starts: make its parameters (a layer-wise reading only)."""
        if self._making is not None:
            for p, i in own:
                p.data = _on_device(self._making(i), self._devices[i])

    def _made(self, own: Sequence[tuple[torch.nn.Parameter, int]]) -> None:
        """A module's forward pass returned: let its parameters go (a layer-wise reading only)."""
        if self._making is not None:
            _empty(p for p, _ in own)

    def score(self, sender: str, round_: int, theta: Sequence[torch.Tensor], update: Sequence[torch.Tensor],
              *, before: list[float] | None = None, reverse: bool = False) -> Score:
        """The reading of one update against theta (`before`: theta's per-batch losses, if known;
        `reverse`: read the update's reverse too, theta + step x update, as release asks)."""
        before = self._mean_losses(theta) if before is None else before
        after = self._mean_losses(lambda i: theta[i].detach() - self.step * update[i].to(theta[i].dtype))
        diffs = [a - b for a, b in zip(after, before)]
        finite = all(math.isfinite(d) for d in diffs)
        spread = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 and finite else 0.0
        reversed_ = None
        if reverse:
            reversed_ = statistics.fmean(self._mean_losses(
                lambda i: theta[i].detach() + self.step * update[i].to(theta[i].dtype)))
        return Score(sender=sender, round=round_, loss_before=statistics.fmean(before),
                     loss_after=statistics.fmean(after), spread=spread, loss_reversed=reversed_)

    def bar(self, scores: Sequence[Score]) -> float:
        """The loss increase above which an update of the round is harmful (module docstring)."""
        rises = [max(sc.harm, 0.0) for sc in scores if math.isfinite(sc.harm)]
        return max(self.margin, SPREAD_MULTIPLE * statistics.median(rises)) if rises else self.margin

    def harmful(self, score: Score, bar: float) -> bool:
        """Worse than the bar; a non-finite loss after the update is harmful too. Where theta's own
        loss is not finite nothing can be judged: the round's rollback covers it (regions/rollback.py)."""
        if not math.isfinite(score.loss_before):
            return False
        return not math.isfinite(score.loss_after) or score.harm > bar

    def screen(self, plan: Any, theta: Sequence[torch.Tensor], res: Any) -> Any:
        """`res` (an ExchangeResult) with the harmful updates taken out of `received`, each
        counted and logged; the others are passed on unchanged."""
        if not res.received:
            self.last = []
            return res
        before = self._mean_losses(theta)
        scores = [self.score(s, plan.round, theta, u, before=before, reverse=self.in_quarantine(s))
                  for s, u in res.received.items()]
        bar = self.bar(scores)
        refused = [sc for sc in scores if self.harmful(sc, bar)]
        held = [sc.sender for sc in scores if sc not in refused and self.in_quarantine(sc.sender)]
        with self._lock:
            self._harmful.update(sc.sender for sc in refused)
            self._quarantined.update(held)
            self.last = scores
        for sc in refused:
            log.warning("refused the update of %s for round %d: harmful: it raises this region's loss on its own "
                        "data from %.4g to %.4g (bar +%.3g, security.score_margin %g; spread %.2g)", sc.sender,
                        sc.round, sc.loss_before, sc.loss_after, bar, self.margin, sc.spread)
        for sender in held:
            log.warning("refused the update of %s for round %d: quarantined (harmful before); %d more harmless "
                        "updates that read apart from their reverse release it",
                        sender, plan.round, self.release_after(sender) - self._clean[sender])
        self.record(plan.round, scores, {sc.sender for sc in refused})
        if not refused and not held:
            return res
        out = {s: u for s, u in res.received.items() if s not in {sc.sender for sc in refused} | set(held)}
        return dataclasses.replace(res, received=out)

    def in_quarantine(self, sender: str) -> bool:
        """Whether `sender`'s updates are refused whatever they score (until release_after harmless ones)."""
        return sender in self._clean

    def release_after(self, sender: str) -> int:
        """Telling harmless updates (`telling`), with no harmful one between, that end `sender`'s
        current quarantine."""
        return min(RELEASE_MAX, RELEASE_AFTER * 2 ** max(0, self._quarantines[sender] - 1))

    def telling(self, score: Score) -> bool:
        """Whether a harmless reading is evidence of good behaviour: the update and its reverse read
        more than the margin apart (module docstring, Quarantine). Late in a run an update of about 0
        and its reverse read alike (bench attack's x-9 and x+9 of a member whose loss was 0)."""
        return score.power is not None and score.power > self.margin

    def record(self, round_: int, scores: Sequence[Score], refused: set[str]) -> None:
        """Fold a screen's verdicts into each sender's history: quarantine a repeat offender,
        release a quarantined one after enough telling harmless updates with no harmful one between."""
        for sc in scores:
            harmful = sc.sender in refused
            if sc.sender in self._clean:
                if harmful:
                    self._clean[sc.sender] = 0
                elif self.telling(sc):
                    self._clean[sc.sender] += 1
                if self._clean[sc.sender] >= self.release_after(sc.sender):
                    del self._clean[sc.sender]
                    log.warning("released %s from quarantine after %d harmless updates that read apart from "
                                "their reverse", sc.sender, self.release_after(sc.sender))
                continue
            history = self._history.setdefault(sc.sender, deque(maxlen=QUARANTINE_WINDOW))
            history.append(harmful)
            if sum(history) >= QUARANTINE_AFTER:
                self._quarantines[sc.sender] += 1
                self._clean[sc.sender] = 0
                history.clear()
                log.warning("quarantined %s at round %d: %d of its last %d updates were harmful; %d harmless ones in "
                            "a row release it", sc.sender, round_, QUARANTINE_AFTER, QUARANTINE_WINDOW,
                            self.release_after(sc.sender))

    def take(self) -> dict[str, int]:
        """Updates refused as harmful, by sender, since the last call."""
        with self._lock:
            out, self._harmful = dict(self._harmful), Counter()
        return out

    def take_quarantined(self) -> dict[str, int]:
        """Updates refused because their sender was quarantined (and not harmful by their own
        score: those are counted as harmful), by sender, since the last call."""
        with self._lock:
            out, self._quarantined = dict(self._quarantined), Counter()
        return out


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` where the scratch's parameter lives (a copy only where it is elsewhere: offload's host theta)."""
    return t if t.device == device else t.to(device)


def _empty(params: Iterable[torch.nn.Parameter]) -> None:
    """The scratch's parameters hold nothing between readings (and between modules of a layer-wise one)."""
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    """Two readings equal value for value (NaN equal to NaN)."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _placeholder(p: torch.Tensor) -> torch.nn.Parameter:
    """An empty parameter of `p`'s dtype and device: the scratch's parameter between readings."""
    return torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)


def harmful_refusals(by_sender: Mapping[str, int], quarantined: Mapping[str, int] | None = None) -> dict[str, int] | None:
    """The refusals-by-reason record of a round's harmful and quarantined updates (None when there were none)."""
    out = {reason: sum(counts.values()) for reason, counts in (("harmful", by_sender), ("quarantined", quarantined or {}))}
    out = {reason: n for reason, n in out.items() if n}
    return out or None


__all__ = ["Gauntlet", "Score", "harmful_refusals"]
