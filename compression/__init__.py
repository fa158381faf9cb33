"""geofed.compression: codecs for model updates, error feedback, and their wire format.

    from geofed.compression import CodecSpec, CodecState, decode_update, encode_update, make_codec
    spec = CodecSpec.parse({"kind": "topk", "fraction": 0.01, "inner": "int8"})
    spec.key                                          # "topk(fraction=0.01,inner=int8)"
    codec = make_codec(spec)
    state = CodecState(error_feedback=True)          # one per peer link
    payload = encode_update(codec, list(delta), state)
    tensors = decode_update(payload, max_bytes=4 * numel + (1 << 20))

Imports only torch, numpy and the standard library (see docs/compression.md), and torch only when
something that needs it is first used: `CodecSpec`, `spec_key`, `codec_names` and the parameter
classes (params.py) are torch-free, so the config loader and `geofed validate`/`-h` stay light;
the rest is imported on first access (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .params import param_kinds as codec_names
from .spec import CodecSpec, spec_key

if TYPE_CHECKING:
    from .base import Codec, CodecError, Section, make_codec
    from .state import CodecState
    from .update import (choco_encode, choco_update, decode_update, encode_and_decode, encode_update,
                         inspect_update)

# name -> the submodule that defines it (imported, with torch, on first access).
_LAZY = {
    "Codec": "base", "CodecError": "base", "Section": "base", "make_codec": "base", "CodecState": "state",
    "choco_encode": "update", "choco_update": "update", "decode_update": "update", "encode_and_decode": "update",
    "encode_update": "update", "inspect_update": "update",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Codec",
    "CodecError",
    "CodecSpec",
    "CodecState",
    "Section",
    "choco_encode",
    "choco_update",
    "codec_names",
    "decode_update",
    "encode_and_decode",
    "encode_update",
    "inspect_update",
    "make_codec",
    "spec_key",
]
