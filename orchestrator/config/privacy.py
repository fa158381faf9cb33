"""``privacy``: differential privacy's config, and the rules that tie secure aggregation and DP to
the rest of a run config (RunConfig calls `check_privacy_rules`; docs/privacy.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.secagg.codecs import secagg_codec_problem


def _doc(text: str, **kw) -> dict:
    return {"doc": text, **kw}


@dataclass(frozen=True, kw_only=True)
class DpSection:
    """``privacy.dp``: which DP mechanism, its clip and noise, and the privacy budget."""

    mode: Literal["off", "record", "update"] = field(default="off", metadata=_doc(
        "off; record: DP-SGD inside every region (each example's gradient clipped to clip, Gaussian noise), "
        "a guarantee per training record; update: each region's pseudo-gradient clipped to clip and noised once "
        "per round, a guarantee per region's whole data (docs/privacy.md)"))
    clip: float = field(default=1.0, metadata=_doc(
        "L2 bound: of each example's gradient (record) or of each region's pseudo-gradient (update)"))
    noise_multiplier: float | None = field(default=None, metadata=_doc(
        "Gaussian noise std over clip; null: the smallest that keeps the planned run (run.rounds) within "
        "target_epsilon, found by the accountant before round 0"))
    target_epsilon: float | None = field(default=None, metadata=_doc(
        "the privacy budget at delta; null: none (then noise_multiplier must be set and epsilon is only reported)"))
    delta: float = field(default=1e-5, metadata=_doc(
        "the delta of the reported (epsilon, delta); well below 1 / the number of records"))
    on_target: Literal["stop", "warn"] = field(default="stop", metadata=_doc(
        "when the next round would take epsilon past target_epsilon: stop the run before it, or warn and go on"))
    accountant: Literal["prv", "rdp"] = field(default="prv", metadata=_doc(
        "how epsilon is computed (and the noise for target_epsilon chosen): prv, the numerical composition of "
        "privacy random variables (package prv-accountant; the exact curve for update-level DP), never above rdp "
        "and about 5% less noise for the same epsilon at a thousand steps; rdp, Rényi DP with Balle et al.'s "
        "conversion (math only)"))
    seeded_noise: bool = field(default=False, metadata=_doc(
        "draw the DP noise from a generator seeded by run.seed and the region (reproducible runs, for research "
        "and benchmarks); false: seeded from the OS's randomness, what a deployment needs (whoever knows the seed "
        "can subtract the noise)"))

    def __post_init__(self):
        if not 0 < self.clip <= 1e6:
            raise ValueError(f"clip: must be in (0, 1e6], got {self.clip}")
        if self.noise_multiplier is not None and not 0.01 <= self.noise_multiplier <= 1e4:
            raise ValueError(f"noise_multiplier: must be in [0.01, 1e4] (or null), got {self.noise_multiplier}")
        if self.target_epsilon is not None and not 0 < self.target_epsilon <= 1e3:
            raise ValueError(f"target_epsilon: must be in (0, 1000] (or null), got {self.target_epsilon}")
        if not 0 < self.delta < 0.1:
            raise ValueError(f"delta: must be in (0, 0.1), got {self.delta}")
        if self.mode != "off" and self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError(f"noise_multiplier: privacy.dp.mode {self.mode} needs noise_multiplier or "
                             "target_epsilon (which then chooses the noise)")


@dataclass(frozen=True, kw_only=True)
class PrivacySection:
    """``privacy``: differential privacy of the trained model (secure aggregation is ``security.secure_aggregation``)."""

    dp: DpSection = field(default_factory=DpSection, metadata=_doc("differential privacy"))


# Tasks whose records are not independent examples: a node's features reach its neighbours'
# gradients, so clipping one example's gradient does not bound one record's influence.
_NOT_PER_EXAMPLE = ("gcn-planetoid",)


def check_privacy_rules(cfg: Any) -> None:
    """Cross-section rules of secure aggregation and DP; ValueError("dotted.key: ...") names the key."""
    sec, dp = cfg.security, cfg.privacy.dp
    if sec.secagg_threshold is not None:
        # Refused, not ignored: a config that sets it expects it to do something, and it no longer can.
        raise ValueError("security.secagg_threshold: retired: the per-round Shamir protocol it configured was removed; "
                         "secure aggregation recovers a dropped region from the survivors' own seeds (docs/privacy.md). "
                         "Remove the key")
    if sec.secure_aggregation:
        _check_secure_aggregation(cfg)
    elif cfg.regions.emulation.availability.mid_round:
        raise ValueError("regions.emulation.availability.mid_round: a mid-round drop is emulated by secure "
                         "aggregation's exchange only; set security.secure_aggregation: true or drop the key")
    if dp.mode == "record" and getattr(cfg.task, "kind", "") in _NOT_PER_EXAMPLE:
        raise ValueError(f"privacy.dp.mode: record-level DP clips per example, and {cfg.task.kind}'s examples share "
                         "a graph (one node's features reach its neighbours' gradients); use mode update")
    if dp.mode == "record" and cfg.sync.inner.precision == "fp16":
        raise ValueError("sync.inner.precision: fp16's loss scaling would scale privacy.dp.mode record's clipped, "
                         "noised gradients; use fp32 or bf16")
    if dp.mode == "update" and not algorithm_traits(cfg.sync.algorithm).outer_step:
        raise ValueError(f"privacy.dp.mode: update-level DP noises DiLoCo's pseudo-gradient; sync.algorithm is "
                         f"{cfg.sync.algorithm} (use mode record)")


def _check_secure_aggregation(cfg: Any) -> None:
    c = cfg.compression
    for key, spec in [("codec", c.codec)] + [(f"ladder.{i}", s) for i, s in enumerate(c.ladder)]:
        problem = secagg_codec_problem(spec)
        if problem is not None:
            raise ValueError(f"compression.{key}: {spec.key} cannot be combined with security.secure_aggregation: "
                             f"{problem}; use int8, int4 or randomk")
    if c.ladder:
        raise ValueError("compression.ladder: security.secure_aggregation sums every region's update in one ring, "
                         "so a round has one codec for all links; per-link codecs (a ladder) are refused")
    if not algorithm_traits(cfg.sync.algorithm).outer_step or cfg.sync.topology != "full":
        raise ValueError(f"security.secure_aggregation: needs sync.algorithm diloco over sync.topology full (every "
                         f"region sums every update), got {cfg.sync.algorithm} over {cfg.sync.topology}")
    n = len(cfg.regions.names)
    if n < 3:
        raise ValueError(f"security.secure_aggregation: needs >= 3 regions (with {n}, a region's own update and the "
                         "sum give the other's)")
    if not cfg.security.tls:
        raise ValueError("security.secure_aggregation: needs security.tls: the round keys are signed by the regions' "
                         "TLS identities; without them anyone on the path can swap a key")
    if cfg.sync.overlap:
        raise ValueError(f"sync.overlap: {cfg.sync.overlap} is not supported with security.secure_aggregation (its "
                         "three-message exchange runs in the round; use overlap: false)")
    if cfg.sync.pacing.mode == "quorum":
        raise ValueError("sync.pacing.mode: quorum closes a round without the slowest region, whose masked update "
                         "then never cancels; security.secure_aggregation needs barrier or time-budget")
    if cfg.security.robust_aggregation in ("trimmed-mean", "median"):
        raise ValueError(f"security.robust_aggregation: {cfg.security.robust_aggregation} needs each peer's update, "
                         "which security.secure_aggregation hides; use clip (it acts on the unmasked sum) or none")

