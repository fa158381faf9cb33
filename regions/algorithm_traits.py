"""What each sync algorithm (``sync.algorithm``) can do, as capabilities rather than its name.

Rules across the run (the config's, the driver's, a region's) ask these instead of comparing the
algorithm's name, so that an algorithm added later says once what it supports. Torch-free: the
config loader reads it. The algorithm classes (regions/sync/) carry theirs as ``traits``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AlgorithmTraits:
    """One algorithm's capabilities."""

    # Rounds exchange pseudo-gradients stepped by an outer optimizer on a global copy (DiLoCo): what
    # fragments, update-level DP, paced rounds and secure aggregation act on.
    outer_step: bool
    # Regions mix models, not updates (gossip): each keeps its own model until consensus.
    mixes_models: bool
    # One inner step a round whatever H says (all-reduce, the per-step baseline).
    per_step: bool
    # Keeps its exchanged state in host memory and trains on the CPU (gossip's public copies).
    cpu_only: bool


TRAITS = {
    "diloco": AlgorithmTraits(outer_step=True, mixes_models=False, per_step=False, cpu_only=False),
    "allreduce": AlgorithmTraits(outer_step=False, mixes_models=False, per_step=True, cpu_only=False),
    "gossip": AlgorithmTraits(outer_step=False, mixes_models=True, per_step=False, cpu_only=True),
}


def algorithm_traits(name: str) -> AlgorithmTraits:
    """The traits of the algorithm `name` (sync.algorithm's choices)."""
    return TRAITS[name]


__all__ = ["TRAITS", "AlgorithmTraits", "algorithm_traits"]
