"""Per-link figures (measured against configured bandwidth and RTT), utilisation and consensus."""

from __future__ import annotations

import math
from pathlib import Path

from .load import Run, num
from .plots import MAX_LINK_PANELS, time_axis
from .style import (
    MEAN_COLOR,
    Plot,
    color,
    markers_for,
    maybe_log,
    new_figure,
    region_style,
    save,
)

MAX_BARS = 16
LOW_CONFIDENCE = 0.5  # LinkEstimator.needs_probe's threshold: such an estimate is due for a re-probe
_QUANT = {"bandwidth": ("bandwidth_mbps", "configured_bandwidth_mbps", "Mbit/s"),
          "rtt": ("rtt_ms", "configured_rtt_ms", "ms")}


def _link_points(run: Run, link: str, key: str, div: float):
    pts = []
    for r in run.rounds:
        v = r.links.get(link, {})
        x = (r.t_end / div) if r.t_end is not None else None
        if x is not None:
            pts.append((x, num(v.get(key))))
    return pts


def _low_confidence(run: Run, link: str, key: str, div: float) -> list[tuple[float, float]]:
    """The points of `link` whose estimate had a confidence under LOW_CONFIDENCE (p2p/estimator.py);
    none for runs from before estimates carried one."""
    pts = []
    for r in run.rounds:
        v = r.links.get(link, {})
        conf, y = num(v.get("confidence")), num(v.get(key))
        if r.t_end is not None and conf is not None and y is not None and conf < LOW_CONFIDENCE:
            pts.append((r.t_end / div, y))
    return pts


def _pick_links(run: Run, measured: str, configured: str) -> tuple[list[str], int]:
    """The links to draw, at most MAX_LINK_PANELS: the ones furthest from their configuration
    (or, not emulated, the slowest), since those are what a reader is looking for."""
    links = run.link_order({k for r in run.rounds for k, v in r.links.items() if num(v.get(measured)) is not None})

    def badness(link: str) -> float:
        last = next((r.links[link] for r in reversed(run.rounds) if link in r.links), {})
        m, c = num(last.get(measured)), num(last.get(configured))
        if m and c:
            return -abs(math.log(m / c))
        return m or 0.0

    if len(links) <= MAX_LINK_PANELS:
        return links, len(links)
    return run.link_order(sorted(links, key=badness)[:MAX_LINK_PANELS]), len(links)


def plot_link(run: Run, out: Path, quantity: str) -> Plot | None:
    """Per-link `quantity` ('bandwidth' or 'rtt'): measured, and configured when emulated; None when no link has it."""
    measured, configured, unit = _QUANT[quantity]
    links, total = _pick_links(run, measured, configured)
    if not links:
        return None
    div, tlabel = time_axis(run)
    emulated = any(num(r.links.get(k, {}).get(configured)) is not None for r in run.rounds for k in links)
    # Full mesh of up to 6 regions: one row per sender, so a row reads "what this region sees".
    per_sender = max(sum(1 for k in links if k.split("->")[0] == k0.split("->")[0]) for k0 in links)
    ncols = per_sender if per_sender <= 5 and total == len(links) else min(4, len(links))
    nrows = math.ceil(len(links) / ncols)
    fig = new_figure(2.9 * ncols + 0.6, 2.2 * nrows + 0.8)
    # RTT panels share one y-axis (an 8 ms link and a 250 ms one must not look alike); bandwidth
    # differs by orders of magnitude between links, so each bandwidth panel keeps its own scale.
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=quantity == "rtt", squeeze=False)
    top = max([y for k in links for key in (measured, configured) for _, y in _link_points(run, k, key, div)
               if y is not None] + [1e-9]) * 1.15
    for i, link in enumerate(links):
        ax = axes[i // ncols][i % ncols]
        m = [(x, y) for x, y in _link_points(run, link, measured, div) if y is not None]
        c = [(x, y) for x, y in _link_points(run, link, configured, div) if y is not None]
        if c:
            # On top of the measured line: where they agree, the dashes still show.
            ax.step([p[0] for p in c], [p[1] for p in c], where="pre", color="#333333", ls=(0, (4, 3)), lw=1.3,
                    label="configured", zorder=4, **({"marker": "_", "markersize": 28} if len(c) == 1 else {}))
        ax.plot([p[0] for p in m], [p[1] for p in m], color=color(0), lw=1.6, label="measured", **markers_for(len(m)))
        low = _low_confidence(run, link, measured, div)
        if low:
            ax.plot([p[0] for p in low], [p[1] for p in low], ls="none", marker="o", markersize=6, color=color(0),
                    markerfacecolor="none", markeredgewidth=1.3, label="low confidence", zorder=5)
        ax.set_title(link.replace("->", " → "), fontsize=9.5)
        ax.set_ylim(bottom=0, top=top if quantity == "rtt" else max([y for _, y in m + c] + [1e-9]) * 1.15)
        if i % ncols == 0:
            ax.set_ylabel(unit)
    for j in range(len(links), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel(tlabel)
    axes[0][0].legend(loc="lower left")
    what = "bandwidth" if quantity == "bandwidth" else "round-trip time"
    fig.suptitle(f"Per-link {what}: measured" + (" vs configured (emulated)" if emulated else ""), fontweight="bold")
    name = f"links_{quantity}.png"
    save(fig, out, name)
    shown = "" if total == len(links) else f" Showing the {len(links)} of {total} links furthest from their configuration."
    if any(_low_confidence(run, k, measured, div) for k in links):
        shown += (f" Points drawn hollow: estimates of confidence under {LOW_CONFIDENCE} (older than the estimator's "
                  "stale time, doubted by transfers the estimate cannot explain, or read on a busy host), "
                  "not yet measured again; rounds.jsonl has each estimate's age_s and confidence.")
    return Plot(name, f"Per-link {what}", "Solid: what the link estimator measured; dashed: what the WAN "
                "emulator was configured to give (only when emulated)."
                + (" The panels share one y-axis." if quantity == "rtt" else " Each panel has its own y-axis.") + shown)


def plot_utilization(run: Run, out: Path) -> Plot | None:
    """utilization.png: compute utilisation per round and per region; None when not recorded."""
    series = run.series("utilization")
    per_region = {r: num(v) for r, v in (run.summary.get("utilization_per_region") or {}).items() if num(v) is not None}
    if not per_region:
        per_region = {r: sum(v for _, _, v in pts) / len(pts) for r, pts in series.items() if pts}
    if not per_region and not any(series.values()):
        return None
    div, tlabel = time_axis(run)
    fig = new_figure(11, 3.8)
    ax_t, ax_b = fig.subplots(1, 2, width_ratios=[1.8, 1])
    for i, region in enumerate(run.regions):
        pts = [(t / div, v) for _, t, v in series.get(region, []) if t is not None]
        if pts:
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.3, **region_style(i, len(run.regions), region),
                      **markers_for(len(pts)))
    ax_t.set(xlabel=tlabel, ylabel="compute utilisation", title="Compute utilisation per round", ylim=(0, 1.05))
    ax_t.yaxis.set_major_formatter(lambda v, _p: f"{v:.0%}")
    if any(series.values()):
        ax_t.legend(loc="best", ncols=2)
    names = [r for r in run.regions if r in per_region]
    if len(names) > MAX_BARS:  # the stragglers are the ones worth a bar
        names = [r for r in names if r in set(sorted(names, key=per_region.get)[:MAX_BARS])]
    vals = [per_region[r] for r in names]
    bars = ax_b.barh(names, vals, color=[region_style(run.regions.index(r), len(run.regions), r)["color"] for r in names])
    ax_b.bar_label(bars, labels=[f"{v:.0%}" for v in vals], padding=3, fontsize=9)
    overall = num(run.summary.get("compute_utilization"))
    if overall is not None:
        ax_b.axvline(overall, color=MEAN_COLOR, ls="--", lw=1.2, label=f"run: {overall:.0%}")
        ax_b.legend(loc="lower right")
    shown = "Over the run" if len(names) == len(per_region) else f"{len(names)} least utilised of {len(per_region)}"
    ax_b.set(xlim=(0, 1.18), title=shown, xlabel="compute utilisation")
    ax_b.xaxis.set_major_formatter(lambda v, _p: f"{v:.0%}")
    ax_b.invert_yaxis()
    ax_b.grid(axis="y", visible=False)
    save(fig, out, "utilization.png")
    return Plot("utilization.png", "Compute utilisation", "Share of each round's wall time a region spent "
                "computing rather than waiting on the network; the goal of adaptive sync is to keep it high.")


def plot_consensus(run: Run, out: Path) -> Plot | None:
    """consensus.png: the consensus distance per round (gossip); None when not recorded."""
    # DiLoCo and all-reduce over a full topology hold one model: their distance is float noise.
    pts = [(r.round, r.consensus_distance) for r in run.rounds if r.consensus_distance is not None]
    if not pts or run.traits is None or not run.traits.mixes_models:
        return None
    fig = new_figure(11, 3.2)
    ax = fig.subplots()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], color=MEAN_COLOR, lw=2, **markers_for(len(pts)))
    maybe_log(ax, [p[1] for p in pts], ratio=10)
    ax.set(xlabel="round", ylabel="consensus distance", title="Consensus distance (gossip)")
    save(fig, out, "consensus.png")
    return Plot("consensus.png", "Consensus distance", "How far the regions' models are from their average; "
                "it should shrink as gossip mixes them.")
