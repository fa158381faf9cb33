"""`geofed bench attack`: one member of 4 turns hostile; what it costs the honest regions (issue 36).

    geofed bench attack [--reps 3] [--quick] [--arms a,b] [--rounds N] [--H N] [--max-run-s S]
                        [--json] [--out DIR]

Every run is a real `geofed run` (Ray actors, mutual-TLS gRPC, no WAN emulation) of 4 regions
training the digits MLP with DiLoCo, the issue's control run. In each attack arm one region
(eu-west-1) is a hostile member: a real region whose own code misbehaves (benchmarks/bench/adversary.py),
carried to its actor at creation (Runner's `hostile` argument; no config key can set it):

* ``withhold``: it never pushes its update, yet receives the others' and answers heartbeats;
* ``withhold_poisoned``: it withholds and serves a random finite state on FetchState;
* ``flip_bound``: its update sign-flipped and scaled to security.norm_multiple x the median of
  its own recent update norms (the clip bound a receiver derives);
* ``flip_x-9``: its update x-9 (under the default bound); ``scale_x+9``: x+9;
* ``secagg_x1e30``: under secure aggregation (int8 grid, 8-bit ring), its update x1e30 in its
  masked contribution (finite; it sets the shared scale).

Each repetition runs the undisturbed run (and, for the secagg arm, the undisturbed run under
secure aggregation) and every arm, round-robin, the order rotated by one each repetition
(benchmarks/bench/wan_reps.py); repetition k runs at run.seed k. Per arm, against the same
repetition's undisturbed run: the honest regions' final accuracy delta in points, the wall-time
ratio (training, set-up excluded), whether the run died, refusals by reason, the member's acts
and how many of them the honest regions counted (benchmarks/bench/attack_results.py); medians
over the repetitions, their min/max under "spread", and whether issue 36's targets hold.

A run still training after --max-run-s is ended at its next round boundary as a finished run
(final evaluation, summary) and marked cut: its time ratio is then a lower bound.
Exit code 0 when every arm holds every target, 1 otherwise, 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from geofed.orchestrator.config import config_from_mapping
from .attack_results import ATTACKER, REGIONS, Arm, RunResult, arm_rows, combine, from_run_dir, run_order, select_arms, table

QUICK = {"rounds": 6, "H": 20}


def arm_config(arm: Arm, *, rounds: int, H: int, seed: int = 0, deadline_max_s: float = 10.0):
    """The run config of one arm. Secure aggregation needs an int8-grid codec and no overlap; its
    arms use the 8-bit ring (int8's bytes). The deadline starts at 5 s and is capped at
    `deadline_max_s` (10 s by default, not the 120 s default) so an arm that stretches rounds
    still ends in minutes; the stretch shows in the time ratio all the same."""
    return config_from_mapping({
        "run": {"name": "bench-attack", "rounds": rounds, "seed": seed, "eval_every": 0, "checkpoint_every": 0,
                "report": False},
        "task": {"kind": "mlp-digits", "partition": "iid"},
        "regions": {"names": list(REGIONS), "num_cpus": 0.5},
        "network": {"emulation": {"mode": "none"}},
        "compression": {"codec": "int8" if arm.secagg else "fp16"},
        "security": {"secure_aggregation": arm.secagg, **({"secagg_bits": 8} if arm.secagg else {})},
        "sync": {"policy": {"kind": "fixed", "H": H}, "inner": {"kind": "adamw", "lr": 0.003, "batch_size": 32},
                 "outer": {"lr": 0.7, "momentum": 0.9},
                 "deadline": {"initial_s": min(5.0, deadline_max_s), "max_s": deadline_max_s}},
        "ray": {"warm_pool_s": 0},
    }, source="geofed bench attack")


def run_arm(arm: Arm, rep: int, parent: Path, *, rounds: int, H: int, max_run_s: float,
            deadline_max_s: float = 10.0) -> RunResult:
    """One run of `arm` (repetition `rep`, seed rep) in a run directory under `parent`; a run that
    raises is a run that died (its directory still says how far it got)."""
    from geofed.orchestrator.driver.rundir import new_run_dir

    cfg = arm_config(arm, rounds=rounds, H=H, seed=rep, deadline_max_s=deadline_max_s)
    run_dir = new_run_dir(cfg, str(parent / f"{arm.name}-rep{rep + 1}"))
    hostile = {ATTACKER: arm.adversary} if arm.adversary is not None else None
    runner = _capped_runner(cfg, run_dir, hostile=hostile, seconds=max_run_s)
    error = None
    try:
        runner.run()
    except Exception as exc:  # noqa: BLE001 - a run that dies is a result of the bench, not its failure
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        try:
            runner.shutdown()
        except Exception as exc:  # noqa: BLE001 - the next arm still runs; the run's own result stands
            print(f"geofed bench attack: {arm.name}: shutting the run down: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
    return from_run_dir(arm.name, rep, run_dir, error=error, cut=runner.cut)


_RUNNER: list[type] = []


def _capped_runner(cfg: Any, run_dir: Path, *, hostile: dict | None, seconds: float):
    """A Runner that ends the run normally (final evaluation, summary) once `seconds` of training
    have passed, marking itself `cut`. Built on first use: Ray and torch load only for a run."""
    if not _RUNNER:
        from geofed.orchestrator.driver.run import Runner

        class CappedRunner(Runner):
            def __init__(self, *args, seconds: float, **kw):
                super().__init__(*args, **kw)
                self.seconds, self.cut = seconds, False

            def _round(self, r: int) -> None:
                super()._round(r)
                if self.clock.now() >= self.seconds and r + 1 < self.cfg.run.rounds:
                    self.cut = True
                    self.coordinator.max_steps = max(1, self.coordinator.steps_done)  # the loop ends a spent budget

        _RUNNER.append(CappedRunner)
    return _RUNNER[0](cfg, run_dir, show_progress=False, hostile=hostile, seconds=seconds)


def run_bench(out: Path, *, arms: Sequence[Arm], reps: int, rounds: int, H: int, max_run_s: float,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every arm and the baselines it needs, `reps` times interleaved, in one local Ray; returns the
    document (also out/bench.json, with every run's own numbers under "runs")."""
    from .runs import bench_ray

    out.mkdir(parents=True, exist_ok=True)
    order = run_order(arms, reps)
    results: list[RunResult] = []
    with bench_ray(arm_config(arms[0], rounds=rounds, H=H), num_cpus=4):
        for i, (rep, arm) in enumerate(order, 1):
            t0 = time.monotonic()
            res = run_arm(arm, rep, out, rounds=rounds, H=H, max_run_s=max_run_s)
            results.append(res)
            log(f"geofed bench attack: [{i}/{len(order)}] rep {rep + 1} {arm.name}: "
                f"{'DIED (' + str(res.error) + ')' if res.died else 'finished'}{' (cut)' if res.cut else ''}, "
                f"{res.rounds} rounds, wall {res.wall_s} s, honest metric {res.honest_metric}, acts {res.acts_total}, "
                f"counted {res.counted}, refusals {res.refusals} ({time.monotonic() - t0:.0f} s with set-up)")
    per_rep = arm_rows(results, arms)
    doc = combine(per_rep)
    doc.update(rounds=rounds, H=H, attacker=ATTACKER, max_run_s=max_run_s,
               baselines={f"{r.name}-rep{r.rep + 1}": {"honest_metric": r.honest_metric, "wall_s": r.wall_s,
                                                        "died": r.died}
                          for r in results if r.name.startswith("undisturbed")})
    (out / "bench.json").write_text(json.dumps({**doc, "per_rep": per_rep, "runs": [r.doc() for r in results]},
                                               indent=2, default=str))
    return doc


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="geofed bench attack", description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions, interleaved (medians reported; default 3)")
    ap.add_argument("--quick", action="store_true",
                    help=f"1 repetition of {QUICK['rounds']} rounds of H {QUICK['H']}: a smoke run, not the measurement")
    ap.add_argument("--arms", default="", help="comma-separated arms or words of their names (withhold, poisoned, "
                                               "flip, scale, secagg); default all")
    ap.add_argument("--rounds", type=int, default=20, help="rounds per run (default 20)")
    ap.add_argument("--H", type=int, default=300, help="inner steps per round (default 300: an undisturbed run trains ~20 s here)")
    ap.add_argument("--max-run-s", type=float, default=600.0,
                    help="end a run still training after this many seconds, marked cut (default 600)")
    ap.add_argument("--json", action="store_true", help="print the document as JSON on stdout (progress on stderr)")
    ap.add_argument("--out", help="where every run's directory is kept (default runs/bench-attack-<UTC time>)")
    return ap


def main(argv: Sequence[str]) -> int:
    """`geofed bench attack ARGS`; 0 when every arm holds issue 36's targets, 1 otherwise, 2 for bad options."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        arms = select_arms(args.arms)
    except ValueError as exc:
        print(f"geofed bench attack: {exc}", file=sys.stderr)
        return 2
    reps, rounds, H = (1, QUICK["rounds"], QUICK["H"]) if args.quick else (args.reps, args.rounds, args.H)
    if reps < 1 or rounds < 1 or H < 1 or not args.max_run_s > 0:
        print("geofed bench attack: --reps, --rounds and --H must be >= 1 and --max-run-s > 0", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-attack-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")
    if out.exists() and any(out.iterdir()):
        print(f"geofed bench attack: --out {out} is not empty (each run keeps its directory there)", file=sys.stderr)
        return 2

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.quick:
        log(f"geofed bench attack: --quick: 1 repetition of {rounds} rounds of H {H} (a smoke run, not the measurement)")
    doc = run_bench(out, arms=arms, reps=reps, rounds=rounds, H=H, max_run_s=args.max_run_s, log=log)
    doc["quick"] = bool(args.quick)
    doc["out"] = str(out)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(table(doc))
        if args.quick:
            print("(--quick: one short repetition, a smoke run, not the measurement)")
        print(f"run directories: {out}")
    return 0 if all(doc["targets"]["held"].values()) else 1
