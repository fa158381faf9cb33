"""report.html: one self-contained page (inline CSS, no script, no network); the PNGs it shows
sit next to it and are referenced by bare file name, so the folder can be moved or zipped."""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from collections.abc import Sequence
from html import escape

from ..driver.progress import end_line, rounds_text
from .compare import CompareRow
from .facts import config_highlights, headline
from .load import Run, num
from .plots import link_bytes
from .style import Plot, human_bytes, human_seconds

MAX_TABLE_ROWS = 200  # a 10 000-round run's decision log is a file to grep, not a page to scroll

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2126;margin:0;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:24px 28px 60px}
h1{font-size:24px;margin:0 0 2px}h2{font-size:18px;margin:34px 0 10px;border-bottom:1px solid #dde1e6;padding-bottom:4px}
.sub{color:#5b6470;margin:0 0 18px;font-size:13px}
.tiles{display:grid;grid-template-columns:repeat(auto-fit,minmax(124px,1fr));gap:10px;margin:16px 0}
.tile{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:10px 14px}
.tile .k{color:#5b6470;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.tile .v{font-size:22px;font-weight:600;margin-top:2px}
.tile.bad .v{color:#b42318}
table{border-collapse:collapse;background:#fff;border:1px solid #dde1e6;font-size:13px;margin:6px 0 4px}
th,td{padding:5px 10px;border-bottom:1px solid #eceef1;text-align:left;vertical-align:top}
th{background:#f0f2f5;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cols{display:flex;flex-wrap:wrap;gap:24px}.cols>div{flex:1 1 320px}
figure{background:#fff;border:1px solid #dde1e6;border-radius:8px;margin:14px 0;padding:12px}
figure img{max-width:100%;height:auto;display:block;margin:0 auto}
figcaption{color:#5b6470;font-size:13px;margin-top:6px}
.warn{background:#fff8e6;border:1px solid #f0c36d;border-radius:8px;padding:8px 14px;margin:12px 0}
.note{color:#5b6470;font-size:12px}code{font-size:12px}
nav{font-size:13px;margin:4px 0 8px}nav a{color:#1f5fa8;text-decoration:none;margin-right:14px}nav a:hover{text-decoration:underline}
"""


def _num_cell(v: float | None, fmt=lambda v: f"{v:.4g}") -> str:
    return "—" if v is None else fmt(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, numeric: Sequence[int] = ()) -> str:
    """An HTML table with every cell escaped; `numeric` columns right-aligned; rows beyond MAX_TABLE_ROWS are
    counted, not shown."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    shown = rows[:MAX_TABLE_ROWS]
    body = "".join("<tr>" + "".join(
        f"<td{' class=n' if j in numeric else ''}>{escape(str(c))}</td>" for j, c in enumerate(r)) + "</tr>" for r in shown)
    more = f'<p class="note">{len(rows) - len(shown)} more rows not shown.</p>' if len(rows) > len(shown) else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}"


def anchor(p: Plot) -> str:
    """The id of a plot's figure in the page (from its file name)."""
    return "plot-" + p.file.rsplit(".", 1)[0]


def figure(p: Plot) -> str:
    """A plot as an HTML figure linking to its image, with title and caption (escaped)."""
    return (f'<figure id="{escape(anchor(p))}"><a href="{escape(p.file)}"><img src="{escape(p.file)}" alt="{escape(p.title)}">'
            f"</a><figcaption><b>{escape(p.title)}.</b> {escape(p.caption)}</figcaption></figure>")


def _tiles(run: Run) -> str:
    h = headline(run)
    faults = run.summary.get("faults") if isinstance(run.summary.get("faults"), dict) else {}
    # Counters overlap (a late update is both dropped and its peer left out), so they are not
    # summed: region failures get a tile only when there were some, the rest is in the table.
    failed = sum(v for k, v in faults.items() if k in ("region_failures", "region_restarts") and isinstance(v, int))
    left_out = faults.get("peers_left_out")
    refusals = (run.summary.get("refusals") or {}).get("total") if isinstance(run.summary.get("refusals"), dict) else None
    tiles = [("rounds", str(h.rounds), False), ("wall time", _num_cell(h.wall_s, human_seconds), False),
             ("bytes sent", human_bytes(h.bytes_sent), False),
             ("final train loss", _num_cell(h.final_train_loss), False)]
    if h.eval_value is not None:
        tiles.append((f"final {h.eval_metric}", f"{h.eval_value:.4g}", False))
    target = run.summary.get("target") if isinstance(run.summary.get("target"), dict) else None
    if target is not None:
        reached = target.get("reached") and num(target.get("time_to_target_s")) is not None
        tiles.append((f"time to {target.get('metric')} {target.get('value')}",
                      human_seconds(target["time_to_target_s"]) if reached else "not reached", not reached))
    if num(run.summary.get("egress_usd")) is not None:
        tiles.append(("egress cost", f"${num(run.summary.get('egress_usd')):.3g}", False))
    tiles.append(("compute utilisation", _num_cell(h.utilization, lambda v: f"{v:.0%}"), False))
    if failed:
        tiles.append(("region failures", str(failed), True))
    tiles.append(("peers left out", str(left_out) if isinstance(left_out, int) else "—", bool(left_out)))
    stalls, out = faults.get("region_stalls"), faults.get("region_rounds_out")
    if (isinstance(stalls, int) and stalls) or (isinstance(out, int) and out):
        # A stalled region is no participant: it is left out of rounds, not counted in peers left out.
        tiles.append(("region stalls / rounds out", f"{stalls if isinstance(stalls, int) else 0} / "
                      f"{out if isinstance(out, int) else 0}", True))
    tiles.append(("refusals", str(refusals) if isinstance(refusals, int) else "—", bool(refusals)))
    clipped = _clipped(run)
    if clipped:
        tiles.append(("clipped updates", str(clipped.get("total", 0)), False))
    return '<div class="tiles">' + "".join(
        f'<div class="tile{" bad" if bad else ""}"><div class="k">{escape(k)}</div><div class="v">{escape(v)}</div></div>'
        for k, v, bad in tiles) + "</div>"


def _clipped(run: Run) -> dict:
    """summary.json's refusals.clipped ({} for a run from before it was counted)."""
    ref = run.summary.get("refusals")
    clipped = ref.get("clipped") if isinstance(ref, dict) else None
    return clipped if isinstance(clipped, dict) else {}


def _faults_table(run: Run) -> str:
    rows = []
    for k, v in (run.summary.get("faults") or {}).items():
        if not isinstance(v, (dict, list)):  # by_region has a table of its own (_region_failures)
            rows.append((k.replace("_", " "), v))
    ref = run.summary.get("refusals") or {}
    if isinstance(ref, dict):
        rows.append(("refusals (total)", ref.get("total", 0)))
        for reason, n in sorted((ref.get("by_reason") or {}).items()):
            rows.append((f"refused: {reason}", n))
    clipped = _clipped(run)
    if clipped:
        # Scaled down, not refused: honest updates above a round's median norm are too, so the
        # sender column is what tells a member clipped round after round.
        rows.append(("clipped updates (total)", clipped.get("total", 0)))
        for sender, n in sorted((clipped.get("by_sender") or {}).items()):
            rows.append((f"clipped from {sender}", n))
    if not rows:
        return '<p class="note">No fault counts (summary.json missing).</p>'
    return table(["fault / refusal", "count"], rows, numeric=[1])


def _region_failures(run: Run) -> str:
    """The regions that failed, stalled or sat rounds out, named (summary.json faults.by_region):
    how often, why, the restarts, the rounds missed and whether it was back at the end; "" for a
    run without any."""
    faults = run.summary.get("faults") if isinstance(run.summary.get("faults"), dict) else {}
    by_region = faults.get("by_region") if isinstance(faults.get("by_region"), dict) else {}
    live = run.summary.get("live_regions") if isinstance(run.summary.get("live_regions"), dict) else {}
    ended = live.get("ended") if isinstance(live.get("ended"), list) else None
    rows = []
    for region, f in by_region.items():
        if not isinstance(f, dict):
            continue
        causes = ", ".join(f"{c} x{n}" if n > 1 else str(c) for c, n in Counter(map(str, f.get("causes") or [])).items())
        rows.append((region, f.get("failures", 0), causes or "—", f.get("restarts", 0), f.get("stalls", 0),
                     rounds_text(f.get("rounds_out") or []) or "—",
                     "—" if ended is None else "yes" if region in ended else "no"))
    if not rows:
        return ""
    return ("<h3>Regions that failed or sat out</h3>" + table(
        ["region", "failures", "causes", "restarts", "stalls", "rounds missed", "in the run at the end"], rows,
        numeric=[1, 3, 4]))


def _end_warning(run: Run) -> str:
    """The run's last line, when it ended with fewer live regions than it started with."""
    line = end_line(run.summary) if isinstance(run.summary, dict) else None
    return f'<div class="warn">{escape(line[0].upper() + line[1:])}.</div>' if line else ""


def _regions_table(run: Run) -> str:
    util = run.summary.get("utilization_per_region") or {}
    ev = run.summary.get("eval_per_region") or {}
    place = run.summary.get("placement") or {}
    last = {m["region"]: m for m in run.metrics}
    sent: dict[str, float] = {}
    for m in run.metrics:
        sent[m["region"]] = sent.get(m["region"], 0.0) + (num(m.get("bytes_sent")) or 0.0)
    rows = []
    for r in run.regions:
        e = ev.get(r) if isinstance(ev.get(r), dict) else (last.get(r, {}).get("eval") or {})
        where = place.get(r) if isinstance(place.get(r), dict) else {}
        rows.append((r, where.get("node_ip") or where.get("host") or "—",
                     _num_cell(num(last.get(r, {}).get("train_loss"))), _num_cell(num(e.get("value")) if e else None),
                     _num_cell(num(util.get(r)), lambda v: f"{v:.0%}"), human_bytes(sent.get(r, 0.0))))
    return table(["region", "node", "last train loss", "last eval", "utilisation", "bytes sent"], rows, numeric=[2, 3, 4, 5])


def _reports_section(run: Run) -> str:
    """What each region's training function passed to ctx.report (the loop API, summary.json's
    `reports`); nothing for a task's run."""
    reports = run.summary.get("reports") or {}
    rows = [(region, key, json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value)
            for region, values in sorted(reports.items()) if isinstance(values, dict)
            for key, value in sorted(values.items())]
    if not rows:
        return ""
    return ('<h2 id="reports">Reports</h2><p class="note">What each region\'s training function passed to '
            "<code>ctx.report</code>.</p>" + table(["region", "key", "value"], rows))


def _links_table(run: Run) -> str:
    links = {k: v for k, v in (run.summary.get("links") or {}).items() if isinstance(v, dict)}
    if not links and run.rounds:
        links = dict(run.rounds[-1].links)
    per_bytes = link_bytes(run)
    if not links and not per_bytes:
        return '<p class="note">No per-link records (a one-region run has no links).</p>'
    rows = []
    for k in run.link_order(set(links) | set(per_bytes)):
        v = links.get(k, {})
        rows.append((k.replace("->", " → "), human_bytes(per_bytes.get(k, 0.0)),
                     _num_cell(num(v.get("bandwidth_mbps")), lambda x: f"{x:.3g}"),
                     _num_cell(num(v.get("configured_bandwidth_mbps")), lambda x: f"{x:.3g}"),
                     _num_cell(num(v.get("rtt_ms")), lambda x: f"{x:.3g}"),
                     _num_cell(num(v.get("configured_rtt_ms")), lambda x: f"{x:.3g}"),
                     _num_cell(num(v.get("usd_per_gb")), lambda x: f"{x:.3g}"),
                     _num_cell(num(v.get("egress_usd")), lambda x: f"${x:.4g}")))
    total = num(run.summary.get("egress_usd"))
    if total is not None:
        rows.append(("all links (egress, probes included)", "", "", "", "", "", "", f"${total:.4g}"))
    return table(["link", "bytes sent", "measured Mbit/s", "configured Mbit/s", "measured RTT ms", "configured RTT ms",
                  "$/GB", "egress $"], rows, numeric=[1, 2, 3, 4, 5, 6, 7])


def _decisions_table(run: Run) -> str:
    """Only the rounds where H or the codecs changed: the policy's decisions, with its reasons."""
    rows, prev = [], None
    for r in run.rounds:
        key = (r.H, tuple(sorted(r.codecs.items())))
        if key != prev:
            codecs = "/".join(sorted(set(r.codecs.values()))) or "—"
            rows.append((r.round, _num_cell(r.t_start, lambda v: f"{v:.1f}"), _num_cell(r.H, lambda v: f"{v:g}"), codecs, r.reason or "—"))
        prev = key
    if not rows:
        return '<p class="note">No rounds recorded.</p>'
    return table(["round", "t (s)", "H", "codecs", "reason"], rows, numeric=[0, 1, 2])


def _events_table(run: Run) -> str:
    if not run.events:
        return '<p class="note">No events recorded.</p>'
    rows = []
    for e in run.events:
        what = e.get("kind") or e.get("event") or e.get("type") or "event"
        rest = {k: v for k, v in e.items() if k not in ("t", "round", "kind", "event", "type")}
        rows.append((_num_cell(num(e.get("t")), lambda v: f"{v:.1f}"), e.get("round", "—"),
                     str(what).replace("_", " "), event_details(str(what), rest)))
    return table(["t (s)", "round", "event", "details"], rows, numeric=[0, 1])


def event_details(what: str, rest: dict) -> str:
    """One event's fields as a line a person reads (not JSON): a summary for the bulky set-up
    events, else `key: value` pairs with nested records counted rather than dumped."""
    if what == "started" and isinstance(rest.get("regions"), dict):
        return f"driver pid {rest.get('driver_pid', '?')}, {len(rest['regions'])} regions" + (", resumed" if rest.get("resume") else "")
    if what == "links_probed" and isinstance(rest.get("links"), dict):
        return f"{len(rest['links'])} links measured before round 0"
    if what == "setup_done":
        phases = rest.get("phases_s") if isinstance(rest.get("phases_s"), dict) else {}
        total = num(rest.get("setup_s"))
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in phases.items() if num(v) is not None)
        return (f"set-up {total:.1f} s" if total is not None else "set-up done") + (f" ({parts})" if parts else "")
    out = []
    for k, v in rest.items():
        if isinstance(v, dict):
            flat = all(not isinstance(x, (dict, list)) for x in v.values())
            v = ", ".join(f"{a}={b}" for a, b in v.items()) if flat and len(v) <= 6 else f"{len(v)} entries"
        elif isinstance(v, list):
            v = ", ".join(map(str, v)) if len(v) <= 6 and all(not isinstance(x, (dict, list)) for x in v) else f"{len(v)} items"
        elif isinstance(v, float):
            v = f"{v:.4g}"
        out.append(f"{k.replace('_', ' ')}: {v}")
    return "; ".join(out)[:300]


def comparison_section(rows: Sequence[CompareRow], plots: Sequence[Plot], target: float | None) -> str:
    """The comparison's HTML: a table of the runs (time and bytes to target relative to the first run) and the plots."""
    base = rows[0] if rows else None

    def rel(v, b):
        return f" ({v / b:.2f}×)" if v is not None and b and base is not None else ""

    trs = []
    for r in rows:
        h, t = r.head, r.reached
        trs.append((r.label, r.setup or "—", h.rounds, _num_cell(h.wall_s, human_seconds),
                    human_bytes(h.bytes_sent), _num_cell(h.final_train_loss),
                    _num_cell(h.eval_value) if h.eval_value is not None else "—",
                    "not reached" if t.seconds is None else human_seconds(t.seconds) + rel(t.seconds, base.reached.seconds),
                    "not reached" if t.bytes is None else human_bytes(t.bytes) + rel(t.bytes, base.reached.bytes)))
    tgt = f"{target:.4g}" if target is not None else "—"
    note = (f'<p class="note">Target: mean train loss ≤ {escape(tgt)} (the loss every run reached unless given); '
            f"time and bytes are counted from the start of round 0 (start-up excluded) to the end of the first round "
            f"at or below it; wall time includes start-up; ratios are to the first run.</p>")
    return ("<h2>Comparison</h2>" + table(
        ["run", "algorithm / policy / codec", "rounds", "wall time", "bytes sent", "final train loss", "final eval",
         "time to target", "bytes to target"], trs, numeric=[2, 3, 4, 5, 6, 7, 8]) + note
            + "".join(figure(p) for p in plots))


def page(title: str, subtitle: str, body: str) -> str:
    """A whole self-contained HTML page (inline CSS) around `body`."""
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body><main><h1>{escape(title)}</h1>"
            f'<p class="sub">{escape(subtitle)} · written {now} by <code>geofed report</code></p>{body}</main></body></html>\n')


def render_run(run: Run, plots: Sequence[Plot], comparison: str = "") -> str:
    """The report page of one run: headline tiles, config, faults, plots, regions, links, policy decisions, events."""
    warn = "".join(f'<div class="warn">{escape(w)}</div>' for w in run.warnings)
    if not run.rounds:
        warn += '<div class="warn">No rounds recorded yet: nothing to plot.</div>'
    config = table(["setting", "value"], config_highlights(run)) if config_highlights(run) else '<p class="note">No config recorded.</p>'
    nav = "<nav>" + "".join(f'<a href="#{escape(anchor(p))}">{escape(p.title)}</a>' for p in plots) + (
        '<a href="#regions">Regions</a><a href="#links">Links</a><a href="#decisions">Policy decisions</a>'
        '<a href="#events">Events</a></nav>')
    body = (nav + warn + _end_warning(run) + _tiles(run)
            + f'<div class="cols"><div><h2>Config</h2>{config}</div><div><h2>Faults and refusals</h2>{_faults_table(run)}'
            + f'{_region_failures(run)}</div></div>'
            + comparison + ("<h2>Plots</h2>" if plots else "") + "".join(figure(p) for p in plots)
            + f'<h2 id="regions">Regions</h2>{_regions_table(run)}{_reports_section(run)}'
            + f'<h2 id="links">Links</h2>{_links_table(run)}'
            + f'<h2 id="decisions">Policy decisions</h2><p class="note">Rounds where H or the codecs changed.</p>{_decisions_table(run)}'
            + f'<h2 id="events">Events</h2>{_events_table(run)}')
    return page(f"geofed run report: {run.name}", str(run.path), body)
