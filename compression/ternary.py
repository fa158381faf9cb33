"""ternary: three levels a value (-L, 0, +L), five values a byte, one fp32 level L per chunk.

Per chunk of `chunk` values, the values with |x| >= `threshold` x mean|x| are sent as sign(x) x L
and the rest as 0, where L is the mean |x| of the values sent: the least-squares level for that
choice, so ||x - decode(x)|| < ||x|| whenever a chunk sends anything (contractive: error
feedback suits it). The default threshold, 0.75 of the mean magnitude, is the least-squares
threshold of a Gaussian (0.61 sigma); on char-lm's pseudo-gradients 0.5 and 1.0 trained within
the seed-to-seed spread of it (docs/bench-wan.md).

Wire sections:

    trits   ceil(n / 5) bytes, five codes each: c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4, code 0 = -L,
            1 = 0, 2 = +L (3^5 = 243 <= 256: log2(3) = 1.58 bits a value, 1.6 with this packing);
            a byte above 242 and a padding code other than 1 (zero) are refused
    levels  fp32 per chunk, finite and >= 0

1.6 bits + 32 / chunk bits a value: ~19.6x at chunk 1024, between int3 (10.2x) and sign (31.8x).
On char-lm's DiLoCo pseudo-gradients with error feedback it trained within 0.8% of int3 at 1.9x
fewer bytes (docs/compression.md, docs/bench-wan.md).

Both directions run over cache-sized blocks of whole chunks and whole bytes with preallocated
buffers: whole-array passes would stream the update through memory a dozen times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import Codec, CodecError, Section, Shape, register, total_numel
from .params import TernaryParams
from .state import CodecState

_PER_BYTE = 5
_MAX_BYTE = 3 ** _PER_BYTE - 1  # 242
# Every byte's five codes, shifted to -1, 0, +1.
_TABLE = torch.tensor([[(b // 3 ** i) % 3 - 1 for i in range(_PER_BYTE)] for b in range(256)], dtype=torch.int8)
# The same codes as the low five bytes of an int64: decoding gathers one word a byte.
_WORDS = torch.from_numpy(np.pad(_TABLE.numpy(), ((0, 0), (0, 3))).view(np.int64).ravel())
# Times a little-endian word holding digits d0..d4 in bytes 0..4, byte 4 of the product is
# d0 + 3 d1 + 9 d2 + 27 d3 + 81 d4: every byte below it sums to at most 242, so none carries.
_PACK = np.uint64(sum(3 ** (_PER_BYTE - 1 - j) << (8 * j) for j in range(_PER_BYTE)))
_BLOCK = 1 << 19  # elements per pass: 2 MiB of fp32 (measured best of 128K..1M)
_TINY = 2.0 ** -149  # the least positive fp32: a >= max(thr, _TINY) is a >= thr and a > 0


def _nbytes(n: int) -> int:
    return -(-n // _PER_BYTE)


def _rows(t: torch.Tensor, c: int) -> list[tuple[int, torch.Tensor]]:
    """(offset, 2-D view) of `t` as its whole chunks and the partial last one."""
    full = t.numel() // c
    parts = [(0, t[: full * c].view(full, c))] if full else []
    return parts + [(full * c, t[full * c:].view(1, -1))] if t.numel() > full * c else parts


def _words(buf: np.ndarray, count: int) -> np.ndarray:
    """`count` int64s starting every 5 bytes of `buf` (overlapping: buf needs 3 bytes to spare)."""
    return np.ndarray((count,), np.uint64, buf, strides=(_PER_BYTE,))


@register
@dataclass(frozen=True, kw_only=True)
class Ternary(TernaryParams, Codec):
    """sign(x) x L where |x| >= threshold x mean|x| of its chunk, else 0; L the chunk's least-squares
    level; five values a byte: ~19.6x at chunk 1024. Use with error feedback."""

    def layout(self, shapes: Sequence[tuple[int, ...]]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.uint8, _nbytes(n)), Section(torch.float32, -(-n // self.chunk))]

    def _step(self) -> int:
        unit = self.chunk * _PER_BYTE // math.gcd(self.chunk, _PER_BYTE)
        return max(1, _BLOCK // unit) * unit

    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        trits, levels = out
        n, c, step, t = x.numel(), self.chunk, self._step(), self.threshold
        m = min(n, step)
        a, keep, a64 = torch.empty(m), torch.empty(m), torch.empty(m, dtype=torch.float64)
        digits, neg = np.empty(_nbytes(m) * _PER_BYTE + 3, dtype=np.int8), np.empty(m, dtype=np.int8)
        packed, words = trits.numpy(), np.empty(_nbytes(m), np.uint64)
        kept, sums = torch.empty(levels.numel(), 1), torch.empty(levels.numel(), 1, dtype=torch.float64)
        for s in range(0, n, step):
            e = min(n, s + step)
            q, g, both = e - s, _nbytes(e - s), neg[: e - s]
            np.signbit(x[s:e].numpy(), out=both.view(np.bool_))  # first: abs then finds x in cache
            for o, xr in _rows(x[s:e], c):
                ci, r = (s + o) // c, xr.shape[0]
                ar, kr, a6 = (b[o: o + xr.numel()].view_as(xr) for b in (a, keep, a64))
                torch.abs(xr, out=ar)
                # float64 sums (values near 3e38 must not overflow) in torch's own order
                mean = torch.sum(a6.copy_(ar), 1, keepdim=True).div_(xr.shape[1]).mul_(t)
                if t > 1:  # mean|x| <= max|x|, so the cap only binds above 1
                    mean = torch.minimum(mean, ar.amax(1, keepdim=True))
                torch.ge(ar, mean.float().clamp_(min=_TINY), out=kr)  # into floats: into bool is 5x slower
                torch.sum(kr, 1, keepdim=True, out=kept[ci: ci + r])
                torch.sum(a6.copy_(ar.mul_(kr)), 1, keepdim=True, out=sums[ci: ci + r])
            # digits in bytes: 1 + kept x sign(x) = (kept + 1) ^ 2 (kept & signbit)
            dk = torch.from_numpy(digits[:q]).copy_(keep[:q]).numpy()
            np.bitwise_and(dk, both, out=both)
            np.bitwise_xor(np.add(dk, 1, out=dk), np.add(both, both, out=both), out=dk)  # numpy's << is 10x slower
            digits[q: g * _PER_BYTE] = 1  # padding codes: zero
            np.multiply(_words(digits, g), _PACK, out=words[:g])
            np.copyto(packed[s // _PER_BYTE: s // _PER_BYTE + g], words[:g].view(np.uint8)[4::8])
        # a chunk holding NaN keeps nothing but its masked sum is NaN: its level is 0
        torch.nan_to_num(sums.div_(kept.clamp_(min=1)).float().view(-1), nan=0.0, posinf=math.inf, out=levels)

    def validate(self, sections: list[torch.Tensor], shapes: Sequence[Shape]) -> None:
        trits, levels = sections
        n = total_numel(shapes)
        if trits.numel():
            top = int(trits.max())
            if top > _MAX_BYTE:
                raise CodecError(f"ternary: a byte of codes is {top}; five base-3 codes make at most {_MAX_BYTE}")
            pad = trits.numel() * _PER_BYTE - n
            if pad and bool((_TABLE[int(trits[-1])][_PER_BYTE - pad:] != 0).any()):
                raise CodecError("ternary: padding codes after the last value must be 1 (zero)")
        if levels.numel() and not (bool(torch.isfinite(levels).all()) and float(levels.min()) >= 0):
            raise CodecError("ternary: chunk levels must be finite and >= 0")

    def decode_into(self, sections: list[torch.Tensor], shapes: Sequence[Shape], out: torch.Tensor) -> None:
        trits, levels = sections
        n, c, step = out.numel(), self.chunk, self._step()
        g = _nbytes(min(n, step))
        idx, gathered = torch.empty(g, dtype=torch.int32), torch.empty(g, dtype=torch.int64)
        codes = np.empty(g * _PER_BYTE + 3, dtype=np.int8)
        for s in range(0, n, step):
            e = min(n, s + step)
            k = _nbytes(e - s)
            torch.index_select(_WORDS, 0, idx[:k].copy_(trits[s // _PER_BYTE: s // _PER_BYTE + k]), out=gathered[:k])
            # numpy copies front to back: each word's three pad bytes are overwritten by the next word
            np.copyto(_words(codes, k), gathered[:k].numpy().view(np.uint64))
            o = out[s:e]
            o.copy_(torch.from_numpy(codes[: e - s]))  # widen, then scale: a mixed int8 x fp32 multiply is 7x slower
            for off, rows in _rows(o, c):
                rows.mul_(levels[(s + off) // c: (s + off) // c + rows.shape[0], None])
