"""Gossip algorithms on lists of tensors: mixing with missing peers, D-PSGD, CHOCO-SGD.

Algorithms never touch the transport: they produce tensors (or encoded bytes) to send and
consume what arrived. Keys of the weight maps are whatever names the caller uses for peers
(region names or indices).

- ``mix``: ``x_i <- w_ii x_i + sum_j w_ij x_j`` over the peers that arrived; the weight of a peer
  that missed the deadline is folded back into the receiver's own weight (so the weights still
  sum to one and a silent peer never blocks or skews the round).
- ``LocalUpdateGossip``: D-PSGD with local updates (Lian et al. 2017): H local steps, then mix
  models (or pseudo-gradients) with the round's neighbours.
- ``ChocoGossip``: CHOCO-SGD (Koloskova et al. 2019, arXiv 1902.00340): each node keeps public
  copies ``x_hat`` of itself and its neighbours, sends ``Q(x - x_hat_self)`` and steps
  ``x += gamma * sum_j w_ij (x_hat_j - x_hat_self)``. It converges with compressors where naive
  compressed gossip stalls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["fold_missing", "mix", "LocalUpdateGossip", "ChocoGossip", "codec_compressor", "Compressor"]

# (tensors) -> (payload bytes, the tensors a receiver will decode from those bytes)
Compressor = Callable[[list[torch.Tensor]], tuple[bytes, list[torch.Tensor]]]


def fold_missing(in_weights: Mapping[Hashable, float], self_weight: float,
                 present: Collection[Hashable]) -> tuple[dict[Hashable, float], float]:
    """Drop the weights of absent peers and add them to the self weight."""
    kept = {j: w for j, w in in_weights.items() if j in present}
    folded = math.fsum(w for j, w in in_weights.items() if j not in present)
    return kept, self_weight + folded


def mix(own: Sequence[torch.Tensor], received: Mapping[Hashable, Sequence[torch.Tensor]],
        in_weights: Mapping[Hashable, float], self_weight: float, *, consume_own: bool = False,
        into_received: bool = False, own_scale: float | None = None) -> list[torch.Tensor]:
    """Weighted average of `own` and the received tensor lists; missing peers fold into self.

    Received entries for peers without a weight are an error (they should have been refused
    by the transport's sender check), as are shape mismatches. `consume_own`: the caller gives
    `own` up, and the average is summed into it (the same operations in the same order, without a
    model-sized output beside it: DiLoCo's pseudo-gradient, issue 39). `into_received`: the caller
    keeps `own` untouched and gives the received lists up: the average is written into the first
    weighted peer's tensors, one tensor at a time through a temporary of that tensor's size (delayed
    overlap's DiLoCo, whose pseudo-gradient is where its next one starts; a new output where no peer
    arrived). `own_scale`: `own` is multiplied by it first (the clip of a caller that keeps `own`:
    robust.fair_share_clip_received), as fair_share_clip would have scaled it, for the same values.
    """
    extra = set(received) - set(in_weights)
    if extra:
        raise ValueError(f"received: values from peers without a weight this round: {sorted(map(str, extra))}")
    weights, w_self = fold_missing(in_weights, self_weight, received)
    if into_received and weights:
        return _mix_into_first(own, received, weights, w_self, own_scale)
    if own_scale is not None:
        own, consume_own = [t.detach() * own_scale for t in own], True
    out = [(t.detach() if consume_own else t.detach().clone()).mul_(w_self) for t in own]
    for j, w in weights.items():
        tensors = received[j]
        if len(tensors) != len(out):
            raise ValueError(f"received: peer {j!r} sent {len(tensors)} tensors, expected {len(out)}")
        for acc, t in zip(out, tensors):
            if t.shape != acc.shape:
                raise ValueError(f"received: peer {j!r} sent shape {tuple(t.shape)}, expected {tuple(acc.shape)}")
            acc.add_(t.to(acc.dtype), alpha=w)
    return out


def _mix_into_first(own: Sequence[torch.Tensor], received: Mapping[Hashable, Sequence[torch.Tensor]],
                    weights: Mapping[Hashable, float], w_self: float, own_scale: float | None) -> list[torch.Tensor]:
    """mix's `into_received`: per tensor, each element takes the operations of mix's own loop in the
    same order (own x w_self, then + w x each peer's, peers in `weights` order), in a temporary of the
    tensor's size that is then copied into the first peer's tensor (read before it is written)."""
    for j in weights:
        if len(received[j]) != len(own):
            raise ValueError(f"received: peer {j!r} sent {len(received[j])} tensors, expected {len(own)}")
        for o, t in zip(own, received[j]):
            if t.shape != o.shape:
                raise ValueError(f"received: peer {j!r} sent shape {tuple(t.shape)}, expected {tuple(o.shape)}")
    first = received[next(iter(weights))]
    if any((t.dtype, t.device) != (o.dtype, o.device) for o, t in zip(own, first)):
        # The mean is made in own's dtype: a peer's tensors of another dtype cannot hold it.
        own = own if own_scale is None else [t.detach() * own_scale for t in own]
        return mix(own, received, weights, w_self, consume_own=own_scale is not None)
    out = []
    for i, (o, dst) in enumerate(zip(own, first)):
        acc = o.detach().mul(w_self) if own_scale is None else (o.detach() * own_scale).mul_(w_self)
        for j, w in weights.items():
            acc.add_(received[j][i].to(acc.dtype), alpha=w)
        out.append(dst.detach().copy_(acc))
        del acc
    return out


class LocalUpdateGossip:
    """D-PSGD with H local steps between gossip rounds.

    The caller trains H steps, sends ``outgoing(params)`` to the round's out-neighbours and then
    calls ``mix_into(params, received, in_weights, self_weight)``, which overwrites the parameters
    in place with the mixed values.
    """

    def __init__(self, compressor: Compressor | None = None):
        self.compressor = compressor

    def outgoing(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor] | bytes:
        # A copy: the caller mixes into params in place while the message may still be queued.
        tensors = [p.detach().clone() for p in params]
        return tensors if self.compressor is None else self.compressor(tensors)[0]

    @staticmethod
    def mix_into(params: Sequence[torch.Tensor], received: Mapping[Hashable, Sequence[torch.Tensor]],
                 in_weights: Mapping[Hashable, float], self_weight: float) -> None:
        mixed = mix(params, received, in_weights, self_weight)
        with torch.no_grad():
            for p, m in zip(params, mixed):
                p.copy_(m)


class ChocoGossip:
    """CHOCO-SGD compressed gossip for one node.

    Each round: ``payload = outgoing(x)`` (sent to every neighbour; updates our own public copy),
    ``incoming(j, q_j)`` for every neighbour's decoded message, then ``x = step(x, in_weights)``.

    Public copies stay consistent only if every neighbour applies every message. A neighbour
    whose message is missing for a round has a stale copy here: it is marked stale and left out
    of the gossip step (its weight folds into ours) until ``resync(j, x_hat_j)`` is called with
    its public copy (``public_copy()`` on that node).
    """

    def __init__(self, *, gamma: float, compressor: Compressor):
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma: must be in (0, 1], got {gamma}")
        self.gamma = gamma
        self.compressor = compressor
        self._self_hat: list[torch.Tensor] | None = None
        self._hats: dict[Hashable, list[torch.Tensor]] = {}
        self._fresh: set[Hashable] = set()
        self.stale: set[Hashable] = set()

    @staticmethod
    def _zeros_like(x: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.zeros_like(t, dtype=_acc_dtype(t)) for t in x]

    def outgoing(self, x: Sequence[torch.Tensor]) -> bytes:
        if self._self_hat is None:
            self._self_hat = self._zeros_like(x)
        diff = [t.detach().to(h.dtype) - h for t, h in zip(x, self._self_hat)]
        payload, q = self.compressor(diff)
        for h, qt in zip(self._self_hat, q):
            h.add_(qt.to(h.dtype))
        return payload

    def incoming(self, peer: Hashable, q: Sequence[torch.Tensor]) -> None:
        if peer in self.stale:
            return
        hat = self._hats.get(peer)
        if hat is None:
            hat = self._hats[peer] = self._zeros_like(q)
        if len(q) != len(hat):
            raise ValueError(f"q: peer {peer!r} sent {len(q)} tensors, expected {len(hat)}")
        for h, qt in zip(hat, q):
            h.add_(qt.to(h.dtype))
        self._fresh.add(peer)

    def step(self, x: Sequence[torch.Tensor], in_weights: Mapping[Hashable, float]) -> list[torch.Tensor]:
        """Gossip step with this round's weights; neighbours without a message become stale."""
        if self._self_hat is None:
            raise RuntimeError("step() before outgoing(): the own public copy does not exist yet")
        for j in in_weights:
            if j not in self._fresh:
                self.stale.add(j)
        out = [t.detach().to(_acc_dtype(t)).clone() for t in x]
        for j, w in in_weights.items():
            if j in self.stale:
                continue
            for o, hj, hi in zip(out, self._hats[j], self._self_hat):
                o.add_(hj - hi, alpha=self.gamma * w)
        self._fresh.clear()
        return [o.to(t.dtype) for o, t in zip(out, x)]

    def public_copy(self) -> list[torch.Tensor]:
        if self._self_hat is None:
            raise RuntimeError("public_copy() before outgoing()")
        return [h.clone() for h in self._self_hat]

    def resync(self, peer: Hashable, x_hat: Sequence[torch.Tensor]) -> None:
        self._hats[peer] = [t.detach().to(_acc_dtype(t)).clone() for t in x_hat]
        self.stale.discard(peer)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    # Public copies accumulate many small corrections: never in half precision.
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def codec_compressor(codec: Any, state: Any = None) -> Compressor:
    """A Compressor from a geofed.compression codec (CHOCO needs a contractive one, no EF)."""
    from geofed.compression import encode_and_decode

    return lambda tensors: encode_and_decode(codec, tensors, state)
