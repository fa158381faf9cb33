"""What the driver does for the loop API (issue 38) that a task's run does not need: the user's
function builds each region's model, and the user's loop decides when its data ends.

- One initial model. A task builds every region's model from one seed; a user's function may not
  (an unseeded `nn.Linear` draws from each process's own generator), and DiLoCo from different
  starts does not converge, silently. Before round 0 of a fresh run (not a resume: the checkpoint
  is the start) the driver compares the regions' count sketches of their synchronised model
  (regions/sketch.py, 32 KiB each) with the first region's; the regions that differ take the first
  region's model and algorithm state through the rejoin path (Region.catch_up, FetchState over
  the regions' own links), as DDP broadcasts rank 0's parameters and buffers. The sketches are
  compared again after it: a region still different fails the run, naming it. Equal starts cost
  the sketches only (their weights are left alone, bit for bit).
- Ended loops. A region whose loop returned (its RoundReport says `loop_ended`) would go on
  sending a zero update that drags the others' mean toward its stale model: from the next round
  it is planned no more, as a region that left (the plans' `alive` leave it out, so nobody waits
  for it and its mixing weight goes back to the others). Once every region's loop has ended the
  run stops, and summary.json says so (`loops_ended`, `ended_early`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .recovery import RunFailed

__all__ = ["LoopEnds", "one_initial_model"]


def _same(a: Any, b: Any) -> bool:
    # Not torch.equal: a region on another device sums its sketch in another order (float rounding);
    # models built apart differ by the size of their weights.
    a, b = torch.as_tensor(a).float().cpu(), torch.as_tensor(b).float().cpu()
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def one_initial_model(names: list[str], sketches: Callable[[list[str]], Mapping[str, Any]],
                      catch_up: Callable[[dict[str, list[str]]], Any], note: Callable[[str], None]) -> list[str]:
    """Make every region in `names` start from the first one's model (module docstring). `sketches(regions)`:
    region -> its count sketch; `catch_up({region: [donor]})`: those regions take the donor's state.
    Returns the regions that took it; raises RunFailed naming those still different after it."""
    first = names[0]
    got = sketches(names)
    differ = [r for r in names[1:] if r in got and not _same(got[r], got[first])]
    if not differ:
        return []
    note(f"regions {', '.join(differ)} built initial weights other than region {first}'s: they start from "
         f"{first}'s (seed model construction with ctx.seed, e.g. torch.manual_seed(ctx.seed), to build one model)")
    catch_up({r: [first] for r in differ})
    got = sketches([first, *differ])
    still = [r for r in differ if r not in got or not _same(got[r], got[first])]
    if still:
        raise RunFailed(f"regions {', '.join(still)} could not take region {first}'s initial model and built other "
                        "weights: every region must start from one model; seed model construction with ctx.seed "
                        "(torch.manual_seed(ctx.seed) before building it)")
    return differ


class LoopEnds:
    """The regions whose training loop has ended, and the round it ended in (module docstring)."""

    def __init__(self) -> None:
        self.ended: dict[str, int] = {}
        self.all_ended_in: int | None = None

    def note(self, r: int, results: Mapping[str, Any], names: Iterable[str]) -> None:
        """Round r's reports: who said `loop_ended`."""
        for region, m in results.items():
            if m.extra.get("loop_ended") and region not in self.ended:
                self.ended[region] = r
        if self.all_ended_in is None and all(reg in self.ended for reg in names):
            self.all_ended_in = r

    def looping(self, regions: Iterable[str]) -> list[str]:
        """`regions` without those whose loop ended (the next round's plans leave them out)."""
        return [r for r in regions if r not in self.ended]

    def freshest_first(self, regions: Iterable[str]) -> list[str]:
        """`regions` ordered by how recent their model is: those still looping (or every one of a task's
        run), then those whose loop ended, latest first (the run's model and evaluation are the first's)."""
        regions = list(regions)
        return sorted(regions, key=lambda r: (-self.ended[r] if r in self.ended else -1 << 62, regions.index(r)))

    @property
    def all_ended(self) -> bool:
        return self.all_ended_in is not None

    def summary_fields(self) -> dict[str, Any]:
        """summary.json's `loops_ended` (region -> the round its loop ended in) and `ended_early`."""
        why = (None if self.all_ended_in is None else
               f"every region's training loop ended (the last in round {self.all_ended_in})")
        return {"loops_ended": dict(self.ended), "ended_early": why}
