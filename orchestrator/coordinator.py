"""The coordinator: turns last round's measurements into this round's plan through the policy.

It sits on the control plane only (Ray calls); no update bytes pass through it.
"""

from __future__ import annotations

import math
from typing import Any

from geofed.regions.worker import RoundPlan

from .config import RunConfig
from .policies import LinkEstimate, Measurements, make_policy


class Coordinator:
    def __init__(self, cfg: RunConfig, *, model_numel: int, clock):
        self.cfg = cfg
        self.regions = list(cfg.regions.names)
        self.model_numel = model_numel
        self.clock = clock
        self.policy = make_policy(cfg.sync.policy, codec=cfg.compression.codec, ladder=cfg.compression.ladder)
        self.links: dict[str, LinkEstimate] = {}
        self.step_time_s: float | None = None
        self.loss: float | None = None
        self.last_sync_s: float | None = None
        self.last_reason = ""
        self.last_codecs: dict[str, Any] = {}

    def lr_scale(self, round_: int) -> float:
        if self.cfg.sync.inner.lr_decay == "cosine":
            return 0.5 * (1 + math.cos(math.pi * round_ / max(1, self.cfg.run.rounds)))
        return 1.0

    def plan(self, round_: int, *, alive: list[str], evaluate: bool) -> dict[str, RoundPlan]:
        """One RoundPlan per alive region (codecs differ per region: they are per out-link)."""
        links = self._round_links(round_, alive)
        if self.cfg.sync.algorithm == "allreduce":
            H, codecs, reason = 1, {}, "allreduce: every step"
            self.last_record = {"H": 1, "codecs": {}, "reason": reason, "policy": {}}
        else:
            decision = self.policy.decide(self._measurements(round_, links))
            H, reason = decision.H, decision.reason
            codecs = {link: decision.codec_for(link) for link in links} if decision.codecs or decision.default_codec else {}
            self.last_record = decision.to_record()
        self.last_reason, self.last_codecs, self.last_H = reason, codecs, H
        scale = self.lr_scale(round_)
        plans = {}
        for region in alive:
            mine = {link.split("->", 1)[1]: spec for link, spec in codecs.items() if link.startswith(region + "->")}
            plans[region] = RoundPlan(round=round_, H=H, codecs=mine, lr_scale=scale, evaluate=evaluate,
                                      alive=tuple(alive))
        return plans

    def _round_links(self, round_: int, alive: list[str]) -> list[str]:
        """The directed links that carry traffic this round (topology, alive regions only)."""
        from geofed.p2p.topology import make_topology

        if not hasattr(self, "_topology"):
            self._topology = make_topology(self.cfg.sync.topology, len(self.regions), seed=self.cfg.run.seed)
        up = set(alive)
        out = []
        for i, src in enumerate(self.regions):
            if src in up:
                out.extend(f"{src}->{self.regions[j]}" for j in self._topology.out_neighbours(i, round_)
                           if self.regions[j] in up)
        return out

    def _measurements(self, round_: int, links: list[str]) -> Measurements:
        lr0 = self.cfg.sync.inner.lr
        return Measurements(now_s=self.clock.now(), round=round_, step_time_s=self.step_time_s, loss=self.loss,
                            lr=lr0 * self.lr_scale(round_), lr0=lr0, model_numel=self.model_numel,
                            links={k: self.links.get(k, LinkEstimate()) for k in links},
                            overlap=self.cfg.sync.overlap, last_sync_s=self.last_sync_s)

    def observe(self, results: dict[str, dict[str, Any]]) -> None:
        """Fold one round of region metrics into the measurements the policy sees next."""
        if not results:
            return
        self.step_time_s = max(m["step_time_s"] for m in results.values())
        losses = [m["train_loss"] for m in results.values() if m.get("train_loss") is not None]
        self.loss = sum(losses) / len(losses) if losses else self.loss
        self.last_sync_s = max(m.get("sync_s", 0.0) for m in results.values())
        for m in results.values():
            for link, est in m.get("links", {}).items():
                bw, rtt = est.get("bandwidth_mbps"), est.get("rtt_ms")
                self.links[link] = LinkEstimate(bandwidth_bps=bw * 1e6 if bw else None,
                                                rtt_s=rtt / 1e3 if rtt is not None else None)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "step_time_s": self.step_time_s, "loss": self.loss,
                "last_sync_s": self.last_sync_s,
                "links": {k: [v.bandwidth_bps, v.rtt_s] for k, v in self.links.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.policy.load_state_dict(d["policy"])
        self.step_time_s, self.loss, self.last_sync_s = d["step_time_s"], d["loss"], d["last_sync_s"]
        self.links = {k: LinkEstimate(bandwidth_bps=v[0], rtt_s=v[1]) for k, v in d["links"].items()}
