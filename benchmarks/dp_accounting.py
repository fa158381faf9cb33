"""The PRV accountant's cost in a run, for bench privacy's dp_eps8 arm (target epsilon 8, delta
1e-5, batch 32 of a 336-example shard, 30 rounds of H 50, record level): the plan (the noise
search), then every round as the driver does it (check_next, spend, metrics).

    python benchmarks/dp_accounting.py [--reps 3] [--python LABEL=INTERPRETER ...] [--json]

Every repetition is a fresh process (the accountant keeps its discretisations for the process);
with several interpreters (e.g. before=/path/to/main/.venv/bin/python after=.venv/bin/python, each
importing its own checkout) the repetitions are interleaved. Prints each run, the medians, and how
far the per-round epsilons of the other interpreters are from the first's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

ONE_RUN = r'''
import json, time
import prv_accountant, scipy.fft  # imports apart from the timings
from geofed.regions.privacy.budget import PrivacyBudget
t = time.perf_counter()
b = PrivacyBudget.plan(mode="record", noise_multiplier=None, target_epsilon=8.0, delta=1e-5, rounds=30,
                       steps_per_round=50, batch_size=32, smallest_shard=336, accountant="prv")
plan_s = time.perf_counter() - t
rounds_s, eps = [], []
for r in range(30):
    t = time.perf_counter()
    assert b.check_next(50) == "ok"
    b.spend(50)
    m = b.metrics()
    rounds_s.append(time.perf_counter() - t)
    eps.append(m["dp_epsilon"])
print(json.dumps({"noise": b.noise_multiplier, "plan_s": plan_s, "rounds_s": rounds_s, "eps": eps}))
'''


def one_run(python: str) -> dict:
    out = subprocess.run([python, "-c", ONE_RUN], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    """Medians over the repetitions: the plan, the 30 rounds, a round's median after the first."""
    med = statistics.median
    return {"plan_s": med(r["plan_s"] for r in runs), "rounds_total_s": med(sum(r["rounds_s"]) for r in runs),
            "round_median_ms": 1e3 * med(med(r["rounds_s"][1:]) for r in runs),
            "first_round_ms": 1e3 * med(r["rounds_s"][0] for r in runs), "noise": runs[0]["noise"],
            "epsilon_last": runs[0]["eps"][-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--python", action="append", default=[], metavar="LABEL=INTERPRETER",
                    help="an interpreter to time (repeatable); default: this one")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON too")
    args = ap.parse_args()
    pythons = dict(p.split("=", 1) for p in args.python) or {"this": sys.executable}
    runs: dict[str, list[dict]] = {label: [] for label in pythons}
    for rep in range(args.reps):
        for label, python in pythons.items():
            r = one_run(python)
            runs[label].append(r)
            per = r["rounds_s"]
            print(f"{label} rep {rep}: plan {r['plan_s']:.2f} s, 30 rounds {sum(per):.3f} s, a round "
                  f"{1e3 * statistics.median(per[1:]):.1f} ms median after the first ({1e3 * per[0]:.0f} ms), "
                  f"max {1e3 * max(per):.0f} ms", flush=True)
    table = {label: summary(rs) for label, rs in runs.items()}
    for label, s in table.items():
        print(f"{label}, median of {args.reps}: plan {s['plan_s']:.2f} s, 30 rounds {s['rounds_total_s']:.3f} s, "
              f"a round {s['round_median_ms']:.1f} ms after the first ({s['first_round_ms']:.0f} ms); "
              f"noise {s['noise']!r}, epsilon after 30 rounds {s['epsilon_last']!r}")
    first, *others = runs
    for label in others:
        diff = [b - a for a, b in zip(runs[first][0]["eps"], runs[label][0]["eps"])]
        table[label]["eps_minus_" + first] = [min(diff), max(diff)]
        print(f"per-round epsilon, {label} - {first}: min {min(diff):.3g}, max {max(diff):.3g}")
    if args.json:
        print(json.dumps(table))


if __name__ == "__main__":
    main()
