"""``sync``: SyncSection and its parts (the inner and outer optimizers, the receive deadline and
gossip's settings). Rules across sections (CHOCO's codecs, robust aggregation) are RunConfig's."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.pacing import PacingSection

from ..policies import FixedPolicyConfig, policy_config_class
from .common import _doc


@dataclass(frozen=True, kw_only=True)
class InnerOptimizer:
    """``sync.inner``: each region's local optimizer, its batch size and the lr schedule over the run."""

    kind: Literal["adamw", "sgd"] = field(default="adamw", metadata=_doc("inner (local) optimizer"))
    lr: float = field(default=1e-3, metadata=_doc("inner learning rate"))
    weight_decay: float = field(default=0.0, metadata=_doc(
        "inner weight decay; 0 by choice (DiLoCo's small-model runs and the built-in tasks train best without), "
        "where torch's AdamW defaults to 0.01: set 0.01 to match torch"))
    momentum: float = field(default=0.0, metadata=_doc("sgd momentum"))
    batch_size: int = field(default=32, metadata=_doc("examples per inner step"))
    lr_decay: Literal["none", "cosine"] = field(default="none", metadata=_doc("inner lr schedule over the run"))
    precision: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata=_doc(
        "autocast of the forward pass: bf16 or fp16 matrix products (fp16 with a loss scaler); parameters, "
        "optimizer state and updates stay fp32 (regions/device.py)"))
    step_in_backward: bool = field(default=True, metadata=_doc(
        "step each parameter in the backward pass as soon as its gradient is complete, and let the gradient go: "
        "a model's worth of gradients is never held at once (4 B/param), the same weights (bitwise on the CPU; "
        "regions/backward_step.py). Steps after the backward pass where a step needs every gradient first: "
        "fp16, record-level DP, gradient tracking, regions.workers > 1, the allreduce baseline, your own optimizer"))

    def __post_init__(self):
        if not 0 < self.lr <= 10:
            raise ValueError(f"lr: must be in (0, 10], got {self.lr}")
        if not 1 <= self.batch_size <= 1_000_000:
            raise ValueError(f"batch_size: must be in [1, 1000000], got {self.batch_size}")
        if self.weight_decay < 0 or not 0 <= self.momentum < 1:
            raise ValueError("weight_decay: must be >= 0 (and momentum in [0, 1))")


@dataclass(frozen=True, kw_only=True)
class OuterOptimizer:
    """``sync.outer``: DiLoCo's outer optimizer on the mixed pseudo-gradients, any torch optimizer
    (regions/sync/outer.py builds it; docs/outer-optimizers.md)."""

    kind: str = field(default="nesterov", metadata=_doc(
        "nesterov: SGD with Nesterov momentum (DiLoCo); sgd: SGD with heavy-ball momentum (momentum 0: plain SGD); "
        "adam: Adam (momentum is its beta1); python:module:Name: your own, marked @outer_optimizer, called with "
        "the parameters, lr and options (docs/outer-optimizers.md)"))
    lr: float = field(default=0.7, metadata=_doc("outer learning rate (DiLoCo's SGD: 0.7; Adam wants far less)"))
    momentum: float = field(default=0.9, metadata=_doc("outer momentum (DiLoCo: 0.9); adam: beta1"))
    beta2: float = field(default=0.999, metadata=_doc("adam: beta2"))
    eps: float = field(default=1e-8, metadata=_doc("adam: epsilon"))
    nesterov: bool | None = field(default=None, metadata=_doc(
        "retired: sync.outer.kind says it (true is kind nesterov, false is kind sgd); a value that agrees with "
        "kind still loads"))
    path: str | None = field(default=None, metadata=_doc(
        "a plug-in kind: folder put on sys.path before importing its module", path="config"))
    options: Mapping[str, Any] = field(default_factory=dict, metadata=_doc("a plug-in kind: keyword arguments for it"))
    offload: bool = field(default=False, metadata=_doc(
        "DiLoCo's outer state (the global copy, outer momentum, overlap's start) in host memory, pinned where CUDA "
        "is, while the model and the inner optimizer stay on the model's device (as INTELLECT-1 does); the "
        "pseudo-gradient, mix and outer step then run on the host. The error-feedback residual and the codec are "
        "on the host either way. On a CPU model nothing moves (docs/bench-memory.md)"))

    def __post_init__(self):
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload: must be true or false, got {self.offload!r}")
        if self.kind not in OUTER_KINDS and not _PLUGIN_OUTER.fullmatch(self.kind):
            raise ValueError(f"kind: expected one of {', '.join(OUTER_KINDS)} or python:module:Name, got {self.kind!r}")
        if not 0 < self.lr <= 10 or not 0 <= self.momentum < 1:
            raise ValueError(f"lr: outer lr must be in (0, 10] and momentum in [0, 1), got {self.lr}, {self.momentum}")
        if not 0 <= self.beta2 < 1 or not 0 < self.eps <= 1:
            raise ValueError(f"beta2: must be in [0, 1) and eps in (0, 1], got {self.beta2}, {self.eps}")
        if self.nesterov is not None and (self.kind, self.nesterov) not in (("nesterov", True), ("sgd", False)):
            raise ValueError(f"nesterov: retired, sync.outer.kind says it: nesterov: true is kind: nesterov (the "
                             f"default), nesterov: false is kind: sgd; got nesterov: {self.nesterov} with kind: {self.kind}")
        if self.kind in OUTER_KINDS and (self.path is not None or self.options):
            raise ValueError(f"options: path and options are a plug-in kind's (python:module:Name), not {self.kind}'s")


OUTER_KINDS = ("nesterov", "sgd", "adam")
_PLUGIN_OUTER = re.compile(r"python:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)


@dataclass(frozen=True, kw_only=True)
class DeadlineSection:
    """``sync.deadline``: the start value, bounds and slack of the adaptive receive deadline."""

    initial_s: float = field(default=30.0, metadata=_doc("receive deadline before any arrival was measured"))
    min_s: float = field(default=1.0, metadata=_doc("smallest adaptive deadline"))
    max_s: float = field(default=120.0, metadata=_doc("largest adaptive deadline"))
    k: float = field(default=4.0, metadata=_doc("deadline = median + k * MAD of recent arrival times"))

    def __post_init__(self):
        if not 0 < self.min_s <= self.initial_s <= self.max_s <= 86400:
            raise ValueError("initial_s: need 0 < min_s <= initial_s <= max_s <= 86400")
        if self.k < 0:
            raise ValueError(f"k: must be >= 0, got {self.k}")


@dataclass(frozen=True, kw_only=True)
class GossipSection:
    """``sync.gossip``: CHOCO compression of the gossip and gradient tracking."""

    choco: bool = field(default=True, metadata=_doc("CHOCO-SGD: compress differences to public copies"))
    gamma: float = field(default=0.5, metadata=_doc("CHOCO consensus step size"))
    tracking: bool = field(default=False, metadata=_doc(
        "gradient tracking: gossip an estimate of the regions' average gradient with the parameters and "
        "correct every local step by it (for non-IID regions, e.g. gcn-planetoid; doubles the bytes)"))

    def __post_init__(self):
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma: must be in (0, 1], got {self.gamma}")


@dataclass(frozen=True, kw_only=True)
class SyncSection:
    """``sync``: the algorithm, topology, H/codec policy, the optimizers, overlap, deadlines and
    resyncs. Refuses CHOCO gossip over a time-varying topology.
    """

    algorithm: Literal["diloco", "allreduce", "gossip"] = field(
        default="diloco", metadata=_doc("diloco: H local steps then outer step on mixed pseudo-gradients; allreduce: per-step gradient averaging (baseline); gossip: decentralized model mixing"))
    topology: str = field(default="full", metadata=_doc("full, ring, exponential, one-peer-exponential, random-matching"))
    policy: Any = field(default_factory=FixedPolicyConfig, metadata=_doc("how H (and codecs) are chosen; kind: fixed, bandwidth, adacomm", choose=policy_config_class))
    inner: InnerOptimizer = field(default_factory=InnerOptimizer, metadata=_doc("local optimizer"))
    outer: OuterOptimizer = field(default_factory=OuterOptimizer, metadata=_doc("outer optimizer (diloco)"))
    overlap: bool | Literal["eager"] = field(default=False, metadata=_doc(
        "exchange round r while round r+1 computes. true (delayed): the outer update of round r is applied one round "
        "late; eager: the region applies its own pseudo-gradient at once and corrects with the global mean when it "
        "arrives (arXiv 2502.12996)"))
    fragments: int = field(default=1, metadata=_doc(
        "streaming DiLoCo (arXiv 2501.18512): split the model into this many fragments (contiguous layers, even "
        "in size) and exchange one per round, fragment round % N; the policy's H stays each parameter's sync "
        "period, so a round runs H/N steps and sends 1/N of the model (diloco over a static topology; "
        "docs/bench-wan.md)"))
    spread_sends: float = field(default=0.0, metadata=_doc(
        "with overlap: pace each push of an overlapped exchange over this share of the round's compute time "
        "(0: at line rate, one burst a round), so a link carries the round's bytes evenly instead of at its "
        "peak; in [0, 0.9], e.g. 0.9 (Streaming DiLoCo's lower peak bandwidth; docs/bench-wan.md)"))
    deadline: DeadlineSection = field(default_factory=DeadlineSection, metadata=_doc("receive deadlines"))
    resync_after_miss: bool = field(default=True, metadata=_doc(
        "diloco/allreduce over the full topology: a region that missed an in-neighbour's update (deadline, outage, "
        "a crashed peer) pulls the model from one that missed none (FetchState) after the round, so every region "
        "trains one model; false: it keeps its own drifted copy. With overlap a miss shows a round late: every "
        "region first applies its exchange in flight (that round's overlap is lost), then the region takes the "
        "donor's model and outer state with the same updates applied (docs/reliability.md)"))
    gossip: GossipSection = field(default_factory=GossipSection, metadata=_doc("gossip algorithm settings"))
    pacing: PacingSection = field(default_factory=PacingSection, metadata=_doc(
        "whether a round waits for its slowest region: barrier, time-budget or quorum (docs/heterogeneity.md)"))

    def __post_init__(self):
        from geofed.p2p.topology import topology_names  # p2p owns the names

        traits = algorithm_traits(self.algorithm)
        if self.pacing.mode != "barrier" and (not traits.outer_step or self.topology != "full"):
            raise ValueError(f"pacing.mode: {self.pacing.mode} paces full-topology diloco, not {self.algorithm} "
                             f"over {self.topology}")
        if self.pacing.mode == "quorum" and self.overlap:
            raise ValueError("pacing.mode: quorum rounds and sync.overlap do not combine (a late region's update "
                             "would be two rounds old before it is applied); use time-budget with overlap")

        if not 0.0 <= self.spread_sends <= 0.9:
            raise ValueError(f"spread_sends: must be in [0, 0.9] (a share of the round's compute), got {self.spread_sends}")
        if self.spread_sends > 0 and not self.overlap:
            raise ValueError("spread_sends: pacing pushes over the round needs sync.overlap (true or eager): without "
                             "it the round waits for its exchange, and spreading would only make it wait longer")
        if self.topology not in topology_names():
            raise ValueError(f"topology: unknown topology {self.topology!r} (known: {', '.join(topology_names())})")
        self._check_fragments()
        if traits.mixes_models and self.gossip.choco and not _static_topology(self.topology):
            # One public copy per region is consistent only if every neighbour gets every message.
            raise ValueError(f"topology: CHOCO gossip (sync.gossip.choco) needs a static topology "
                             f"(full, ring, exponential), got {self.topology!r}")

    def _check_fragments(self) -> None:
        """sync.fragments > 1: what streaming fragments do not combine with, said here, not mid-run."""
        if not 1 <= self.fragments <= 1024:
            raise ValueError(f"fragments: must be in [1, 1024], got {self.fragments}")
        if self.fragments == 1:
            return
        if not algorithm_traits(self.algorithm).outer_step:
            raise ValueError(f"fragments: {self.fragments} fragments need sync.algorithm diloco, not {self.algorithm}")
        if self.pacing.mode == "quorum":
            raise ValueError("fragments: quorum rounds (sync.pacing.mode) and sync.fragments do not combine "
                             "(a late region's update would belong to another fragment's round)")
        if not _static_topology(self.topology):
            # Fragment f meets the topology of rounds f, f+N, ... only: a time-varying one (one peer per
            # round) could pair a fragment with the same peer for ever.
            raise ValueError(f"fragments: sync.fragments needs a static topology (full, ring, exponential), "
                             f"got {self.topology!r}")


def _static_topology(name: str) -> bool:
    from geofed.p2p.topology import StaticTopology, make_topology

    return isinstance(make_topology(name, 4), StaticTopology)
