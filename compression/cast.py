"""Codecs that cast: identity (fp32), fp16, bf16."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, Section, Shape, register, total_numel
from .params import BF16Params, FP16Params, IdentityParams
from .state import CodecState

_FP16_MAX = float(torch.finfo(torch.float16).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_BLOCK = 1 << 16


class _Cast(Codec):
    dtype: ClassVar[torch.dtype]
    limit: ClassVar[float]

    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        return [Section(self.dtype, total_numel(shapes))]

    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        (dst,) = out
        if x.numel() and self.limit < float("inf"):
            absmax = state.input_absmax
            if absmax is None:
                lo, hi = torch.aminmax(x)
                absmax = max(hi.item(), -lo.item())
            if absmax > self.limit:
                # Saturate instead of sending inf (which the receiver must reject): a few huge
                # values lose their tail, error feedback carries it to the next round.
                tmp = torch.empty(min(_BLOCK, x.numel()))
                for s in range(0, x.numel(), _BLOCK):
                    e = min(s + _BLOCK, x.numel())
                    torch.clamp(x[s:e], -self.limit, self.limit, out=tmp[: e - s])
                    dst[s:e].copy_(tmp[: e - s])
                return
        dst.copy_(x)

    def decode_into(self, sections: list[torch.Tensor], shapes: Sequence[Shape], out: torch.Tensor) -> None:
        out.copy_(sections[0])


@register
@dataclass(frozen=True, kw_only=True)
class Identity(IdentityParams, _Cast):
    """fp32 as is: 1x, exact. The baseline and the safe choice on a fast link."""

    dtype: ClassVar[torch.dtype] = torch.float32
    limit: ClassVar[float] = float("inf")


@register
@dataclass(frozen=True, kw_only=True)
class FP16(FP16Params, _Cast):
    """IEEE half: 2x, relative error <= 2^-11 per value; saturates at +-65504."""

    dtype: ClassVar[torch.dtype] = torch.float16
    limit: ClassVar[float] = _FP16_MAX


@register
@dataclass(frozen=True, kw_only=True)
class BF16(BF16Params, _Cast):
    """bfloat16: 2x, relative error <= 2^-8 per value, fp32's range."""

    dtype: ClassVar[torch.dtype] = torch.bfloat16
    limit: ClassVar[float] = _BF16_MAX
