"""The figures of one run. Each function writes one PNG and returns its Plot, or None when the
run has nothing to show for it (no eval, no links, one region's empty matrix)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from matplotlib.ticker import MaxNLocator

from .load import Run, link_pairs, num
from .style import (
    MEAN_COLOR,
    Plot,
    bytes_formatter,
    color,
    human_bytes,
    markers_for,
    maybe_log,
    new_figure,
    readable_log,
    region_style,
    save,
    time_unit,
)

MAX_LINK_PANELS = 16


def time_axis(run: Run) -> tuple[float, str]:
    """(divisor, label) of the run's time axis, sized to the last round's end."""
    ends = [r.t_end for r in run.rounds if r.t_end is not None]
    return time_unit(max(ends) if ends else 0.0)


def round_axis(ax, run: Run) -> None:
    """Whole rounds only; a one-round run gets a margin instead of ticks at -0.04 .. 0.04."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    rounds = [r.round for r in run.rounds]
    if rounds and max(rounds) - min(rounds) < 2:
        ax.set_xlim(min(rounds) - 1, max(rounds) + 1)


def _draw_series(ax, run: Run, series, mean_pts, *, use_time: bool, div: float) -> None:
    """Per-region thin lines and the mean thick, against time (t_end) or round."""
    def xy(points):
        pts = [(t / div if use_time else rnd, v) for rnd, t, v in points if not use_time or t is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    for i, region in enumerate(run.regions):
        xs, ys = xy(series.get(region, []))
        if xs:
            ax.plot(xs, ys, lw=1.2, alpha=0.75, **region_style(i, len(run.regions), region), **markers_for(len(xs)))
    xs, ys = xy(mean_pts)
    if xs and len(run.regions) > 1:
        ax.plot(xs, ys, color=MEAN_COLOR, lw=2.4, label="mean", **markers_for(len(xs)))


def plot_loss(run: Run, out: Path) -> Plot | None:
    """loss.png: train loss per region and mean, against time and round; None when no loss was recorded."""
    series = run.series("train_loss")
    mean_pts = [(r.round, r.t_end, r.mean_train_loss) for r in run.rounds if r.mean_train_loss is not None]
    if not mean_pts and not any(series.values()):
        return None
    div, tlabel = time_axis(run)
    fig = new_figure(11, 4.2)
    ax_t, ax_r = fig.subplots(1, 2, sharey=True)
    _draw_series(ax_t, run, series, mean_pts, use_time=True, div=div)
    _draw_series(ax_r, run, series, mean_pts, use_time=False, div=div)
    values = [v for pts in series.values() for _, _, v in pts] + [v for _, _, v in mean_pts]
    maybe_log(ax_t, values, ratio=8)
    ax_t.set(xlabel=tlabel, ylabel="train loss", title="Train loss vs wall-clock time")
    ax_r.set(xlabel="round", title="Train loss vs round")
    round_axis(ax_r, run)
    ax_r.legend(loc="best")
    save(fig, out, "loss.png")
    return Plot("loss.png", "Train loss", "Thin lines: each region's local train loss at the end of a round; "
                "thick black: the mean over regions. Left against the driver's wall clock, right against the round.")


def _averaged_eval(run: Run) -> tuple[str, list[tuple[int, float | None, float]]]:
    """(metric, [(round, t, value)]) of the run's own evaluations (rounds.jsonl eval_avg: the
    synchronised model, gossip's average); [] for a run that logged none (an older run)."""
    rows = [r for r in run.rounds if r.eval_value is not None]
    metric = rows[0].eval_metric if rows else ""
    return metric or "", [(r.eval_round, r.eval_t, r.eval_value) for r in rows]


def plot_eval(run: Run, out: Path) -> Plot | None:
    """eval.png: the evaluation of the model the summary reports (DiLoCo's synchronised model, gossip's
    average) against time and round, ending at the summary's final value; None when nothing was evaluated."""
    metric, avg_pts = _averaged_eval(run)
    series: dict = {}
    if not avg_pts:  # a run that logged no eval_avg: the regions' own evaluations (metrics.jsonl), and their mean
        metric, series = run.eval_series()
        by_round: dict[int, list[float]] = {}
        t_of: dict[int, float | None] = {}
        for pts in series.values():
            for rnd, t, v in pts:
                by_round.setdefault(rnd, []).append(v)
                t_of[rnd] = t
        avg_pts = [(rnd, t_of[rnd], sum(v) / len(v)) for rnd, v in sorted(by_round.items())]
    final = run.summary.get("eval") if isinstance(run.summary.get("eval"), dict) else None
    final_v = num(final.get("value")) if final else None
    if not avg_pts and (final_v is None or not run.rounds):
        return None
    metric = metric or str(final.get("metric", "eval"))
    div, tlabel = time_axis(run)
    fig = new_figure(11, 4.0)
    ax_t, ax_r = fig.subplots(1, 2, sharey=True)
    for i, region in enumerate(run.regions):
        pts = series.get(region, [])
        if pts and len(run.regions) > 1:
            for ax, xs in ((ax_t, [t / div for _, t, _ in pts if t is not None]), (ax_r, [r for r, t, _ in pts if t is not None])):
                ax.plot(xs, [v for _, t, v in pts if t is not None], lw=1.0, alpha=0.6,
                        **region_style(i, len(run.regions), region), **markers_for(len(xs)))
    label = "averaged model" if run.traits is not None and run.traits.mixes_models else "synchronised model"
    timed = [(r, t, v) for r, t, v in avg_pts if t is not None]
    ax_t.plot([t / div for _, t, _ in timed], [v for *_, v in timed], color=MEAN_COLOR, lw=2.4, label=label, **markers_for(len(timed)))
    ax_r.plot([r for r, _, _ in avg_pts], [v for *_, v in avg_pts], color=MEAN_COLOR, lw=2.4, label=label, **markers_for(len(avg_pts)))
    if final_v is not None and run.rounds:
        last = run.rounds[-1]
        if last.t_end is not None:
            ax_t.plot([last.t_end / div], [final_v], marker="*", markersize=14, color="tab:red", ls="none", label="final (summary)")
        ax_r.plot([last.round], [final_v], marker="*", markersize=14, color="tab:red", ls="none", label="final (summary)")
    ax_t.set(xlabel=tlabel, ylabel=metric, title=f"Eval {metric} vs wall-clock time")
    ax_r.set(xlabel="round", title=f"Eval {metric} vs round")
    round_axis(ax_r, run)
    caption = (f"Thick black: the {label} the run evaluates and summary.json reports (DiLoCo, all-reduce: the "
               "synchronised model; gossip: the average of the regions' models), in the rounds where evaluation ran "
               "(run.eval_every); red star: the final evaluation after the last round, summary.json's value.")
    if series:
        caption += " Thin lines: each region's own evaluation (this run logged no averaged evaluation per round)."
    target = run.summary.get("target") if isinstance(run.summary.get("target"), dict) else None
    if target and num(target.get("value")) is not None:
        caption += _mark_target(ax_t, ax_r, target, div)
    ax_r.legend(loc="best")
    save(fig, out, "eval.png")
    return Plot("eval.png", f"Evaluation ({metric})", caption)


def _mark_target(ax_t, ax_r, target: dict, div: float) -> str:
    """run.target: a dotted line at its value, a dashed one where the run reached it."""
    for ax in (ax_t, ax_r):
        ax.axhline(target["value"], color="grey", linestyle=":", linewidth=1, label="target")
    if not target.get("reached"):
        return f" Dotted: the target {target['value']:g}, not reached."
    ax_t.axvline(target["time_to_target_s"] / div, color="tab:red", linestyle="--", linewidth=1)
    ax_r.axvline(target["round"], color="tab:red", linestyle="--", linewidth=1, label="target reached")
    return (f" Dotted: the target {target['value']:g}; dashed: reached in round {target['round']} after "
            f"{target['time_to_target_s']:.3g} s, {target['steps_to_target']} steps.")


def _codec_label(codecs: dict[str, str]) -> str:
    names = sorted(set(codecs.values()))
    return "/".join(names)


def plot_sync(run: Run, out: Path) -> Plot | None:
    """sync.png: H and the codecs per round above the link estimates on the same time axis; None without H."""
    rows = [r for r in run.rounds if r.H is not None]
    if not rows:
        return None
    use_time = all(r.t_start is not None and r.t_end is not None for r in rows)
    div, tlabel = time_axis(run) if use_time else (1.0, "round")
    start = [(r.t_start / div) if use_time else r.round for r in rows]
    end = [(r.t_end / div) if use_time else r.round + 1 for r in rows]
    # Bandwidth is what the policy sizes H by; when the estimator had none (updates too small to
    # time), RTT is what it reacted to, so show that rather than an empty panel.
    key = "bandwidth_mbps" if _links_with(run, "bandwidth_mbps") else "rtt_ms"
    links = _links_with(run, key)
    fig = new_figure(11, 5.6 if links else 3.2)
    axes = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1.3]) if links else [fig.subplots(1, 1)]
    ax = axes[0]
    _draw_h(ax, rows, start, end)
    if links:
        _draw_link_estimates(axes[1], run, links, div, use_time, key)
    axes[-1].set_xlabel(tlabel)
    save(fig, out, "sync.png")
    return Plot("sync.png", "Sync interval, codec and link estimates", "Top: local steps per round (H) and "
                "the codec(s) in use (shaded). Bottom: the coordinator's bandwidth (else RTT) estimate of each directed "
                "link on the same time axis, so a policy's reaction to a link change lines up with its cause.")


CODEC_COLORS = ("#9ecae1", "#fdae6b", "#a1d99b", "#dadaeb", "#fc9272", "#c7e9c0")
MAX_COLORED_LINKS = 6


def _draw_h(ax, rows, start, end) -> None:
    # Shade each stretch of rounds by the codecs in use, so a codec switch lines up with H.
    labels = [_codec_label(r.codecs) for r in rows]
    palette = {c: CODEC_COLORS[i % len(CODEC_COLORS)] for i, c in enumerate(dict.fromkeys(labels))}
    hs = [r.H for r in rows]
    log = min(hs) > 0 and max(hs) / min(hs) > 20  # an adaptive policy can move H by 100x
    top = max(hs) * (2.5 if log else 1.3)
    seg = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or labels[i] != labels[seg]:
            if labels[seg]:  # a one-region run sends nothing, so has no codec
                ax.axvspan(start[seg], end[i - 1], color=palette[labels[seg]], alpha=0.55, lw=0)
                ax.text(start[seg], top * (0.85 if log else 0.97), f" {labels[seg]}", va="top", ha="left", fontsize=9, color="#333333")
            seg = i
    ax.step(start + [end[-1]], hs + [hs[-1]], where="post", color=MEAN_COLOR, lw=2.2)
    ax.set(ylabel="H (local steps)", title="Sync interval H per round; shading: codec in use")
    if log:
        ax.set_yscale("log")
        readable_log(ax.yaxis)
        ax.set_ylim(min(hs) / 1.5, top)
    else:
        ax.set_ylim(0, top)
    ax.grid(axis="x", visible=False)


def _links_with(run: Run, key: str) -> list[str]:
    return run.link_order({k for r in run.rounds for k, v in r.links.items() if num(v.get(key)) is not None})


def _salient_links(run: Run, links: list[str], key: str, n: int) -> set[str]:
    """The n links a reader of the H panel needs: those the policy's reasons name (its
    bottlenecks), then the slowest, then those whose estimate moved the most."""
    named = Counter(k for r in run.rounds for k in links if k in r.reason)

    def values(link):
        return [v for v in (num(r.links[link].get(key)) for r in run.rounds if link in r.links) if v]

    def slowness(link):
        v = sorted(values(link))
        med = v[len(v) // 2] if v else 0.0
        return med if key == "rtt_ms" else -med

    def spread(link):
        v = values(link)
        return max(v) / min(v) if v else 1.0

    picked = [k for k, _ in named.most_common(n)]
    for ranked in (sorted(links, key=slowness, reverse=True)[:2], sorted(links, key=spread, reverse=True)):
        picked += [k for k in ranked if k not in picked][: n - len(picked)]
    return set(picked[:n])


def _draw_link_estimates(ax, run: Run, links: list[str], div: float, use_time: bool, key: str) -> None:
    """Every link's estimate; past MAX_COLORED_LINKS only the salient ones get a colour (and a
    legend entry), the rest stay grey: twelve coloured lines read as none."""
    colored = _salient_links(run, links, key, MAX_COLORED_LINKS - 1) if len(links) > MAX_COLORED_LINKS else set(links)
    cidx = {k: i for i, k in enumerate(run.link_order(colored))}
    grey_labelled = False
    for link in sorted(links, key=lambda k: k in colored):  # grey first, so coloured lines sit on top
        pts = [((r.t_end / div) if use_time else r.round + 1, num(r.links[link].get(key)))
               for r in run.rounds if link in r.links and (r.t_end is not None or not use_time)]
        pts = [(x, y) for x, y in pts if y is not None]
        if link in colored:
            kw = dict(color=color(cidx[link]), lw=1.6,
                      label=link.replace("->", " → "), **markers_for(len(pts)))
        else:
            kw = {"color": "#b0b0b0", "lw": 1.0, "label": None if grey_labelled else f"{len(links) - len(colored)} other links"}
            grey_labelled = True
        ax.plot([p[0] for p in pts], [p[1] for p in pts], **kw)
    maybe_log(ax, [num(v.get(key)) for r in run.rounds for v in r.links.values()], ratio=10)
    if key == "bandwidth_mbps":
        ax.set(ylabel="estimated bandwidth (Mbit/s)", title="Link bandwidth as the coordinator estimated it")
    else:
        ax.set(ylabel="estimated RTT (ms)", title="Link RTT as the coordinator estimated it (no bandwidth estimates in this run)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))


def link_bytes(run: Run) -> dict[str, float]:
    """Bytes sent per directed link: the summary's count, else the sum of per-round transfers."""
    out: dict[str, float] = {}
    for k, v in (run.summary.get("links") or {}).items():
        if isinstance(v, dict) and num(v.get("bytes")) is not None and link_pairs(k):
            out[k] = num(v["bytes"])
    if out:
        return out
    for m in run.metrics:
        for tr in m.get("transfers") or []:
            if isinstance(tr, dict) and tr.get("direction") == "send" and num(tr.get("bytes")) is not None:
                key = f"{m['region']}->{tr.get('peer')}"
                out[key] = out.get(key, 0.0) + num(tr["bytes"])
    return out


def plot_bytes_matrix(run: Run, out: Path) -> Plot | None:
    """bytes_matrix.png: bytes each region sent to each peer over the run; None without traffic."""
    per_link = link_bytes(run)
    if not per_link:
        return None
    names = list(run.regions)
    for k in per_link:
        for r in link_pairs(k):
            if r not in names:
                names.append(r)
    idx = {r: i for i, r in enumerate(names)}
    mat = np.full((len(names), len(names)), np.nan)
    for k, v in per_link.items():
        a, b = link_pairs(k)
        mat[idx[a], idx[b]] = v
    n = len(names)
    side = min(10, 2.8 + 0.7 * n)
    fig = new_figure(side + 1.6, side)
    ax = fig.subplots()
    # Headroom above the largest cell keeps it mid-blue, so black labels read on every cell.
    top = float(np.nanmax(mat)) if np.isfinite(mat).any() else 0.0
    im = ax.imshow(mat, cmap="Blues", vmin=0, vmax=top * 1.5 or 1.0)
    ax.set_xticks(range(n), names, rotation=35, ha="right")
    ax.set_yticks(range(n), names)
    ax.set(xlabel="to (receiver)", ylabel="from (sender)", title="Bytes sent per directed link")
    ax.grid(False)
    if n <= 12:
        for (i, j), v in np.ndenumerate(mat):
            text, c = ("—", "#999999") if not np.isfinite(v) else (human_bytes(v), "black")
            ax.text(j, i, text, ha="center", va="center", fontsize=9 if n <= 6 else 7, color=c)
    fig.colorbar(im, ax=ax, shrink=0.8, format=bytes_formatter(), label="bytes sent")
    save(fig, out, "bytes_matrix.png")
    return Plot("bytes_matrix.png", "Where the bytes went", "Bytes each region (row) sent to each peer "
                "(column) over the whole run, counted at the transport with headers; — : no traffic.")


def plot_bytes_cumulative(run: Run, out: Path) -> Plot | None:
    """bytes_cumulative.png: bytes sent so far, all regions and per region, against time; None without traffic."""
    fig = bytes_cumulative_figure(run)
    if fig is None:
        return None
    save(fig, out, "bytes_cumulative.png")
    return Plot("bytes_cumulative.png", "Cumulative bytes", "Bytes sent so far, all regions (black) and "
                "per region, against the wall clock: a flatter line is a cheaper run.")


REGION_DASHES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 2)))
REGION_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def bytes_cumulative_figure(run: Run):
    """The figure of plot_bytes_cumulative (tests read its lines); None without traffic."""
    rows = [r for r in run.rounds if r.t_end is not None]
    if not rows or not any(r.bytes_sent for r in rows):
        return None
    div, tlabel = time_axis(run)
    fig = new_figure(11, 3.8)
    ax = fig.subplots()
    per_region = run.series("bytes_sent")
    # From the first round's start, not 0: the seconds Ray takes to start are not a slow link.
    t0 = (rows[0].t_start if rows[0].t_start is not None else 0.0) / div
    for i, region in enumerate(run.regions):
        pts = per_region.get(region, [])
        xs = [t0] + [t / div for _, t, _ in pts if t is not None]
        ys = np.cumsum([0.0] + [v for _, t, v in pts if t is not None])
        if len(xs) > 1 and len(run.regions) > 1:
            style = region_style(i, len(run.regions), region)
            style["label"] = style["label"] and f"sent by {style['label']}"
            # Regions of a full topology send the same bytes: their lines coincide, so each
            # has its own dash and marker, and the one drawn on top does not hide the others.
            ax.plot(xs, ys, lw=1.2, alpha=0.8, **style, ls=REGION_DASHES[i % len(REGION_DASHES)],
                    marker=REGION_MARKERS[i % len(REGION_MARKERS)], markersize=5 if len(xs) <= 30 else 0,
                    markevery=max(1, len(xs) // 15), fillstyle="none")
    xs = [t0] + [r.t_end / div for r in rows]
    ys = np.cumsum([0.0] + [r.bytes_sent for r in rows])
    ax.plot(xs, ys, color=MEAN_COLOR, lw=2.4, label="all regions", **markers_for(len(xs)))
    ax.yaxis.set_major_formatter(bytes_formatter())
    ax.set(xlabel=tlabel, ylabel="cumulative bytes sent", title="Cumulative bytes sent")
    ax.legend(loc="upper left")
    return fig
