"""What `geofed bench wan` reports about each arm, read back from its run directory.

Times count from the start of round 0 on the run's clock (Ray start-up and connecting are left
out, as in the comparison report). Time and bytes to target are, with ``target_on="eval"``, those
of the first evaluation of the synchronised model whose held-out loss is at or below the target
(`eval_to_target`: the model a user gets, when it existed, and the bytes of every exchange up to
its round); with ``target_on="train"`` those of the first round whose mean train loss is at or
below it (report.facts.to_target, the comparison report's definition). In overlap mode a round's
bytes are those of the exchange that completed in it (the previous round's), and the run's last
round also flushes its own.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geofed.orchestrator.report.facts import ToTarget, to_target, training_start
from geofed.orchestrator.report.load import Run, load_run

FINAL_FRACTION = 0.1  # final loss: step-weighted mean train loss over the last 10% of steps


@dataclass(frozen=True, kw_only=True)
class ArmResult:
    """What one arm's run directory says: time and bytes to the target loss, H over rounds, losses, utilisation."""

    name: str
    kind: str
    H: int | None                 # fixed H; adaptive: the median H over rounds
    H_rounds: list[tuple[float, float, int]]  # (t_start, t_end, H) per round, run clock from round 0
    time_to_target_s: float | None
    bytes_to_target: float | None
    final_loss: float | None
    eval: float | None            # the averaged model's held-out metric (digits: accuracy)
    eval_metric: str | None
    utilization: float | None     # summary.json compute_utilization: compute / the region's own round time
    utilization_wall: float | None  # compute / (training wall time), per region, averaged
    utilization_training: float | None  # as utilization, without the run's last round's wait (the final flush)
    steps: int
    loss_at_baseline_steps: float | None  # final_loss over the allreduce arm's step count (equal compute)
    wall_s: float | None
    bytes_sent: float
    drop_at_s: float | None       # the drop on this run's clock (drop scenario)
    run_dir: str
    peak_to_mean: float | None = None  # summary.json's busiest link: bytes per 1 s window, peak over mean
    eval_at_baseline_steps: float | None = None  # the synchronised model's held-out metric at the allreduce arm's steps

    def doc(self) -> dict[str, Any]:
        """The arm's entry of the issue's --json document."""
        return {"name": self.name, "H": self.H, "time_to_target_s": _r(self.time_to_target_s),
                "bytes_to_target": None if self.bytes_to_target is None else int(self.bytes_to_target),
                "final_loss": _r(self.final_loss, 6), "eval": _r(self.eval, 4), "utilization": _r(self.utilization, 4),
                "peak_to_mean": _r(self.peak_to_mean, 3), "eval_at_baseline_steps": _r(self.eval_at_baseline_steps, 4)}


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def measure(run_dir: Path, *, name: str, kind: str, H: int | None, target_loss: float,
            drop_at_s: float | None = None, baseline_steps: int | None = None, target_on: str = "train") -> ArmResult:
    """Read an arm's run directory back into an ArmResult (time to `target_loss` from round 0, on the
    held-out loss of the synchronised model with ``target_on="eval"``, else on the mean train loss;
    `baseline_steps`: also the losses at the allreduce arm's step count).
    """
    run = load_run(run_dir)
    t0 = training_start(run)
    reached = eval_to_target(run, target_loss) if target_on == "eval" else to_target(run, target_loss)
    rounds = [r for r in run.rounds if r.t_start is not None and r.t_end is not None and r.H is not None]
    H_rounds = [(r.t_start - t0, r.t_end - t0, int(r.H)) for r in rounds]
    if H is None and H_rounds:
        H = int(statistics.median(h for _, _, h in H_rounds))
    s = run.summary
    ev = s.get("eval") if isinstance(s.get("eval"), dict) else {}
    wall = (rounds[-1].t_end - t0) if rounds else None
    return ArmResult(
        name=name, kind=kind, H=H, H_rounds=H_rounds, time_to_target_s=reached.seconds,
        bytes_to_target=reached.bytes, final_loss=final_loss(run), eval=ev.get("value"), eval_metric=ev.get("metric"),
        utilization=s.get("compute_utilization"), utilization_wall=wall_utilization(run.metrics, wall),
        utilization_training=training_utilization(run.metrics),
        steps=sum(h for _, _, h in H_rounds), wall_s=wall,
        loss_at_baseline_steps=None if baseline_steps is None else final_loss(run, baseline_steps), bytes_sent=float(s.get("bytes_sent", 0.0)),
        drop_at_s=drop_at_s, run_dir=str(run_dir), peak_to_mean=(s.get("peak_to_mean") or {}).get("ratio"),
        eval_at_baseline_steps=None if baseline_steps is None else eval_at_steps(run, baseline_steps))


def _steps_by_round(run: Run) -> dict[int, int]:
    """Inner steps per region by the end of each round."""
    out, done = {}, 0
    for r in run.rounds:
        done += int(r.H or 0)
        out[r.round] = done
    return out


def _evals(run: Run) -> list[tuple[int, float, float | None]]:
    """(eval_round, value, eval_t) of every evaluation of the synchronised model, by round: a round's
    own and the earlier ones it also reported (a flush under overlap reports two)."""
    out = {}
    for r in run.rounds:
        for rnd, value, t in r.evals_earlier:
            out.setdefault(rnd, (rnd, value, t))
        if r.eval_value is not None and r.eval_round is not None:
            out.setdefault(r.eval_round, (r.eval_round, r.eval_value, r.eval_t))
    return [out[k] for k in sorted(out)]


def eval_at_steps(run: Run, steps: int) -> float | None:
    """The held-out metric of the synchronised model of the round that ended at exactly `steps` inner
    steps (run.eval_at_steps makes one), else None."""
    at = _steps_by_round(run)
    return next((value for rnd, value, _ in _evals(run) if at.get(rnd) == steps), None)


def _exchange_round(m: dict[str, Any]) -> int:
    """The round whose exchange a region's metrics record reports (overlap: the previous one)."""
    er = m.get("exchange_round", m["round"])
    return m["round"] if er is None else int(er)


def eval_to_target(run: Run, target: float) -> ToTarget:
    """The first evaluation of the synchronised model at or below `target` (a loss): its round, the
    seconds from round 0 to when that model existed (eval_t; with overlap, when its exchange
    completed), and the bytes every region sent for exchanges up to that round (the model has
    those and no others; with overlap round r's exchange is reported by round r + 1)."""
    t0 = training_start(run)
    for rnd, value, t in _evals(run):
        if value <= target:
            sent = sum(float(m.get("bytes_sent", 0.0)) for m in run.metrics if _exchange_round(m) <= rnd)
            return ToTarget(rnd, None if t is None else t - t0, sent)
    return ToTarget(None, None, None)


def final_loss(run, at_steps: int | None = None) -> float | None:
    """Step-weighted mean train loss over the last FINAL_FRACTION of the first ``at_steps`` steps
    (default: all of them). A per-step run's last round is one minibatch per region, too noisy
    to compare alone; ``at_steps`` compares runs of different lengths at equal compute."""
    rows = [(int(r.H or 0), r.mean_train_loss) for r in run.rounds if r.mean_train_loss is not None and r.H]
    total = sum(h for h, _ in rows)
    end = total if at_steps is None else min(at_steps, total)
    if not end or (at_steps is not None and total < at_steps):
        return None
    lo = end - max(1.0, FINAL_FRACTION * end)
    acc = got = 0.0
    start = 0
    for h, loss in rows:
        take = max(0.0, min(start + h, end) - max(start, lo))
        acc, got, start = acc + take * loss, got + take, start + h
    return acc / got if got else None


def wall_utilization(metrics: list[dict[str, Any]], wall_s: float | None) -> float | None:
    """Each region's compute seconds over the training wall time, averaged over regions. Unlike
    summary.json's figure this counts the time a region idles between rounds (waiting for the
    slowest region and the driver): on 2 shared cores, mostly CPU time-sharing between regions."""
    if not wall_s or wall_s <= 0:
        return None
    compute: dict[str, float] = {}
    for m in metrics:
        compute[m["region"]] = compute.get(m["region"], 0.0) + float(m.get("compute_s", 0.0))
    return sum(min(1.0, c / wall_s) for c in compute.values()) / len(compute) if compute else None


def training_utilization(metrics: list[dict[str, Any]]) -> float | None:
    """summary.json's utilisation without the wait of each region's last round: the exchange of
    the last round cannot overlap anything (there is no next round), a fixed tail of one sync
    that a run of a few seconds, as the bench's, weighs far more than a long one."""
    compute: dict[str, float] = {}
    wall: dict[str, float] = {}
    last: dict[str, dict[str, Any]] = {}
    for m in metrics:
        r = m["region"]
        compute[r] = compute.get(r, 0.0) + float(m.get("compute_s", 0.0))
        wall[r] = wall.get(r, 0.0) + float(m.get("wall_s", 0.0))
        if r not in last or m["round"] > last[r]["round"]:
            last[r] = m
    utils = [min(1.0, compute[r] / (wall[r] - float(last[r].get("overlap_wait_s", 0.0))))
             for r in compute if wall[r] - float(last[r].get("overlap_wait_s", 0.0)) > 0]
    return sum(utils) / len(utils) if utils else None


def loss_before(result: ArmResult, t: float) -> float | None:
    """The arm's mean train loss in its last round that ended by ``t`` (run clock)."""
    run = load_run(result.run_dir)
    t0 = training_start(run)
    before = [r.mean_train_loss for r in run.rounds
              if r.t_end is not None and r.t_end - t0 <= t and r.mean_train_loss is not None]
    return before[-1] if before else None


def ratios(arms: list[ArmResult], scenario: str) -> dict[str, Any]:
    """The issue's ratios (> 1: adaptive is better; None where it does not apply or a side never
    reached the target), and which arms they compare."""
    by = {a.name: a for a in arms}
    ad = by.get("adaptive")
    fixed = [a for a in arms if a.kind == "fixed"]
    out: dict[str, Any] = {"time_vs_allreduce": None, "bytes_vs_allreduce": None, "time_vs_best_fixed": None,
                           "time_vs_best_fixed_before_drop": None}
    notes: dict[str, Any] = {}
    ar = by.get("allreduce")
    for a in arms if ar is not None else []:  # the frontier arms (issue 21), each against per-step sync
        if a.kind == "adaptive" and a.name != "adaptive":
            out[f"{a.name}:time_vs_allreduce"] = _ratio(ar.time_to_target_s, a.time_to_target_s)
            out[f"{a.name}:bytes_vs_allreduce"] = _ratio(ar.bytes_to_target, a.bytes_to_target)
            # held-out loss at equal examples over per-step sync's (<= 1.02: issue 21's quality target)
            out[f"{a.name}:loss_vs_allreduce"] = loss_ratio(a, ar)
    if ad is None:
        return {**out, "_notes": notes}
    if ar is not None:
        out["time_vs_allreduce"] = _ratio(ar.time_to_target_s, ad.time_to_target_s)
        out["bytes_vs_allreduce"] = _ratio(ar.bytes_to_target, ad.bytes_to_target)
        out["loss_vs_allreduce"] = loss_ratio(ad, ar)
    reached = [a for a in fixed if a.time_to_target_s is not None]
    if reached:
        best = min(reached, key=lambda a: a.time_to_target_s)
        out["time_vs_best_fixed"] = _ratio(best.time_to_target_s, ad.time_to_target_s)
        notes["best_fixed"] = best.name
    if scenario == "drop" and fixed:
        leader = best_before_drop(fixed)
        if leader is not None:
            out["time_vs_best_fixed_before_drop"] = _ratio(leader.time_to_target_s, ad.time_to_target_s)
            notes["best_fixed_before_drop"] = leader.name
    return {**out, "_notes": notes}


def loss_ratio(arm: ArmResult, allreduce: ArmResult) -> float | None:
    """The arm's loss at per-step sync's step count (equal examples) over per-step sync's: the held-out
    loss of the synchronised models where both were evaluated there (run.eval_at_steps), else the
    final train loss. 1.02: 2% worse."""
    if arm.eval_at_baseline_steps is not None and allreduce.eval_at_baseline_steps is not None:
        return _ratio(arm.eval_at_baseline_steps, allreduce.eval_at_baseline_steps)
    return _ratio(arm.loss_at_baseline_steps, allreduce.final_loss)


def best_before_drop(fixed: list[ArmResult]) -> ArmResult | None:
    """The fixed arm that led when the drop came: the lowest mean train loss in its last round
    that ended before the drop (what someone tuning H on the network as it was would pick)."""
    scored = []
    for a in fixed:
        if a.drop_at_s is None:
            continue
        loss = loss_before(a, a.drop_at_s)
        if loss is not None:
            scored.append((loss, a.H or 0, a))
    return min(scored, key=lambda x: (x[0], x[1]))[2] if scored else None


def _ratio(baseline: float | None, adaptive: float | None) -> float | None:
    if baseline is None or adaptive is None or adaptive <= 0:
        return None
    return round(baseline / adaptive, 3)
