"""Quantizing codecs with one fp32 scale per chunk: int8, int4 (two per byte), int3 (eight per
three bytes), sign (1 bit).

The work runs over cache-sized blocks of whole chunks: multiply by the chunk's inverse scale,
round, narrow, each pass inside L2. Whole-array passes would stream the 4-byte input
through memory three or four times and lose to a five-line per-tensor quantizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import Codec, CodecError, Section, Shape, register, total_numel
from .params import Int3Params, Int4Params, Int8Params, SignParams
from .state import CodecState

_BLOCK = 1 << 18  # elements per block: 1 MiB of fp32, inside L2 (measured best of 16K..256K)
_TINY = 2.0 ** -100


def _nchunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def _blocks(n: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(start, end) of cache-sized runs of whole chunks covering [0, n)."""
    step = max(1, _BLOCK // chunk) * chunk
    for s in range(0, n, step):
        yield s, min(n, s + step)


def _scale_rows(o: torch.Tensor, scales: torch.Tensor, start: int, chunk: int) -> None:
    """o (elements start.. of the update, starting on a chunk boundary) *= its chunks' scales."""
    m = o.numel()
    full = m // chunk
    c0 = start // chunk
    if full:
        o[: full * chunk].view(full, chunk).mul_(scales[c0: c0 + full, None])
    if m > full * chunk:
        o[full * chunk:].mul_(scales[c0 + full])


def _absmax_per_chunk(x: torch.Tensor, chunk: int) -> torch.Tensor:
    n = x.numel()
    nfull = n // chunk
    out = torch.empty(_nchunks(n, chunk))
    if nfull:
        # amax and amin separately: aminmax(dim=1) ran 20x slower than the two (torch 2.13 CPU)
        x2 = x[: nfull * chunk].view(nfull, chunk)
        torch.maximum(x2.amax(1), x2.amin(1).neg_(), out=out[:nfull])
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
        # |x * levels/absmax| <= levels * (1 + 2^-22): rounds to at most `levels`, no clamp needed
        return t.round_().view(-1)
    # stochastic rounding: floor(v + U[0,1)) is unbiased; v + u can reach levels + 1
    assert noise is not None  # _quantized_blocks allocates it whenever there is a generator
    r = noise[: t.numel()].view_as(t)
    r.uniform_(generator=gen)
    return t.add_(r).floor_().clamp_(-levels, levels).view(-1)


def _scales(x: torch.Tensor, chunk: int, levels: int, scales_out: torch.Tensor) -> torch.Tensor:
    """Write the per-chunk scales (absmax/levels); return the inverse scales (0 for 0 chunks)."""
    absmax = _absmax_per_chunk(x, chunk)
    torch.div(absmax, levels, out=scales_out)
    # levels/absmax overflows fp32 below ~4e-37 (then inf * 0 = NaN, cast to garbage): chunks
    # whose values are all under 2^-100 are sent as zeros, an error no model update notices.
    return torch.where(absmax > _TINY, levels / absmax, torch.zeros(()))


class _ChunkedQuant(Codec):
    chunk: int
    levels: ClassVar[int]
    blockwise: ClassVar[bool] = True  # never raises on finite input; decodes block by block

    def _generator(self, state: CodecState) -> torch.Generator | None:
        return state.generator if getattr(self, "stochastic", False) else None

    def _block_elements(self, n: int) -> int:
        return min(n, max(1, _BLOCK // self.chunk) * self.chunk)

    def _decode_blocks(self, sections: list[torch.Tensor], n: int,
                       out: torch.Tensor | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Decode block by block, yielding (start, end, values): written into out[start:end], or
        without `out` into one block-sized buffer that the next block overwrites."""
        raise NotImplementedError

    def decode_into(self, sections: list[torch.Tensor], shapes: Sequence[Shape], out: torch.Tensor) -> None:
        for _ in self._decode_blocks(sections, out.numel(), out):
            pass  # each block is written into `out` as it is yielded

    def subtract_decoded(
        self, residual: torch.Tensor, sections: list[torch.Tensor], shapes: Sequence[Shape], scratch: torch.Tensor
    ) -> None:
        """residual -= decode(sections), one cache-sized block at a time (`scratch` unused): the same
        values as a whole decode, without its model-sized buffer."""
        for s, e, o in self._decode_blocks(sections, residual.numel(), None):
            residual[s:e].sub_(o)


@register
@dataclass(frozen=True, kw_only=True)
class Int8(Int8Params, _ChunkedQuant):
    """int8 with one fp32 scale per `chunk` values: ~3.99x; error <= scale/2 per value.

    stochastic: round up or down at random (unbiased; then not contractive, so no EF).
    """

    levels: ClassVar[int] = 127

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.int8, n), Section(torch.float32, _nchunks(n, self.chunk))]

    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        q, scales = out
        inv = _scales(x, self.chunk, self.levels, scales)
        for start, t in _quantized_blocks(x, self.chunk, inv, self.levels, self._generator(state)):
            q[start: start + t.numel()].copy_(t)

    def _decode_blocks(self, sections: list[torch.Tensor], n: int,
                       out: torch.Tensor | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        q, scales = sections
        buf = out if out is not None else torch.empty(self._block_elements(n))  # all, or one block
        # Widen then scale in place: one mixed int8 x fp32 multiply ran 7x slower than the two.
        for s, e in _blocks(n, self.chunk):
            o = buf[s:e] if out is not None else buf[: e - s]
            o.copy_(q[s:e])
            _scale_rows(o, scales, s, self.chunk)
            yield s, e, o


@register
@dataclass(frozen=True, kw_only=True)
class Int4(Int4Params, _ChunkedQuant):
    """4-bit signed levels -7..7, two per byte, one fp32 scale per `chunk`: ~7.75x at 1024."""

    levels: ClassVar[int] = 7

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.uint8, (n + 1) // 2), Section(torch.float32, _nchunks(n, self.chunk))]

    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        packed, scales = out
        inv = _scales(x, self.chunk, self.levels, scales)
        cap = min(x.numel(), max(1, _BLOCK // self.chunk) * self.chunk) + 1
        u8 = torch.empty(cap + 1, dtype=torch.uint8)
        w16 = torch.empty(cap // 2 + 1, dtype=torch.int16)
        for start, t in _quantized_blocks(x, self.chunk, inv, self.levels, self._generator(state)):
            m = t.numel()
            u = u8[: m + (m & 1)]
            # -7..7 as int8 then + 8 as bytes: torch 2.13 casts float to int8 4x faster than to
            # uint8, and adds on bytes 3x faster than on floats. Nibble 8 decodes to 0 and pads
            # an odd tail.
            u[:m].view(torch.int8).copy_(t)
            u[:m].add_(8)
            if m & 1:
                u[m] = 8
            # Each byte pair as one little-endian int16 (first value in the low byte): w | w >> 4
            # puts the second value's nibble above the first's, the cast keeps the low byte.
            # 4x faster than or-ing strided byte views.
            w = u.view(torch.int16)
            h = torch.bitwise_right_shift(w, 4, out=w16[: w.numel()]).bitwise_or_(w)
            packed[start // 2: start // 2 + w.numel()].copy_(h)

    def _decode_blocks(self, sections: list[torch.Tensor], n: int,
                       out: torch.Tensor | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        packed, scales = sections
        q = torch.empty(self._block_elements(n) + 1, dtype=torch.int8)
        buf = out if out is not None else torch.empty(self._block_elements(n))  # all, or one block
        for s, e in _blocks(n, self.chunk):
            p = packed[s // 2: (e + 1) // 2]
            pairs = q[: 2 * p.numel()].view(-1, 2)
            torch.bitwise_and(p, 15, out=pairs[:, 0])
            torch.bitwise_right_shift(p, 4, out=pairs[:, 1])
            o = buf[s:e] if out is not None else buf[: e - s]
            o.copy_(q[: e - s]).sub_(8)
            _scale_rows(o, scales, s, self.chunk)
            yield s, e, o


@register
@dataclass(frozen=True, kw_only=True)
class Int3(Int3Params, _ChunkedQuant):
    """3-bit signed levels -3..3, eight per three bytes, one fp32 scale per `chunk`: ~10.2x at 256.

    The rung between int4 and top-k: a byte budget of 1000x takes H >= 127 with int4 and H >= 98
    with int3. Seven levels need smaller chunks than int4's 15: on the digits MLP, the first
    round at H 100 reached 0.95 in 4 of 5 seeds with chunk 256 (as int8 did), 3 of 5 with 1024
    (docs/bench-cluster.md).
    """

    levels: ClassVar[int] = 3

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.uint8, 3 * _nchunks(n, 8)), Section(torch.float32, _nchunks(n, self.chunk))]

    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        packed, scales = out
        inv = _scales(x, self.chunk, self.levels, scales)
        cap = _nchunks(min(x.numel(), max(1, _BLOCK // self.chunk) * self.chunk), 8) * 8
        codes = torch.empty(cap)
        word = torch.empty(cap // 8)
        for start, t in _quantized_blocks(x, self.chunk, inv, self.levels, self._generator(state)):
            m = t.numel()
            groups = _nchunks(m, 8)
            # Codes 1..7 (level + 4; 4 also pads the tail) as floats, eight to a row, times
            # 8^0..8^7: each row's sum is its 24-bit word, exact in fp32 (every partial sum is an
            # integer below 2^24). One matrix-vector product ran 2x faster than eight shift-ors.
            c = codes[: groups * 8]
            torch.add(t, 4, out=c[:m])
            c[m:] = 4
            w = torch.mv(c.view(groups, 8), _INT3_WEIGHTS, out=word[:groups]).to(torch.int32)
            # the word's three low bytes (little-endian), first value lowest
            packed[3 * (start // 8): 3 * (start // 8 + groups)].view(groups, 3).copy_(w.view(torch.uint8).view(groups, 4)[:, :3])

    def _decode_blocks(self, sections: list[torch.Tensor], n: int,
                       out: torch.Tensor | None) -> Iterator[tuple[int, int, torch.Tensor]]:
        packed, scales = sections
        cap = _nchunks(self._block_elements(n), 8)
        w32 = torch.zeros(cap, 4, dtype=torch.uint8)
        codes = torch.empty(cap, 8, dtype=torch.int32)
        buf = out if out is not None else torch.empty(self._block_elements(n))  # all, or one block
        for s, e in _blocks(n, self.chunk):
            groups = _nchunks(e - s, 8)
            wb = w32[:groups]
            wb[:, :3].copy_(packed[3 * (s // 8): 3 * (s // 8 + groups)].view(groups, 3))
            w = wb.view(torch.int32)  # (groups, 1): the fourth byte stays 0
            # one broadcast shift by 0, 3, ..., 21: 2x faster than eight strided shifts
            c = torch.bitwise_right_shift(w, _INT3_SHIFTS, out=codes[:groups]).bitwise_and_(7)
            o = buf[s:e] if out is not None else buf[: e - s]
            o.copy_(c.view(-1)[: e - s]).sub_(4)
            _scale_rows(o, scales, s, self.chunk)
            yield s, e, o


_INT3_WEIGHTS = torch.tensor([8.0 ** i for i in range(8)])
_INT3_SHIFTS = torch.arange(0, 24, 3, dtype=torch.int32)


@register
@dataclass(frozen=True, kw_only=True)
class Sign(SignParams, Codec):
    """One bit per value (x >= 0) and one fp32 scale, mean |x|, per `chunk`: ~31.75x at 4096.

    The scaled sign of EF-signSGD: contractive, so use it with error feedback.
    """


    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        n = total_numel(shapes)
        return [Section(torch.uint8, (n + 7) // 8), Section(torch.float32, _nchunks(n, self.chunk))]

    def _step(self) -> int:
        # whole chunks and whole bytes per block
        unit = self.chunk * 8 // math.gcd(self.chunk, 8)
        return max(1, _BLOCK // unit) * unit

    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        bits, scales = out
        n, c, step = x.numel(), self.chunk, self._step()
        tmp = torch.empty(min(n, step))
        xn, positive = x.numpy(), np.empty(min(n, step), dtype=np.bool_)
        for s in range(0, n, step):
            e = min(n, s + step)
            a = torch.abs(x[s:e], out=tmp[: e - s])
            full = (e - s) // c
            if full:
                torch.sum(a[: full * c].view(full, c), 1, out=scales[s // c: s // c + full]).div_(c)
            if e - s > full * c:
                scales[s // c + full] = a[full * c:].mean()
            # numpy's compare into bool is SIMD, ~8x torch 2.13's on CPU
            np.greater_equal(xn[s:e], 0, out=positive[: e - s])
            packed = np.packbits(positive[: e - s], bitorder="little")
            bits[s // 8: s // 8 + packed.size].copy_(torch.from_numpy(packed))
        if scales.numel() and not bool(torch.isfinite(scales).all()):  # the receiver would refuse it
            raise CodecError("sign: a chunk's mean magnitude overflows fp32 (values near 3e38)")

    def decode_into(self, sections: list[torch.Tensor], shapes: Sequence[Shape], out: torch.Tensor) -> None:
        bits, scales = sections
        n, step = out.numel(), self._step()
        for s in range(0, n, step):
            e = min(n, s + step)
            u = np.unpackbits(bits[s // 8: (e + 7) // 8].numpy(), count=e - s, bitorder="little")
            o = out[s:e]
            o.copy_(torch.from_numpy(u)).mul_(2).sub_(1)  # bit -> +-1
            _scale_rows(o, scales, s, self.chunk)
