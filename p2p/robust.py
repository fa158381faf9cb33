"""Robust aggregation and update admission: what one hostile member's update can do to a region.

Pure functions on lists of tensors (no transport), plus ``UpdateAdmission``, which a region's
validator calls for every decoded update on the receiving server thread, before the push is
acknowledged, so a refused update is refused to its sender with a counted reason.

What holds, each by a test (tests/security/test_robust_aggregation.py unless named):

- Every mode refuses an update holding a value above ``security.max_update_value``
  (``out_of_bounds``): a finite 3e38 passes a NaN/Inf check and overflows the first forward pass.
- ``clip`` (the default) with ``security.clip_multiple`` c (default 1; DiLoCo, all-reduce,
  fragments): ``fair_share_clip`` scales every update of a round's mix, the region's own too,
  down to c x the median L2 norm of that round's updates. With the mix's weights 1/n, one
  member's pull on the mean step is then at most c x that median / n, whatever it sent: x-1000,
  x+9, x-9 and a flip at the old 10x bound, 4 regions, pull <= 0.25 of the median and cosine with
  the honest mean > 0 (test_under_the_default_one_member_keeps_the_mean_step_forward_and_its_share).
  Every region holding the same updates computes the same clipped mean, so full-topology DiLoCo
  keeps one model. Counted as ``clipped`` by sender (metrics, summary.json, the report); honest
  updates above a round's median are scaled and counted too.
- ``trimmed-mean`` and ``median`` (full-topology DiLoCo/all-reduce only) refuse an update whose
  norm passes ``security.norm_multiple`` x the recent median norm (``outlier``) and aggregate
  coordinate-wise: with f hostile values among n, the coordinate-wise median (f < n / 2) and the
  trimmed mean that drops k >= f values at each end (k = ``trim_count``) keep every coordinate
  within the honest values' range of that coordinate
  (test_median_and_trimmed_mean_ignore_one_hostile_value_in_three: n = 3, f = 1).
- ``none``: the value bound only.

What does not hold: a member inside the bounds still moves the mean. Under ``clip`` a flip at the
median norm subtracts up to 1/n of it from every round's step (measured on digits, 4 regions: 2-3
points of final accuracy, benchmarks/robust_defaults.py, docs/reliability.md); under trimmed-mean
or median it can pull every coordinate to an end of the honest range. With half the members
hostile or more, the median norm and the median value are theirs: nothing is bounded. Gossip mixes
models, not updates, so it keeps only the arrival bound below.

The arrival bound (gossip, ``clip_multiple`` 0, and the reference of the ``outlier`` refusal, of
secure aggregation's mean and of a resync donor's distance): the median of the last ``window``
norms over all senders and the region's own updates (``observe_own``), not per sender: a
per-sender median lets a hostile peer raise its own reference step by step (each update 10x its
last accepted one: test_one_sender_cannot_raise_the_reference_norm_by_escalating), while one
peer among the others and the region itself moves a shared median by at most one position (an
update over the bound is not counted in it). No norm is judged before ``min_samples`` norms are
known (the first round): the value bound and the receiving region's rollback on a non-finite loss
cover that round.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import Counter, deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from .mailbox import Refusal

__all__ = ["MODES", "AdmissionPerLayout", "UpdateAdmission", "coordinate_median", "fair_share_clip", "fair_share_clip_received", "l2_norm", "max_abs",
           "robust_mix", "trim_count", "trimmed_mean"]

log = logging.getLogger("geofed.p2p")

MODES = ("none", "clip", "trimmed-mean", "median")


def l2_norm(tensors: Sequence[torch.Tensor]) -> float:
    """inf when a square overflows fp32 (values past ~1e19): admit() checks the value bound first."""
    return math.sqrt(math.fsum(float(torch.linalg.vector_norm(t.detach().float())) ** 2 for t in tensors))


def max_abs(tensors: Sequence[torch.Tensor]) -> float:
    """The largest |value| over all tensors (0.0 for none): what security.max_update_value bounds."""
    return max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)


def trim_count(n: int, trim_fraction: float) -> int:
    """How many values trimmed_mean drops at each end of a coordinate among `n`."""
    if n < 3:
        return 0
    return min(max(1, math.floor(trim_fraction * n)), (n - 1) // 2)


def _stacked(values: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    if not values:
        raise ValueError("values: nothing to aggregate")
    n = len(values[0])
    for i, v in enumerate(values):
        if len(v) != n:
            raise ValueError(f"values: entry {i} has {len(v)} tensors, expected {n}")
    out = []
    for j in range(n):
        shapes = {tuple(v[j].shape) for v in values}
        if len(shapes) != 1:
            raise ValueError(f"values: tensor {j} has shapes {sorted(shapes)}")
        out.append(torch.stack([v[j].detach().float() for v in values]))
    return out


def coordinate_median(values: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The coordinate-wise median of n tensor lists (the mean of the two middle values for even n)."""
    out = []
    for s in _stacked(values):
        n = s.shape[0]
        ordered = s.sort(dim=0).values
        mid = ordered[(n - 1) // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        out.append(mid)
    return out


def trimmed_mean(values: Sequence[Sequence[torch.Tensor]], trim: int) -> list[torch.Tensor]:
    """Coordinate-wise mean after dropping the `trim` smallest and `trim` largest values."""
    n = len(values)
    if trim < 0 or n - 2 * trim < 1:
        raise ValueError(f"trim: need 0 <= trim and 2 * trim < n, got trim={trim}, n={n}")
    return [s.sort(dim=0).values[trim:n - trim].mean(dim=0) for s in _stacked(values)]


def robust_mix(own: Sequence[torch.Tensor], received: Mapping[Hashable, Sequence[torch.Tensor]], *,
               how: str, trim_fraction: float = 0.25) -> list[torch.Tensor]:
    """`trimmed-mean` or `median` of the region's own tensors and every received list (the
    peers that missed the deadline are simply not among them)."""
    values = [list(own), *(list(v) for v in received.values())]
    if how == "median":
        mixed = coordinate_median(values)
    elif how == "trimmed-mean":
        mixed = trimmed_mean(values, trim_count(len(values), trim_fraction))
    else:
        raise ValueError(f"how: expected 'trimmed-mean' or 'median', got {how!r}")
    return [m.to(t.dtype) for m, t in zip(mixed, own)]


def fair_share_clip(own: Sequence[torch.Tensor], received: Mapping[str, Sequence[torch.Tensor]], *,
                    multiple: float = 1.0, in_place: bool = False) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]], list[str]]:
    """(own, received, the peers scaled down): every update of the round, the region's own too,
    scaled down to `multiple` x the median L2 norm of the round's updates (the mean of the two
    middle norms for an even count). With weights 1/n, a member's pull on the mean is then at most
    `multiple` x that median / n, whatever it sent. The region's own update is held to the same
    bound so that every region holding the same updates computes the same mean (full-topology
    DiLoCo keeps one model). The median of the round, not of a window: it follows the honest norms
    down as training converges, where a window's median lags them. `in_place`: the caller gives every
    update up (DiLoCo's mix reads none of them after): an update over the bound is scaled where it
    is, with the same values, not copied (with the default multiple 1 and two regions one of the two
    is over it every round: a model's worth, issue 39)."""
    if not received:
        return list(own), {}, []
    own_scale, scales = _fair_share_scales(own, received, multiple)

    def held(tensors: Sequence[torch.Tensor], scale: float | None) -> list[torch.Tensor]:
        if scale is None:
            return list(tensors)
        return [t.mul_(scale) if in_place else t * scale for t in tensors]

    out = {s: held(v, scales[s]) for s, v in received.items()}
    return held(own, own_scale), out, sorted(s for s in received if scales[s] is not None)


def fair_share_clip_received(own: Sequence[torch.Tensor], received: Mapping[str, Sequence[torch.Tensor]], *,
                             multiple: float = 1.0) -> tuple[float | None, dict[str, list[torch.Tensor]], list[str]]:
    """fair_share_clip for a caller that keeps its own update and gives the received ones up (delayed
    overlap's DiLoCo: its pseudo-gradient is where its next one starts from): the received updates over
    the bound are scaled in place, the own one is not touched. (own's scale, None where it is not
    over; received; the peers scaled down): the mix applies own's scale where it reads own
    (gossip.mix's `own_scale`), the same multiplication by the same factor, so the same values."""
    if not received:
        return None, {}, []
    own_scale, scales = _fair_share_scales(own, received, multiple)
    def held(tensors: Sequence[torch.Tensor], scale: float | None) -> list[torch.Tensor]:
        return list(tensors) if scale is None else [t.mul_(scale) for t in tensors]

    out = {s: held(v, scales[s]) for s, v in received.items()}
    return own_scale, out, sorted(s for s in received if scales[s] is not None)


def _fair_share_scales(own: Sequence[torch.Tensor], received: Mapping[str, Sequence[torch.Tensor]],
                       multiple: float) -> tuple[float | None, dict[str, float | None]]:
    """Each update's factor down to `multiple` x the round's median norm, None where it is not over."""
    norms = {s: l2_norm(v) for s, v in received.items()}
    own_norm = l2_norm(own)
    bound = multiple * statistics.median([own_norm, *norms.values()])

    def scale(norm: float) -> float | None:  # float rounding of one same norm is not an outsized update
        return bound / norm if norm > bound * (1 + 1e-6) and math.isfinite(bound) else None

    return scale(own_norm), {s: scale(n) for s, n in norms.items()}


class UpdateAdmission:
    """Judges every incoming update by magnitude; thread-safe (server threads call ``admit``)."""

    def __init__(self, *, mode: str = "clip", max_update_value: float = 1e6, norm_multiple: float = 10.0,
                 window: int = 32, min_samples: int = 3, clip: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if not max_update_value > 0 or not norm_multiple > 1:
            raise ValueError(f"max_update_value: must be > 0 and norm_multiple > 1, got {max_update_value}, {norm_multiple}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"window: need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        self.mode, self.max_update_value, self.norm_multiple = mode, max_update_value, norm_multiple
        # clip=False: `clip` mode's bound is applied at the mix instead (fair_share_clip), where
        # the round's norms are known; here an outsized update only stays out of the reference.
        self.clip = clip
        self.min_samples = min_samples
        self._norms: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.clipped: Counter[str] = Counter()  # sender -> updates scaled down

    def reference(self) -> float | None:
        """The median of the recent norms, or None before min_samples of them."""
        with self._lock:
            return statistics.median(self._norms) if len(self._norms) >= self.min_samples else None

    def bound(self) -> float | None:
        ref = self.reference()
        return None if ref is None else self.norm_multiple * ref

    def observe_own(self, tensors: Sequence[torch.Tensor]) -> None:
        """The region's own update of a round: a norm no peer controls."""
        norm = l2_norm(tensors)
        if math.isfinite(norm):
            with self._lock:
                self._norms.append(norm)

    def admit(self, sender: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The update to file (clipped under `clip`), or Refusal("out_of_bounds" | "outlier")."""
        peak = max_abs(tensors)
        if peak > self.max_update_value:
            raise Refusal("out_of_bounds", f"a value of magnitude {peak:.3g} exceeds security.max_update_value "
                                           f"{self.max_update_value:.3g}")
        if self.mode == "none":
            return tensors
        norm, bound = l2_norm(tensors), self.bound()
        if bound is not None and norm > bound:
            if self.mode != "clip":
                raise Refusal("outlier", f"norm {norm:.3g} exceeds {self.norm_multiple:g} x the recent median "
                                         f"norm ({bound:.3g})")
            if not self.clip:
                return tensors  # the mix clips it (fair_share_clip); it never enters the reference
            with self._lock:
                self.clipped[sender] += 1
            log.warning("clipped the update of %s: norm %.3g -> %.3g (%g x the recent median)", sender, norm,
                        bound, self.norm_multiple)
            scale = bound / norm
            return [t * scale for t in tensors]  # an outlier never enters the reference
        with self._lock:
            self._norms.append(norm)
        return tensors

    def note_clipped(self, senders: Sequence[str]) -> None:
        """Count updates scaled down elsewhere (the mix's fair_share_clip, secure aggregation's mean)."""
        with self._lock:
            self.clipped.update(senders)

    def take_clipped(self) -> dict[str, int]:
        """Clipped updates by sender since the last call."""
        with self._lock:
            out, self.clipped = dict(self.clipped), Counter()
        return out


class AdmissionPerLayout:
    """One UpdateAdmission per message layout (the tensors' shapes): sync.fragments sends one fragment
    of the model per round, and a fragment's update norm says nothing about another's (an embedding's
    against an output layer's), so each fragment keeps its own reference norm. Same interface."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._by_layout: dict[tuple, UpdateAdmission] = {}
        self._lock = threading.Lock()
        self._mix = UpdateAdmission(**kwargs)  # its argument checks, now; it counts the mix's clips

    def _of(self, tensors: Sequence[torch.Tensor]) -> UpdateAdmission:
        key = tuple(tuple(t.shape) for t in tensors)
        with self._lock:
            if key not in self._by_layout:
                self._by_layout[key] = UpdateAdmission(**self._kwargs)
            return self._by_layout[key]

    def observe_own(self, tensors: Sequence[torch.Tensor]) -> None:
        """The region's own update, filed with its layout's norms."""
        self._of(tensors).observe_own(tensors)

    def bound(self) -> float | None:
        """The whole model's norm bound: the root sum of squares of every layout's bound (None
        before any is known). A donor's state is held to it (p2p/rejoin.py)."""
        with self._lock:
            admissions = list(self._by_layout.values())
        bounds = [b for b in (a.bound() for a in admissions) if b is not None]
        return math.sqrt(math.fsum(b * b for b in bounds)) if bounds else None

    def admit(self, sender: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """UpdateAdmission.admit against the norms of the same layout."""
        return self._of(tensors).admit(sender, tensors)

    def note_clipped(self, senders: Sequence[str]) -> None:
        """UpdateAdmission.note_clipped (whatever the layout)."""
        self._mix.note_clipped(senders)

    def take_clipped(self) -> dict[str, int]:
        """Clipped updates by sender since the last call, over every layout."""
        with self._lock:
            admissions = [self._mix, *self._by_layout.values()]
        out: Counter[str] = Counter()
        for a in admissions:
            out.update(a.take_clipped())
        return dict(out)
