"""Repetitions of `geofed bench wan`: the interleaved order of the runs, and medians with spreads.

Pure functions (no Ray, no run directories), so the order and the arithmetic are unit-tested.

Order: repetition r (0-based) runs every arm once, in the scenario's order rotated left by
r: with arms A B C and 3 repetitions, A B C, then B C A, then C A B. Round-robin, so load that
comes and goes on a shared machine lands on every arm rather than on all the runs of one; and
rotated, so no arm always runs first (on a cold page cache, right after Ray starts) or always
right after the same neighbour.

Ratios (`wan_results.ratios`) are computed within each repetition, from that repetition's
arms, and the reported ratio is their median over the repetitions where it is defined; the
spread is their min and max and how many repetitions gave one (`n`). An arm's reported time and
bytes to target are medians over its repetitions where a repetition that never reached the
target counts as slower than any that did (so the median is null when most did not); its other
figures are medians over the repetitions that have them. An even count takes the mean of the
middle two (statistics.median).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .wan_results import ArmResult, ratios

T = TypeVar("T")


def interleaved_schedule(arms: Sequence[T], reps: int) -> list[tuple[int, T]]:
    """(repetition, arm) in run order: repetition r runs `arms` rotated left by r (module docstring)."""
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps: must be an integer >= 1, got {reps!r}")
    n = len(arms)
    return [(r, arms[(r + i) % n]) for r in range(reps) for i in range(n)]


def median_spread(values: Sequence[float | None]) -> tuple[float | None, dict[str, Any]]:
    """(median, {"min", "max", "n"}) of the values that are not None; (None, nulls and n=0) when none are."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return None, {"min": None, "max": None, "n": 0}
    return statistics.median(got), {"min": min(got), "max": max(got), "n": len(got)}


def median_reached(values: Sequence[float | None]) -> float | None:
    """Median where None (target never reached) ranks above every number; None if the middle is one."""
    if not values:
        return None
    ranked = sorted(math.inf if v is None else float(v) for v in values)
    m = statistics.median(ranked)
    return None if math.isinf(m) or math.isnan(m) else m


def combine(per_rep: Sequence[Sequence[ArmResult]], scenario: str) -> dict[str, Any]:
    """The repetitions' results as the --json document's "arms", "ratios", "reps" and "spread", plus
    "per_rep" (each repetition's arms and ratios, for bench.json) and "notes" (which arms the
    ratios compared, per repetition).

    `per_rep[r]` holds repetition r's ArmResults in any order; every repetition must hold the same arms.
    """
    if not per_rep:
        raise ValueError("per_rep: no repetitions")
    names = [a.name for a in per_rep[0]]
    for r, rep in enumerate(per_rep):
        if sorted(a.name for a in rep) != sorted(names):
            raise ValueError(f"per_rep[{r}]: arms {sorted(a.name for a in rep)}, repetition 0 has {sorted(names)}")
    rep_ratios, notes = [], []
    for rep in per_rep:
        rt = ratios(list(rep), scenario)
        notes.append(rt.pop("_notes"))
        rep_ratios.append(rt)
    medians, spread = {}, {}
    for key in rep_ratios[0]:
        m, s = median_spread([rt[key] for rt in rep_ratios])
        medians[key], spread[key] = _round(m), {k: _round(v) if k != "n" else v for k, v in s.items()}
    by_name = [{a.name: a for a in rep} for rep in per_rep]
    arms = [median_arm_doc([rep[name] for rep in by_name]) for name in names]
    return {"arms": arms, "ratios": medians, "reps": len(per_rep), "spread": spread, "notes": notes,
            "per_rep": [{"rep": r + 1, "arms": [a.doc() for a in rep], "ratios": rt}
                        for r, (rep, rt) in enumerate(zip(per_rep, rep_ratios))]}


def median_arm_doc(runs: Sequence[ArmResult]) -> dict[str, Any]:
    """One arm's entry of the document (ArmResult.doc's keys) as medians over its repetitions."""
    docs = [r.doc() for r in runs]
    out: dict[str, Any] = {"name": docs[0]["name"]}
    for key in docs[0]:
        if key == "name":
            continue
        vals = [d[key] for d in docs]
        med = median_reached(vals) if key in ("time_to_target_s", "bytes_to_target") else median_spread(vals)[0]
        out[key] = _as(med, key)
    return out


def representative(runs: Sequence[ArmResult], key: Callable[[ArmResult], float | None] | None = None) -> ArmResult:
    """The repetition at the median of `key` (default: time to target, never-reached ranking last):
    the one run whose details (per-round utilisation, H over rounds) the report and the target lines show."""
    key = key or (lambda a: a.time_to_target_s)
    ranked = sorted(runs, key=lambda a: (math.inf if key(a) is None else key(a)))
    return ranked[(len(ranked) - 1) // 2]


_DIGITS = {"time_to_target_s": 3, "final_loss": 6}  # as ArmResult.doc rounds them; others 4


def _as(value: float | None, key: str) -> Any:
    if value is None:
        return None
    if key in ("H", "bytes_to_target"):
        return int(round(value))
    return round(value, _DIGITS.get(key, 4))


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
