"""gossip: decentralized model mixing, no server in the data path (D-PSGD with H local steps).

With `sync.gossip.choco`, CHOCO-SGD (Koloskova et al. 2019, arXiv 1902.00340) through
geofed.p2p.gossip.ChocoGossip: each region keeps public copies x_hat of itself and its
in-neighbours, sends Q(x - x_hat_self) and moves x += gamma * sum_j w_ij (x_hat_j - x_hat_self).

With `sync.gossip.tracking`, gradient tracking (regions/graph/tracking.py explains why
label-skewed regions need it): every inner step's gradient is corrected by the tracker, and the
tracker vector y travels in the same message as the parameters (one list: params + y), so one
exchange and one set of public copies serve both.

A missed message must not corrupt a public copy: the sender's x_hat_self moved, the receiver's
copy of it did not. The receiver marks that peer stale (ChocoGossip leaves it out of the mixing,
its weight folding into the receiver's own); in its next round, after its own sends, it pulls
the peer's public copy as it stood at the end of the peer's previous round (every region
publishes one per round, served by FetchState), resyncs, and applies the peer's message of that
round. A region that rejoins with a donor's state resets its own public copy and sends nothing
for one round, so that every neighbour sees it missing and resyncs in turn. Resyncs are rare (a
lost message, a crash) and cost one FetchState each (the peer's model and gossip state).
"""

from __future__ import annotations

import io
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from geofed.p2p.gossip import ChocoGossip
from geofed.p2p.transport import TransportError

from ..algorithm_traits import algorithm_traits
from ..exchange import ExchangeResult
from ..graph.tracking import GradientTracker
from .common import exchange_metrics
from .protocol import Shapes, SyncContext

if TYPE_CHECKING:
    from ..messages import RoundPlan

log = logging.getLogger(__name__)
KEEP_PUBLISHED = 2  # own public copies kept for resyncing peers: this round's and the last


class _PublicCopies(ChocoGossip):
    """ChocoGossip whose compressor is the round's exchange, with its state in and out.

    ``outgoing(x)`` would call a compressor with Q's input; here the round does it in two halves
    around its exchange: ``diff(x)`` is Q's input (the payload), and ``sent(q)`` moves our public
    copy by the q every receiver decodes (bit for bit what the payload decodes to).
    """

    def __init__(self, *, gamma: float, shapes: Sequence[tuple[int, ...]]):
        super().__init__(gamma=gamma, compressor=_exchange_is_the_compressor)
        self._self_hat = [torch.zeros(s) for s in shapes]  # every copy starts at zero everywhere

    def diff(self, x: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Q's input: x less our public copy."""
        return [t.detach().to(h.dtype) - h for t, h in zip(x, self._self_hat)]

    def sent(self, q: Sequence[torch.Tensor]) -> None:
        """Our public copy moves by q, as every receiver's copy of it does."""
        for h, qt in zip(self._self_hat, q):
            h.add_(qt.to(h.dtype))

    def state(self) -> dict[str, Any]:
        return {"self": list(self._self_hat), "peers": dict(self._hats), "stale": sorted(self.stale)}

    def load(self, d: Mapping[str, Any]) -> None:
        self._self_hat = [t.clone() for t in d["self"]]
        self._hats = {p: [t.clone() for t in v] for p, v in d["peers"].items()}
        self.stale = set(d["stale"])
        self._fresh = set()

    def reset(self, own: Sequence[torch.Tensor], peers: Sequence[str]) -> None:
        """Start over: own copy `own`, every neighbour's copy unknown until resynced."""
        self._self_hat = [t.detach().to(torch.float32).clone() for t in own]
        self._hats = {}
        self.stale = set(peers)
        self._fresh = set()


class GossipSync:
    """Decentralized gossip on the parameters (and the gradient tracker) after H local steps."""

    traits = algorithm_traits("gossip")
    announces_outer_step = False  # its state may change at any point of a round: rollback copies it at the start
    restores_live = False

    evaluates_in_exchange = False

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        g = ctx.settings.gossip
        self.choco_on, self.gamma = g.choco, g.gamma
        self.tracker = GradientTracker() if g.tracking else None
        self.message_shapes = self.wire_shapes(ctx.settings, ctx.shapes)
        self.choco = _PublicCopies(gamma=self.gamma, shapes=self.message_shapes) if self.choco_on else None
        self.published: dict[int, list[torch.Tensor]] = {}
        self.region = ctx.region
        self.round = -1
        self.rejoined = False
        self._x: list[torch.Tensor] = []  # this round's parameters (and tracker): CHOCO's step mixes them
        self._lock = threading.Lock()  # against FetchState threads reading our state mid-round
        # Dropout draws from torch's global generator: seed it per region so that a run repeats.
        torch.manual_seed(ctx.seed * 1000 + ctx.index)
        if self.choco is not None:
            self._publish(-1)

    @classmethod
    def wire_shapes(cls, settings: Any, shapes: Shapes) -> Shapes:
        """Params, then (gradient tracking) the tracker y in the params' shapes."""
        return list(shapes) * (2 if settings.gossip.tracking else 1)

    # -- one round ---------------------------------------------------------------------------
    def run_round(self, plan: RoundPlan) -> dict[str, Any]:
        """H inner steps (corrected by the gradient tracker, if on), then one gossip exchange and mix of the parameters
        (and tracker); with CHOCO, stale peers are resynced and this round's public copy is published.
        """
        hook = self._track if self.tracker is not None else None
        metrics = self.ctx.stepper.inner_steps(plan.H, plan.lr_scale, before_step=hook)
        t0 = time.monotonic()
        sent = self.payload(plan, self.ctx.params)
        # CHOCO: one codec for every out-link, as all neighbours must apply the same q to our public
        # copy; a region back from a rejoin only listens this round (no lock: peers may fetch meanwhile).
        res = self.ctx.exchange(plan, sent, single_codec=self.choco is not None, send=not self.rejoined)
        metrics.update(exchange_metrics(res), **self.apply(plan, sent, res))
        if self.choco is not None:
            metrics["bytes_received"] += metrics["resync_bytes"]
            self._publish(plan.round)
        metrics["sync_s"] = time.monotonic() - t0
        self.round = plan.round
        return metrics

    def payload(self, plan: RoundPlan, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters (and the tracker y); CHOCO: their difference to our public copy."""
        x = [p.detach() for p in params]
        if self.tracker is not None:
            x += _split(self.tracker.y, self.ctx.shapes)
        self._x = x
        return x if self.choco is None else self.choco.diff(x)

    def apply(self, plan: RoundPlan, own: Sequence[torch.Tensor], received: ExchangeResult) -> dict[str, Any]:
        """The mix into the parameters (and tracker). CHOCO: our public copy moves by what was sent,
        stale in-neighbours are resynced (after our own sends, so that fetching never delays our
        message to anyone; the copy fetched predates the peer's message of this round, applied next),
        and the gossip step mixes the public copies."""
        if self.choco is None:
            self._store(self.ctx.mix(plan, own, received))
            return {}
        q = next(iter(received.own_decoded.values()), None)
        self.choco.sent(q if q is not None else own)  # sent to nobody: no copy of ours moved anywhere
        resync = self._resync(plan)
        with self._lock:
            for peer, qp in received.received.items():
                self.choco.incoming(peer, qp)
            # All in-neighbours of the topology, up or not: one without a message becomes stale.
            mixed = self.choco.step(self._x, self.ctx.in_weights(plan.round))
        self._store(mixed)
        self.rejoined = False
        return {**resync, "stale_peers": sorted(self.choco.stale)}

    def _track(self, k: int) -> None:
        self.tracker.correct(self.ctx.params, first_step_of_round=(k == 0))

    def _store(self, mixed: Sequence[torch.Tensor]) -> None:
        n = len(self.ctx.params)
        with torch.no_grad():
            for p, m in zip(self.ctx.params, mixed[:n]):
                p.copy_(m)
        if self.tracker is not None:
            self.tracker.y = torch.cat([t.reshape(-1) for t in mixed[n:]]).to(self.tracker.y.dtype)

    # -- public copies: publish, resync ------------------------------------------------------
    def _publish(self, round_: int) -> None:
        """Own public copy at the end of `round_`, for peers that resync (never mutated later)."""
        snap = self.choco.public_copy()
        kept = {r: v for r, v in self.published.items() if r > round_ - KEEP_PUBLISHED}
        kept[round_] = snap
        self.published = kept  # rebinding, so a FetchState thread sees the old or the new dict

    def _resync(self, plan: RoundPlan) -> dict[str, Any]:
        """Pull the public copy of every stale in-neighbour that is up; failures stay stale."""
        alive = set(plan.alive) if plan.alive is not None else None
        todo = sorted(p for p in self.choco.stale if alive is None or p in alive)
        done, nbytes = [], 0
        for peer in todo:
            try:
                data = self.ctx.fetch_state(peer, timeout_s=self.ctx.settings.deadline.max_s)
                nbytes += len(data)
                snap = self._copy_from_state(peer, data, plan.round)
            except (TransportError, ValueError) as exc:
                log.warning("%s: resync with %s failed (%s); it stays out of the mixing", self.region, peer, exc)
                continue
            with self._lock:
                self.choco.resync(peer, snap)
            done.append(peer)
        return {"resynced": done, "resync_bytes": nbytes}

    def _copy_from_state(self, peer: str, data: bytes, round_: int) -> list[torch.Tensor]:
        """`peer`'s public copy as of the end of its last round before `round_`, checked."""
        try:
            state = torch.load(io.BytesIO(data), weights_only=True)
            published = state["algorithm"]["published"]
        except Exception as exc:  # noqa: BLE001 - a peer's bytes: any failure means unusable
            raise ValueError(f"state of {peer} is unreadable: {type(exc).__name__}: {exc}") from None
        before = [r for r in published if isinstance(r, int) and r < round_]
        if not before:
            raise ValueError(f"{peer} published no public copy before round {round_}")
        snap = published[max(before)]
        shapes = [tuple(t.shape) for t in snap] if isinstance(snap, list) else None
        if shapes != [tuple(s) for s in self.message_shapes]:
            raise ValueError(f"public copy of {peer} has shapes {shapes}, expected {self.message_shapes}")
        if not all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in snap):
            raise ValueError(f"public copy of {peer} is not finite float32")
        return snap

    # -- state -------------------------------------------------------------------------------
    def finish(self) -> dict:
        """Nothing is in flight between rounds."""
        return {}

    def eval_params(self) -> list[torch.Tensor]:
        """This region's own model: gossip's models differ until consensus."""
        return self.ctx.params

    def state_dict(self) -> dict:
        """Round, published public copies (what FetchState serves to resyncing peers), CHOCO copies and
        tracker. Taken under the lock: FetchState threads call it while a round runs.
        """
        with self._lock:
            d: dict[str, Any] = {"region": self.region, "round": self.round, "published": dict(self.published)}
            if self.choco is not None:
                d["choco"] = self.choco.state()
        if self.tracker is not None:
            d["tracker"] = self.tracker.state_dict()
        return d

    def load_state_dict(self, d: dict) -> None:
        """The region's own state: restore it. Another region's (a donor's, with the model the worker
        just loaded): start the public copies over as a rejoin and stay silent for one round.
        """
        if d.get("region") != self.region:
            self._rejoin_from(d)
            return
        self.round = int(d["round"])
        self.published = {int(r): [t.clone() for t in v] for r, v in d["published"].items()}
        if self.choco is not None:
            self.choco.load(d["choco"])
        if self.tracker is not None:
            self.tracker.load_state_dict(d["tracker"])

    def _rejoin_from(self, donor: dict) -> None:
        """The worker loaded a donor's model (catch_up): our public copies no longer match
        anyone's. The tracker stays ours (restored from our checkpoint, or fresh)."""
        self.round = int(donor["round"])
        if self.choco is None:
            return
        y = self.tracker.y if self.tracker is not None else None
        own = [p.detach() for p in self.ctx.params]
        if self.tracker is not None:
            own += _split(y, self.ctx.shapes) if y is not None else [torch.zeros(s) for s in self.ctx.shapes]
        with self._lock:
            self.choco.reset(own, list(self.ctx.in_weights(self.round + 1)))
        self.published = {}
        self._publish(self.round)
        self.rejoined = True

    def rolled_back(self) -> None:
        """The worker restored the start of a round (regions/rollback.py): our public copy had
        moved with the round's message, which the neighbours applied; start over as a rejoin does."""
        if self.choco is not None:
            self._rejoin_from({"round": self.round})

    def close(self) -> None:
        """No background work (FetchState runs on the transport's threads)."""
        pass


def _exchange_is_the_compressor(diff: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    raise AssertionError("GossipSync exchanges CHOCO's payload itself (diff, then sent), never through outgoing()")


def _split(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [t.view(s) for t, s in zip(flat.split(sizes), shapes)]
