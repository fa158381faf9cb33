"""Config of the sync policy (``sync.policy``), one dataclass per kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class FixedPolicyConfig:
    kind: Literal["fixed"] = "fixed"
    H: int = field(default=20, metadata={"doc": "local steps between syncs"})

    def __post_init__(self):
        if not 1 <= self.H <= 1_000_000:
            raise ValueError(f"H: must be in [1, 1000000], got {self.H}")


_KINDS: dict[str, type] = {"fixed": FixedPolicyConfig}


def register_policy_config(kind: str, cls: type) -> None:
    _KINDS[kind] = cls


def policy_config_class(kind: str) -> type:
    if kind not in _KINDS:
        raise KeyError(f"unknown policy {kind!r} (known: {', '.join(sorted(_KINDS))})")
    return _KINDS[kind]
