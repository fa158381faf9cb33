"""Encode and decode a whole model update (many tensors, one payload), error feedback, CHOCO.

The tensors are concatenated into one flat fp32 buffer (with error feedback: residual +
update, in the state's scratch buffer), the codec writes its sections straight into the
outgoing payload (a buffer of the state's that its previous holder has dropped, when there is
one: fresh pages cost more than most codecs' work), and decoding splits one flat fp32 result
back into the original shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import wire
from .base import Codec, CodecError, Shape, make_codec
from .state import CodecState


def encode_update(codec: Codec | str, tensors: Sequence[torch.Tensor], state: CodecState | None = None) -> bytes:
    """Encode `tensors` (any floating dtype, any shapes) into one self-describing payload.

    `state` is the sending stream's state (one per peer link): error-feedback residual, warm
    starts, seeds, byte counters. Without one, nothing carries over between calls.
    """
    payload, _ = _encode(make_codec(codec), tensors, state, want_decoded=False)
    return payload


def encode_and_decode(
    codec: Codec | str, tensors: Sequence[torch.Tensor], state: CodecState | None = None
) -> tuple[bytes, list[torch.Tensor]]:
    """`encode_update`, plus exactly what `decode_update` will return for the payload.

    The decoded tensors are fp32 views of one buffer, computed from the payload's own bytes
    by the receiver's code path, so sender and receivers hold bit-identical values.
    """
    payload, decoded = _encode(make_codec(codec), tensors, state, want_decoded=True)
    assert decoded is not None
    return payload, decoded


def decode_update(
    payload: bytes | bytearray | memoryview,
    *,
    max_bytes: int,
    expected_shapes: Sequence[Shape] | None = None,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Decode a payload into fp32 tensors (views of one buffer), validating it first.

    max_bytes bounds both the payload and the decoded fp32 result (4 bytes x elements): set
    it to at least 4 x the model's element count. expected_shapes, when given, must match the
    payload's shapes exactly. out: a flat contiguous fp32 buffer of exactly the update's
    element count to decode into (reusing one per peer saves the page faults of a fresh
    result, most of the decode time of a big update); the result is views of it.
    Anything malformed raises CodecError naming the problem; `out` may then hold garbage.
    """
    _check_max_bytes(max_bytes)
    mv = _as_bytes_view(payload)
    if out is not None and (out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous() or out.device.type != "cpu"):
        raise ValueError(f"out: must be a flat contiguous CPU float32 tensor, got {out.dtype} {tuple(out.shape)}")
    try:
        header = wire.parse(mv, max_bytes=max_bytes, expected_shapes=expected_shapes)
        sections = wire.section_views(mv, header)
        header.codec.validate(sections, header.shapes)
        flat = _output(out, sum(math.prod(s) for s in header.shapes))
        header.codec.decode_into(sections, header.shapes, flat)
    except CodecError:
        raise
    except (ValueError, IndexError, RuntimeError, OverflowError, TypeError) as exc:
        # Validation above should leave nothing for torch to trip on; if it does, the caller
        # still gets the one exception type that means "bad payload".
        raise CodecError(f"malformed payload: {type(exc).__name__}: {exc}") from exc
    bad = _first_nonfinite(flat)
    if bad is not None:
        raise CodecError(f"values: decoded update has NaN/Inf (first at element {bad})")
    return _split(flat, header.shapes)


def inspect_update(payload: bytes | bytearray | memoryview, *, max_bytes: int) -> wire.Header:
    """The validated header (codec, shapes, original dtypes, sections) without decoding."""
    _check_max_bytes(max_bytes)
    return wire.parse(_as_bytes_view(payload), max_bytes=max_bytes, expected_shapes=None)


def choco_encode(
    codec: Codec | str, x: Sequence[torch.Tensor], x_hat: Sequence[torch.Tensor], state: CodecState | None = None
) -> tuple[bytes, list[torch.Tensor]]:
    """CHOCO-gossip step (Koloskova et al. 2019): encode q = Q(x - x_hat).

    Returns (payload, q). The sender and every receiver then apply `choco_update(x_hat, q)` to
    their copy of this node's public x_hat, which stays identical everywhere because q is
    what the payload decodes to. No error feedback: x - x_hat already carries what was not
    sent, so `state` (for warm starts and seeds) must have error_feedback=False.
    """
    if state is not None and state.error_feedback:
        raise ValueError("state: CHOCO needs CodecState(error_feedback=False): x - x_hat already carries the residual")
    if len(x) != len(x_hat):
        raise ValueError(f"x_hat: {len(x_hat)} tensors for {len(x)} in x")
    diffs = []
    for i, (a, b) in enumerate(zip(x, x_hat)):
        if a.shape != b.shape:
            raise ValueError(f"x_hat: tensor {i} has shape {tuple(b.shape)}, x has {tuple(a.shape)}")
        diffs.append(a.detach().float() - b.detach().float())
    return encode_and_decode(codec, diffs, state)


def choco_update(x_hat: Sequence[torch.Tensor], q: Sequence[torch.Tensor]) -> None:
    """x_hat += q in place (the public-copy update of CHOCO gossip)."""
    if len(x_hat) != len(q):
        raise ValueError(f"q: {len(q)} tensors for {len(x_hat)} in x_hat")
    with torch.no_grad():
        for i, (h, d) in enumerate(zip(x_hat, q)):
            if h.shape != d.shape:
                raise ValueError(f"q: tensor {i} has shape {tuple(d.shape)}, x_hat has {tuple(h.shape)}")
            h.add_(d)


# ---- internals -------------------------------------------------------------------------
def _encode(codec: Codec, tensors: Sequence[torch.Tensor], state: CodecState | None, *,
            want_decoded: bool) -> tuple[bytes, list[torch.Tensor] | None]:
    tensors, absmax = _check_inputs(tensors)
    shapes = [tuple(t.shape) for t in tensors]
    dtypes = [t.dtype for t in tensors]
    pool = None if state is None else state.payloads  # a one-off encode keeps nothing
    if state is None:
        state = CodecState(error_feedback=False)
    state.bind(shapes)
    n = sum(t.numel() for t in tensors)
    ef = state.error_feedback and codec.contractive and not codec.lossless
    state.ef_applied = ef
    buf, header = wire.build_header(codec, shapes, dtypes, pool)
    views = wire.section_views(buf, header)
    # With EF, x = residual + update is built in the scratch buffer; once encoded, the two
    # buffers swap roles, so a failed encode leaves the residual untouched and nothing is copied.
    # A blockwise codec (it cannot fail) corrects the residual in place: no scratch at all.
    in_place = ef and codec.blockwise
    if ef:
        residual = state.residual_buffer(n)
        x = _corrected(tensors, residual, residual if in_place else state.scratch(n))
    else:
        x = _flatten(tensors, n)
    state.input_absmax = None if ef else absmax
    codec.encode_into(x, shapes, views, state)
    decoded = None
    if ef and not in_place:
        state.store["scratch"], state.residual = state.residual, x
    if want_decoded:
        flat = torch.empty(n)
        codec.decode_into(views, shapes, flat)
        decoded = _split(flat, shapes)
        if ef:
            x.sub_(flat)  # corrected - sent is what is left
    elif ef:
        codec.subtract_decoded(x, views, shapes, torch.empty(0) if in_place else state.scratch(n))
    wire.seal(buf)
    payload = buf
    state.counter += 1
    state.bytes_raw += 4 * n
    state.bytes_wire += len(payload)
    return payload, decoded


def _check_inputs(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors: pass a sequence of tensors (e.g. [t] or list(model.parameters())), not one tensor")
    out = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}]: expected a torch.Tensor, got {type(t).__name__}")
        wire.tensor_dtype_code(t.dtype)
        t = t.detach()
        out.append(t if t.device.type == "cpu" else t.cpu())
    # aminmax propagates NaN and Inf, and its result is what the half casts need to saturate.
    absmax = 0.0
    for i, t in enumerate(out):
        if t.numel():
            lo, hi = (float(v) for v in torch.aminmax(t))
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise CodecError(f"tensors[{i}]: contains NaN or Inf; refusing to encode it")
            absmax = max(absmax, hi, -lo)
    return out, absmax


def _corrected(tensors: list[torch.Tensor], residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    off = 0
    for t in tensors:
        torch.add(residual[off: off + t.numel()], t.reshape(-1), out=out[off: off + t.numel()])
        off += t.numel()
    return out


def _flatten(tensors: list[torch.Tensor], n: int) -> torch.Tensor:
    if len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].is_contiguous():
        return tensors[0].view(-1)  # codecs never write their input
    flat = torch.empty(n)
    off = 0
    for t in tensors:
        flat[off: off + t.numel()].copy_(t.reshape(-1))
        off += t.numel()
    return flat


def _output(out: torch.Tensor | None, numel: int) -> torch.Tensor:
    if out is None:
        return torch.empty(numel)
    if out.numel() != numel:
        raise CodecError(f"shape: payload holds {numel} elements, out has {out.numel()}")
    return out


def _split(flat: torch.Tensor, shapes: Sequence[Shape]) -> list[torch.Tensor]:
    out, off = [], 0
    for s in shapes:
        k = math.prod(s)
        out.append(flat[off: off + k].view(s))
        off += k
    return out


def _first_nonfinite(flat: torch.Tensor) -> int | None:
    # A sum is one fast pass and turns any NaN/Inf non-finite; only then look element-wise
    # (the sum of finite values can overflow too).
    if flat.numel() == 0 or bool(torch.isfinite(flat.sum())):
        return None
    bad = (~torch.isfinite(flat)).nonzero()
    return int(bad[0, 0]) if bad.numel() else None


def _check_max_bytes(max_bytes: int) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes: must be a positive integer, got {max_bytes!r}")


def _as_bytes_view(payload: object) -> memoryview:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload: expected bytes, bytearray or memoryview, got {type(payload).__name__}")
    mv = memoryview(payload)
    if not mv.c_contiguous:
        raise CodecError("payload: memoryview is not contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
