"""What the run's traffic cost: cumulative egress dollars over time (summary.json's prices)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .load import Run, num
from .plots import time_axis
from .style import MEAN_COLOR, Plot, markers_for, new_figure, save

GB = 2**30  # as p2p/wan/prices.py: the providers bill GB of 2**30 bytes


def link_prices(run: Run) -> dict[str, float]:
    """$/GB per directed link as summary.json priced it (links that were not priced are absent)."""
    out = {}
    for k, v in (run.summary.get("links") or {}).items():
        if isinstance(v, dict) and num(v.get("usd_per_gb")) is not None:
            out[k] = num(v["usd_per_gb"])
    return out


def cost_points(run: Run) -> list[tuple[float, float]]:
    """(seconds, cumulative $) after each round: the round's update bytes per link x its price, the
    set-up probes' cost at the first round's start."""
    prices = link_prices(run)
    if not prices:
        return []
    per_round: dict[int, float] = {}
    for m in run.metrics:
        for tr in m.get("transfers") or []:
            if isinstance(tr, dict) and tr.get("direction") == "send" and num(tr.get("bytes")) is not None:
                p = prices.get(f"{m.get('region')}->{tr.get('peer')}")
                if p is not None:
                    per_round[m.get("round")] = per_round.get(m.get("round"), 0.0) + num(tr["bytes"]) / GB * p
    rows = [r for r in run.rounds if r.t_end is not None]
    if not rows:
        return []
    total = num(run.summary.get("egress_usd")) or 0.0
    rounds_usd = sum(per_round.values())
    probes = max(0.0, total - rounds_usd)  # what the transport counted beyond the rounds' pushes
    t0 = rows[0].t_start if rows[0].t_start is not None else 0.0
    pts, acc = [(t0, probes)], probes
    for r in rows:
        acc += per_round.get(r.round, 0.0)
        pts.append((r.t_end, acc))
    return pts


def plot_egress_cumulative(run: Run, out: Path) -> Plot | None:
    """egress_cumulative.png: egress dollars so far against time; None when nothing was priced."""
    fig = egress_cumulative_figure(run)
    if fig is None:
        return None
    save(fig, out, "egress_cumulative.png")
    provider = (run.summary.get("egress") or {}).get("provider", "?")
    return Plot("egress_cumulative.png", "Cumulative egress cost",
                f"Dollars for the bytes sent between regions so far, at {provider} list prices per directed link "
                "(network.egress; the links table has $/GB and each link's total). The first point is the set-up probes.")


def egress_cumulative_figure(run: Run):
    """The figure of plot_egress_cumulative (tests read its axes); None when nothing was priced."""
    pts = cost_points(run)
    if len(pts) < 2 or pts[-1][1] <= 0:
        return None
    div, tlabel = time_axis(run)
    fig = new_figure(11, 3.4)
    ax = fig.subplots()
    xs = [t / div for t, _ in pts]
    ax.plot(xs, np.array([c for _, c in pts]), color=MEAN_COLOR, lw=2.2, **markers_for(len(xs)))
    ax.set(xlabel=tlabel, ylabel="cumulative egress (US$)", title="Cumulative egress cost")
    # From $0: autoscale started at the set-up probes' cost, and the rounds' dollars looked like the bill.
    ax.set_ylim(bottom=0.0)
    return fig
