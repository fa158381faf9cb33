"""AdaComm (Wang & Joshi, "Adaptive Communication Strategies to Achieve the Best Error-Runtime
Trade-off in Local-Update SGD", SysML 2019): sync rarely while the loss is high, more often as it
falls.

Their error bound for local SGD after wall time T with compute Y and sync D per round,
``2F/(eta*T)*(Y + D/tau) + eta*L*sigma^2/m + eta^2*L^2*sigma^2*(tau-1)``, is smallest at
``tau* ~ sqrt(F / eta^3)``; restarted at the start of each interval l this gives

    tau_l = ceil( tau_0 * sqrt(F_l / F_0) * (eta_0 / eta_l)^(3/2) )

(``lr_exponent`` = 3/2; 0 ignores the learning rate). The factor is held for an interval
(``interval_s`` of run time, AdaComm's T_0, or ``interval_rounds``). Here ``tau_0`` is the base
policy's H (fixed, or the bandwidth policy's current H), so the factor rides on top of what
the links allow; codecs are the base's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import cost
from .config import AdacommPolicyConfig
from .registry import PolicyContext, register_policy
from .types import Decision, Measurements


class AdacommPolicy:
    """The base policy's H times AdaComm's loss (and learning-rate) factor; the base's codecs."""

    kind = "adacomm"

    def __init__(self, cfg: AdacommPolicyConfig, *, base: Any):
        self.cfg = cfg
        self.base = base
        self._F0: float | None = None
        self._factor = 1.0
        self._loss_ratio: float | None = None
        self._lr_ratio: float | None = None
        self._start_round: int | None = None   # current interval's start
        self._start_s: float | None = None

    def decide(self, m: Measurements) -> Decision:
        """The base's decision with H times the current interval's factor (clamped to [H_min, H_max]);
        the factor is recomputed when an interval ends, from the loss (and lr) then.
        """
        b = self.base.decide(m)
        event = self._update(m)
        c = self.cfg
        H = min(max(cost.ceil_H(b.H * self._factor), c.H_min), c.H_max)
        details = {"kind": self.kind, "event": event, "H": H, "H_base": b.H, "factor": round(self._factor, 6),
                   "loss_ratio": self._loss_ratio, "lr_ratio": self._lr_ratio, "F0": self._F0, "loss": m.loss,
                   "interval_start_round": self._start_round, "base": dict(b.details)}
        if self._F0 is None:
            head = f"adacomm waits for a loss: H={H} from {self.base.kind} H={b.H}"
        else:
            lr = "" if self._lr_ratio is None else f", lr0/lr {self._lr_ratio:.3g}"
            head = (f"adacomm x{self._factor:.3g} (loss/F0 {self._loss_ratio:.3g}{lr}) on {self.base.kind} "
                    f"H={b.H} -> H={H}")
        return Decision(H=H, codecs=b.codecs, default_codec=b.default_codec, details=details,
                        reason=f"{head} | {b.reason}")

    def _update(self, m: Measurements) -> str:
        """Start a new interval when the last one has run out; returns the event name."""
        loss = m.loss if m.loss is not None and math.isfinite(m.loss) and m.loss > 0 else None  # None: unusable
        if self._F0 is None:
            if loss is None:
                return "initial"
            self._F0, self._loss_ratio, self._start_round, self._start_s = loss, 1.0, m.round, m.now_s
            return "interval"
        if not self._interval_over(m) or loss is None:
            return "steady"
        self._loss_ratio = loss / self._F0
        factor = math.sqrt(self._loss_ratio)
        if self.cfg.lr_exponent and m.lr > 0 and m.lr0 > 0:
            self._lr_ratio = m.lr0 / m.lr
            factor *= self._lr_ratio ** self.cfg.lr_exponent
        self._factor = factor
        self._start_round, self._start_s = m.round, m.now_s
        return "interval"

    def _interval_over(self, m: Measurements) -> bool:
        # Asked only once F0 is set, and the interval's start is set with it.
        if self.cfg.interval_s is not None:
            assert self._start_s is not None
            return m.now_s - self._start_s >= self.cfg.interval_s
        assert self._start_round is not None
        return m.round - self._start_round >= self.cfg.interval_rounds

    def state_dict(self) -> dict[str, Any]:
        """F0, the factor and its interval, and the base policy's state."""
        return {"kind": self.kind, "F0": self._F0, "factor": self._factor, "loss_ratio": self._loss_ratio,
                "lr_ratio": self._lr_ratio, "start_round": self._start_round, "start_s": self._start_s,
                "base": self.base.state_dict()}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore `state_dict()` (the base's too); ValueError for another kind's state."""
        if d.get("kind") != self.kind:
            raise ValueError(f"policy state is for {d.get('kind')!r}, not {self.kind!r}")
        self._F0, self._factor = d["F0"], float(d["factor"])
        self._loss_ratio, self._lr_ratio = d["loss_ratio"], d["lr_ratio"]
        self._start_round, self._start_s = d["start_round"], d["start_s"]
        self.base.load_state_dict(d["base"])


def _make(cfg: AdacommPolicyConfig, ctx: PolicyContext) -> AdacommPolicy:
    return AdacommPolicy(cfg, base=ctx.make(cfg.base))


register_policy("adacomm", config=AdacommPolicyConfig, factory=_make)
