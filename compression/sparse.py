"""Sparsifying codecs: top-k (indices on the wire, compactly) and random-k (a seed instead).

Top-k indices are sorted and split: the low 16 bits of each as uint16, and per 65536-wide
block the count of kept indices as int32. That is 2 bytes per kept value plus 4 bytes per
65536 inputs, against 4 or 8 for plain int32/int64 indices, and decodes with one
`repeat_interleave`. Kept values go through an `inner` codec (fp16 by default, or int8...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import Codec, CodecError, Section, Shape, register, total_numel
from .params import RandomKParams, TopKParams, check_fraction as _check_fraction  # noqa: F401 - sparseloco's
from .cast import FP16
from .state import CodecState

_LOW_BITS = 16
_SPAN = 1 << _LOW_BITS
_EXACT_BELOW = 1 << 18  # torch.topk is quick enough on small inputs; a sampled threshold above
_SAMPLE = 1 << 15
_BLOCK = 1 << 16  # elements per threshold pass: 256 KiB of fp32, inside L2


def _k(fraction: float, n: int) -> int:
    # The receiver recomputes k from the spec, so this must be a pure function of (fraction, n).
    return 0 if n == 0 else min(n, max(1, math.ceil(fraction * n - 1e-9)))


def _select_sampled(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor | None:
    """Sorted indices of a superset of the top-k by |x| via a threshold estimated on a sample.

    If at least k values reach the threshold, the true top-k are all among them (the k-th
    largest |x| is then >= the threshold), so picking the k largest candidates is exact.
    Returns None when the sample put the threshold too high three times.
    """
    n = x.numel()
    sample = x.index_select(0, torch.randint(n, (_SAMPLE,), generator=gen)).abs_()
    margin = 1.25
    for _ in range(3):
        want = min(n, int(k * margin) + 64)
        rank = max(1, _SAMPLE - math.ceil(_SAMPLE * want / n))
        cand = _at_least(x, float(sample.kthvalue(rank).values))
        if cand.numel() >= k:
            return cand
        margin *= 4
    return None


def _at_least(x: torch.Tensor, thr: float) -> torch.Tensor:
    """Sorted int64 indices of |x| >= thr, one L2-sized block at a time.

    numpy on views of x's memory, not torch: on CPU, torch 2.13's compare into bool and its
    nonzero ran ~8x and ~6x slower than numpy's SIMD loops here (27 vs 3 us and 50 vs 8 us per
    64K block); this pass was most of top-k's encode time.
    """
    xn = x.numpy()
    n = xn.size
    mag = np.empty(min(n, _BLOCK), dtype=np.float32)
    hit = np.empty(min(n, _BLOCK), dtype=np.bool_)
    parts = []
    for s in range(0, n, _BLOCK):
        e = min(n, s + _BLOCK)
        np.greater_equal(np.abs(xn[s:e], out=mag[: e - s]), thr, out=hit[: e - s])
        idx = hit[: e - s].nonzero()[0]
        idx += s
        parts.append(idx)
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))


def _largest_in_order(x: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """The k of the sorted indices `cand` with the largest |x|, still sorted.

    A partition finds the k-th largest value and a compare keeps what reaches it: ~0.5 ms for
    1.25k candidates at 25M, where torch.topk plus a sort of the k took ~12 ms.
    """
    mag = x.index_select(0, cand).abs_().numpy()
    m = mag.size
    kth = np.partition(mag, m - k)[m - k]
    keep = mag > kth  # fewer than k: the k-th value itself is not above it
    need = k - int(np.count_nonzero(keep))
    keep[np.flatnonzero(mag == kth)[:need]] = True  # ties: any of them make an exact top-k
    return torch.from_numpy(cand.numpy()[keep])


def topk_indices(x: torch.Tensor, k: int, state: CodecState) -> torch.Tensor:
    """Sorted int64 indices of the k largest |x| (exact)."""
    n = x.numel()
    if k == n:
        return torch.arange(n)
    cand = _select_sampled(x, k, state.generator) if n > _EXACT_BELOW and k * 8 < n else None
    if cand is None:
        return torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return cand if cand.numel() == k else _largest_in_order(x, cand, k)


def _nblocks(n: int) -> int:
    return -(-n // _SPAN)


@register
@dataclass(frozen=True, kw_only=True)
class TopK(TopKParams, Codec):
    """The `fraction` largest |values| of the whole update (exact), values through `inner`.

    1% with fp16 values: ~99x; with int8 values: ~132x. Contractive: use with error feedback.
    """

    fraction: float = 0.01
    inner: Codec = FP16()  # the torch codec; TopKParams checks it

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        n = total_numel(shapes)
        k = _k(self.fraction, n)
        return [Section(torch.int32, _nblocks(n)), Section(torch.uint16, k)] + self.inner.layout([(k,)])

    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        counts, low = out[0], out[1]
        n = x.numel()
        k = _k(self.fraction, n)
        if k == 0:
            return
        idx = topk_indices(x, k, state)
        counts.copy_(torch.bincount(idx >> _LOW_BITS, minlength=_nblocks(n)))
        low.copy_(idx & (_SPAN - 1))
        self.inner.encode_into(x.index_select(0, idx), [(k,)], out[2:], state)

    def _indices(self, sections: list[torch.Tensor], n: int) -> torch.Tensor:
        counts, low = sections[0], sections[1]
        base = torch.arange(counts.numel(), dtype=torch.int64) << _LOW_BITS
        return torch.repeat_interleave(base, counts.to(torch.int64), output_size=low.numel()) + low.to(torch.int64)

    def validate(self, sections: list[torch.Tensor], shapes: Sequence[Shape]) -> None:
        counts, low = sections[0], sections[1]
        n = total_numel(shapes)
        if counts.numel() and (counts.min().item() < 0 or counts.to(torch.int64).sum().item() != low.numel()):
            raise CodecError(f"topk: block counts sum to {counts.to(torch.int64).sum().item()} (min {counts.min().item()}),"
                             f" not the {low.numel()} indices sent")
        if low.numel():
            idx = self._indices(sections, n)
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise CodecError("topk: indices are not strictly increasing (duplicated or unsorted)")
            if idx[-1].item() >= n:
                raise CodecError(f"topk: index {idx[-1].item()} out of range for {n} elements")
        self.inner.validate(sections[2:], [(low.numel(),)])

    def _values(self, sections: list[torch.Tensor]) -> torch.Tensor:
        k = sections[1].numel()
        vals = torch.empty(k)
        self.inner.decode_into(sections[2:], [(k,)], vals)
        return vals

    def decode_into(self, sections: list[torch.Tensor], shapes: Sequence[Shape], out: torch.Tensor) -> None:
        out.zero_()
        if sections[1].numel():
            out.index_copy_(0, self._indices(sections, out.numel()), self._values(sections))

    def subtract_decoded(self, residual: torch.Tensor, sections: list[torch.Tensor], shapes: Sequence[Shape],
                         scratch: torch.Tensor) -> None:
        if sections[1].numel():
            residual.index_add_(0, self._indices(sections, residual.numel()), self._values(sections), alpha=-1)


def _mix64(v: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping multiply; logical shifts by masking).

    Plain integer arithmetic, so sender and receiver derive the same random-k indices on any
    machine and torch version, which a torch/numpy RNG stream does not promise.
    """
    def shr(a: torch.Tensor, s: int) -> torch.Tensor:
        return (a >> s) & ((1 << (64 - s)) - 1)

    v = v ^ shr(v, 30)
    v = v * -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
    v = v ^ shr(v, 27)
    v = v * -7723592293110705685  # 0x94d049bb133111eb as int64
    return v ^ shr(v, 31)


def randomk_indices(seed: int, start: int, stop: int, n: int) -> torch.Tensor:
    """Indices start..stop-1 of the sequence in [0, n) drawn with replacement from `seed`."""
    golden = -7046029254386353131  # 0x9e3779b97f4a7c15 as int64
    v = torch.arange(start + 1, stop + 1, dtype=torch.int64) * golden + seed
    return (_mix64(v) & ((1 << 63) - 1)) % n


@register
@dataclass(frozen=True, kw_only=True)
class RandomK(RandomKParams, Codec):
    """`fraction` of the values at indices drawn (with replacement) from a seed sent on the
    wire, rescaled by n/k on decode: unbiased, linear for a shared seed, not contractive (no EF).
    """

    fraction: float = 0.01
    inner: Codec = FP16()  # the torch codec; RandomKParams checks it

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        k = _k(self.fraction, total_numel(shapes))
        return [Section(torch.int64, 1)] + self.inner.layout([(k,)])

    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        n = x.numel()
        k = _k(self.fraction, n)
        seed = _mix64(torch.tensor([state.seed ^ state.counter], dtype=torch.int64))
        out[0].copy_(seed)
        if k:
            self.inner.encode_into(x.index_select(0, randomk_indices(int(seed.item()), 0, k, n)), [(k,)], out[1:], state)

    def decode_into(self, sections: list[torch.Tensor], shapes: Sequence[Shape], out: torch.Tensor) -> None:
        out.zero_()
        n = out.numel()
        k = _k(self.fraction, n)
        if k:
            vals = torch.empty(k)
            self.inner.decode_into(sections[1:], [(k,)], vals)
            seed = int(sections[0].item())
            # in blocks: int64 indices for all k would be 2x the result (k = n at fraction 1)
            for s in range(0, k, _BLOCK):
                e = min(k, s + _BLOCK)
                out.index_add_(0, randomk_indices(seed, s, e, n), vals[s:e], alpha=n / k)

    def validate(self, sections: list[torch.Tensor], shapes: Sequence[Shape]) -> None:
        k = _k(self.fraction, total_numel(shapes))
        self.inner.validate(sections[1:], [(k,)])
