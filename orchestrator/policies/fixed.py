"""The fixed policy: the configured H every round, ``compression.codec`` on every link."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from geofed.compression import CodecSpec

from .config import FixedPolicyConfig
from .explain import describe_link
from .registry import PolicyContext, register_policy
from .types import Decision, Measurements


class FixedPolicy:
    """``sync.policy.H`` local steps every round, ``compression.codec`` on every link."""

    kind = "fixed"

    def __init__(self, cfg: FixedPolicyConfig, *, codec: CodecSpec):
        self.cfg = cfg
        self.codec = codec

    def decide(self, m: Measurements) -> Decision:
        """Always the configured H and compression.codec; the details still describe the links."""
        details = {"kind": self.kind, "event": "steady", "mode": "overlap" if m.overlap else "serial",
                   "H": self.cfg.H, "H_prev": self.cfg.H, "H_wanted": self.cfg.H,
                   "links": {n: describe_link(e) for n, e in m.links.items()}}
        return Decision(H=self.cfg.H, codecs={n: self.codec for n in m.links}, default_codec=self.codec,
                        reason=f"fixed H={self.cfg.H}", details=details)

    def state_dict(self) -> dict[str, Any]:
        """Stateless: only its kind, so a checkpoint of another policy is refused on load."""
        return {"kind": self.kind}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Check the state is a fixed policy's (ValueError otherwise); there is nothing else to restore."""
        if d.get("kind") != self.kind:
            raise ValueError(f"policy state is for {d.get('kind')!r}, not {self.kind!r}")


def _make(cfg: FixedPolicyConfig, ctx: PolicyContext) -> FixedPolicy:
    # A ladder is ignored on purpose: the fixed arms of `geofed bench wan` are the static
    # baselines the adaptive policies are measured against, one codec everywhere.
    return FixedPolicy(cfg, codec=ctx.codec)


register_policy("fixed", config=FixedPolicyConfig, factory=_make)
