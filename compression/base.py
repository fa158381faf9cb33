"""The codec seam: the `Codec` interface, `CodecError`, and the closed registry by name.

A codec is a frozen keyword-only dataclass: its fields are its parameters (the spec), it holds
no mutable state (per-link state lives in `CodecState`). It works on ONE flat fp32 buffer that
holds a whole model update (the tensors concatenated), plus the shapes of those tensors for
codecs that need them (PowerSGD). Its output is a fixed list of typed *sections* whose dtypes
and lengths follow from the parameters and the shapes alone (`layout`), so the wire format can
check a payload against the layout before allocating anything, and the encoder can write each
section straight into the outgoing buffer.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .params import PARAMS, CodecParams, build
from .params import check_inner, check_int  # noqa: F401 - re-exported: the codec modules' checks
from .spec import CodecSpec
from .state import CodecState


Shape = tuple[int, ...]


class CodecError(ValueError):
    """A payload that cannot be decoded (malformed, truncated, lying, too big, not finite)."""


@dataclass(frozen=True)
class Section:
    """One typed array of an encoded update: its dtype and element count."""

    dtype: torch.dtype
    count: int

    @property
    def nbytes(self) -> int:
        """Bytes of the section's data, before the wire format pads it to a multiple of 8."""
        return self.count * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# A fixed header (magic .. section count) plus one tensor record and a few section records: what
# `estimate_ratio` adds to the sections of a single 1-D tensor (see wire.py for the layout).
HEADER_ESTIMATE_BYTES = 160


class Codec(CodecParams, ABC):
    """Encode/decode one flat fp32 buffer into/from typed sections.

    Subclasses are frozen keyword-only dataclasses registered with `@register`, each a subclass of
    its kind's parameter class (params.py: fields, defaults, range checks and the class flags
    linear, lossless, elementwise, sparse and contractive, without torch), adding only the work.

    `blockwise`: `encode_into` never raises on finite input and `subtract_decoded` decodes block by
    block, using no `scratch`. Error feedback then adds the update into the residual in place
    instead of into a second model-sized buffer (4 B/param less, issue 39); the price is that an
    encode that failed anyway would leave the residual corrected, which such a codec never does.
    """

    blockwise: ClassVar[bool] = False

    # ---- description -------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The canonical key of this codec's spec (`CodecSpec.key`): "int8", "topk(fraction=0.01,inner=int8)"."""
        return CodecSpec.of(self).key

    def spec(self) -> dict[str, Any]:
        """Every parameter, inner codecs nested: the wire format's JSON description of the codec
        (`make_codec(c.spec()) == c`). The typed spec is `CodecSpec.of(c)`."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.spec() if isinstance(value, Codec) else value
        return out

    def estimate_ratio(self, numel: int, shapes: Sequence[Shape] | None = None) -> float:
        """fp32 bytes / wire bytes for an update of `numel` floats, without encoding.

        `shapes` (the model's tensor shapes) matters only to shape-aware codecs; PowerSGD
        assumes one square matrix when it is not given.
        """
        if numel < 0:
            raise ValueError(f"numel: must be >= 0, got {numel}")
        if shapes is None:
            shapes = self._default_shapes(numel)
        elif sum(math.prod(s) for s in shapes) != numel:
            raise ValueError(f"shapes: hold {sum(math.prod(s) for s in shapes)} elements, not numel={numel}")
        wire = HEADER_ESTIMATE_BYTES + sum(_padded(s.nbytes) for s in self.layout(shapes))
        return 4.0 * numel / wire

    def _default_shapes(self, numel: int) -> list[Shape]:
        return [(numel,)]

    # ---- the work ----------------------------------------------------------------------
    @abstractmethod
    def layout(self, shapes: Sequence[Shape]) -> list[Section]:
        """The sections an update of these shapes encodes to; a pure function of params+shapes."""

    @abstractmethod
    def encode_into(self, x: torch.Tensor, shapes: Sequence[Shape], out: list[torch.Tensor], state: CodecState) -> None:
        """Encode flat fp32 `x` (never modified) into the preallocated section tensors `out`."""

    @abstractmethod
    def decode_into(self, sections: list[torch.Tensor], shapes: Sequence[Shape], out: torch.Tensor) -> None:
        """Decode validated `sections` into the flat fp32 `out` (every element written)."""

    def validate(self, sections: list[torch.Tensor], shapes: Sequence[Shape]) -> None:
        """Check section *contents* that could make decoding misbehave (indices, counts).

        Sizes and dtypes are already checked against `layout`; NaN/Inf are checked on the
        decoded result. Raise CodecError naming the problem. Optional: dense codecs, whose
        sections hold only values, have nothing to check and keep this no-op.
        """

    def subtract_decoded(
        self, residual: torch.Tensor, sections: list[torch.Tensor], shapes: Sequence[Shape], scratch: torch.Tensor
    ) -> None:
        """residual -= decode(sections), in place (error feedback); `scratch` is a reusable
        buffer like `residual` (fresh pages cost more than the decode), empty for a `blockwise`
        codec, which overrides this. Sparse codecs override it too."""
        self.decode_into(sections, shapes, scratch)
        residual.sub_(scratch)


def total_numel(shapes: Sequence[Shape]) -> int:
    """Element count of an update made of tensors with these shapes."""
    return sum(math.prod(s) for s in shapes)


def _padded(nbytes: int) -> int:
    return (nbytes + 7) & ~7


# ---- registry --------------------------------------------------------------------------
_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry under its `kind`, which must be new and have
    its parameter class in params.py (which the codec subclasses: one declaration of the parameters)."""
    assert cls.kind not in _REGISTRY, cls.kind
    assert issubclass(cls, PARAMS[cls.kind]), (cls, PARAMS[cls.kind])
    _REGISTRY[cls.kind] = cls
    return cls


# The modules whose @register fills _REGISTRY: imported on the first make_codec/codec_names, so that
# importing geofed.compression (or its torch-free spec) does not import every codec.
CODEC_MODULES = ("cast", "powersgd", "quant", "sparse", "sparseloco", "ternary")


def _load_codecs() -> None:
    if len(_REGISTRY) < len(PARAMS):
        import importlib

        for name in CODEC_MODULES:
            importlib.import_module(f"{__package__}.{name}")


def codec_names() -> list[str]:
    """The registered codec kinds, sorted."""
    _load_codecs()
    return sorted(_REGISTRY)


def make_codec(spec: str | Mapping[str, Any] | Codec | CodecSpec) -> Codec:
    """Build a codec from a name ("int8"), a mapping ({"kind": "topk", "fraction": 0.01}) or a
    `CodecSpec`. (Key strings such as "topk(fraction=0.01)" are `CodecSpec.parse`'s: the wire
    format's spec is JSON and never one.)

    Raises ValueError("key: message") for an unknown kind, an unknown or badly typed
    parameter, or a value out of range. A Codec passes through unchanged.
    """
    if isinstance(spec, Codec):
        return spec
    _load_codecs()
    if isinstance(spec, CodecSpec):
        spec = spec.to_data()
    return build(_REGISTRY, spec, make_codec)
