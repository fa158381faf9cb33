"""The shared-scale grid of secure aggregation in the round (regions/secagg_round.py): every
region's tensors as one int64 vector on per-chunk scales, and the length-prefixed framing of its
side messages (scales and advert; masked update, grid digest and the next round's absmax)."""

from __future__ import annotations

import struct

import numpy as np
import torch

from geofed.p2p import secmask
from geofed.p2p.secagg import SecAggError

CHUNK = 4096  # values per shared scale (int8's chunk)


def pack(*parts: bytes) -> bytes:
    """Each part with its 4-byte little-endian length in front."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def unpack(payload: bytes, count: int) -> list[bytes]:
    """Exactly `count` parts of `pack` (SecAggError "malformed" otherwise)."""
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(payload):
            raise SecAggError("malformed", "a secure-aggregation message ends inside a length")
        (n,) = struct.unpack_from("<I", payload, pos)
        if pos + 4 + n > len(payload):
            raise SecAggError("malformed", "a secure-aggregation message ends inside a part")
        out.append(payload[pos + 4:pos + 4 + n])
        pos += 4 + n
    if pos != len(payload):
        raise SecAggError("malformed", f"{len(payload) - pos} bytes after a secure-aggregation message")
    return out



def quantize_all(own: list[torch.Tensor], scales: np.ndarray, levels: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One int64 vector of every tensor's values (each tensor chunked on its own) and, per
    tensor, its slice of `scales`."""
    parts, spans, c0 = [], [], 0
    for o in own:
        nch = -(-o.numel() // CHUNK)
        spans.append((c0, c0 + nch))
        parts.append(secmask.quantize(o.numpy(), scales[c0:c0 + nch], chunk=CHUNK, levels=levels))
        c0 += nch
    return np.concatenate(parts), spans


def dequantize_all(q: np.ndarray, scales: np.ndarray, spans, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The float tensors (shaped like `like`) of `q`, a region's values or a sum of them."""
    out, pos = [], 0
    for (c0, c1), ref in zip(spans, like):
        vals = secmask.dequantize(q[pos:pos + ref.numel()], scales[c0:c1], chunk=CHUNK)
        out.append(torch.from_numpy(vals).reshape(ref.shape))
        pos += ref.numel()
    return out


def absmax_of(raw: bytes, nchunks: int, sender: str) -> np.ndarray:
    """A peer's chunk maxima (SecAggError "malformed" unless `nchunks` finite non-negative floats)."""
    if len(raw) != 4 * nchunks:
        raise SecAggError("malformed", f"{sender} sent {len(raw) // 4} chunk maxima, {nchunks} expected")
    am = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.all(np.isfinite(am)) or np.any(am < 0):
        raise SecAggError("malformed", f"{sender}'s chunk maxima are not finite non-negative numbers")
    return am
