"""Config of the built-in sync policies (``sync.policy``), one dataclass per kind.

Each kind registers its class with its policy (registry.py); the strict loader picks the class
by ``sync.policy.kind``. Errors are ``ValueError("field: message")`` and the loader prefixes the
dotted path (``configs/x.yaml: sync.policy.target_comm_fraction: must be in (0, 1)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

H_LIMIT = 1_000_000


def _doc(text: str, **kw: Any) -> dict[str, Any]:
    return {"doc": text, **kw}


@dataclass(frozen=True, kw_only=True)
class FixedPolicyConfig:
    """``sync.policy.kind: fixed``: the same H every round."""

    kind: Literal["fixed"] = "fixed"
    H: int = field(default=20, metadata=_doc("local steps between syncs"))

    def __post_init__(self) -> None:
        if not 1 <= self.H <= H_LIMIT:
            raise ValueError(f"H: must be in [1, {H_LIMIT}], got {self.H}")


@dataclass(frozen=True, kw_only=True)
class BandwidthPolicyConfig:
    """``sync.policy.kind: bandwidth``: H (and, with a ladder, each link's codec) from the measured
    links and step time, with hysteresis.
    """

    kind: Literal["bandwidth"] = "bandwidth"
    initial_H: int = field(default=50, metadata=_doc("H until links and step time are measured"))
    H_min: int = field(default=1, metadata=_doc("smallest H the policy picks"))
    H_max: int = field(default=10_000, metadata=_doc("largest H the policy picks"))
    target_comm_fraction: float = field(
        default=0.1, metadata=_doc("without overlap: communication is at most this share of a round's wall time"))
    overlap_margin: float = field(
        default=1.2, metadata=_doc("with overlap: H*step_time >= overlap_margin * sync time"))
    rtt_factor: float = field(default=1.0, metadata=_doc("k in the sync cost D = k*RTT + bytes/bandwidth"))
    hysteresis: float = field(
        default=0.25, metadata=_doc("change H (or a link's codec) only when it is off by more than this fraction"))
    hold_rounds: int = field(default=3, metadata=_doc("at least this many rounds between two changes of H (or of one link's codec)"))
    target_H: int = field(
        default=100, metadata=_doc("with a codec ladder: links compress only as much as a round of target_H steps needs"))
    min_compression: float = field(
        default=1.0, metadata=_doc(
            "a byte budget: H x codec ratio >= this on every link, i.e. a region sends at most 1/min_compression "
            "of the bytes per inner step that per-step fp32 sync would (egress cost); 1: no budget"))

    def __post_init__(self) -> None:
        if not 1 <= self.min_compression <= 1e9:
            raise ValueError(f"min_compression: must be in [1, 1e9], got {self.min_compression}")
        if not 1 <= self.H_min <= self.H_max <= H_LIMIT:
            raise ValueError(f"H_min: need 1 <= H_min <= H_max <= {H_LIMIT}, got H_min={self.H_min}, H_max={self.H_max}")
        if not self.H_min <= self.initial_H <= self.H_max:
            raise ValueError(f"initial_H: must be in [H_min, H_max] = [{self.H_min}, {self.H_max}], got {self.initial_H}")
        if not self.H_min <= self.target_H <= self.H_max:
            raise ValueError(f"target_H: must be in [H_min, H_max] = [{self.H_min}, {self.H_max}], got {self.target_H}")
        if not 0 < self.target_comm_fraction < 1:
            raise ValueError(f"target_comm_fraction: must be in (0, 1), got {self.target_comm_fraction}")
        if not 1 <= self.overlap_margin <= 100:
            raise ValueError(f"overlap_margin: must be in [1, 100], got {self.overlap_margin}")
        if not 0 <= self.rtt_factor <= 100:
            raise ValueError(f"rtt_factor: must be in [0, 100], got {self.rtt_factor}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis: must be in [0, 1), got {self.hysteresis}")
        if not 0 <= self.hold_rounds <= 1_000_000:
            raise ValueError(f"hold_rounds: must be in [0, 1000000], got {self.hold_rounds}")


def base_config_class(kind: str) -> type:
    """What AdaComm's factor may sit on: a fixed H or the bandwidth policy's H."""
    bases = {"fixed": FixedPolicyConfig, "bandwidth": BandwidthPolicyConfig}
    if kind not in bases:
        raise KeyError(f"unknown base policy {kind!r} (known: {', '.join(sorted(bases))})")
    return bases[kind]


@dataclass(frozen=True, kw_only=True)
class AdacommPolicyConfig:
    """``sync.policy.kind: adacomm``: AdaComm's loss (and lr) factor on a base policy's H."""

    kind: Literal["adacomm"] = "adacomm"
    base: Any = field(
        default_factory=BandwidthPolicyConfig,
        metadata=_doc("the H the loss factor multiplies (AdaComm's tau_0): kind fixed or bandwidth", choose=base_config_class))
    interval_rounds: int = field(default=5, metadata=_doc("hold the loss factor for this many rounds (when interval_s is null)"))
    interval_s: float | None = field(
        default=None, metadata=_doc("hold the loss factor for this many seconds of run time (AdaComm's T_0); overrides interval_rounds"))
    lr_exponent: float = field(
        default=1.5, metadata=_doc("factor also times (lr0/lr)^lr_exponent (AdaComm's optimum tau ~ sqrt(F/lr^3): 1.5; 0: ignore lr)"))
    H_min: int = field(default=1, metadata=_doc("smallest H after the factor"))
    H_max: int = field(default=10_000, metadata=_doc("largest H after the factor"))

    def __post_init__(self) -> None:
        if not isinstance(self.base, (FixedPolicyConfig, BandwidthPolicyConfig)):
            raise ValueError(f"base: must be a fixed or bandwidth policy, got {type(self.base).__name__}")
        if not 1 <= self.interval_rounds <= 1_000_000:
            raise ValueError(f"interval_rounds: must be in [1, 1000000], got {self.interval_rounds}")
        if self.interval_s is not None and not 0 < self.interval_s <= 1e9:
            raise ValueError(f"interval_s: must be > 0 (or null), got {self.interval_s}")
        if not 0 <= self.lr_exponent <= 4:
            raise ValueError(f"lr_exponent: must be in [0, 4], got {self.lr_exponent}")
        if not 1 <= self.H_min <= self.H_max <= H_LIMIT:
            raise ValueError(f"H_min: need 1 <= H_min <= H_max <= {H_LIMIT}, got H_min={self.H_min}, H_max={self.H_max}")
