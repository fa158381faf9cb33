"""`geofed bench attack`'s arms and arithmetic: which member misbehaves how, the interleaved order,
what one run's directory says, and the medians, spreads and targets of the --json document.

Pure (no Ray): the bench's driver (benchmarks/bench/attack.py) runs the arms and hands each run's
directory here, so the order, the accounting and the judgement are unit-tested on synthetic runs.

Accounting. The hostile region counts its own acts (metrics.jsonl `hostile`: pushes withheld,
flipped or scaled, one per peer; FetchState answers poisoned; masked contributions scaled, one per
peer). The honest regions count what they refused or clipped: their `refusals` by reason and the
whole run's (summary.json, whatever reasons the run knows), their `clipped` updates from the
hostile member, the member's updates they refused as `harmful` or `quarantined` (regions/gauntlet.py; honest
senders' are listed as `harmful_other`, `quarantined_other` and not counted), secure aggregation's `secagg_refused` by reason (shown as `secagg_<reason>`; where
the transport counted the same refusal under `<reason>`, it is one), and (for withheld pushes only, at
most one per act) the rounds where they recorded the hostile member missing. Refusals are counted
by the refusing region, not by sender; reasons a network fault alone gives (late, aborted, ...)
are listed but do not count as catching the member. "Every hostile act counted" holds when what
the honest regions counted is at least the number of acts.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geofed.bench.adversary import Adversary

from .wan_reps import interleaved_schedule, median_spread

REGIONS = ("us-east-1", "eu-west-1", "ap-northeast-1", "eu-central-1")
ATTACKER = "eu-west-1"
# The targets (issue 36, "Done when"), judged on each arm's medians over the repetitions.
MAX_DELTA_POINTS = 1.0  # honest final accuracy at most this many points below undisturbed
MAX_TIME_RATIO = 1.5
# Refusal reasons a network fault gives without any member lying: shown, never taken as catching one.
BENIGN_REASONS = frozenset({"late", "aborted", "truncated", "busy", "no_deadline", "tls_handshake", "unknown_sender",
                            "not_neighbour", "future_round", "replayed", "no_state", "missed"})
# Listed, never taken as catching the member: the above, and honest updates refused as harmful.
NOT_CAUGHT = BENIGN_REASONS | {"harmful_other", "quarantined_other"}
# The gauntlet's refusals (regions/gauntlet.py), each round's by sender: only the member's catch it.
BY_SENDER = ("harmful", "quarantined")


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One run of the bench: `adversary` for the hostile member (None: undisturbed), under secure
    aggregation or not; an attack arm is compared with the undisturbed run of the same kind."""

    name: str
    adversary: Adversary | None
    secagg: bool = False

    @property
    def baseline(self) -> str:
        return "undisturbed_secagg" if self.secagg else "undisturbed"


BASELINES = (Arm(name="undisturbed", adversary=None), Arm(name="undisturbed_secagg", adversary=None, secagg=True))
ARMS = (
    Arm(name="withhold", adversary=Adversary(kind="withhold")),
    Arm(name="withhold_poisoned", adversary=Adversary(kind="poisoned")),
    Arm(name="flip_bound", adversary=Adversary(kind="bound", factor=-1.0)),
    Arm(name="flip_x-9", adversary=Adversary(kind="scale", factor=-9.0)),
    Arm(name="scale_x+9", adversary=Adversary(kind="scale", factor=9.0)),
    Arm(name="secagg_x1e30", adversary=Adversary(kind="secagg", factor=1e30), secagg=True),
)
BY_NAME = {a.name: a for a in (*BASELINES, *ARMS)}


def select_arms(spec: str | None) -> list[Arm]:
    """The attack arms named in `spec` (comma-separated; a name or a word of names, e.g. `flip`),
    in ARMS' order; all of them for None or ''. ValueError names what matches nothing."""
    if not spec:
        return list(ARMS)
    words = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in words if not any(w == a.name or w in a.name.split("_") for a in ARMS)]
    if unknown:
        raise ValueError(f"--arms: {', '.join(unknown)} names no arm (arms: {', '.join(a.name for a in ARMS)})")
    return [a for a in ARMS if any(w == a.name or w in a.name.split("_") for w in words)]


def run_order(arms: Sequence[Arm], reps: int) -> list[tuple[int, Arm]]:
    """(repetition, arm) in run order: the baselines the arms need, then the arms, each repetition
    rotated left by its index (benchmarks/bench/wan_reps.py's interleaving)."""
    names = {a.baseline for a in arms}
    runs = [b for b in BASELINES if b.name in names] + list(arms)
    return interleaved_schedule(runs, reps)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """What one run's directory says (from_run_dir), or a run that died before writing one."""

    name: str
    rep: int
    died: bool
    wall_s: float | None
    honest_metric: float | None  # mean final metric of the regions other than the attacker
    higher_is_better: bool = True
    refusals: dict[str, int] = field(default_factory=dict)
    acts: dict[str, int] = field(default_factory=dict)
    counted: int = 0
    rounds: int = 0
    resyncs: int = 0
    cut: bool = False  # ended early by --max-run-s
    error: str | None = None

    @property
    def acts_total(self) -> int:
        return sum(self.acts.values())

    def doc(self) -> dict[str, Any]:
        return {"name": self.name, "rep": self.rep, "died": self.died, "error": self.error, "wall_s": self.wall_s,
                "honest_metric": self.honest_metric, "refusals": self.refusals, "acts": self.acts,
                "counted": self.counted, "rounds": self.rounds, "resyncs": self.resyncs, "cut": self.cut}


def from_run_dir(name: str, rep: int, run_dir: Path, *, attacker: str = ATTACKER, error: str | None = None,
                 cut: bool = False) -> RunResult:
    """One run's result from its directory (summary.json, metrics.jsonl, rounds.jsonl); `error`:
    the run died with it (then the wall time is where its last round ended)."""
    summary = _read_json(run_dir / "summary.json")
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    refusals, acts, counted = account(metrics, summary, attacker=attacker)
    evals = {r: e for r, e in ((summary or {}).get("eval_per_region") or {}).items() if r != attacker and e}
    values = [float(e["value"]) for e in evals.values() if e.get("value") is not None]
    higher = all(e.get("higher_is_better", True) for e in evals.values())
    died = error is not None or summary is None
    wall = (summary or {}).get("wall_s")
    if wall is None:
        ends = [r.get("t_end") for r in _read_jsonl(run_dir / "rounds.jsonl") if r.get("t_end") is not None]
        wall = max(ends) if ends else None
    return RunResult(name=name, rep=rep, died=died, wall_s=wall,
                     honest_metric=statistics.fmean(values) if values and not died else None,
                     higher_is_better=higher, refusals=refusals, acts=acts, counted=counted,
                     rounds=max((m["round"] for m in metrics if "round" in m), default=-1) + 1,
                     resyncs=int(((summary or {}).get("faults") or {}).get("resyncs", 0)), cut=cut,
                     error=error if error is not None else (None if summary is not None else "no summary.json"))


def account(metrics: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None, *,
            attacker: str) -> tuple[dict[str, int], dict[str, int], int]:
    """(the honest regions' refusals by reason, the attacker's acts by kind, how many acts the
    honest regions counted) from metrics.jsonl's records and summary.json (module docstring)."""
    refusals: dict[str, int] = {}
    acts: dict[str, int] = {}
    secagg: dict[str, dict[str, int]] = {}  # region -> its cumulative secagg_refused (the last record's)
    missed = 0
    for m in metrics:
        region = m.get("region")
        if region == attacker:
            for kind, n in (m.get("hostile") or {}).items():
                acts[kind] = acts.get(kind, 0) + int(n)
            continue
        for reason, n in (m.get("refusals") or {}).items():
            if reason not in BY_SENDER:  # counted by sender below: an honest update refused is no catch
                refusals[reason] = refusals.get(reason, 0) + int(n)
        for reason in BY_SENDER:
            for sender, n in (m.get(reason) or {}).items():
                key = reason if sender == attacker else f"{reason}_other"
                refusals[key] = refusals.get(key, 0) + int(n)
        clipped = int((m.get("clipped") or {}).get(attacker, 0))
        if clipped:
            refusals["clipped"] = refusals.get("clipped", 0) + clipped
        if m.get("secagg_refused"):
            secagg[region] = dict(m["secagg_refused"])
        if attacker in (m.get("peers_missing") or []):
            missed += 1
    for counts in secagg.values():
        for reason, n in counts.items():
            refusals[f"secagg_{reason}"] = refusals.get(f"secagg_{reason}", 0) + int(n)
    # The whole run's count (it includes what was refused after each region's last round, and any
    # reason a later version counts only there): a reason it has more of than the rounds' is raised to it.
    by_region = ((summary or {}).get("refusals") or {}).get("by_region") or {}
    if attacker not in by_region or not by_region.get(attacker):
        for reason, n in (((summary or {}).get("refusals") or {}).get("by_reason") or {}).items():
            if reason not in BY_SENDER:  # the run's total of every sender's; the rounds' say whose
                refusals[reason] = max(refusals.get(reason, 0), int(n))
    if missed:
        refusals["missed"] = missed
    caught = sum(n for reason, n in refusals.items()
                 if reason not in NOT_CAUGHT and reason not in secagg_reasons(refusals))
    # A secure-aggregation refusal the transport counted too (under its plain reason) is one refusal.
    caught += sum(max(0, n - refusals.get(reason[len("secagg_"):], 0)) for reason, n in refusals.items()
                  if reason in secagg_reasons(refusals))
    counted = caught + min(missed, acts.get("withheld", 0))
    return refusals, acts, counted


def secagg_reasons(refusals: Mapping[str, int]) -> set[str]:
    """The keys of `refusals` that are secure aggregation's own counts (secagg_refused, prefixed)."""
    return {r for r in refusals if r.startswith("secagg_")}


def arm_rows(results: Sequence[RunResult], arms: Sequence[Arm]) -> list[list[dict[str, Any]]]:
    """Per repetition, each arm against its baseline of the same repetition: [rep][arm] rows with
    metric_delta_points (honest regions, arm - undisturbed, in points), time_ratio (arm wall time /
    undisturbed wall time), died, refusals, acts and counted."""
    by = {(r.rep, r.name): r for r in results}
    reps = sorted({r.rep for r in results})
    out = []
    for rep in reps:
        rows = []
        for arm in arms:
            run, base = by.get((rep, arm.name)), by.get((rep, arm.baseline))
            if run is None:
                continue
            rows.append(_row(run, base))
        out.append(rows)
    return out


def _row(run: RunResult, base: RunResult | None) -> dict[str, Any]:
    delta = ratio = None
    if base is not None and run.honest_metric is not None and base.honest_metric is not None:
        sign = 1.0 if run.higher_is_better else -1.0  # a loss that rose is a loss of points
        delta = round(100.0 * sign * (run.honest_metric - base.honest_metric), 3)
    if base is not None and run.wall_s is not None and base.wall_s:
        ratio = round(run.wall_s / base.wall_s, 3)
    return {"name": run.name, "metric_delta_points": delta, "time_ratio": ratio, "died": run.died,
            "refusals": dict(run.refusals), "acts": dict(run.acts), "counted": run.counted,
            "acts_total": run.acts_total, "cut": run.cut, "baseline_died": None if base is None else base.died}


def combine(per_rep: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The --json document: {"arms": [{name, metric_delta_points, time_ratio, died, refusals, acts,
    counted, targets}], "reps", "spread": {arm: {metric_delta_points|time_ratio: {min, max, n}}},
    "targets"}: numbers are medians over the repetitions (those where they exist); died is whether
    any repetition died; refusals, acts and counted are medians per key."""
    if not per_rep:
        raise ValueError("per_rep: no repetitions")
    names = [row["name"] for row in per_rep[0]]
    arms, spread = [], {}
    for name in names:
        rows = [row for rep in per_rep for row in rep if row["name"] == name]
        delta, d_spread = median_spread([r["metric_delta_points"] for r in rows])
        ratio, r_spread = median_spread([r["time_ratio"] for r in rows])
        arm = {"name": name, "metric_delta_points": _round(delta), "time_ratio": _round(ratio),
               "died": any(r["died"] for r in rows), "refusals": _median_counts([r["refusals"] for r in rows]),
               "acts": _median_counts([r["acts"] for r in rows]),
               "counted": _median_int([r["counted"] for r in rows]), "acts_total": _median_int([r["acts_total"] for r in rows]),
               "died_reps": sum(1 for r in rows if r["died"]), "cut_reps": sum(1 for r in rows if r["cut"]),
               "all_counted_reps": sum(1 for r in rows if r["counted"] >= r["acts_total"])}
        arm["targets"] = judge(arm, n_reps=len(rows))
        arms.append(arm)
        spread[name] = {"metric_delta_points": {k: _round(v) if k != "n" else v for k, v in d_spread.items()},
                        "time_ratio": {k: _round(v) if k != "n" else v for k, v in r_spread.items()}}
    return {"arms": arms, "reps": len(per_rep), "spread": spread,
            "targets": {"max_delta_points": MAX_DELTA_POINTS, "max_time_ratio": MAX_TIME_RATIO,
                        "held": {a["name"]: a["targets"]["all"] for a in arms}}}


def judge(arm: Mapping[str, Any], *, n_reps: int) -> dict[str, bool]:
    """Issue 36's targets for one arm's medians: honest accuracy at most MAX_DELTA_POINTS below
    undisturbed (better is fine), time ratio <= MAX_TIME_RATIO, no repetition died, and in every
    repetition the honest regions counted at least as many events as the member committed acts
    (and it committed some: an arm whose member did nothing has proved nothing)."""
    delta, ratio = arm.get("metric_delta_points"), arm.get("time_ratio")
    out = {"metric": delta is not None and delta >= -MAX_DELTA_POINTS,
           "time": ratio is not None and ratio <= MAX_TIME_RATIO,
           "alive": not arm.get("died"),
           "counted": arm.get("acts_total", 0) > 0 and arm.get("all_counted_reps", 0) == n_reps}
    out["all"] = all(out.values())
    return out


def _median_counts(dicts: Sequence[Mapping[str, int]]) -> dict[str, float | int]:
    keys = sorted({k for d in dicts for k in d})
    return {k: _median_int([d.get(k, 0) for d in dicts]) for k in keys}


def _median_int(values: Sequence[int]) -> float | int:
    m = statistics.median(values) if values else 0
    return int(m) if float(m).is_integer() else m


def _round(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else round(v, 3)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a run that died while writing it
    return out


def table(doc: Mapping[str, Any]) -> str:
    """The document as a plain table (stdout without --json)."""
    head = f"{'arm':18s} {'delta pts':>9s} {'time x':>7s} {'died':>5s} {'acts':>6s} {'counted':>7s}  targets  refusals"
    lines = [head]
    for a in doc["arms"]:
        t = a["targets"]
        marks = "".join(("+" if t[k] else "-") for k in ("metric", "time", "alive", "counted"))
        refs = ", ".join(f"{k} {v}" for k, v in a["refusals"].items()) or "none"
        lines.append(f"{a['name']:18s} {_fmt(a['metric_delta_points']):>9s} {_fmt(a['time_ratio']):>7s} "
                     f"{'yes' if a['died'] else 'no':>5s} {_fmt(a['acts_total']):>6s} {_fmt(a['counted']):>7s}  "
                     f"{marks:7s}  {refs}")
    lines.append(f"medians over {doc['reps']} repetition(s); targets +/- in the order: accuracy within "
                 f"{MAX_DELTA_POINTS:g} point, time <= {MAX_TIME_RATIO:g}x, not died, every act counted")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, (int, float)) else str(v)
