"""The parts of ``sync`` with no rules across sections: the inner and outer optimizers, the
receive deadline and gossip's settings (SyncSection itself is in __init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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

    def __post_init__(self):
        if not 0 < self.lr <= 10:
            raise ValueError(f"lr: must be in (0, 10], got {self.lr}")
        if not 1 <= self.batch_size <= 1_000_000:
            raise ValueError(f"batch_size: must be in [1, 1000000], got {self.batch_size}")
        if self.weight_decay < 0 or not 0 <= self.momentum < 1:
            raise ValueError("weight_decay: must be >= 0 (and momentum in [0, 1))")


@dataclass(frozen=True, kw_only=True)
class OuterOptimizer:
    """``sync.outer``: DiLoCo's outer SGD (with Nesterov momentum) on the mixed pseudo-gradients."""

    lr: float = field(default=0.7, metadata=_doc("outer SGD learning rate (DiLoCo: 0.7)"))
    momentum: float = field(default=0.9, metadata=_doc("outer momentum (DiLoCo: 0.9)"))
    nesterov: bool = field(default=True, metadata=_doc("Nesterov momentum"))

    def __post_init__(self):
        if not 0 < self.lr <= 10 or not 0 <= self.momentum < 1:
            raise ValueError(f"lr: outer lr must be in (0, 10] and momentum in [0, 1), got {self.lr}, {self.momentum}")


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
