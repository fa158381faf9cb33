"""geofed.compression: codecs for model updates, error feedback, and their wire format.

    from geofed.compression import CodecSpec, CodecState, encode_update, decode_update
    spec = CodecSpec.parse({"kind": "topk", "fraction": 0.01, "inner": "int8"})
    spec.key                                          # "topk(fraction=0.01,inner=int8)"
    codec = spec.codec()
    state = CodecState(error_feedback=True)          # one per peer link
    payload = encode_update(codec, list(delta), state)
    tensors = decode_update(payload, max_bytes=4 * numel + (1 << 20))

Imports only torch, numpy and the standard library (see docs/compression.md).
"""

from . import cast as _cast  # noqa: F401  (registers identity, fp16, bf16)
from . import powersgd as _powersgd  # noqa: F401
from . import quant as _quant  # noqa: F401
from . import sparse as _sparse  # noqa: F401
from . import sparseloco as _sparseloco  # noqa: F401
from . import ternary as _ternary  # noqa: F401
from .base import Codec, CodecError, Section, codec_names, make_codec
from .spec import CodecSpec, spec_key
from .state import CodecState
from .update import (
    choco_encode,
    choco_update,
    decode_update,
    encode_and_decode,
    encode_update,
    inspect_update,
)

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
