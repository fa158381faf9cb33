"""The registry of sync policies: a kind names its config class and its factory.

    register_policy("mine", config=MinePolicyConfig, factory=make_mine)

``config`` is a frozen keyword-only dataclass whose ``kind`` field defaults to the kind
(``kind: Literal["mine"] = "mine"``); the strict loader builds it from ``sync.policy`` when
``sync.policy.kind`` names it, checking its fields like any section's. ``factory(cfg, ctx)``
returns the Policy; ``ctx`` (PolicyContext) holds compression.codec, compression.ladder and the
codec-ratio estimate, and ``ctx.make(other_cfg)`` builds a nested policy (AdaComm's base).
The built-in kinds register themselves in fixed.py, bandwidth.py and adacomm.py. A plug-in
registers before the config is loaded. Only the driver builds the policy, but the run config
(its policy section too) travels to every region actor: the config class must be importable
on every node, like a ``python:module:function`` task's module.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from geofed.compression import CodecSpec

from .cost import RatioFn, compression_ratio
from .types import Policy

_KIND_RE = re.compile(r"[a-z][a-z0-9_-]{0,39}")


@dataclass(frozen=True, kw_only=True)
class PolicyContext:
    """What a policy factory gets besides its own config."""

    codec: CodecSpec                      # compression.codec
    ladder: tuple[CodecSpec, ...] = ()    # compression.ladder
    ratio: RatioFn = compression_ratio    # ratio(spec, numel): fp32 bytes / wire bytes

    def make(self, cfg: Any) -> Policy:
        """The policy for another policy config, in this context (a policy built on another)."""
        return _build(cfg, self)


PolicyFactory = Callable[[Any, PolicyContext], Policy]


@dataclass(frozen=True)
class PolicyKind:
    """A registered policy kind: its config class and its factory."""

    config: type
    factory: PolicyFactory


_POLICIES: dict[str, PolicyKind] = {}


def register_policy(kind: str, *, config: type, factory: PolicyFactory) -> None:
    """Make ``sync.policy.kind: <kind>`` load ``config`` and build its policy with ``factory``.

    Registering the same kind again with the same config and factory does nothing; with others
    it is a ValueError (two plug-ins must not silently replace each other).
    """
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise ValueError(f"kind: a policy kind is lowercase letters, digits, - and _ (<= 40), got {kind!r}")
    if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
        raise ValueError(f"config: expected a dataclass, got {config!r}")
    kind_field = next((f for f in dataclasses.fields(config) if f.name == "kind"), None)
    if kind_field is None or kind_field.default != kind:
        raise ValueError(f"config: {config.__name__} needs a field `kind` that defaults to {kind!r} "
                         f"(kind: Literal[{kind!r}] = {kind!r})")
    if not callable(factory):
        raise ValueError(f"factory: expected a callable (cfg, ctx) -> Policy, got {factory!r}")
    entry = PolicyKind(config, factory)
    if _POLICIES.get(kind, entry) != entry:
        raise ValueError(f"kind: policy {kind!r} is already registered (by {_POLICIES[kind].config.__name__})")
    _POLICIES[kind] = entry


def policy_kinds() -> list[str]:
    """The registered policy kinds, sorted."""
    return sorted(_POLICIES)


def policy_config_class(kind: str) -> type:
    """The config class of ``kind``; KeyError listing the known kinds (the strict loader's ``choose``)."""
    if kind not in _POLICIES:
        raise KeyError(f"unknown policy {kind!r} (known: {', '.join(policy_kinds())})")
    return _POLICIES[kind].config


SpecLike = CodecSpec | str | Mapping[str, Any]  # a CodecSpec, or a spelling CodecSpec.parse takes


def make_policy(cfg: Any, *, codec: SpecLike, ladder: Sequence[SpecLike] = (), ratio: RatioFn | None = None) -> Policy:
    """The policy for config ``cfg``; ``codec`` is compression.codec, ``ladder`` compression.ladder
    (CodecSpecs, or any spelling ``CodecSpec.parse`` takes).

    ``ratio(spec, numel) -> float`` estimates a codec's compression; by default it asks
    ``make_codec(spec).estimate_ratio(numel)`` (tests inject their own).
    """
    ctx = PolicyContext(codec=CodecSpec.parse(codec), ladder=tuple(CodecSpec.parse(s) for s in ladder),
                        ratio=ratio or compression_ratio)
    return _build(cfg, ctx)


def _build(cfg: Any, ctx: PolicyContext) -> Policy:
    kind = getattr(cfg, "kind", None)
    entry = _POLICIES.get(kind) if isinstance(kind, str) else None
    if entry is None or not isinstance(cfg, entry.config):
        raise TypeError(f"no policy for config {type(cfg).__name__} (known kinds: {', '.join(policy_kinds())})")
    policy = entry.factory(cfg, ctx)
    if not isinstance(policy, Policy):
        raise TypeError(f"the {cfg.kind!r} policy factory returned {type(policy).__name__}, not a Policy "
                        "(decide, state_dict, load_state_dict)")
    return policy
