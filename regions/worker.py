"""What the driver and a region say to each other across the Ray boundary: `RoundPlan`, what one
round asks of a region (the region itself is regions/region.py; its actor regions/actor.py).

`rss_mb` is here too: both sides report their own process's memory with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from geofed.compression import CodecSpec


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """What the coordinator asks of a region for one round: H local steps, the codec of each
    out-link, the lr scale, evaluation and sketch flags, whether it is the last round, and which
    regions it believes are up.
    """

    round: int
    H: int
    codecs: dict[str, CodecSpec] = field(default_factory=dict)  # peer -> codec of my link to it
    lr_scale: float = 1.0
    evaluate: bool = False
    alive: tuple[str, ...] | None = None  # regions the coordinator believes are up (None: all)
    final: bool = False  # the run's last round: apply an exchange still in flight (overlap) before returning
    sketch: bool = False  # report a count sketch of the synchronised model (the driver's consensus distance)
    # sync.pacing (regions/pacing.py): time-budget rounds step until budget_s (at most max_steps) and
    # scale their pseudo-gradient by norm_steps / steps; quorum rounds close a receive at `quorum`.
    budget_s: float | None = None
    budget_until: float | None = None  # time.time() when the budget ends, whenever the round starts
    max_steps: int | None = None
    norm_steps: float | None = None
    quorum: int | None = None
    grace_s: float = 0.0
    # privacy.dp (regions/privacy/dp.py): the mechanism, its clip and the noise multiplier the driver's
    # PrivacyBudget chose; record: DP-SGD inner steps, update: DiLoCo's sent pseudo-gradient noised.
    dp_mode: str = "off"
    dp_clip: float = 1.0
    dp_noise: float | None = None
    # sync.pacing.fill_gaps (regions/gapfill.py): after returning, step until the next call arrives.
    fill: bool = False
    # In-neighbours on probation (a member muted for withholding, tried again: recovery.WithholdWatch):
    # their update is taken if it comes with the others, and nobody waits for it (p2p/mailbox.py).
    optional: tuple[str, ...] = ()


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux /proc; 0.0 where it is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        return 0.0


__all__ = ["RoundPlan", "rss_mb"]

