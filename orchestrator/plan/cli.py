"""`geofed plan CONFIG ...`: the planner's command line (parses, calls plan(), prints)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

USAGE = """Predict round time, compute utilisation, bytes and egress dollars of candidate (H, codec) pairs
for a run config before paying for it, and recommend the cheapest one that keeps the compute busy
(docs/plan.md)."""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _step_time(text: str) -> float | dict[str, float]:
    """`S` or `REGION=S,REGION=S,...` (seconds per inner step, each > 0)."""
    def seconds(v: str) -> float:
        x = float(v)
        if not x > 0 or x == float("inf"):
            raise ValueError
        return x

    try:
        if "=" not in text:
            return seconds(text)
        return {k.strip(): seconds(v) for k, v in (item.split("=", 1) for item in _csv(text))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 or REGION=SECONDS,..., got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed plan", description=USAGE)
    p.add_argument("config", help="YAML run config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    p.add_argument("--regions", type=_csv, help="comma-separated regions (default: regions.names)")
    p.add_argument("--H", dest="Hs", type=lambda s: [int(x) for x in _csv(s)], metavar="H,H,...",
                   help="candidate H values (default: 20,50,100,200,400,1000, the config's H and the policy's H_max)")
    p.add_argument("--codecs", type=lambda s: s.split(";") if ";" in s else _csv(s), metavar="C,C,...",
                   help="candidate codecs (default: the config's codec and ladder, fp16, int8, topk 1%%); "
                        "separate with ';' when a codec key holds commas")
    p.add_argument("--step-time", dest="step_time", type=_step_time, metavar="S|REGION=S,...",
                   help="seconds per inner step as the regions will see it (e.g. measured on the target GPU), or one "
                        "per region for a cluster whose nodes differ (the slowest paces the rounds); default: a probe "
                        "here, with one process per region at once for a local run (docs/plan.md)")
    p.add_argument("--links", metavar="FILE", help="link matrix: an earlier run's summary.json (its measured links) "
                   "or a YAML/JSON mapping 'a->b': {bandwidth_mbps, rtt_ms}; default: the config's emulation/preset")
    p.add_argument("--prices", metavar="FILE", help="egress price file (default: the packaged p2p/wan/prices.yaml)")
    p.add_argument("--overhead", type=float, metavar="S",
                   help="control-plane CPU seconds per round on an uncontended core (default: the bench's calibration)")
    p.add_argument("--contention", type=float, default=None, metavar="K",
                   help="regions' step time over the step time alone here (>= 1). Default: measured for a local "
                        "run (the step timed in one process per region at once on this host), 1 for a cluster "
                        "(ray.address: a node per region). Regions sharing cores step K times slower and their "
                        "codec and control-plane work stretch with them (docs/plan.md)")
    p.add_argument("--utilization-floor", dest="floor", type=float, default=0.9, metavar="X",
                   help="recommend the cheapest candidate with at least this compute utilisation (default 0.9); "
                        "when none has it, the fastest per step (docs/plan.md)")
    p.add_argument("--budget-usd-per-hour", dest="budget", type=float, metavar="Y",
                   help="and the fastest candidate whose egress costs at most this per hour")
    p.add_argument("--write-config", dest="write_config", metavar="OUT",
                   help="write CONFIG with the recommendation applied (fixed H, its codec)")
    p.add_argument("--address", metavar="ADDRESS",
                   help="plan the run as `geofed run --address ADDRESS` makes it: on a Ray cluster, a node per "
                        "region (this host's co-location is not measured; give --step-time as the nodes see it)")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    return p


def main(argv: Sequence[str]) -> int:
    """`geofed plan ARGS`; exit 2 on a bad config, links or price file (the message names the key)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    from geofed.p2p.wan.prices import PriceError

    from ..config import load_config
    from . import plan
    from .inputs import PlanInputError
    from .probe import ProbeError

    if not 0 <= args.floor <= 1:
        print("geofed plan: --utilization-floor: must be in [0, 1]", file=sys.stderr)
        return 2
    # --address decides where the regions run, as it does for `geofed run`; a written config keeps the file's.
    joined = [f"ray.address={json.dumps(args.address)}"] if args.address else []
    cfg = load_config(args.config, [*args.overrides, *joined])  # ConfigError: the CLI prints it, exit 2
    try:
        doc = plan(cfg, regions=args.regions, Hs=args.Hs, codecs=args.codecs, step_s=args.step_time,
                   links_path=args.links, prices_path=args.prices, utilization_floor=args.floor,
                   budget_usd_per_hour=args.budget, overhead_s=args.overhead, contention=args.contention)
    except (PlanInputError, PriceError, ValueError) as exc:
        print(f"geofed plan: {exc}", file=sys.stderr)
        return 2
    except ProbeError as exc:  # not the user's input: the machine could not run the step-time probe
        print(f"geofed plan: {exc}", file=sys.stderr)
        return 1
    doc["config"] = args.config
    if args.write_config:
        doc["written_config"] = write_config(args.config, args.overrides, doc, args.write_config)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_plan(Console(width=None if sys.stdout.isatty() else 150), doc)
    return 0


def write_config(path: str, overrides: Sequence[str], doc: dict, out: str) -> str | None:
    """CONFIG with the recommendation (docs/plan.md's rule) applied (sync.policy fixed H, compression.codec); None when none."""
    import yaml

    from ..config import config_from_mapping, load_mapping

    rec = doc["recommendation"]
    if rec is None:
        return None
    data = load_mapping(Path(path), overrides)  # paths made absolute: the written file may live elsewhere
    data.setdefault("sync", {})["policy"] = {"kind": "fixed", "H": rec["H"]}
    data.setdefault("compression", {})["codec"] = rec["codec"]
    config_from_mapping(dict(data), source=out)  # the written file must load
    Path(out).write_text(f"# geofed plan {path}: H={rec['H']}, codec {rec['codec']} (docs/plan.md)\n"
                         + yaml.safe_dump(data, sort_keys=False))
    return out


def _money(x: float | None) -> str:
    return "?" if x is None else f"${x:.3g}"


def print_plan(console: Console, doc: dict) -> None:
    """The candidates as a table, the recommendations under it."""
    rec = doc["recommended"]
    picks = [((r["H"], r["codec"]), k) for k, r in rec.items() if r is not None]
    if doc["recommendation"] is not None and not doc["recommendation"]["met_floor"]:
        picks.append(((doc["recommendation"]["H"], doc["recommendation"]["codec"]), "recommendation"))
    t = Table(title=f"geofed plan {doc.get('config', '')}: {len(doc['regions'])} regions, step "
                    f"{doc['step_time_s'] * 1e3:.3g} ms ({doc['step_time_source']}), "
                    f"{'overlap' if doc['overlap'] else 'serial'}, {doc['egress_provider']} list prices")
    for col in ("H", "codec", "round s", "util", "MB/round", "GB to end", "$/hour", "$/run", "bottleneck", ""):
        t.add_column(col, justify="right" if col not in ("codec", "bottleneck", "") else "left")
    for c in doc["candidates"]:
        mark = {"cheapest_meeting_floor": "<- cheapest", "fastest_under_budget": "<- fastest",
                "recommendation": "<- recommended (below the floor)"}
        note = ", ".join(mark[k] for hc, k in picks if hc == (c["H"], c["codec"]))
        t.add_row(str(c["H"]), c["codec"], f"{c['round_s']:.3g}", f"{c['utilization']:.0%}",
                  f"{c['bytes_per_round'] / 1e6:.3g}", f"{c['bytes_to_end'] / 2**30:.3g}",
                  _money(c["egress_usd_per_hour"]), _money(c["egress_usd_per_run"]), c["bottleneck"] or "-", note)
    console.print(t)
    floor = doc["utilization_floor"]
    for key, text in (("cheapest_meeting_floor", f"cheapest with utilisation >= {floor:.0%}"),
                      ("fastest_under_budget", "fastest" + ("" if doc["budget_usd_per_hour"] is None
                                                            else f" under ${doc['budget_usd_per_hour']:g}/hour"))):
        r = rec[key]
        console.print(f"{text}: " + ("none qualifies" if r is None else f"H={r['H']} codec {r['codec']}"))
    pol = doc.get("policy")
    if pol is not None and pol["kind"] != "fixed":
        pp = pol["prediction"]
        console.print(f"the run's policy ({pol['kind']}, H {pol['H_min']}..{pol['H_max']}) settles at H={pol['H']} "
                      f"codec {pol['codec']}: predicted utilisation {pp['utilization']:.0%}, round {pp['round_s']:.3g} s")
    r = doc["recommendation"]
    if r is not None:
        console.print(f"recommended: H={r['H']} codec {r['codec']}: {r['why']}"
                      + ("" if r["met_floor"] else f" (predicted utilisation {r['utilization']:.0%})"))
    for n in doc["notes"]:
        console.print(f"note: {n}")
    if doc.get("written_config"):
        console.print(f"wrote {doc['written_config']}")
