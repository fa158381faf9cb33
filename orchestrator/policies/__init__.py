"""Sync policies: pure functions (measurements, own state) -> (H, codec per link, reason).

``make_policy(cfg, codec=..., ladder=...)`` builds the policy ``sync.policy`` names; the runtime
calls ``decide(Measurements)`` once per round and stores ``state_dict()`` in its checkpoints.
See docs/policies.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .adacomm import AdacommPolicy
from .bandwidth import BandwidthPolicy
from .config import AdacommPolicyConfig, BandwidthPolicyConfig, FixedPolicyConfig, policy_config_class
from .cost import RatioFn, compression_ratio
from .fixed import FixedPolicy
from .types import Decision, LinkEstimate, Measurements, Policy


def make_policy(cfg: Any, *, codec: Any, ladder: Sequence[Any] = (), ratio: RatioFn | None = None) -> Policy:
    """The policy for config ``cfg``; ``codec`` is compression.codec, ``ladder`` compression.ladder.

    ``ratio(spec, numel) -> float`` estimates a codec's compression; by default it asks
    ``geofed.compression.make_codec(spec).estimate_ratio(numel)`` (tests inject their own).
    """
    ratio = ratio or compression_ratio
    if isinstance(cfg, FixedPolicyConfig):
        return FixedPolicy(cfg, codec=codec, ladder=ladder)
    if isinstance(cfg, BandwidthPolicyConfig):
        return BandwidthPolicy(cfg, codec=codec, ladder=ladder, ratio=ratio)
    if isinstance(cfg, AdacommPolicyConfig):
        return AdacommPolicy(cfg, base=make_policy(cfg.base, codec=codec, ladder=ladder, ratio=ratio))
    raise TypeError(f"no policy for config {type(cfg).__name__}")


__all__ = [
    "AdacommPolicy", "AdacommPolicyConfig", "BandwidthPolicy", "BandwidthPolicyConfig", "Decision",
    "FixedPolicy", "FixedPolicyConfig", "LinkEstimate", "Measurements", "Policy", "make_policy",
    "policy_config_class",
]
