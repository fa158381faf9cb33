"""Payload buffers: `bytes` objects filled in place, and the per-stream pool that reuses them.

Page faults, not codec work, bound the encode of a big update on these machines: a fresh
100 MB object costs ~40 ms (~0.4 ms per MB), identity's copy into a warm one ~5 ms. A stream
encodes the same layout round after round, so its `CodecState` keeps the last payload it
produced (`PayloadPool`) and overwrites it in place for a later encode of the same length, but
only once *nothing else references it*: not the caller, not a send still in flight (which holds
the payload or a memoryview of it), not a receiver's inbox. That is checked on the object's
reference count, so a payload somebody still holds never changes under them. A pool of two
double-buffers (the next encode while the last payload's sends still run: the one being sent is
left alone, the other reused); a stream keeps one, since overlap settles the exchange in flight
before the next encode (regions/sync/overlap.py), and a push that stalls past it costs a fresh
payload's page faults rather than a second payload held every round (1 B/param at int8, issue 39).

Both tricks are CPython's (a bytes object's storage and reference count); each is verified at
import, and where it does not hold this falls back to a fresh object per payload.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch

MIN_BYTES = 36  # the wire format's fixed header; sizes 0 and 1 may be shared singletons


def new_bytes(n: int) -> bytes:
    """An uninitialised bytes object of n >= 36 bytes, to be filled in place before anyone
    sees it (what C code does with PyBytes_FromStringAndSize(NULL, n)). It saves a memset and
    a full copy (bytearray, then bytes(...)); without ctypes.pythonapi a zeroed object serves."""
    assert n >= MIN_BYTES
    if _PyBytes_FromStringAndSize is None:
        return bytes(n)
    return _PyBytes_FromStringAndSize(None, n)


def writable(buf: bytes) -> torch.Tensor:
    """A uint8 tensor over `buf`'s storage, for a buffer nobody else can see yet."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": ours, not shared
        return torch.frombuffer(buf, dtype=torch.uint8)


class PayloadPool:
    """The last `capacity` payloads of one stream, reused once nobody else holds them.

    Not thread-safe (like the `CodecState` that owns it): one stream encodes on one thread.
    Memory: up to `capacity` payloads stay allocated between encodes.
    """

    def __init__(self, capacity: int = 2):
        self.capacity = capacity if _REUSABLE else 0
        self._bufs: list[bytes] = []  # least recently handed out first
        self.reused = 0  # encodes that found a free buffer (for tests and curiosity)

    def take(self, n: int) -> bytes:
        """A bytes object of n bytes with garbage contents, the caller's to fill."""
        bufs = self._bufs
        for i in range(len(bufs)):
            # No local name may hold the candidate while its references are counted.
            if len(bufs[i]) == n and _refs(bufs, i) == _ONLY_LISTED:
                buf = bufs.pop(i)
                _forget_hash(buf)
                self.reused += 1
                break
        else:
            buf = new_bytes(n)
        if self.capacity:
            bufs.append(buf)
            del bufs[: -self.capacity]  # forgotten, not freed: a holder keeps its payload
        return buf

    def clear(self) -> None:
        self._bufs.clear()


def _refs(items: list, i: int) -> int:
    return sys.getrefcount(items[i])


def _forget_hash(buf: bytes) -> None:
    # bytes caches its hash; a reused object must not answer with its previous contents' hash.
    assert _HASH_OFFSET is not None  # called only where _REUSABLE holds
    _ctypes.c_ssize_t.from_address(id(buf) + _HASH_OFFSET).value = -1


def _calibrate() -> tuple[int, int | None]:
    """(references a pooled buffer has when only the pool holds it, offset of the cached hash
    in a bytes object), or None for the offset when either cannot be relied on."""
    probe = [new_bytes(64)]
    alone = _refs(probe, 0)
    extra = probe[0]
    counted = _refs(probe, 0) == alone + 1  # another holder must show
    del extra
    writable(probe[0]).fill_(7)
    h = hash(probe[0])
    offset = bytes.__basicsize__ - 1 - _ctypes.sizeof(_ctypes.c_ssize_t)  # ob_shash, before ob_sval
    if not counted or _ctypes.c_ssize_t.from_address(id(probe[0]) + offset).value != h:
        return alone, None
    _ctypes.c_ssize_t.from_address(id(probe[0]) + offset).value = -1
    return alone, (offset if hash(probe[0]) == h else None)


_PyBytes_FromStringAndSize: Callable[[None, int], bytes] | None
try:
    import ctypes as _ctypes

    _PyBytes_FromStringAndSize = _ctypes.pythonapi.PyBytes_FromStringAndSize
    _PyBytes_FromStringAndSize.restype = _ctypes.py_object
    _PyBytes_FromStringAndSize.argtypes = (_ctypes.c_void_p, _ctypes.c_ssize_t)
    _ONLY_LISTED, _HASH_OFFSET = _calibrate()
except (ImportError, AttributeError):  # pragma: no cover - PyPy and friends
    _PyBytes_FromStringAndSize = None
    _ONLY_LISTED, _HASH_OFFSET = 0, None
_REUSABLE = _PyBytes_FromStringAndSize is not None and _HASH_OFFSET is not None and sys.implementation.name == "cpython"
