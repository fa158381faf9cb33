"""The closed codec registry's parameters, without torch: each codec kind's fields, defaults,
class flags and range checks, as one frozen keyword-only dataclass per kind.

The torch codecs (cast.py, quant.py, ...) subclass these classes and add only the work
(`layout`, `encode_into`, `decode_into`), so a kind's parameters are declared and checked in one
place. `geofed validate`, `geofed -h` and the config loader validate codec specs through this
module alone (`CodecSpec` builds on it), so they never import torch; `base.register` refuses a
codec whose kind has no parameter class here, and tests/unit/test_cli_imports.py holds that the
two registries name the same kinds with the same fields and defaults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar


class CodecParams:
    """A codec kind's parameters (the dataclass fields of a subclass) and its class flags.

      linear      decode(encode(a)) + decode(encode(b)) == decode(encode(a + b)) (given the same
                  shared randomness), so compressed updates may be summed before decoding;
      lossless    decoding returns exactly the input (no error to feed back);
      elementwise works on a flat vector without shapes, so it can be another codec's `inner`;
      sparse      sends a subset of the values (never another sparse codec's `inner`).
    """

    if TYPE_CHECKING:  # what @dataclass gives every subclass: lets dataclasses.fields take a CodecParams
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    kind: ClassVar[str]
    linear: ClassVar[bool] = False
    lossless: ClassVar[bool] = False
    elementwise: ClassVar[bool] = True
    sparse: ClassVar[bool] = False

    @property
    def contractive(self) -> bool:
        """||x - decode(encode(x))|| < ||x||: the kind of codec error feedback suits (EF made
        unbiased, rescaled codecs diverge). A property: it can depend on the parameters."""
        return True


PARAMS: dict[str, type[CodecParams]] = {}


def register_params(cls: type[CodecParams]) -> type[CodecParams]:
    """Class decorator adding a kind's parameter class; the kind must be new."""
    assert cls.kind not in PARAMS, cls.kind
    PARAMS[cls.kind] = cls
    return cls


def param_kinds() -> list[str]:
    """Every codec kind, sorted (torch-free; `base.codec_names()` lists the same once loaded)."""
    return sorted(PARAMS)


def make_params(spec: str | Mapping[str, Any] | CodecParams) -> CodecParams:
    """The parameter object of a name ("int8") or a mapping ({"kind": "topk", "fraction": 0.01});
    ValueError("key: message") as `base.make_codec` raises (it shares `build`)."""
    return build(PARAMS, spec, make_params)


def build(registry: Mapping[str, type], spec: Any, make_inner: Callable[[Any], Any]) -> Any:
    """Check and build one spec against `registry` (kind -> class): the torch-free parameter
    classes here, or the torch codecs (base.make_codec). Inner codecs go through `make_inner`."""
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"codec: expected a codec name or a mapping with 'kind', got {type(spec).__name__}")
    params = dict(spec)
    kind = params.pop("kind", None)
    names = ", ".join(sorted(PARAMS))
    if not isinstance(kind, str):
        raise ValueError("kind: missing (a codec spec needs kind: one of " + names + ")")
    cls = registry.get(kind)
    if cls is None:
        raise ValueError(f"kind: unknown codec {kind!r} (known: {names})")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in params.items():
        if key not in known:
            raise ValueError(f"{key}: unknown parameter of codec {kind!r} (known: {', '.join(known) or 'none'})")
        params[key] = _coerce(kind, key, known[key].type, value, make_inner)
    return cls(**params)


def _coerce(kind: str, key: str, annotation: Any, value: Any, make_inner: Callable[[Any], Any]) -> Any:
    """Type-check one parameter; YAML gives ints where floats are meant, accept those."""
    ann = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if ann == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{key}: must be true or false, got {value!r}")
        return value
    if ann == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: must be an integer, got {value!r}")
        return value
    if ann == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: must be a number, got {value!r}")
        return float(value)
    if ann in ("Codec", "CodecParams"):
        try:
            return make_inner(value)
        except ValueError as exc:
            raise ValueError(f"{key}.{exc}") from None
    raise AssertionError(f"{kind}.{key}: unhandled parameter type {ann}")


def check_inner(owner: str, inner: CodecParams) -> None:
    """An inner codec must work on a flat vector (no shapes) and not be sparse itself."""
    if not inner.elementwise or inner.sparse:
        raise ValueError(f"inner: {inner.kind!r} cannot be the inner codec of {owner!r} (use identity, fp16, bf16, int8, int4, int3, ternary or sign)")


def check_int(name: str, value: int, lo: int, hi: int) -> None:
    """Raise ValueError("name: ...") unless lo <= value <= hi (for codec parameters in __post_init__)."""
    if not lo <= value <= hi:
        raise ValueError(f"{name}: must be in [{lo}, {hi}], got {value}")


def check_fraction(fraction: float) -> None:
    """Raise ValueError("fraction: ...") unless 0 < fraction <= 1."""
    if not (0.0 < fraction <= 1.0) or math.isnan(fraction):
        raise ValueError(f"fraction: must be in (0, 1], got {fraction}")


# ---- the kinds (their torch halves: cast.py, quant.py, sparse.py, powersgd.py, ...) ----------
@register_params
@dataclass(frozen=True, kw_only=True)
class IdentityParams(CodecParams):
    """identity: fp32 as is (cast.py)."""

    kind: ClassVar[str] = "identity"
    linear: ClassVar[bool] = True
    lossless: ClassVar[bool] = True


@register_params
@dataclass(frozen=True, kw_only=True)
class FP16Params(CodecParams):
    """fp16: IEEE half (cast.py)."""

    kind: ClassVar[str] = "fp16"
    linear: ClassVar[bool] = True


@register_params
@dataclass(frozen=True, kw_only=True)
class BF16Params(CodecParams):
    """bf16: bfloat16 (cast.py)."""

    kind: ClassVar[str] = "bf16"
    linear: ClassVar[bool] = True


class _ChunkedQuantParams(CodecParams):
    chunk: int
    stochastic: bool
    per_pack: ClassVar[int] = 1   # values packed together: chunks hold whole packs
    _pack_rule: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_int("chunk", self.chunk, 1, 1 << 24)
        if self.chunk % self.per_pack:
            raise ValueError(f"chunk: {self._pack_rule}, got {self.chunk}")

    @property
    def contractive(self) -> bool:
        return not self.stochastic


@register_params
@dataclass(frozen=True, kw_only=True)
class Int8Params(_ChunkedQuantParams):
    """int8: one fp32 scale per `chunk` values (quant.py)."""

    kind: ClassVar[str] = "int8"
    chunk: int = 4096
    stochastic: bool = False


@register_params
@dataclass(frozen=True, kw_only=True)
class Int4Params(_ChunkedQuantParams):
    """int4: two values per byte (quant.py)."""

    kind: ClassVar[str] = "int4"
    per_pack: ClassVar[int] = 2
    _pack_rule: ClassVar[str] = "must be even for int4 (two values per byte)"
    chunk: int = 1024
    stochastic: bool = False


@register_params
@dataclass(frozen=True, kw_only=True)
class Int3Params(_ChunkedQuantParams):
    """int3: eight values per three bytes (quant.py)."""

    kind: ClassVar[str] = "int3"
    per_pack: ClassVar[int] = 8
    _pack_rule: ClassVar[str] = "must be a multiple of 8 for int3 (eight values per three bytes)"
    chunk: int = 256
    stochastic: bool = False


@register_params
@dataclass(frozen=True, kw_only=True)
class SignParams(CodecParams):
    """sign: one bit per value and a scale per `chunk` (quant.py)."""

    kind: ClassVar[str] = "sign"
    chunk: int = 4096

    def __post_init__(self) -> None:
        check_int("chunk", self.chunk, 1, 1 << 24)


@register_params
@dataclass(frozen=True, kw_only=True)
class TernaryParams(CodecParams):
    """ternary: five values a byte, a level per `chunk` (ternary.py)."""

    kind: ClassVar[str] = "ternary"
    chunk: int = 1024
    threshold: float = 0.75

    def __post_init__(self) -> None:
        check_int("chunk", self.chunk, 1, 1 << 24)
        if not 0.0 <= self.threshold <= 10.0:
            raise ValueError(f"threshold: must be in [0, 10] (times the chunk's mean |x|), got {self.threshold}")


@register_params
@dataclass(frozen=True, kw_only=True)
class TopKParams(CodecParams):
    """topk: the `fraction` largest |values|, values through `inner` (sparse.py)."""

    kind: ClassVar[str] = "topk"
    elementwise: ClassVar[bool] = False
    sparse: ClassVar[bool] = True
    fraction: float = 0.01
    inner: CodecParams = FP16Params()

    def __post_init__(self) -> None:
        check_fraction(self.fraction)
        check_inner(self.kind, self.inner)

    @property
    def contractive(self) -> bool:
        return self.inner.contractive


@register_params
@dataclass(frozen=True, kw_only=True)
class RandomKParams(CodecParams):
    """randomk: `fraction` of the values at seeded indices, rescaled (sparse.py)."""

    kind: ClassVar[str] = "randomk"
    linear: ClassVar[bool] = True
    elementwise: ClassVar[bool] = False
    sparse: ClassVar[bool] = True
    fraction: float = 0.01
    inner: CodecParams = FP16Params()

    def __post_init__(self) -> None:
        check_fraction(self.fraction)
        check_inner(self.kind, self.inner)

    @property
    def contractive(self) -> bool:
        return False


@register_params
@dataclass(frozen=True, kw_only=True)
class PowerSGDParams(CodecParams):
    """powersgd: rank-`rank` factors of every matrix (powersgd.py)."""

    kind: ClassVar[str] = "powersgd"
    linear: ClassVar[bool] = True  # for a shared Q
    elementwise: ClassVar[bool] = False
    rank: int = 4

    def __post_init__(self) -> None:
        # Decoding costs numel x rank multiply-adds whatever the payload's size: 64 bounds what a
        # hostile payload can make a receiver compute (PowerSGD itself uses ranks 1-8).
        check_int("rank", self.rank, 1, 64)


SPARSELOCO_MIN_BITS, SPARSELOCO_MAX_BITS = 4, 16


@register_params
@dataclass(frozen=True, kw_only=True)
class SparseLoCoParams(CodecParams):
    """sparseloco: top `fraction` of every `chunk`, 2-bit values (sparseloco.py)."""

    kind: ClassVar[str] = "sparseloco"
    elementwise: ClassVar[bool] = False
    sparse: ClassVar[bool] = True
    fraction: float = 0.01
    chunk: int = 4096

    def __post_init__(self) -> None:
        check_fraction(self.fraction)
        lo, hi = 1 << SPARSELOCO_MIN_BITS, 1 << SPARSELOCO_MAX_BITS
        if not (lo <= self.chunk <= hi) or self.chunk & (self.chunk - 1):
            raise ValueError(f"chunk: must be a power of two in [{lo}, {hi}], got {self.chunk}")
