"""ternary: three levels a value (-L, 0, +L), five values a byte, one fp32 level L per chunk.

Per chunk of `chunk` values, the values with |x| >= `threshold` x mean|x| are sent as sign(x) x L
and the rest as 0, where L is the mean |x| of the values sent: the least-squares level for that
choice, so ||x - decode(x)|| < ||x|| whenever a chunk sends anything (contractive: error
feedback suits it). The default threshold, 0.75 of the mean magnitude, is the least-squares
threshold of a Gaussian (0.61 sigma); on pseudo-gradients, which have heavier tails, it measured
as well as 0.5 and 1.0.

Wire sections:

    trits   ceil(n / 5) bytes, five codes each: c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4, code 0 = -L,
            1 = 0, 2 = +L (3^5 = 243 <= 256: log2(3) = 1.58 bits a value, 1.6 with this packing);
            a byte above 242 and a padding code other than 1 (zero) are refused
    levels  fp32 per chunk, finite and >= 0

1.6 bits + 32 / chunk bits a value: ~19.6x at chunk 1024, between int3 (10.2x) and sign (31.8x).
On char-lm's DiLoCo pseudo-gradients with error feedback it trained within 0.6% of int3 at 1.9x
fewer bytes (docs/compression.md, docs/bench-wan.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, CodecError, Section, check_int, register, total_numel

_PER_BYTE = 5
_POWERS = torch.tensor([1.0, 3.0, 9.0, 27.0, 81.0])
_MAX_BYTE = 3 ** _PER_BYTE - 1  # 242
# Every byte's five codes, shifted to -1, 0, +1: decoding is one gather.
_TABLE = torch.tensor([[(b // 3 ** i) % 3 - 1 for i in range(_PER_BYTE)] for b in range(256)], dtype=torch.int8)
_BLOCK = 1 << 18  # elements per pass, in whole chunks: 1 MiB of fp32 stays in L2


def _nbytes(n: int) -> int:
    return -(-n // _PER_BYTE)


def _nchunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


@register
@dataclass(frozen=True, kw_only=True)
class Ternary(Codec):
    """sign(x) x L where |x| >= threshold x mean|x| of its chunk, else 0; L the chunk's least-squares
    level; five values a byte: ~19.6x at chunk 1024. Use with error feedback."""

    kind: ClassVar[str] = "ternary"
    chunk: int = 1024
    threshold: float = 0.75

    def __post_init__(self):
        check_int("chunk", self.chunk, 1, 1 << 24)
        if not 0.0 <= self.threshold <= 10.0:
            raise ValueError(f"threshold: must be in [0, 10] (times the chunk's mean |x|), got {self.threshold}")

    def layout(self, shapes: Sequence[tuple[int, ...]]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.uint8, _nbytes(n)), Section(torch.float32, _nchunks(n, self.chunk))]

    def encode_into(self, x, shapes, out, state) -> None:
        trits, levels = out
        n, c = x.numel(), self.chunk
        unit = c * _PER_BYTE // math.gcd(c, _PER_BYTE)  # a pass holds whole chunks and whole bytes
        step = max(1, _BLOCK // unit) * unit
        for s in range(0, n, step):
            e = min(n, s + step)
            codes, lv = self._block(x[s:e])
            levels[s // c: s // c + lv.numel()].copy_(lv)
            m = codes.numel()
            groups = _nbytes(m)
            if groups * _PER_BYTE > m:  # the tail's padding codes are 1: zero
                codes = torch.cat([codes, torch.ones(groups * _PER_BYTE - m)])
            # base-3 digits times 3^0..3^4: each row's sum (<= 242) is exact in fp32
            trits[s // _PER_BYTE: s // _PER_BYTE + groups].copy_(torch.mv(codes.view(groups, _PER_BYTE), _POWERS))

    def _block(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes 0/1/2 as floats, one level per chunk) of `x`: whole chunks, the last maybe partial."""
        c = self.chunk
        full = x.numel() // c
        parts = [x[: full * c].view(full, c)] if full else []
        if x.numel() > full * c:
            parts.append(x[full * c:].view(1, -1))
        codes, levels = [], []
        for rows in parts:
            a = rows.abs()
            # float64 sums: values near 3e38 must not overflow; the threshold is at most the largest |x|
            mean = a.sum(1, dtype=torch.float64) / rows.shape[1]
            thr = torch.minimum(self.threshold * mean, a.amax(1).double()).float()
            keep = (a >= thr[:, None]) & (a > 0)
            kept = keep.sum(1)
            level = torch.where(keep, a, 0.0).sum(1, dtype=torch.float64) / kept.clamp(min=1)
            codes.append(torch.where(keep, torch.sign(rows), 0.0).add_(1).reshape(-1))
            levels.append(level.float())
        return torch.cat(codes), torch.cat(levels)

    def validate(self, sections, shapes) -> None:
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

    def decode_into(self, sections, shapes, out) -> None:
        trits, levels = sections
        n, c = out.numel(), self.chunk
        if n == 0:
            return
        out.copy_(_TABLE[trits.long()].view(-1)[:n])
        full = n // c
        if full:
            out[: full * c].view(full, c).mul_(levels[:full, None])
        if n > full * c:
            out[full * c:].mul_(levels[full])
