"""Secure aggregation's arithmetic: seeds, keystreams, masks over Z_2^b and the shared-scale
quantiser that puts a float update into that ring (the protocol around it: p2p/secagg.py).

Region i adds PRG(s_ij) for every peer j with i < j (names compared as strings) and subtracts it
when i > j, so the pairwise masks cancel in the sum over all regions; it also adds a self mask
PRG(b_i) that the others remove once i is known to have survived (SecAgg's double masking: a
region wrongly declared dropped keeps its self mask, so revealing its pairwise key reveals nothing).

The ring is Z_2^b, b in {8, 16, 32}: numpy's unsigned adds wrap modulo 2^b, which is the ring's
arithmetic. Masked values are uniform over the ring whatever the input, so a masked update is b
bits a value on the wire: 32 is 4x an int8 update, 16 is 2x, 8 is 1x but then every region may use
only `levels_for(n, 8)` levels so that the sum of n of them cannot wrap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

RING_BITS = (8, 16, 32)
_DTYPES = {8: np.dtype("<u1"), 16: np.dtype("<u2"), 32: np.dtype("<u4")}
_NONCE = bytes(16)  # every seed keys one stream only (HKDF binds it to run, round and pair)
_LABEL = b"geofed-secagg-v1"


def ring_dtype(bits: int) -> np.dtype:
    """The little-endian unsigned dtype of Z_2^bits; ValueError for a ring geofed does not use."""
    if bits not in _DTYPES:
        raise ValueError(f"bits: the mask ring must be Z_2^b with b in {RING_BITS}, got {bits}")
    return _DTYPES[bits]


def _info(kind: bytes, run_id: str, round: int, *names: str) -> bytes:
    """HKDF's info: every field length-prefixed, so no two contexts share one encoding."""
    parts = [_LABEL, kind, run_id.encode(), round.to_bytes(8, "big")] + [n.encode() for n in names]
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def _hkdf(key_material: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key_material)


def pair_seed(private_key: X25519PrivateKey, peer_public: bytes, *, run_id: str, round: int,
              me: str, peer: str) -> bytes:
    """The 32-byte seed `me` and `peer` share this round: X25519, then HKDF-SHA256 bound to the run,
    the round and the two names (sorted, so both ends derive the same seed)."""
    try:
        shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # a low-order point gives the all-zero secret, which cryptography refuses
        raise ValueError(f"public_key: {peer}'s key gives no shared secret ({exc})") from None
    lo, hi = sorted((me, peer))
    return _hkdf(shared, _info(b"pair", run_id, round, lo, hi))


def self_seed_key(self_seed: bytes, *, run_id: str, round: int, region: str) -> bytes:
    """The keystream key of a region's self mask, bound to the run, round and region."""
    return _hkdf(self_seed, _info(b"self", run_id, round, region))


def keystream(seed: bytes, n: int, bits: int) -> np.ndarray:
    """n uniform elements of Z_2^bits: ChaCha20 keyed by `seed` over zeros."""
    dtype = ring_dtype(bits)
    enc = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    return np.frombuffer(enc.update(bytes(n * dtype.itemsize)), dtype=dtype).copy()


def pair_sign(me: str, peer: str) -> int:
    """+1 when `me` adds the pair's mask (me < peer), -1 when it subtracts it."""
    if me == peer:
        raise ValueError(f"peer: a region has no pairwise mask with itself ({me!r})")
    return 1 if me < peer else -1


def to_ring(values: np.ndarray, bits: int) -> np.ndarray:
    """Signed integers as elements of Z_2^bits (two's complement)."""
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"values: secure aggregation masks integers (quantise first), got {values.dtype}")
    return (values.astype(np.int64) & ((1 << bits) - 1)).astype(ring_dtype(bits))


def from_ring(ring: np.ndarray, bits: int) -> np.ndarray:
    """Ring elements back to signed int64, centred on 0 (the top half is negative)."""
    out = ring.astype(np.int64)
    out[out >= 1 << (bits - 1)] -= 1 << bits
    return out


def mask(values: np.ndarray, *, me: str, pair_seeds: Mapping[str, bytes], self_key: bytes, bits: int) -> np.ndarray:
    """`values` (integers) plus every pairwise mask with its sign and the self mask, in Z_2^bits."""
    y = to_ring(np.ravel(values), bits)
    for peer, seed in pair_seeds.items():
        stream = keystream(seed, y.size, bits)
        if pair_sign(me, peer) > 0:
            np.add(y, stream, out=y)
        else:
            np.subtract(y, stream, out=y)
    np.add(y, keystream(self_key, y.size, bits), out=y)
    return y


def ring_sum(arrays: Iterable[np.ndarray], bits: int) -> np.ndarray:
    """The sum in Z_2^bits; every array must have the ring's dtype and one length."""
    dtype, total = ring_dtype(bits), None
    for a in arrays:
        if a.dtype != dtype or a.ndim != 1:
            raise ValueError(f"masked: expected 1-D {dtype} vectors, got {a.ndim}-D {a.dtype}")
        if total is None:
            total = a.copy()
        elif a.size != total.size:
            raise ValueError(f"masked: vectors of {total.size} and {a.size} elements")
        else:
            np.add(total, a, out=total)
    if total is None:
        raise ValueError("masked: nothing to sum")
    return total


# ---- the shared-scale quantiser ------------------------------------------------------------

def levels_for(regions: int, bits: int, max_levels: int = 127) -> int:
    """The most levels each region may use so that a sum of `regions` values in [-L, L] never
    wraps Z_2^bits (|sum| <= 2^(bits-1) - 1), at most `max_levels` (int8's 127)."""
    ring_dtype(bits)
    levels = min(max_levels, ((1 << (bits - 1)) - 1) // max(1, regions))
    if levels < 1:
        raise ValueError(f"bits: Z_2^{bits} cannot hold a sum of {regions} regions' values")
    return levels


def shared_scales(absmax: Iterable[np.ndarray], levels: int) -> np.ndarray:
    """One scale per chunk that every region quantises with: the largest |value| any region
    reported for that chunk, over `levels`. The absmaxes are public (they are what an int8 update
    sends in the clear); a zero chunk gets scale 1 so that it quantises to zeros."""
    stacked = np.max(np.stack([np.asarray(a, dtype=np.float32) for a in absmax]), axis=0)
    if not np.all(np.isfinite(stacked)):
        raise ValueError("absmax: a region reported a non-finite chunk maximum")
    return np.where(stacked > 0, stacked / levels, 1.0).astype(np.float32)


def chunk_absmax(x: np.ndarray, chunk: int) -> np.ndarray:
    """Each chunk's largest |value| (the last chunk may be short)."""
    x = np.abs(np.ravel(x).astype(np.float32))
    pad = (-x.size) % chunk
    return np.pad(x, (0, pad)).reshape(-1, chunk).max(axis=1)


def quantize(x: np.ndarray, scales: np.ndarray, *, chunk: int, levels: int) -> np.ndarray:
    """int64 values round(x / scale) clipped to [-levels, levels], with each chunk's shared scale."""
    x = np.ravel(x).astype(np.float32)
    per_value = np.repeat(np.asarray(scales, dtype=np.float32), chunk)[: x.size]
    if per_value.size != x.size:
        raise ValueError(f"scales: {len(scales)} chunks of {chunk} do not cover {x.size} values")
    return np.clip(np.rint(x / per_value), -levels, levels).astype(np.int64)


def dequantize(q: np.ndarray, scales: np.ndarray, *, chunk: int) -> np.ndarray:
    """The float values of quantised integers (a region's or a sum of them)."""
    per_value = np.repeat(np.asarray(scales, dtype=np.float32), chunk)[: q.size]
    return (q.astype(np.float64) * per_value).astype(np.float32)
