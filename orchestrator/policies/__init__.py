"""Sync policies: pure functions (measurements, own state) -> (H, codec per link, reason).

``make_policy(cfg, codec=..., ladder=...)`` builds the policy ``sync.policy`` names; the runtime
calls ``decide(Measurements)`` once per round and stores ``state_dict()`` in its checkpoints.
A policy kind is registered with its config class and factory (``register_policy``, registry.py);
importing this package registers the built-in fixed, bandwidth and adacomm. See docs/policies.md.
"""

from __future__ import annotations

from .adacomm import AdacommPolicy
from .bandwidth import BandwidthPolicy
from .config import AdacommPolicyConfig, BandwidthPolicyConfig, FixedPolicyConfig
from .fixed import FixedPolicy
from .registry import PolicyContext, make_policy, policy_config_class, policy_kinds, register_policy
from .types import Decision, LinkEstimate, Measurements, Policy

__all__ = [
    "AdacommPolicy", "AdacommPolicyConfig", "BandwidthPolicy", "BandwidthPolicyConfig", "Decision",
    "FixedPolicy", "FixedPolicyConfig", "LinkEstimate", "Measurements", "Policy", "PolicyContext", "make_policy",
    "policy_config_class", "policy_kinds", "register_policy",
]
