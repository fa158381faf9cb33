"""`geofed bench wan`: per-step sync vs fixed H vs adaptive, 4 regions over the emulated WAN.

    geofed bench wan [--scenario steady|drop] [--quick] [--reps N] [--arms A,B] [--json] [--out DIR]

Each arm is a real `geofed run` (Ray actors, mutual-TLS gRPC, the proxy WAN emulator) built
by bench_wan_arms from configs/bench-wan.yaml; bench_wan_results reads each run directory back.
Every arm runs ``--reps`` times (3; ``--quick``: 1), interleaved round-robin with the start arm
rotated per repetition, and ratios are medians over repetitions with their spread (wan_reps).
Every run directory is kept under ``--out``, with a comparison report (report.html).
``--json`` prints issue 6's document on stdout and nothing else there (progress goes to stderr).
docs/bench-wan.md has the scenarios, the scaling argument and measured tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from .wan_arms import BASES, Arm, Scenario, build_arms, scenarios
from .wan_reps import combine, interleaved_schedule, representative
from .wan_results import ArmResult, measure

TARGETS = {  # issue 6
    "steady": {"time_vs_allreduce": 20.0, "bytes_vs_allreduce": 1000.0},
    "drop": {"time_vs_best_fixed_before_drop": 1.3, "time_vs_best_fixed": 1 / 1.1},
}
STEADY_FINAL_LOSS_TOLERANCE = 0.02   # adaptive's final loss within 2% of per-step sync's
STEADY_UTILIZATION = 0.97


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed bench wan", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("steady", "drop"), default="steady",
                   help="steady: every link 50 Mbit/s x scale, 80 ms RTT; drop: bandwidth falls 10x during the run")
    p.add_argument("--base", choices=tuple(BASES), default="char-lm",
                   help="the task every arm trains: char-lm (a GRU, configs/bench-wan.yaml) or gpt (a small "
                        "transformer, configs/bench-wan-gpt.yaml; steady only)")
    p.add_argument("--quick", action="store_true", help="a smaller version (fewer steps and arms, one repetition)")
    p.add_argument("--reps", type=_positive, default=None, metavar="N",
                   help="run every arm N times, interleaved, and report medians with their spread (default 3; --quick: 1)")
    p.add_argument("--json", action="store_true", help="print issue 6's JSON document on stdout")
    p.add_argument("--out", help="folder for the arms' run directories (default runs/bench-wan-<scenario>-<UTC time>)")
    p.add_argument("--arms", help="only these arms, comma-separated (e.g. allreduce,adaptive,adaptive-frag-eager)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config key in every arm (e.g. --set run.seed=1)")
    return p


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def main(argv: Sequence[str]) -> int:
    """`geofed bench wan ARGS`; returns the exit code (1: a run failed, a signal's code after a clean stop)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    available = scenarios(args.base, quick=args.quick)
    if args.scenario not in available:
        print(f"geofed bench wan: --base {args.base} has the {', '.join(available)} scenario only", file=sys.stderr)
        return 2
    scenario = available[args.scenario]
    if args.overrides:
        import dataclasses

        scenario = dataclasses.replace(scenario, overrides=tuple(args.overrides))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out or f"runs/bench-wan-{scenario.name}-{stamp}")
    console = Console(stderr=True)
    from geofed.orchestrator.driver.cluster import PlacementError
    from geofed.orchestrator.driver.recovery import Interrupted
    from geofed.orchestrator.driver.run import RunFailed

    reps = args.reps or (1 if args.quick else 3)
    try:
        only = [a.strip() for a in args.arms.split(",")] if args.arms else None
        doc, results, report = run_bench(scenario, out, console=console, reps=reps, only=only)
    except ValueError as exc:
        print(f"geofed bench wan: {exc}", file=sys.stderr)
        return 2
    except (PlacementError, RunFailed) as exc:
        print(f"geofed bench wan: {exc} (run directories so far: {out})", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(f"geofed bench wan: {stop} (run directories so far: {out})", file=sys.stderr)
        return stop.exit_code
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_results(Console(), scenario, results, doc)
        print(f"report: {report}")
        print(f"run directories: {out}")
    return 0


def run_bench(scenario: Scenario, out: Path, *, console: Console | None = None,
              base: dict[str, Any] | None = None, reps: int = 1,
              only: Sequence[str] | None = None) -> tuple[dict[str, Any], list[ArmResult], Path]:
    """Run every arm of ``scenario`` ``reps`` times in `interleaved_schedule` order (run directories
    under ``out``; ``out/rep<k>/<arm>`` when reps > 1); returns the --json document (medians over
    repetitions), each arm's median repetition (`representative`) and the comparison report's path."""
    from geofed.orchestrator.report import write_comparison
    from .runs import bench_ray

    console = console or Console(stderr=True)
    arms = build_arms(scenario, base)
    if only:
        unknown = sorted(set(only) - {a.name for a in arms})
        if unknown:
            raise ValueError(f"--arms: no arm {', '.join(unknown)} (arms: {', '.join(a.name for a in arms)})")
        arms = [a for a in arms if a.name in only]
    schedule = interleaved_schedule(arms, reps)
    out.mkdir(parents=True, exist_ok=True)
    per_rep: list[list[ArmResult]] = [[] for _ in range(reps)]
    with bench_ray(arms[0].cfg):
        em = arms[0].cfg.network.emulation  # after --set: what the links really are
        mbps = em.default.bandwidth_mbps * em.bandwidth_scale
        console.rule(f"geofed bench wan: {scenario.name}, {len(arms)} arms x {_reps_text(reps)}, links {mbps:g} Mbit/s "
                     f"{scenario.rtt_ms:g} ms RTT" + (f", /{scenario.drop_factor:g} at {scenario.drop_at_s:g} s"
                                                      if scenario.drop_at_s else ""))
        for i, (r, arm) in enumerate(schedule):
            where = out if reps == 1 else out / f"rep{r + 1}"
            label = arm.name if reps == 1 else f"rep {r + 1} {arm.name}"
            per_rep[r].append(run_arm(arm, scenario, where, console=console, index=i, total=len(schedule), label=label))
    combined = combine(per_rep, scenario.name)
    doc = {"scenario": scenario.name, "arms": combined["arms"], "ratios": combined["ratios"], "reps": reps,
           "spread": combined["spread"], "peak_to_mean": best_arm_peak(combined["arms"])}
    results = [representative([next(a for a in rep if a.name == arm.name) for rep in per_rep]) for arm in arms]
    title = f"geofed bench wan: {scenario.name} (target {_target_text(scenario)})"
    report = write_comparison([Path(r.run_dir) for r in results], [r.name for r in results], out / "report",
                              target_loss=scenario.target_loss,
                              title=title if reps == 1 else f"{title}, each arm's median of {reps} repetitions")
    (out / "bench.json").write_text(json.dumps({
        **doc, "notes": combined["notes"], "order": [[r + 1, a.name] for r, a in schedule],
        "per_rep": combined["per_rep"], "scenario_config": _scenario_dict(scenario),
        "details": [{"rep": r + 1, **_detail(a)} for r, rep in enumerate(per_rep) for a in rep]}, indent=2))
    return doc, results, report


def best_arm_peak(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """The busiest link's peak-to-mean rate (median over repetitions) of the best arm: the synchronising arm
    (not per-step allreduce) with the shortest median time to target, else the first with a ratio."""
    rated = [a for a in arms if a.get("peak_to_mean") is not None and a["name"] != "allreduce"]
    if not rated:
        return {"arm": None, "ratio": None}
    best = min(rated, key=lambda a: (a["time_to_target_s"] is None, a["time_to_target_s"] or 0.0))
    return {"arm": best["name"], "ratio": best["peak_to_mean"]}


def _target_text(sc: Scenario) -> str:
    return (f"held-out loss {sc.target_loss:g} of the synchronised model" if sc.target_on == "eval"
            else f"train loss {sc.target_loss:g}")


def _reps_text(reps: int) -> str:
    return ("1 repetition (no spread; the full bench runs 3)" if reps == 1
            else f"{reps} repetitions, interleaved")


def run_arm(arm: Arm, scenario: Scenario, out: Path, *, console: Console, index: int, total: int,
            label: str | None = None) -> ArmResult:
    """Run one arm as a real `geofed run` in its own run directory under `out`, and measure it."""
    from geofed.orchestrator.driver.rundir import new_run_dir
    from geofed.orchestrator.driver.run import Runner, prepare_task

    cfg = prepare_task(arm.cfg, source=f"bench wan arm {arm.name}")
    run_dir = new_run_dir(cfg, str(out / arm.name))
    runner = Runner(cfg, run_dir, show_progress=False)
    steps = cfg.run.max_steps or cfg.run.rounds
    with _ProgressWatch(run_dir, steps, f"[{index + 1}/{total}] {label or arm.name}", console):
        try:
            summary = runner.run()
            # at_s counts from the emulator's start, the run's clock from round 0: where the drop fell.
            offset = (time.monotonic() - runner.clock.now()) - runner.emulator.start_time
        finally:
            runner.shutdown()
    drop = None if scenario.drop_at_s is None else scenario.drop_at_s - offset
    res = measure(run_dir, name=arm.name, kind=arm.kind, H=arm.H, target_loss=scenario.target_loss, drop_at_s=drop,
                  baseline_steps=scenario.baseline_steps, target_on=scenario.target_on)
    tt = "not reached" if res.time_to_target_s is None else f"{res.time_to_target_s:.2f} s"
    held = "" if res.eval_at_baseline_steps is None else f"; held-out at {scenario.baseline_steps} steps " \
        f"{res.eval_at_baseline_steps:.4f}"
    console.print(f"  {label or arm.name}: {summary.get('rounds')} rounds, {res.steps} steps, {res.wall_s or 0:.1f} s; "
                  f"target {scenario.target_loss:g} {tt}; final loss {_f(res.final_loss)}{held}; "
                  f"utilisation {_f(res.utilization)}")
    return res


class _ProgressWatch:
    """A rich progress bar for one arm, fed by polling its rounds.jsonl (the runner runs quiet)."""

    def __init__(self, run_dir: Path, steps: int, label: str, console: Console):
        self.path, self.steps = Path(run_dir) / "rounds.jsonl", steps
        self.progress = Progress(TextColumn(label), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("steps  loss {task.fields[loss]}  H {task.fields[H]}"),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.task = self.progress.add_task(label, total=steps, loss="-", H="-")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-wan-progress", daemon=True)

    def __enter__(self):
        self.progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self.progress.stop()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            try:
                lines = self.path.read_text().splitlines()
            except OSError:
                continue
            done, last = 0, None
            for line in lines:
                try:
                    last = json.loads(line)
                except ValueError:
                    continue  # a line being written
                done += int(last.get("H") or 0)
            if last is not None:
                loss = last.get("mean_train_loss")
                self.progress.update(self.task, completed=min(done, self.steps), H=str(last.get("H")),
                                     loss="-" if loss is None else f"{loss:.4f}")


def print_results(console: Console, scenario: Scenario, results: list[ArmResult], doc: dict[str, Any]) -> None:
    """The arms' table (H, time and bytes to target, losses, utilisation: medians over repetitions; the
    adaptive H range, wall util and wall: the median repetition's run), then the issue's target checks."""
    reps = doc.get("reps", 1)
    t = Table(title=f"geofed bench wan: {scenario.name} (target {_target_text(scenario)}, "
                    f"{scenario.max_steps} steps per region, {'medians of ' + str(reps) if reps > 1 else '1'} "
                    f"repetition{'s' if reps > 1 else ''})")
    held = f"held-out at {scenario.baseline_steps}" if scenario.baseline_steps else "held-out"
    for col in ("arm", "H", "to target", "bytes to target", "final loss", held, "eval", "util", "peak/mean",
                "wall util", "wall"):
        t.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    med = {a["name"]: a for a in doc["arms"]}
    for r in results:
        m = med[r.name]
        H = str(r.H) if r.kind != "adaptive" else _H_range(r)
        t.add_row(r.name, H, "-" if m["time_to_target_s"] is None else f"{m['time_to_target_s']:.2f} s",
                  "-" if m["bytes_to_target"] is None else _bytes(m["bytes_to_target"]), _f(m["final_loss"]),
                  _f(m.get("eval_at_baseline_steps")), _f(m["eval"]), _f(m["utilization"]), _f(m.get("peak_to_mean")), _f(r.utilization_wall),
                  f"{r.wall_s or 0:.1f} s")
    console.print(t)
    for line in check_targets(scenario, results, doc):
        console.print(line)


def _spread_text(doc: dict[str, Any], key: str) -> str:
    reps, sp = doc.get("reps", 1), doc.get("spread", {}).get(key)
    if reps == 1:
        return " (1 repetition: no spread)"
    if not sp or not sp.get("n"):
        return f" (no value in any of {reps} repetitions)"
    return f" (median of {sp['n']}/{reps} repetitions, min {_f(sp['min'])}, max {_f(sp['max'])})"


def check_targets(scenario: Scenario, results: list[ArmResult], doc: dict[str, Any]) -> list[str]:
    """One line per issue-6 target: the measured value, the target, met or not."""
    lines = []
    for key, want in TARGETS[scenario.name].items():
        got = doc["ratios"].get(key)
        lines.append(f"{key}: {_f(got)}{_spread_text(doc, key)} (target >= {want:.3g}) "
                     f"{_mark(got is not None and got >= want)}")
    by = {r.name: r for r in results}
    ad, ar = by.get("adaptive"), by.get("allreduce")
    if doc.get("reps", 1) > 1 and ad is not None:
        lines.append(f"below: the median repetition's run of each arm (by time to target), "
                     f"utilisation the median of {doc['reps']}")
    if scenario.name == "steady" and ad is not None:
        got = doc["ratios"].get("loss_vs_allreduce")
        if ar is not None and got is not None:
            what = "held-out loss" if ad.eval_at_baseline_steps is not None else "final train loss"
            lines.append(f"{what} at {ar.steps} steps (equal examples): adaptive / per-step {_f(got)}"
                         f"{_spread_text(doc, 'loss_vs_allreduce')} (target <= {1 + STEADY_FINAL_LOSS_TOLERANCE:.3g}) "
                         f"{_mark(got <= 1 + STEADY_FINAL_LOSS_TOLERANCE)}; adaptive after {ad.steps} steps "
                         f"train {_f(ad.final_loss)}")
        util = next((a["utilization"] for a in doc["arms"] if a["name"] == "adaptive"), ad.utilization)
        if util is not None:
            per_round = _round_utils(ad.run_dir)
            rounds = (f"; per round min {min(per_round):.3f}, median {statistics.median(per_round):.3f}"
                      if per_round else "")
            lines.append(f"utilisation adaptive {util:.3f} (target >= {STEADY_UTILIZATION}) "
                         f"{_mark(util >= STEADY_UTILIZATION)}; without the final flush "
                         f"{_f(ad.utilization_training)}; wall {_f(ad.utilization_wall)}{rounds}")
    lines.extend(_frontier_lines(results, doc))
    if scenario.name == "drop" and ad is not None and ad.drop_at_s is not None:
        before = [h for _, e, h in ad.H_rounds if e <= ad.drop_at_s]
        after = [h for s, _, h in ad.H_rounds if s >= ad.drop_at_s]
        lines.append(f"adaptive H before the drop {_H_span(before)}, after {_H_span(after)} "
                     f"(drop at {ad.drop_at_s:.2f} s of training)")
    return lines


FRONTIER = {"bytes_vs_allreduce": 1000.0, "loss_vs_allreduce": 1 + STEADY_FINAL_LOSS_TOLERANCE}
PEAK_TO_MEAN = 1.25  # issue 21: the busiest link's peak-to-mean with fragments


def _frontier_lines(results: list[ArmResult], doc: dict[str, Any]) -> list[str]:
    """Issue 21's targets for each frontier arm (bytes to target and loss at equal examples against
    per-step sync; peak-to-mean with fragments), medians over repetitions with their spread."""
    lines = []
    for r in results:
        if r.kind != "adaptive" or r.name == "adaptive":
            continue
        for key, want in FRONTIER.items():
            got = doc["ratios"].get(f"{r.name}:{key}")
            ok = got is not None and (got >= want if key.startswith("bytes") else got <= want)
            lines.append(f"{r.name} {key}: {_f(got)}{_spread_text(doc, f'{r.name}:{key}')} "
                         f"(target {'>=' if key.startswith('bytes') else '<='} {want:.4g}) {_mark(ok)}")
        ptm = next((a.get("peak_to_mean") for a in doc["arms"] if a["name"] == r.name), None)
        if "frag" in r.name:
            lines.append(f"{r.name} peak-to-mean on the busiest link: {_f(ptm)} (target <= {PEAK_TO_MEAN}) "
                         f"{_mark(ptm is not None and ptm <= PEAK_TO_MEAN)}")
    return lines


def _scenario_dict(sc: Scenario) -> dict[str, Any]:
    import dataclasses

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(sc).items()}


def _detail(r: ArmResult) -> dict[str, Any]:
    return {"name": r.name, "run_dir": r.run_dir, "steps": r.steps, "wall_s": r.wall_s, "bytes_sent": r.bytes_sent,
            "loss_at_baseline_steps": r.loss_at_baseline_steps, "utilization_min_round": _min_round_util(r.run_dir),
            "utilization_training": r.utilization_training,
            "utilization_wall": r.utilization_wall, "eval_metric": r.eval_metric, "drop_at_s": r.drop_at_s,
            "H_rounds": r.H_rounds}


def _min_round_util(run_dir: str) -> float | None:
    utils = _round_utils(run_dir)
    return min(utils) if utils else None


def _round_utils(run_dir: str) -> list[float]:
    """rounds.jsonl's utilisation (mean over regions) of every round."""
    from geofed.orchestrator.driver.rundir import read_jsonl

    return [r["utilization"] for r in read_jsonl(Path(run_dir) / "rounds.jsonl") if r.get("utilization") is not None]


def _H_range(r: ArmResult) -> str:
    hs = [h for _, _, h in r.H_rounds]
    return f"{min(hs)}-{max(hs)} (median {r.H})" if hs else "-"


def _H_span(hs: list[int]) -> str:
    return "-" if not hs else f"{min(hs)}-{max(hs)} (last {hs[-1]})" if min(hs) != max(hs) else str(hs[0])


def _bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _mark(ok: bool) -> str:
    return "[green]met[/green]" if ok else "[red]NOT met[/red]"
