"""The bytes of secure aggregation's messages. Decoding is strict and bounded (a peer's bytes are
hostile until checked): every malformed message is a SecAggError("malformed"), never another
exception.

Two layouts. The key advert, the reveal and the recovery answer: magic b"GSA1", one type byte,
then fields, each a 4-byte big-endian length and its bytes. The round's side messages (SETUP:
absmax, advert, keys wanted; MASKED: masked update, grid digest, next absmax, self-key share):
parts, each with a 4-byte little-endian length in front (`pack`/`unpack`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

import numpy as np

from . import SecAggError, masks
from .keys import KeyAdvert

MAGIC = b"GSA1"
ADVERT = 1  # types 2 and 3 were the per-round protocol's share bundle and reveal (deleted)
REVEAL, RECOVER = 5, 6
MAX_FIELD = 1 << 16  # every field but a masked vector is small
MAX_FIELDS = 2 * 256 + 16  # an advert for 256 regions


def _pack(kind: int, fields: list[bytes]) -> bytes:
    return MAGIC + bytes([kind]) + b"".join(len(f).to_bytes(4, "big") + f for f in fields)


def _unpack(data: bytes | memoryview, kind: int) -> list[bytes]:
    data = bytes(data)
    if data[:4] != MAGIC or len(data) < 5 or data[4] != kind:
        raise SecAggError("malformed", f"not a secure-aggregation message of type {kind}")
    fields: list[bytes] = []
    pos = 5
    while pos < len(data):
        if len(fields) >= MAX_FIELDS or pos + 4 > len(data):
            raise SecAggError("malformed", "too many fields or a truncated length")
        n = int.from_bytes(data[pos:pos + 4], "big")
        if n > MAX_FIELD or pos + 4 + n > len(data):
            raise SecAggError("malformed", f"a field of {n} bytes runs past the message")
        fields.append(data[pos + 4:pos + 4 + n])
        pos += 4 + n
    return fields


def _text(b: bytes) -> str:
    try:
        s = b.decode("utf-8")
    except UnicodeDecodeError:
        raise SecAggError("malformed", "a name is not UTF-8") from None
    if not s or len(s) > 256 or not s.isprintable():
        raise SecAggError("malformed", f"a name of {len(s)} characters or with control characters")
    return s


def _int(b: bytes) -> int:
    if len(b) != 8:
        raise SecAggError("malformed", "a round is not 8 bytes")
    return int.from_bytes(b, "big")


def encode_advert(a: KeyAdvert, cert_pem: bytes = b"") -> bytes:
    """A KeyAdvert and the signer's certificate (PEM, checked against the run's CA by the
    receiver; empty without TLS): run, round, region, key, signature, certificate, n, then the key
    and seed commitments."""
    n = len(a.commitments[0])
    return _pack(ADVERT, [a.run_id.encode(), a.round.to_bytes(8, "big"), a.region.encode(), a.public_key,
                          a.signature, cert_pem, n.to_bytes(2, "big"), *a.commitments[0], *a.commitments[1]])


def decode_advert(data: bytes | memoryview) -> tuple[KeyAdvert, bytes]:
    """The advert in `data` and the certificate it came with (`keys.verify_run_advert` checks both)."""
    f = _unpack(data, ADVERT)
    if len(f) < 7:
        raise SecAggError("malformed", "an advert needs at least 7 fields")
    n = int.from_bytes(f[6], "big")
    if len(f) != 7 + 2 * n:
        raise SecAggError("malformed", f"an advert for {n} regions has {len(f) - 7} commitments")
    advert = KeyAdvert(run_id=_text(f[0]), round=_int(f[1]), region=_text(f[2]), public_key=f[3], signature=f[4],
                       commitments=(tuple(f[7:7 + n]), tuple(f[7 + n:])))
    return advert, f[5]


def encode_masked(masked: np.ndarray) -> bytes:
    """A masked update: the ring elements, little-endian (its length says nothing the shapes do not)."""
    return masked.astype(masked.dtype.newbyteorder("<"), copy=False).tobytes()


def decode_masked(data: bytes | memoryview, *, numel: int, bits: int) -> np.ndarray:
    """A masked update of exactly `numel` elements of Z_2^bits."""
    dtype = masks.ring_dtype(bits)
    if len(data) != numel * dtype.itemsize:
        raise SecAggError("malformed", f"a masked update of {len(data)} bytes; {numel} values of {bits} bits "
                                       f"are {numel * dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype).copy()


# ---- the reveal and the recovery answer --------------------------------------------------

def encode_reveal(run_id: str, round: int, region: str, *, self_key: bytes, survivors: Iterable[str],
                  grid: bytes) -> bytes:
    """A region's reveal to one peer: its round's self key (empty for a peer that did not
    acknowledge its masked update), the survivors it saw and the digest of its grid."""
    return _pack(REVEAL, [run_id.encode(), round.to_bytes(8, "big"), region.encode(), self_key, grid,
                              *(s.encode() for s in sorted(survivors))])


def decode_reveal(data: bytes | memoryview) -> tuple[str, int, str, bytes, frozenset[str], bytes]:
    """(run id, round, region, self key or b"", survivors, grid digest)."""
    f = _unpack(data, REVEAL)
    if len(f) < 5 or len(f[3]) not in (0, 32) or len(f[4]) != 16:
        raise SecAggError("malformed", "a reveal is run, round, region, a 32-byte key or none, a grid digest, survivors")
    return _text(f[0]), _int(f[1]), _text(f[2]), f[3], frozenset(_text(s) for s in f[5:]), f[4]


def encode_recover(run_id: str, round: int, region: str, seeds: Mapping[str, bytes]) -> bytes:
    """A survivor's answer to a region that lost some masked updates: its pair seed with each
    dropped region it also lost (regions it did get are left out: it will not help unmask them)."""
    fields = [run_id.encode(), round.to_bytes(8, "big"), region.encode()]
    for d, seed in sorted(seeds.items()):
        fields += [d.encode(), seed]
    return _pack(RECOVER, fields)


def decode_recover(data: bytes | memoryview) -> tuple[str, int, str, dict[str, bytes]]:
    """(run id, round, region, {dropped region: the pair seed})."""
    f = _unpack(data, RECOVER)
    if len(f) < 3 or (len(f) - 3) % 2 or any(len(f[i]) != 32 for i in range(4, len(f), 2)):
        raise SecAggError("malformed", "a recovery answer is run, round, region, then (dropped, 32-byte seed) pairs")
    return _text(f[0]), _int(f[1]), _text(f[2]), {_text(f[i]): f[i + 1] for i in range(3, len(f), 2)}


# ---- the round's side messages ------------------------------------------------------------

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
