"""What the codec test modules share: seeded inputs, a round trip that checks the sender's view,
payload surgery (re-sealing the checksum after a poke), and a least-squares problem trained through
a codec (error feedback's effect, measured)."""

from __future__ import annotations

import struct
import zlib

import torch
from geofed.compression import CodecState, decode_update, encode_and_decode, encode_update

MAX = 1 << 26  # max_bytes of every decode here: far above any test payload


def randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def roundtrip(spec, x: torch.Tensor, state: CodecState | None = None) -> tuple[bytes, torch.Tensor]:
    """(payload, decoded) of one tensor; the sender's view (what EF subtracts) is what receivers decode."""
    payload, (sent,) = encode_and_decode(spec, [x], state)
    (got,) = decode_update(payload, max_bytes=MAX, expected_shapes=[x.shape])
    assert torch.equal(sent, got)
    return payload, got


def payload(spec, n: int, seed: int = 0) -> bytearray:
    return bytearray(encode_update(spec, [randn(n, seed)]))


def reseal(p: bytearray) -> bytes:
    """The payload with its CRC-32 recomputed: a poked section reaches the codec's own checks."""
    struct.pack_into("<I", p, 8, zlib.crc32(bytes(p[12:])))
    return bytes(p)


def least_squares(workers: int = 4, d: int = 512, m: int = 300, seed: int = 0):
    """Each worker's (A, b) of a least-squares problem; the workers' optima differ (non-IID)."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(workers):
        a = torch.randn(m, d, generator=g) / d ** 0.5
        data.append((a, a @ (torch.randn(d, generator=g) * 2 + i) + 0.1 * torch.randn(m, generator=g)))
    return data


def train(data, codec, ef: bool, *, steps: int, lr: float = 2.0):
    """Gradient descent on the mean of the workers' losses, each gradient sent through `codec`
    (None: fp32); returns (final mean loss, the workers' codec states)."""
    w = torch.zeros(data[0][0].shape[1])
    states = [CodecState(error_feedback=ef, seed=i) for i in range(len(data))]
    for _ in range(steps):
        update = torch.zeros_like(w)
        for (a, b), state in zip(data, states):
            grad = a.T @ (a @ w - b) / a.shape[0]
            update += grad if codec is None else encode_and_decode(codec, [grad], state)[1][0]
        w -= lr * update / len(data)
    return sum(float(((a @ w - b) ** 2).mean() / 2) for a, b in data) / len(data), states
