"""Quantizing codecs with one fp32 scale per chunk: int8, int4 (two per byte), sign (1 bit).

The work runs over cache-sized blocks of whole chunks: multiply by the chunk's inverse scale,
round, clamp, narrow, each pass inside L2. Whole-array passes would stream the 4-byte input
through memory three or four times and lose to a five-line per-tensor quantizer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import Codec, Section, Shape, check_int, register, total_numel
from .state import CodecState

_BLOCK = 1 << 16  # elements per block: 256 KiB of fp32, inside L2


def _nchunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def _absmax_per_chunk(x: torch.Tensor, chunk: int) -> torch.Tensor:
    n = x.numel()
    nfull = n // chunk
    out = torch.empty(_nchunks(n, chunk))
    if nfull:
        lo, hi = torch.aminmax(x[: nfull * chunk].view(nfull, chunk), dim=1)
        torch.maximum(hi, lo.neg_(), out=out[:nfull])
    if n > nfull * chunk:
        lo, hi = torch.aminmax(x[nfull * chunk:])
        out[nfull] = torch.maximum(hi, -lo)
    return out


def _quantized_blocks(
    x: torch.Tensor, chunk: int, inv: torch.Tensor, levels: int, gen: torch.Generator | None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start, q) where q (float, integral values in [-levels, levels]) quantizes
    x[start:start+len(q)]; blocks hold whole chunks (the last may be a partial chunk)."""
    n = x.numel()
    rows = max(1, _BLOCK // chunk)
    buf = torch.empty(min(n, rows * chunk))
    noise = torch.empty_like(buf) if gen is not None else None
    nfull = n // chunk
    x2 = x[: nfull * chunk].view(nfull, chunk)
    for r0 in range(0, nfull, rows):
        r1 = min(nfull, r0 + rows)
        t = buf[: (r1 - r0) * chunk].view(r1 - r0, chunk)
        torch.mul(x2[r0:r1], inv[r0:r1, None], out=t)
        yield r0 * chunk, _round(t, levels, gen, noise)
    if n > nfull * chunk:
        t = buf[: n - nfull * chunk]
        torch.mul(x[nfull * chunk:], inv[nfull], out=t)
        yield nfull * chunk, _round(t, levels, gen, noise)


def _round(t: torch.Tensor, levels: int, gen: torch.Generator | None, noise: torch.Tensor | None) -> torch.Tensor:
    if gen is None:
        t.round_()
    else:  # stochastic rounding: floor(v + U[0,1)) is unbiased
        r = noise[: t.numel()].view_as(t)
        r.uniform_(generator=gen)
        t.add_(r).floor_()
    return t.clamp_(-levels, levels).view(-1)


def _scales(x: torch.Tensor, chunk: int, levels: int, scales_out: torch.Tensor) -> torch.Tensor:
    """Write the per-chunk scales (absmax/levels); return the inverse scales (0 for 0 chunks)."""
    absmax = _absmax_per_chunk(x, chunk)
    torch.div(absmax, levels, out=scales_out)
    inv = torch.where(absmax > 0, levels / absmax, torch.zeros(()))
    return inv


class _ChunkedQuant(Codec):
    chunk: int
    levels: ClassVar[int]

    def _chunk_check(self) -> None:
        check_int("chunk", self.chunk, 1, 1 << 24)

    def _generator(self, state: CodecState) -> torch.Generator | None:
        return state.generator if getattr(self, "stochastic", False) else None


@register
@dataclass(frozen=True, kw_only=True)
class Int8(_ChunkedQuant):
    """int8 with one fp32 scale per `chunk` values: ~3.99x; error <= scale/2 per value.

    stochastic: round up or down at random (unbiased; then not contractive, so no EF).
    """

    kind: ClassVar[str] = "int8"
    levels: ClassVar[int] = 127
    chunk: int = 4096
    stochastic: bool = False

    def __post_init__(self):
        self._chunk_check()

    @property
    def contractive(self) -> bool:
        return not self.stochastic

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.int8, n), Section(torch.float32, _nchunks(n, self.chunk))]

    def encode_into(self, x, shapes, out, state) -> None:
        q, scales = out
        inv = _scales(x, self.chunk, self.levels, scales)
        for start, t in _quantized_blocks(x, self.chunk, inv, self.levels, self._generator(state)):
            q[start: start + t.numel()].copy_(t)

    def decode_into(self, sections, shapes, out) -> None:
        q, scales = sections
        n, c = out.numel(), self.chunk
        nfull = n // c
        if nfull:
            torch.mul(q[: nfull * c].view(nfull, c), scales[:nfull, None], out=out[: nfull * c].view(nfull, c))
        if n > nfull * c:
            torch.mul(q[nfull * c:], scales[nfull], out=out[nfull * c:])


@register
@dataclass(frozen=True, kw_only=True)
class Int4(_ChunkedQuant):
    """4-bit signed levels -7..7, two per byte, one fp32 scale per `chunk`: ~7.75x at 1024."""

    kind: ClassVar[str] = "int4"
    levels: ClassVar[int] = 7
    chunk: int = 1024
    stochastic: bool = False

    def __post_init__(self):
        self._chunk_check()
        if self.chunk % 2:
            raise ValueError(f"chunk: must be even for int4 (two values per byte), got {self.chunk}")

    @property
    def contractive(self) -> bool:
        return not self.stochastic

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.uint8, (n + 1) // 2), Section(torch.float32, _nchunks(n, self.chunk))]

    def encode_into(self, x, shapes, out, state) -> None:
        packed, scales = out
        inv = _scales(x, self.chunk, self.levels, scales)
        u8 = torch.empty(min(x.numel(), max(1, _BLOCK // self.chunk) * self.chunk) + 1, dtype=torch.uint8)
        for start, t in _quantized_blocks(x, self.chunk, inv, self.levels, self._generator(state)):
            m = t.numel()
            u = u8[: m + (m & 1)]
            u[:m].copy_(t.add_(8))  # 1..15; nibble 8 decodes to 0 and pads an odd tail
            if m & 1:
                u[m] = 8
            torch.bitwise_or(u[0::2], u[1::2].bitwise_left_shift(4), out=packed[start // 2: start // 2 + u.numel() // 2])

    def decode_into(self, sections, shapes, out) -> None:
        packed, scales = sections
        n, c = out.numel(), self.chunk
        rows = max(1, _BLOCK // c)
        q = torch.empty(min(n, rows * c) + 1, dtype=torch.int8)
        for s in range(0, n, rows * c):
            e = min(n, s + rows * c)
            p = packed[s // 2: (e + 1) // 2]
            pairs = q[: 2 * p.numel()].view(-1, 2)
            pairs[:, 0].copy_(p & 15)
            pairs[:, 1].copy_(p >> 4)
            qb = q[: e - s].sub_(8)
            nfull = (e - s) // c
            if nfull:
                torch.mul(qb[: nfull * c].view(nfull, c), scales[s // c: s // c + nfull, None],
                          out=out[s: s + nfull * c].view(nfull, c))
            if e - s > nfull * c:
                torch.mul(qb[nfull * c:], scales[s // c + nfull], out=out[s + nfull * c: e])


@register
@dataclass(frozen=True, kw_only=True)
class Sign(Codec):
    """One bit per value (x >= 0) and one fp32 scale, mean |x|, per `chunk`: ~31.75x at 4096.

    The scaled sign of EF-signSGD: contractive, so use it with error feedback.
    """

    kind: ClassVar[str] = "sign"
    chunk: int = 4096

    def __post_init__(self):
        check_int("chunk", self.chunk, 1, 1 << 24)

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.uint8, (n + 7) // 8), Section(torch.float32, _nchunks(n, self.chunk))]

    def encode_into(self, x, shapes, out, state) -> None:
        bits, scales = out
        n, c = x.numel(), self.chunk
        nfull = n // c
        if nfull:
            torch.linalg.vector_norm(x[: nfull * c].view(nfull, c), ord=1, dim=1, out=scales[:nfull]).div_(c)
        if n > nfull * c:
            scales[nfull] = x[nfull * c:].abs().mean()
        packed = np.packbits((x >= 0).numpy(), bitorder="little")
        bits.copy_(torch.from_numpy(packed))

    def decode_into(self, sections, shapes, out) -> None:
        bits, scales = sections
        n, c = out.numel(), self.chunk
        positive = torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little")).view(torch.bool)
        nfull = n // c
        if nfull:
            s = scales[:nfull, None]
            torch.where(positive[: nfull * c].view(nfull, c), s, -s, out=out[: nfull * c].view(nfull, c))
        if n > nfull * c:
            s = scales[nfull]
            torch.where(positive[nfull * c:], s, -s, out=out[nfull * c:])
