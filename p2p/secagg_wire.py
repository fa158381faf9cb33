"""The bytes of secure aggregation's messages: key adverts and masked updates (p2p/secagg_run.py
adds its reveal and recovery messages on the same layout). Decoding is strict and bounded (a
peer's bytes are hostile until checked): every malformed message is a SecAggError("malformed"),
never another exception.

Layout: magic b"GSA1", one type byte, then fields, each a 4-byte big-endian length and its bytes.
"""

from __future__ import annotations

import numpy as np

from . import secmask
from .secagg import KeyAdvert, SecAggError

MAGIC = b"GSA1"
ADVERT = 1  # types 2 and 3 were the per-round protocol's share bundle and reveal; 5 and 6 are secagg_run's
MAX_FIELD = 1 << 16  # every field but a masked vector is small
MAX_FIELDS = 2 * 256 + 16  # an advert for 256 regions


def _pack(kind: int, fields: list[bytes]) -> bytes:
    return MAGIC + bytes([kind]) + b"".join(len(f).to_bytes(4, "big") + f for f in fields)


def _unpack(data: bytes | memoryview, kind: int) -> list[bytes]:
    data = bytes(data)
    if data[:4] != MAGIC or len(data) < 5 or data[4] != kind:
        raise SecAggError("malformed", f"not a secure-aggregation message of type {kind}")
    fields, pos = [], 5
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
    """The advert in `data` and the certificate it came with (`secagg_run.verify_run_advert` checks both)."""
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
    dtype = secmask.ring_dtype(bits)
    if len(data) != numel * dtype.itemsize:
        raise SecAggError("malformed", f"a masked update of {len(data)} bytes; {numel} values of {bits} bits "
                                       f"are {numel * dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype).copy()
