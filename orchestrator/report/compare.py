"""Several runs side by side: overlaid curves and the time/bytes each took to reach one loss."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, MaxNLocator

from .facts import (
    Headline,
    ToTarget,
    config_highlights,
    headline,
    to_target,
    training_start,
)
from .load import Run
from .style import (
    Plot,
    bytes_formatter,
    color,
    human_bytes,
    markers_for,
    maybe_log,
    new_figure,
    readable_log,
    save,
    time_unit,
)


@dataclass(frozen=True)
class CompareRow:
    """One run of a comparison: its label, headline figures, when it reached the target, and its setup in a few
    words."""

    label: str
    run: Run
    head: Headline
    reached: ToTarget
    setup: str  # algorithm / policy / codec, what usually differs between compared runs


def compare_rows(runs: Sequence[Run], labels: Sequence[str], target: float | None) -> list[CompareRow]:
    """A row per run for the comparison table and plots; `target`: the train loss the runs are timed to (None:
    not timed)."""
    rows = []
    for run, label in zip(runs, labels):
        hl = dict(config_highlights(run))
        setup = " / ".join(hl[k] for k in ("algorithm", "sync policy", "codec") if k in hl)
        reached = to_target(run, target) if target is not None else ToTarget(None, None, None)
        rows.append(CompareRow(label, run, headline(run), reached, setup))
    return rows


def unique_labels(runs: Sequence[Run]) -> list[str]:
    """The runs' names, with ' (2)', ' (3)'... added to repeats so every label is unique."""
    labels, seen = [], {}
    for run in runs:
        n = seen.get(run.name, 0)
        seen[run.name] = n + 1
        labels.append(run.name if n == 0 else f"{run.name} ({n + 1})")
    return labels


def _curve(run: Run):
    """(seconds since round 0 started, cumulative bytes, mean loss) per round; rounds without a
    time or a loss are skipped."""
    out, sent, t0 = [], 0.0, training_start(run)
    for r in run.rounds:
        sent += r.bytes_sent
        if r.t_end is not None and r.mean_train_loss is not None:
            out.append((r.t_end - t0, sent, r.mean_train_loss))
    return out


def plot_compare_loss(rows: Sequence[CompareRow], out: Path, target: float | None) -> Plot | None:
    """compare_loss.png: mean train loss against time and against bytes, per run; None when no run has a loss."""
    fig = compare_loss_figure(rows, target)
    if fig is None:
        return None
    save(fig, out, "compare_loss.png")
    return Plot("compare_loss.png", "Runs compared: loss", "Mean train loss over regions for each run, against "
                "the wall clock (left) and against the bytes all regions sent (right); a star marks where a run "
                "first reached the target loss.")


def compare_loss_figure(rows: Sequence[CompareRow], target: float | None) -> Figure | None:
    """The figure of plot_compare_loss (tests read its axes)."""
    curves = [_curve(r.run) for r in rows]
    if not any(curves):
        return None
    div, tlabel = time_unit(max((c[-1][0] for c in curves if c), default=0.0))
    fig = new_figure(12, 4.4)
    ax_t, ax_b = fig.subplots(1, 2, sharey=True)
    for i, (row, c) in enumerate(zip(rows, curves)):
        if not c:
            continue
        kw = dict(color=color(i), lw=2, label=row.label, **markers_for(len(c)))
        ax_t.plot([p[0] / div for p in c], [p[2] for p in c], **kw)
        ax_b.plot([max(p[1], 1.0) for p in c], [p[2] for p in c], **kw)
        if row.reached.seconds is not None:
            # A star where the run first reached the target: the table's numbers, on the curves.
            ax_t.plot(row.reached.seconds / div, target, marker="*", ms=14, color=color(i), mec="black", zorder=5)
            ax_b.plot(max(row.reached.bytes, 1.0), target, marker="*", ms=14, color=color(i), mec="black", zorder=5)
    maybe_log(ax_t, [p[2] for c in curves for p in c], ratio=8)
    for ax in (ax_t, ax_b):
        if target is not None:
            ax.axhline(target, color="#555555", ls="--", lw=1, label=f"target {target:.4g}")
    sent = [p[1] for c in curves for p in c if p[1] > 0]
    if sent and max(sent) / min(sent) > 30:
        ax_b.set_xscale("log")
        readable_log(ax_b.xaxis, human_bytes)
        # Labels like "20 MB" are wide: 1-2-5 ticks over two decades (9 labels) ran into each
        # other on a half-width panel; past ~1.2 decades one tick a decade, at most six.
        decades = math.log10(max(sent) / min(sent))
        ax_b.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 1.2 else (1.0,),
                                                numticks=6))
    else:
        ax_b.xaxis.set_major_locator(MaxNLocator(nbins=4))  # "3.46 MB" labels: five fit, auto's eight do not
        ax_b.xaxis.set_major_formatter(bytes_formatter())
    ax_t.set(xlabel=tlabel.replace("wall-clock time", "time since round 0 started"), ylabel="mean train loss",
             title="Loss vs wall-clock time")
    ax_b.set(xlabel="cumulative bytes sent (all regions)", title="Loss vs bytes sent")
    # Below the panels: run labels are long and would sit on the curves.
    fig.legend(*ax_b.get_legend_handles_labels(), loc="outside lower center", ncols=min(4, len(rows) + 1))
    return fig


def plot_compare_sync(rows: Sequence[CompareRow], out: Path) -> Plot | None:
    """compare_sync.png: H and compute utilisation over time, per run; None when no run recorded H."""
    have = [r for r in rows if any(x.H is not None and x.t_start is not None for x in r.run.rounds)]
    if not have:
        return None
    ends = [x.t_end - training_start(r.run) for r in have for x in r.run.rounds if x.t_end is not None]
    div, tlabel = time_unit(max(ends, default=0.0))
    tlabel = tlabel.replace("wall-clock time", "time since round 0 started")
    fig = new_figure(12, 3.8)
    ax_h, ax_u = fig.subplots(1, 2)
    for i, row in enumerate(rows):
        t0 = training_start(row.run)
        pts = [((x.t_start - t0) / div, (x.t_end - t0) / div, x.H) for x in row.run.rounds
               if x.H is not None and x.t_start is not None and x.t_end is not None]
        if pts:
            xs = [p[0] for p in pts] + [pts[-1][1]]
            hs = [p[2] for p in pts] + [pts[-1][2]]
            ax_h.step(xs, hs, where="post", color=color(i), lw=2, label=row.label)
        ut = [((x.t_end - t0) / div, x.utilization) for x in row.run.rounds if x.utilization is not None and x.t_end is not None]
        if ut:
            ax_u.plot([p[0] for p in ut], [p[1] for p in ut], color=color(i), lw=1.8, label=row.label, **markers_for(len(ut)))
    maybe_log(ax_h, [x.H for r in have for x in r.run.rounds if x.H], ratio=20)
    ax_h.set(xlabel=tlabel, ylabel="H (local steps per round)", title="Sync interval H")
    ax_u.set(xlabel=tlabel, ylabel="compute utilisation", title="Compute utilisation per round", ylim=(0, 1.05))
    ax_u.yaxis.set_major_formatter(lambda v, _p: f"{v:.0%}")
    fig.legend(*ax_h.get_legend_handles_labels(), loc="outside lower center", ncols=min(4, len(rows)))
    save(fig, out, "compare_sync.png")
    return Plot("compare_sync.png", "Runs compared: sync interval and utilisation", "How often each run "
                "synchronised (H, local steps between syncs) and how much of its time it spent computing.")


def plot_compare_eval(rows: Sequence[CompareRow], out: Path) -> Plot | None:
    """compare_eval.png: the mean evaluation metric over time, per run; None when no run evaluated."""
    series = []
    for row in rows:
        metric, per_region = row.run.eval_series()
        by_round: dict[int, list[tuple[float | None, float]]] = {}
        for pts in per_region.values():
            for rnd, t, v in pts:
                by_round.setdefault(rnd, []).append((t, v))
        t0 = training_start(row.run)
        pts = [(vals[0][0] - t0, float(np.mean([v for _, v in vals]))) for _, vals in sorted(by_round.items())
               if vals[0][0] is not None]
        series.append((metric, pts))
    if not any(pts for _, pts in series):
        return None
    div, tlabel = time_unit(max((p[0] for _, pts in series for p in pts), default=0.0))
    metric = next(m for m, pts in series if pts)
    fig = new_figure(12, 3.8)
    ax = fig.subplots()
    for i, (row, (_, pts)) in enumerate(zip(rows, series)):
        if pts:
            ax.plot([p[0] / div for p in pts], [p[1] for p in pts], color=color(i), lw=2, label=row.label, **markers_for(len(pts)))
    ax.set(xlabel=tlabel.replace("wall-clock time", "time since round 0 started"), ylabel=metric,
           title=f"Eval {metric} (mean over regions)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=min(4, len(rows)))
    save(fig, out, "compare_eval.png")
    return Plot("compare_eval.png", f"Runs compared: eval {metric}", "The mean over regions of the evaluation "
                "metric, on the rounds where each run evaluated.")
