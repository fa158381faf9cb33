"""What the run's own sync policy settles on, and the range it may choose from.

The plan's candidates are fixed (H, codec) pairs, but an adaptive run does not run one of them:
its policy (orchestrator/policies) sizes H from the step time and the links every round. The
planner therefore runs that same policy, as the coordinator builds it, on the plan's inputs (the
step time as the co-located regions see it, the config's link matrix, the control plane's
per-round time) until its decision stops changing, and predicts the run at that decision. The
recommendation is kept inside what the policy may choose (H_min..H_max, the codec ladder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geofed.compression import CodecSpec

from ..policies import Measurements, make_policy
from ..policies.config import H_LIMIT
from .model import Setup

MAX_ROUNDS = 200   # a policy that has not settled by then is reported as its last decision


@dataclass(frozen=True, kw_only=True)
class PolicyRange:
    """The (H, codec) pairs a run's policy may use: H in [H_min, H_max], codecs of its ladder.

    A fixed policy's config is what the plan is there to choose (`--write-config` writes the
    pick as one), so it admits every pair."""

    kind: str
    H_min: int
    H_max: int
    codecs: tuple[str, ...] | None   # codec keys; None: any

    def admits(self, H: int, codec: str) -> bool:
        return self.H_min <= H <= self.H_max and (self.codecs is None or codec in self.codecs)

    def clamp(self, H: int) -> int:
        return min(max(H, self.H_min), self.H_max)


def policy_range(cfg) -> PolicyRange:
    """sync.policy's H bounds and compression's ladder (or its one codec) for this config."""
    p = cfg.sync.policy
    codecs = tuple(s.key for s in (cfg.compression.ladder or (cfg.compression.codec,)))
    if p.kind == "fixed":
        return PolicyRange(kind="fixed", H_min=1, H_max=H_LIMIT, codecs=None)
    # bandwidth and adacomm (whose own clamp comes last) bound H; a plug-in without bounds: any H.
    lo, hi = getattr(p, "H_min", 1), getattr(p, "H_max", H_LIMIT)
    return PolicyRange(kind=p.kind, H_min=int(lo), H_max=int(hi), codecs=codecs)


def steady_decision(cfg, setup: Setup, numel: int) -> dict[str, Any]:
    """The decision the run's policy repeats once it has the plan's measurements: H, the codec of
    the bottleneck-sized rounds (the strongest it chose), every link's codec, the round it settled
    and its reason. The links are the first segment's (the run's start); the step time and the
    overhead are the plan's, as the coordinator measures them (slowest region; control plane)."""
    p = cfg.sync.policy
    policy = make_policy(p, codec=cfg.compression.codec, ladder=cfg.compression.ladder)
    links = {name: setup.segments[0].links[name].estimate for name in setup.out_links}
    lr = float(cfg.sync.inner.lr)
    hold = int(getattr(p, "hold_rounds", 0) or getattr(getattr(p, "base", None), "hold_rounds", 0) or 0)
    last, same, settled = None, 0, None
    for r in range(MAX_ROUNDS):
        m = Measurements(now_s=float(r), round=r, step_time_s=setup.step_s, loss=None, lr=lr, lr0=lr,
                         model_numel=numel, links=links, overlap=setup.overlap,
                         round_overhead_s=setup.overhead_s * setup.contention)
        d = policy.decide(m)
        key = (d.H, tuple(sorted((k, v.key) for k, v in d.codecs.items())))
        same = same + 1 if key == last else 0
        if same == 0:
            settled = r
        last = key
        if same > hold + 2:
            break
    codec = d.default_codec or cfg.compression.codec
    assert isinstance(codec, CodecSpec)
    return {"kind": p.kind, "H": d.H, "codec": codec.key, "codecs": {k: v.key for k, v in d.codecs.items()},
            "settled_round": settled, "reason": d.reason}
