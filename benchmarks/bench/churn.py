"""`geofed bench churn`: what repeated faults cost a run (issue 41).

    geofed bench churn [--task digits|char-lm] [--regions 4|8] [--rounds N] [--every S] [--reps N]
                       [--quick] [--json] [--out DIR] [--set KEY=VALUE ...]

Two arms, run side by side and interleaved (repetition i runs them in an order rotated by i):
``undisturbed`` and ``churn``, the same run with one fault every `--every` seconds (30) from its first round, in
rotation: kill -9 of a region, SIGSTOP of a region for 10 s, a 10 s outage of a link, a graceful
`geofed leave` followed by `geofed join` 30 s later, and kill -9 of the driver followed by
`geofed run --resume` (bench/churn_faults.py). Each run is a real `geofed run` in a process of its
own (the driver must be killable) joined to one local Ray that the bench starts for all of them:
Ray actors, mutual-TLS gRPC, the proxy WAN emulator with the AWS preset (the default config,
configs/local-wan.yaml, digits on 4 regions, or char-lm), with H fixed (`--H`, 200) so that the arms
differ only by the faults.

It reports, per arm, the median over repetitions with its spread: examples per second of the whole
run (the rounds that count, each once, over the wall time from the first launch to the end: time
lost to faults, restarts and rounds done again included), the final metric, the rounds done again
after a driver kill (the `resumed` events' lost rounds) and the peak RSS of any region. The ratios
(churn against undisturbed, per repetition, then the median) are the issue's targets:
throughput_ratio >= 0.95, metric_delta_points >= -1, rounds_redone_after_driver_kill == 0 and
rss_growth_mb <= 16 (the soak test's bound per region). Beside them, `ceiling`: the throughput ratio
the faults allow by construction (a region that left is out until its join is asked, a stopped one
for its stop; recovery taken as free) and the measured ratio over it, which is what recovery cost.
Exit code 0 when the runs ended, whatever
the targets (the table and `targets_met` say which were met); 1 when a run failed; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from geofed.orchestrator.config import config_from_mapping, default_config_path
from geofed.orchestrator.config.strict import parse_yaml_file
from geofed.orchestrator.driver.rundir import read_jsonl

from .churn_faults import KINDS, DriverProcess, Injector, Timing, outage_event, plan_faults
from .wan_reps import interleaved_schedule, median_spread

ARMS = ("undisturbed", "churn")
REGIONS8 = ["us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1", "us-west-2", "eu-west-2",
            "ap-southeast-1", "us-east-2"]
TASK_CONFIGS = {"digits": "local-wan.yaml", "char-lm": "bench-hetero-lm.yaml"}
RSS_GROWTH_BOUND_MB = 16.0  # tests/integration/test_reliability_soak.py REGION_RSS_GROWTH_MB
TARGETS = {"throughput_ratio": 0.95, "metric_delta_points": -1.0, "rounds_redone_after_driver_kill": 0,
           "rss_growth_mb": RSS_GROWTH_BOUND_MB}
NODE_LABEL = "geofed-bench-churn"  # the bench's one Ray node carries it for every region (regions.labels)
DEFAULT_ROUND_S = 0.6  # a round of the digits default with H 200 on 2 cores, until the undisturbed arm measured one


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What every run of one bench shares."""

    task: str
    regions: int
    rounds: int
    H: int
    timing: Timing
    overrides: tuple[str, ...] = ()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed bench churn", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASK_CONFIGS), default="digits",
                   help="digits (the default config's MLP) or char-lm (the GRU on tinyshakespeare)")
    p.add_argument("--regions", type=int, choices=(4, 8), default=4, help="regions in the run (default 4)")
    p.add_argument("--rounds", type=int, default=500,
                   help="rounds of every run (default 500: about 5 minutes undisturbed on 2 cores)")
    p.add_argument("--H", type=int, default=200, help="inner steps per round, fixed (default 200)")
    p.add_argument("--every", type=float, default=30.0, help="seconds between faults (default 30)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of both arms, interleaved (default 3)")
    p.add_argument("--quick", action="store_true",
                   help="one repetition of short runs (150 rounds, a fault every 12 s, 4 s stops and outages, "
                        "a join 12 s after the leave: every kind once), said so in the output")
    p.add_argument("--json", action="store_true", help="print the JSON document on stdout")
    p.add_argument("--out", help="folder for the run directories (default runs/bench-churn-<UTC time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key in every run (e.g. --set run.seed=1)")
    return p


def run_mapping(setup: Setup, *, name: str, schedule: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The config of one run: the task's config file, `setup`'s regions, rounds and fixed H, and the
    churn arm's link outages in the emulator's schedule."""
    m = copy.deepcopy(parse_yaml_file(default_config_path().parent / TASK_CONFIGS[setup.task]))
    m["run"].update({"name": name, "rounds": setup.rounds, "report": False, "checkpoint_every": 1})
    m["regions"]["names"] = REGIONS8[:setup.regions]
    # The drivers join the bench's Ray (--address), which pins each region to a node with its label:
    # here one node carries the label of all of them.
    m["regions"]["labels"] = {r: NODE_LABEL for r in m["regions"]["names"]}
    m.setdefault("sync", {})["policy"] = {"kind": "fixed", "H": setup.H}
    if schedule:
        m["network"]["emulation"]["schedule"] = [dict(e) for e in schedule]
    return m


def measure(run_dir: Path, *, wall_s: float, batch_size: int) -> dict[str, Any]:
    """One run's numbers from its run directory (module docstring)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")  # a resume truncated the rounds it did again: each counts once
    events = read_jsonl(run_dir / "events.jsonl")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    examples = sum(int(m.get("steps") or 0) for m in metrics) * batch_size
    peaks: dict[str, float] = {}
    for m in metrics:
        if m.get("rss_mb") is not None:
            peaks[m["region"]] = max(peaks.get(m["region"], 0.0), float(m["rss_mb"]))
    ev = summary.get("eval") or {}
    rounds = read_jsonl(run_dir / "rounds.jsonl")
    train_s = rounds[-1]["t_end"] - rounds[0]["t_start"] if rounds else None
    return {"round_s": round(train_s / len(rounds), 4) if train_s is not None else None,
            "train_s": None if train_s is None else round(train_s, 2),
            "run_dir": str(run_dir), "wall_s": round(wall_s, 2), "examples": examples,
            "examples_per_s": round(examples / wall_s, 1) if wall_s > 0 else None,
            "final_metric": ev.get("value"), "metric": ev.get("metric"), "higher_is_better": ev.get("higher_is_better", True),
            "rounds": summary.get("rounds"),
            "rounds_redone": sum(len(e.get("lost_rounds") or []) for e in events if e.get("event") == "resumed"),
            "driver_launches": sum(1 for e in events if e.get("event") == "started"),
            "peak_rss_mb": max(peaks.values()) if peaks else None, "peak_rss_by_region": peaks}


def ratios(undisturbed: dict[str, Any], churn: dict[str, Any]) -> dict[str, float | None]:
    """One repetition's churn against its undisturbed run (metric_delta_points: accuracy in points,
    a loss's difference as is, negative when churn is worse)."""
    def diff(key: str) -> float | None:
        a, b = churn.get(key), undisturbed.get(key)
        return None if a is None or b is None else float(a) - float(b)

    tp = (churn["examples_per_s"] / undisturbed["examples_per_s"]
          if churn.get("examples_per_s") and undisturbed.get("examples_per_s") else None)
    delta = diff("final_metric")
    if delta is not None:
        delta = delta * 100 if churn.get("metric") == "accuracy" else (delta if churn.get("higher_is_better", True) else -delta)
    return {"throughput_ratio": None if tp is None else round(tp, 4),
            "metric_delta_points": None if delta is None else round(delta, 3),
            "rounds_redone_after_driver_kill": churn.get("rounds_redone"),
            "rss_growth_mb": None if diff("peak_rss_mb") is None else round(diff("peak_rss_mb"), 1)}


def ceiling(undisturbed: dict[str, Any], actions: Sequence[dict[str, Any]], *, regions: int,
            timing: Timing) -> dict[str, float | None]:
    """What the faults cost by construction, with recovery free: a region that left is out until its
    join is asked `timing.rejoin_after_s` later, a stopped one for `stop_s`; each region-second out
    is a region-second of examples the undisturbed run made at its steady rate (its training time
    `train_s`, set-up excluded). `throughput_ceiling` is the throughput_ratio a churn run would reach
    if every recovery took no time at all; `absent_region_s` the region-seconds out."""
    absent = sum(timing.rejoin_after_s if a["kind"] == "leave" else float(a.get("stop_s") or 0.0)
                 for a in actions if a.get("ok") and a["kind"] in ("leave", "region-stop"))
    train_s = undisturbed.get("train_s")
    top = 1.0 - absent / (regions * train_s) if train_s else None
    return {"absent_region_s": round(absent, 1), "throughput_ceiling": None if top is None else round(top, 4)}


def document(per_rep: list[dict[str, dict[str, Any]]], *, setup: Setup, quick: bool,
             faults: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The JSON document: arms (medians with spread), ratios (median of the per-repetition ratios), targets."""
    arms = []
    for arm in ARMS:
        rows = [rep[arm] for rep in per_rep if arm in rep]
        doc: dict[str, Any] = {"name": arm, "spread": {}}
        for key in ("examples_per_s", "final_metric", "wall_s", "rounds_redone", "peak_rss_mb"):
            doc[key], doc["spread"][key] = median_spread([r.get(key) for r in rows])
        arms.append(doc)
    per = [ratios(rep["undisturbed"], rep["churn"]) for rep in per_rep if set(ARMS) <= set(rep)]
    out_ratios, spread = {}, {}
    for key in TARGETS:
        out_ratios[key], spread[key] = median_spread([p[key] for p in per])
    met = {key: _met(key, out_ratios[key]) for key in TARGETS}
    tops = [ceiling(rep["undisturbed"], acts, regions=setup.regions, timing=setup.timing)
            for rep, acts in zip(per_rep, faults) if set(ARMS) <= set(rep)]
    of = [p["throughput_ratio"] / t["throughput_ceiling"] for p, t in zip(per, tops)
          if p["throughput_ratio"] is not None and t["throughput_ceiling"]]
    top, top_spread = median_spread([t["throughput_ceiling"] for t in tops])
    of_median, of_spread = median_spread(of)
    return {"ceiling": {"throughput_ceiling": top, "throughput_of_ceiling": None if of_median is None else round(of_median, 4),
                        "spread": {"throughput_ceiling": top_spread, "throughput_of_ceiling": of_spread},
                        "per_rep": tops},
            "task": setup.task, "regions": setup.regions, "rounds": setup.rounds, "H": setup.H,
            "fault_every_s": setup.timing.every_s, "reps": len(per_rep), "quick": quick, "arms": arms,
            "ratios": out_ratios, "spread": spread, "per_rep": per, "targets": TARGETS, "targets_met": met,
            "faults": faults}


def _met(key: str, value: float | None) -> bool | None:
    if value is None:
        return None
    if key == "rounds_redone_after_driver_kill":
        return value <= TARGETS[key]
    if key == "rss_growth_mb":
        return value <= TARGETS[key]
    return value >= TARGETS[key]


def run_one(setup: Setup, arm: str, where: Path, *, address: str, round_s: float,
            console: Console) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One run of `arm` in `where` (its config, run directory and driver log); (its numbers, the faults it took)."""
    where.mkdir(parents=True, exist_ok=True)
    faults = []
    if arm == "churn":
        until = setup.rounds * round_s
        faults = plan_faults(REGIONS8[:setup.regions], until_s=until, timing=setup.timing)
    schedule = [outage_event(f, round_s=round_s, outage_s=setup.timing.outage_s) for f in faults if f.kind == "link-outage"]
    mapping = run_mapping(setup, name=f"churn-{arm}", schedule=schedule)
    cfg = config_from_mapping(copy.deepcopy(mapping), list(setup.overrides), source=f"bench churn {arm}")
    config_path = where / "config.yaml"
    config_path.write_text(yaml.safe_dump(mapping, sort_keys=False))
    driver = DriverProcess(config_path, where / "run", address=address, log=where / "driver.log",
                           overrides=setup.overrides)
    t0 = time.monotonic()
    driver.start()
    injector = Injector(driver, faults, t0=t0, timing=setup.timing).start()
    try:
        code = driver.wait(timeout_s=max(1800.0, 10 * setup.rounds * round_s))
    except BaseException:
        injector.join(5)
        driver.stop()
        raise
    wall = time.monotonic() - t0
    injector.join()
    if code != 0:
        raise RuntimeError(f"bench churn: the {arm} run ended with exit code {code} (its log: {where / 'driver.log'})")
    got = measure(where / "run", wall_s=wall, batch_size=cfg.sync.inner.batch_size)
    got["faults_done"] = sum(1 for a in injector.actions if a["ok"])
    got["round0_s"] = injector.round0_s  # when the faults' clock started (None: no faults)
    console.print(f"{arm}: {got['examples_per_s']} examples/s over {got['wall_s']} s, final {got['metric']} "
                  f"{got['final_metric']}, rounds redone {got['rounds_redone']}, peak RSS {got['peak_rss_mb']} MB"
                  + (f", {got['faults_done']}/{len(injector.actions)} fault actions done" if faults else ""))
    return got, injector.actions


def run_bench(out: Path, setup: Setup, *, reps: int, quick: bool, console: Console | None = None) -> dict[str, Any]:
    """Both arms `reps` times, interleaved; returns the JSON document (also out/bench.json)."""
    import ray

    console = console or Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    order = interleaved_schedule(list(ARMS), reps)
    cfg = config_from_mapping(run_mapping(setup, name="churn"), list(setup.overrides), source="bench churn")
    per_rep: list[dict[str, dict[str, Any]]] = [{} for _ in range(reps)]
    faults: list[list[dict[str, Any]]] = [[] for _ in range(reps)]
    round_s = DEFAULT_ROUND_S
    console.rule(f"geofed bench churn: {len(order)} runs ({reps} interleaved repetition{'s' * (reps > 1)}"
                 f"{', --quick' if quick else ''}), {setup.task}, {setup.regions} regions, {setup.rounds} rounds, "
                 f"a fault every {setup.timing.every_s:g} s ({', '.join(KINDS)})")
    if ray.is_initialized():
        raise RuntimeError("bench churn starts a Ray of its own (its node labelled for every region): call it without one")
    ray.init(num_cpus=max(4, setup.regions), include_dashboard=False, log_to_driver=False,
             labels={cfg.regions.label_key: NODE_LABEL},
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(cfg.regions.torch_threads)}})
    try:
        address = ray.get_runtime_context().gcs_address
        for k, (rep, arm) in enumerate(order):
            console.print(f"[{k + 1}/{len(order)}] rep {rep} {arm}")
            got, actions = run_one(setup, arm, out / f"rep{rep}" / arm, address=address, round_s=round_s, console=console)
            per_rep[rep][arm] = got
            if arm == "undisturbed" and got["rounds"]:
                round_s = got["round_s"] or round_s  # where the churn arm's outages fall, by round
            else:
                faults[rep] = actions
            with (out / "rows.jsonl").open("a") as f:  # a bench cut short keeps what it measured
                f.write(json.dumps({"rep": rep, "arm": arm, **got, "actions": actions}) + "\n")
    finally:
        ray.shutdown()
    doc = document(per_rep, setup=setup, quick=quick, faults=faults)
    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    return doc


def print_table(console: Console, doc: dict[str, Any]) -> None:
    t = Table(title=f"geofed bench churn ({doc['reps']} rep{'s' * (doc['reps'] > 1)}{', quick' if doc['quick'] else ''}; "
                    f"a fault every {doc['fault_every_s']:g} s; medians [min-max])")
    for col in ("arm", "examples/s", "final metric", "wall s", "rounds redone", "peak RSS MB"):
        t.add_column(col)
    for a in doc["arms"]:
        t.add_row(a["name"], *(_spread(a, k, nd) for k, nd in (("examples_per_s", 1), ("final_metric", 4), ("wall_s", 1),
                                                                ("rounds_redone", 0), ("peak_rss_mb", 1))))
    console.print(t)
    for key, value in doc["ratios"].items():
        sp = doc["spread"][key]
        met = doc["targets_met"][key]
        op = "<=" if key in ("rounds_redone_after_driver_kill", "rss_growth_mb") else ">="
        console.print(f"{key}: {_fmt(value, 3)} [{_fmt(sp['min'], 3)}-{_fmt(sp['max'], 3)}] (target {op} "
                      f"{doc['targets'][key]:g}: {'met' if met else 'not met' if met is False else '-'})")
    top = doc.get("ceiling") or {}
    if top.get("throughput_ceiling") is not None:
        console.print(f"throughput_ceiling: {_fmt(top['throughput_ceiling'], 3)} (the faults' own absences with free "
                      f"recovery: leaves until the join is asked, stops); throughput_ratio / ceiling: "
                      f"{_fmt(top['throughput_of_ceiling'], 3)}")


def _spread(a: dict[str, Any], key: str, nd: int) -> str:
    sp = a["spread"][key]
    return f"{_fmt(a[key], nd)} [{_fmt(sp['min'], nd)}-{_fmt(sp['max'], nd)}]"


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv: Sequence[str]) -> int:
    """`geofed bench churn ARGS`; the exit code (module docstring)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    reps = 1 if args.quick else args.reps
    for name, value, low in (("--reps", reps, 1), ("--rounds", args.rounds, 10), ("--H", args.H, 1)):
        if value < low:
            print(f"geofed bench churn: {name}: must be >= {low}, got {value}", file=sys.stderr)
            return 2
    if args.every <= 0:
        print(f"geofed bench churn: --every: must be > 0, got {args.every}", file=sys.stderr)
        return 2
    timing = (Timing(every_s=12.0, stop_s=4.0, outage_s=4.0, rejoin_after_s=12.0) if args.quick
              else Timing(every_s=args.every))
    setup = Setup(task=args.task, regions=args.regions, rounds=150 if args.quick else args.rounds, H=args.H,
                  timing=timing, overrides=tuple(args.overrides))
    try:
        config_from_mapping(run_mapping(setup, name="churn"), list(setup.overrides), source="geofed bench churn")
    except ValueError as exc:  # ConfigError names the key
        print(f"geofed bench churn: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-churn-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}")
    try:
        doc = run_bench(out, setup, reps=reps, quick=args.quick)
    except (RuntimeError, TimeoutError) as exc:
        print(f"geofed bench churn: {exc} (run directories so far: {out})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_table(Console(), doc)
        print(f"run directories: {out}")
    return 0


__all__ = ["ARMS", "TARGETS", "ceiling", "document", "main", "measure", "ratios", "run_bench", "run_mapping"]
