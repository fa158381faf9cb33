"""The coordinator: turns last round's measurements into this round's plan through the policy.

It sits on the control plane only (Ray calls); no update bytes pass through it. What it feeds
the policy:

* links: each region's own p2p link estimates (``policies.links.LinkView``), from the set-up
  probes that warm and measure every connection before round 0 and from every push since;
* step time: the slowest region's compute seconds per inner step, the minimum over the last few
  rounds: regions that share cores see their step time swing +-40% from round to round, and an
  H sized on a slow round's step time leaves the exchange exposed in the next, faster one;
* round overhead: the driver's time per round that neither the slowest region's round nor the
  network explains (plan, dispatch, collect, log, checkpoint), the minimum of the last few; with
  overlap it is the part of a round that cannot be hidden;
* loss, learning rate, model size, whether the exchange overlaps compute.

With ``sync.fragments: N`` the policy's H is each fragment's sync period and a round runs
``ceil(H/N)`` steps (regions/sync/fragments.py); the per-round record says so. The rules that cut
a round's H after that (time-budget calibration, ``run.max_steps``, ``run.eval_at_steps``) are
the plan stages (plan_stages.py), applied in order. The round that spends ``run.max_steps`` is
marked final (the worker applies an overlapped exchange still in flight before it returns).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Collection, Mapping
from typing import Any

from geofed.compression import CodecSpec
from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.messages import RoundPlan, RoundReport

from ..config import RunConfig
from ..policies import LinkEstimate, Measurements, make_policy
from ..policies.links import LinkView
from .plan_stages import CALIBRATION_STEPS, Calibration, EvalMarks, Step, StepBudget

OVERHEAD_WINDOW = 5  # rounds in the minimum of the per-round control-plane overhead
STEP_WINDOW = 5      # rounds in the minimum of the step time (regions time-sharing cores read +-40% a round)
WARMUP_ROUNDS = 2    # Ray's first calls and the first exchanges are slower: their overhead is not the run's
MIN_OVERHEAD_SAMPLES = 3


class Coordinator:
    """The driver's planner: folds each round's region metrics into Measurements, asks the policy for
    the next H and codecs, and turns the decision into one RoundPlan per alive region (see the module
    docstring for what the policy is fed). Its state goes into the driver's checkpoint.
    """

    def __init__(self, cfg: RunConfig, *, model_numel: int, clock):
        self.cfg = cfg
        self.traits = algorithm_traits(cfg.sync.algorithm)  # what the algorithm does, asked instead of its name
        self.regions = list(cfg.regions.names)
        self.model_numel = model_numel
        self.clock = clock
        self.policy = make_policy(cfg.sync.policy, codec=cfg.compression.codec, ladder=cfg.compression.ladder)
        self.link_view = LinkView()
        self.step_time_s: float | None = None
        self.loss: float | None = None
        self.last_sync_s: float | None = None
        self.last_reason = ""
        self.last_codecs: dict[str, CodecSpec] = {}
        self.last_H = 0
        self.last_record: dict[str, Any] = {}
        self.steps_done = 0
        self.budget = StepBudget(getattr(cfg.run, "max_steps", 0) or 0)
        self.marks = EvalMarks(getattr(cfg.run, "eval_at_steps", ()) or ())
        self.calibration = Calibration(self.region_step_time) if cfg.sync.pacing.mode == "time-budget" else None
        self.stages = tuple(s for s in (self.calibration, self.budget, self.marks) if s is not None)
        self.at_eval_mark = False  # the last planned round ends on one of run.eval_at_steps
        self._overheads: deque[float] = deque(maxlen=OVERHEAD_WINDOW)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._plan_t: float | None = None       # clock at the last plan()
        self._round_wall: float | None = None   # slowest region's wall time of the last observed round
        self._rounds_seen = 0
        self.pacing = cfg.sync.pacing
        # region -> its recent rounds' (step time, steps that measured it) (time-budget)
        self._region_steps: dict[str, deque[tuple[float, int]]] = {}
        self._warm_steps: dict[str, float] = {}  # region -> its set-up warm-up pass time (time-budget)

    @property
    def max_steps(self) -> int:
        """run.max_steps (0: none); a bench that ends a run early sets it to the steps done."""
        return self.budget.max_steps

    @max_steps.setter
    def max_steps(self, steps: int) -> None:
        self.budget.max_steps = steps

    @property
    def done(self) -> bool:
        """The step budget (run.max_steps) is spent: the runner stops after this round."""
        return self.budget.spent(self.steps_done)

    @property
    def round_overhead_s(self) -> float | None:
        """The per-round control-plane time (the floor of the last few rounds after warm-up), or None
        until MIN_OVERHEAD_SAMPLES rounds were measured.
        """
        # The floor of recent rounds: what every round pays; spikes (a loaded host) come and go,
        # and a floor needs a few rounds (one 34 ms spike once sent H from 53 to 448).
        return min(self._overheads) if len(self._overheads) >= MIN_OVERHEAD_SAMPLES else None

    def lr_scale(self, round_: int) -> float:
        """The factor on sync.inner.lr for `round_`: 1, or cosine over the step budget (else over run.rounds)."""
        if self.cfg.sync.inner.lr_decay == "cosine":
            progress = self.steps_done / self.max_steps if self.max_steps else round_ / max(1, self.cfg.run.rounds)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    def plan(self, round_: int, *, alive: list[str], evaluate: bool, muted: Collection[str] = (),
             optional: Collection[str] = ()) -> dict[str, RoundPlan]:
        """One RoundPlan per alive region (codecs differ per region: they are per out-link). `muted`
        regions (members whose updates never arrive: recovery.WithholdWatch) run the round alone:
        the others neither send to them nor wait for them, and none of them evaluates. `optional`
        regions (such a member back on probation) take part, but nobody waits for their update."""
        self._note_overhead()
        links = self.round_links(round_, alive)
        step, codecs = self._decide(round_, links)
        for stage in self.stages:
            step = stage.apply(step, alive=alive, steps_done=self.steps_done)
        H, reason = step.H, step.reason
        self.steps_done += H
        self.at_eval_mark = self.marks.hit(self.steps_done)
        evaluate = evaluate or self.at_eval_mark
        final = self.done or round_ == self.cfg.run.rounds - 1
        self.last_reason, self.last_codecs, self.last_H = reason, codecs, H
        scale = self.lr_scale(round_)
        plans = {}
        muted = set(muted) & set(alive)
        heard = [r for r in alive if r not in muted] or list(alive)
        evaluators = self.evaluators(heard) if evaluate else ()
        sketch = evaluate and not self.traits.mixes_models  # gossip fetches the models themselves
        paced = self._pacing_fields(H, alive)
        steps = self._calibration_steps(alive) if self.calibration and self.calibration.active(alive) else {}
        fill = not final and self._fills()
        members = tuple(self.regions) if len(self.regions) > len(self.cfg.regions.names) else None
        for region in alive:
            mine = {link.split("->", 1)[1]: spec for link, spec in codecs.items() if link.startswith(region + "->")}
            plans[region] = RoundPlan(round=round_, H=steps.get(region, H), codecs=mine, lr_scale=scale, evaluate=region in evaluators,
                                      alive=(region,) if region in muted else tuple(heard), final=final, sketch=sketch, fill=fill,
                                      optional=tuple(sorted(set(optional) & set(heard) - {region})),
                                      members=members, **paced)
        self._plan_t = self.clock.now()
        return plans

    def _decide(self, round_: int, links: list[str]) -> tuple[Step, dict[str, CodecSpec]]:
        """The policy's H and codecs for the round (all-reduce: every step, no codec)."""
        if self.traits.per_step:
            reason = "allreduce: every step"
            self.last_record = {"H": 1, "codecs": {}, "reason": reason, "policy": {}}
            return Step(H=1, reason=reason), {}
        decision = self.policy.decide(self._measurements(round_, links))
        H, reason = decision.H, decision.reason
        n = self.cfg.sync.fragments
        if n > 1:
            # Streaming fragments: the policy's H is each parameter's sync period (a fragment's
            # bytes are 1/N of the model, its round H/N steps: the same bytes per step and the
            # same hiding condition), so a round runs H/N steps and syncs one fragment.
            H, reason = max(1, math.ceil(H / n)), f"{reason} | H {H}/{n} fragments per round"
        codecs = {link: decision.codec_for(link) for link in links} if decision.codecs or decision.default_codec else {}
        self.last_record = decision.to_record()
        return Step(H=H, reason=reason), codecs

    def evaluators(self, alive: list[str]) -> list[str]:
        """Who evaluates in an eval round. DiLoCo and all-reduce: the first alive region, on its
        synchronised model, which every region holds alike (nothing crosses the wire); quorum
        rounds: the fastest one, which is in the quorum. Gossip: every region its own model; the
        driver then averages them (a fetch, counted)."""
        if self.traits.mixes_models:
            return list(alive)
        if self.pacing.mode == "quorum" and alive:
            unknown = float("inf")  # a region that never reported in time may be the slow one
            return [min(alive, key=lambda r: (self.region_step_time(r) or unknown, alive.index(r)))]
        return list(alive[:1])

    def _fills(self) -> bool:
        """Whether regions fill the gap after a round with steps (sync.pacing.fill_gaps,
        regions/gapfill.py): time-budget rounds of DiLoCo with overlap, where the model a region
        holds between rounds is its own unsynced progress; not with record-level DP (its accountant
        counts the planned steps) or fragments (their outer state is per fragment)."""
        cfg, p = self.cfg, self.pacing
        return (p.mode == "time-budget" and p.fill_gaps and cfg.sync.overlap and self.traits.outer_step
                and cfg.sync.fragments <= 1 and cfg.privacy.dp.mode == "off")

    def _calibration_steps(self, alive: list[str]) -> dict[str, int]:
        """A time-budget calibration round's steps per region: CALIBRATION_STEPS for a region of
        the median warm-up pass time, fewer for a slower one, so that no region waits long for
        the slowest (with 10 steps everywhere, the fast regions of bench hetero sat idle 0.4 s).
        Empty (H for all) unless every region timed its warm-up."""
        warm = {r: self._warm_steps.get(r) for r in alive}
        if not warm or not all(warm.values()):
            return {}
        mid = statistics.median(warm.values())
        return {r: max(1, min(CALIBRATION_STEPS, round(CALIBRATION_STEPS * mid / w))) for r, w in warm.items()}

    def region_step_time(self, region: str) -> float | None:
        """A region's step time: the median of its last few rounds' with each round weighted by its
        steps, or None before it reported one. Weighted: a round of one or two steps reports its cold
        first step (a new round's data, allocation), 10-40x a steady one; unweighted, one such round
        beside a 10-step one set the next budget 20x too long (fresh-clone CI, test_hetero_rounds)."""
        rounds = self._region_steps.get(region)
        if not rounds:
            return None
        ordered = sorted(rounds)
        half, seen = sum(n for _, n in ordered) / 2, 0
        for t, n in ordered:
            seen += n
            if seen >= half:
                return t
        return ordered[-1][0]

    def _observe_steps(self, region: str, m: RoundReport) -> None:
        step = m.steps.step_time_steady_s or m.steps.step_time_s  # without the round's first step
        self._region_steps.setdefault(region, deque(maxlen=STEP_WINDOW)).append((step, max(1, m.steps.steps)))

    def _pacing_fields(self, H: int, alive: list[str]) -> dict[str, Any]:
        """The plan's sync.pacing fields (regions/pacing.py): time-budget: the budget (H steps of the
        fastest region), the step cap and FedNova's tau_eff (the mean of the steps expected of the
        round's regions); quorum: k and the grace. Barrier, and a time-budget round before any
        step time is known, plan H steps for all."""
        p = self.pacing
        if p.mode == "quorum":
            return {"quorum": p.quorum_of(len(alive)), "grace_s": p.grace_s}
        times = {r: self.region_step_time(r) for r in alive}
        if p.mode != "time-budget" or not alive or any(t is None for t in times.values()):
            return {}
        cap = max(H, math.ceil(H * p.max_steps_factor))
        # H steps of the median region: on time-shared cores the fastest region's best step time
        # is an outlier (a budget sized on it gave the fast regions 20 of H=50 steps).
        budget = H * statistics.median(times.values())
        expected = [min(cap, max(1.0, budget / t)) for t in times.values()]
        # The budget ends at the same moment for every region (time.time(): one clock per machine,
        # NTP across nodes), not budget_s after each one's start: in bench hetero's flaky scenario a
        # region back from an absence fetched the model first and stretched its round 2-4x.
        return {"budget_s": budget, "budget_until": time.time() + budget, "max_steps": cap,
                "norm_steps": sum(expected) / len(expected)}

    def _note_overhead(self) -> None:
        """The last round's driver cycle (plan to plan) minus its slowest region's own wall time."""
        if self._plan_t is not None and self._round_wall is not None and self._rounds_seen > WARMUP_ROUNDS:
            self._overheads.append(max(0.0, self.clock.now() - self._plan_t - self._round_wall))
        self._round_wall = None

    def add_region(self, region: str) -> None:
        """A region joined under a new name (driver/membership.py): the topology is over the run's
        regions and it from the next plan on (each plan names them: RoundPlan.members)."""
        if region in self.regions:
            raise ValueError(f"region {region!r} is one of the run's regions already")
        self.regions.append(region)
        if hasattr(self, "_topology"):
            del self._topology  # round_links builds it again over the new count

    def round_links(self, round_: int, alive: list[str]) -> list[str]:
        """The directed links that carry traffic this round (topology, alive regions only)."""
        from geofed.p2p.topology import make_topology

        if not hasattr(self, "_topology"):
            self._topology = make_topology(self.cfg.sync.topology, len(self.regions), seed=self.cfg.run.seed)
        up = set(alive)
        out = []
        for i, src in enumerate(self.regions):
            if src in up:
                out.extend(f"{src}->{self.regions[j]}" for j in self._topology.out_neighbours(i, round_)
                           if self.regions[j] in up)
        return out

    def _measurements(self, round_: int, links: list[str]) -> Measurements:
        lr0 = self.cfg.sync.inner.lr
        return Measurements(now_s=self.clock.now(), round=round_, step_time_s=self.step_time_s, loss=self.loss,
                            lr=lr0 * self.lr_scale(round_), lr0=lr0, model_numel=self.model_numel,
                            links={k: self.link_view.estimate(k) for k in links},
                            overlap=self.cfg.sync.overlap, last_sync_s=self.last_sync_s,
                            round_overhead_s=self.round_overhead_s)

    def observe_probe(self, results: dict[str, dict[str, Any]]) -> None:
        """The regions' set-up link probes. The step time is left to round 0: a probe of a few
        steps on a scratch model read 0.66-2.8 ms where the rounds' steps took 2.3-4.9 ms on a
        loaded 4-node cluster (geofed bench cluster), and an H sized on it was 2-3x too large."""
        self.link_view.observe_round(results)
        # time-budget: each region's warm-up pass time; their ratios size the calibration round.
        self._warm_steps = {r: m["warm_step_s"] for r, m in results.items() if m.get("warm_step_s")}

    def observe(self, results: Mapping[str, RoundReport]) -> None:
        """Fold one round's region reports into the measurements the policy sees next."""
        if not results:
            return
        for region, m in results.items():
            self._observe_steps(region, m)
        if self.pacing.mode == "time-budget":
            # The budget is H steps of the median region: the policy sizes H on its step time.
            self._steps.append(statistics.median(m.steps.step_time_s for m in results.values()))
        else:
            self._steps.append(max(m.steps.step_time_s for m in results.values()))
        self.step_time_s = min(self._steps)
        losses = [m.steps.train_loss for m in results.values() if m.steps.train_loss is not None]
        self.loss = sum(losses) / len(losses) if losses else self.loss
        self.last_sync_s = max(m.exchange.sync_s or 0.0 for m in results.values())
        self._round_wall = max(m.wall_s for m in results.values())
        self._rounds_seen += 1
        self.link_view.observe_round({region: {"links": m.links} for region, m in results.items()})

    def observe_late(self, region: str, m: RoundReport) -> None:
        """A round that ended after its quorum round closed: its step time and links still count."""
        self._observe_steps(region, m)
        self.link_view.observe_round({region: {"links": m.links}})

    @property
    def links(self) -> dict[str, LinkEstimate]:
        """Every link's latest estimate (LinkView's), keyed 'src->dst'."""
        return {k: self.link_view.estimate(k) for k in self.link_view.links()}

    def links_record(self) -> dict[str, dict[str, Any]]:
        """Every link's estimate as events.jsonl and the report show it (Mbit/s, ms)."""
        return {k: {"bandwidth_mbps": None if e.bandwidth_bps is None else round(e.bandwidth_bps / 1e6, 4),
                    "rtt_ms": None if e.rtt_s is None else round(e.rtt_s * 1e3, 3), "concurrent": e.concurrent}
                for k, e in self.links.items()}

    def state_dict(self) -> dict[str, Any]:
        """The policy's state and the measurements the next plan depends on (step times, loss, overheads,
        links, steps done): a resumed run plans as the uninterrupted one would.
        """
        return {"policy": self.policy.state_dict(), "step_time_s": self.step_time_s, "loss": self.loss,
                "last_sync_s": self.last_sync_s, "steps_done": self.steps_done,
                "overheads": list(self._overheads), "steps": list(self._steps), "links": self.link_view.state_dict(),
                "region_steps": {r: [list(x) for x in v] for r, v in self._region_steps.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore `state_dict()` (keys missing from older checkpoints keep their fresh values)."""
        self.policy.load_state_dict(d["policy"])
        self.step_time_s, self.loss, self.last_sync_s = d["step_time_s"], d["loss"], d["last_sync_s"]
        self.steps_done = int(d.get("steps_done", 0))
        self._overheads = deque(d.get("overheads", []), maxlen=OVERHEAD_WINDOW)
        self._steps = deque(d.get("steps", []), maxlen=STEP_WINDOW)
        # Checkpoints before the steps weighting hold bare step times: one step each.
        self._region_steps = {r: deque(((x, 1) if isinstance(x, (int, float)) else (float(x[0]), int(x[1])) for x in v),
                                       maxlen=STEP_WINDOW) for r, v in d.get("region_steps", {}).items()}
        if "links" in d:
            self.link_view.load_state_dict(d["links"])
