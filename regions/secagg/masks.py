"""Secure aggregation's arithmetic: seeds, keystreams, masks over Z_2^b and the shared-scale
quantiser that puts a float update into that ring (the protocol around it: round.py), the unmasking of a round's sum and the shared-scale grid
that puts a region's tensors on it.

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

import hashlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import SecAggError

RING_BITS = (8, 16, 32)
_DTYPES: dict[int, np.dtype] = {8: np.dtype("<u1"), 16: np.dtype("<u2"), 32: np.dtype("<u4")}
_NONCE = bytes(16)  # every seed keys one stream only (HKDF binds it to run, round and pair)
_LABEL = b"geofed-secagg-v1"
CHUNK = 4096  # values per shared scale (int8's chunk)


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


# ---- the round's sum ---------------------------------------------------------------------

def unmask_total(masked: Mapping[str, np.ndarray], *, self_keys: Mapping[str, bytes],
                 dropped_seeds: Mapping[tuple[str, str], bytes], bits: int) -> np.ndarray:
    """The int64 sum of the survivors' (`masked`'s) values: their self masks removed with their
    round's self keys, and the mask each survivor s shared with each dropped d removed with the
    pair seed `dropped_seeds[(s, d)]` (s added it with pair_sign(s, d))."""
    if set(self_keys) != set(masked):
        raise SecAggError("too_few_shares", f"self keys of {sorted(self_keys)}, survivors {sorted(masked)}")
    total = ring_sum(masked.values(), bits)
    n = total.size
    for s in sorted(masked):
        np.subtract(total, keystream(self_keys[s], n, bits), out=total)
    for (s, d), seed in sorted(dropped_seeds.items()):
        if s not in masked or d in masked:
            raise SecAggError("reveal_conflict", f"a pair seed of {s} and {d}: {s} must survive, {d} be dropped")
        stream = keystream(seed, n, bits)
        (np.subtract if pair_sign(s, d) > 0 else np.add)(total, stream, out=total)
    return from_ring(total, bits)


def digest(*arrays: np.ndarray) -> bytes:
    """What two regions compare to know they used one grid (the shared scales)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()[:16]


# ---- the shared-scale grid: a region's tensors as one vector -----------------------------

def quantize_all(own: list[torch.Tensor], scales: np.ndarray, levels: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One int64 vector of every tensor's values (each tensor chunked on its own) and, per
    tensor, its slice of `scales`."""
    parts, spans, c0 = [], [], 0
    for o in own:
        nch = -(-o.numel() // CHUNK)
        spans.append((c0, c0 + nch))
        parts.append(quantize(o.numpy(), scales[c0:c0 + nch], chunk=CHUNK, levels=levels))
        c0 += nch
    return np.concatenate(parts), spans


def dequantize_all(q: np.ndarray, scales: np.ndarray, spans: Sequence[tuple[int, int]], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The float tensors (shaped like `like`) of `q`, a region's values or a sum of them."""
    out, pos = [], 0
    for (c0, c1), ref in zip(spans, like):
        vals = dequantize(q[pos:pos + ref.numel()], scales[c0:c1], chunk=CHUNK)
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
