"""The wire format of one encoded update, and its validation.

All integers little-endian. Every section starts at a multiple of 8 bytes (so zero-copy
`torch.frombuffer` views are aligned); padding bytes are zero.

    offset  size  field
    0       4     magic b"GFCU"
    4       2     version (1)
    6       2     flags (0)
    8       4     CRC-32 (zlib) of every byte from offset 12 to the end
    12      8     total length of the payload in bytes
    20      4     spec length S (JSON of the codec spec, UTF-8, <= 4096)
    24      4     tensor count T (<= 2^16)
    28      4     section count C (<= 64)
    32      4     reserved (0)
    36      S     codec spec: {"kind": ..., every parameter}
    ...           T tensor records: dtype code (u8), ndim (u8, <= 32), ndim dims (u64 each)
    ...           C section records: dtype code (u8), element count (u64)
    ...           zero padding to a multiple of 8, then the C sections, each padded to 8

`parse` checks, before anything is allocated: the length against max_bytes and the header's
total, the checksum, the codec spec (a known codec, valid parameters), every dtype code, the
shapes (against expected_shapes when given, and 4 bytes x elements <= max_bytes), and that the
section table is exactly the codec's layout for those shapes with the sections ending exactly
at the payload's end.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Codec, CodecError, Section, Shape, _padded, make_codec
from .buffers import PayloadPool, new_bytes, writable

if sys.byteorder != "little":  # sections are read in place with the host's byte order
    raise ImportError("geofed.compression: the wire format is little-endian; big-endian hosts are not supported")

MAGIC = b"GFCU"
VERSION = 1
_FIXED = struct.Struct("<4sHHIQIIII")
FIXED_BYTES = _FIXED.size  # 36
MAX_SPEC_BYTES = 4096
MAX_NDIM = 32
MAX_DIM = 1 << 40  # also bounds empty tensors, whose element count bounds nothing
MAX_SECTIONS = 64
MAX_TENSORS = 1 << 16  # bounds per-tensor Python work (parse, views) of a hostile header to ~0.7 s
_SECTION = struct.Struct("<BQ")

TENSOR_DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16, 4: torch.float64}
SECTION_DTYPES = {1: torch.uint8, 2: torch.int8, 3: torch.uint16, 4: torch.int16, 5: torch.int32,
                  6: torch.int64, 7: torch.float16, 8: torch.bfloat16, 9: torch.float32}
_TENSOR_CODES = {v: k for k, v in TENSOR_DTYPES.items()}
_SECTION_CODES = {v: k for k, v in SECTION_DTYPES.items()}


def tensor_dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a tensor dtype; CodecError for dtypes an update cannot carry (non-float)."""
    code = _TENSOR_CODES.get(dtype)
    if code is None:
        raise CodecError(f"dtype: cannot encode {dtype} tensors (floating point only: {', '.join(map(str, _TENSOR_CODES))})")
    return code


@dataclass(frozen=True)
class Header:
    """A parsed and fully validated payload header: the codec, the tensors' shapes and dtypes,
    and the sections (exactly `codec.layout(shapes)`) with their byte offsets in a payload of `total` bytes.
    """

    codec: Codec
    shapes: list[Shape]
    dtypes: list[torch.dtype]
    sections: list[Section]
    offsets: list[int]  # byte offset of each section
    total: int


def build_header(codec: Codec, shapes: Sequence[Shape], dtypes: Sequence[torch.dtype],
                 pool: PayloadPool | None = None) -> tuple[bytes, Header]:
    """The payload object of its final size (from `pool` when given), header and padding
    written, sections not yet (the codec writes every byte of them in place through
    `section_views`; `seal` adds the checksum)."""
    spec = json.dumps(codec.spec(), separators=(",", ":"), sort_keys=True).encode()
    if len(spec) > MAX_SPEC_BYTES:
        raise ValueError(f"codec: spec of {len(spec)} bytes exceeds {MAX_SPEC_BYTES}")
    if len(shapes) > MAX_TENSORS:
        raise ValueError(f"tensors: {len(shapes)} tensors, at most {MAX_TENSORS} per update (concatenate small ones)")
    parts = [spec]
    for s, dt in zip(shapes, dtypes):
        if len(s) > MAX_NDIM:
            raise CodecError(f"shape: {len(s)} dimensions, at most {MAX_NDIM}")
        parts.append(struct.pack(f"<BB{len(s)}Q", tensor_dtype_code(dt), len(s), *s))
    sections = codec.layout(shapes)
    assert len(sections) <= MAX_SECTIONS
    parts += [_SECTION.pack(_SECTION_CODES[sec.dtype], sec.count) for sec in sections]
    head = bytearray(_FIXED.size) + b"".join(parts)
    head += bytes(_padded(len(head)) - len(head))
    offsets, pos = [], len(head)
    for sec in sections:
        offsets.append(pos)
        pos += _padded(sec.nbytes)
    _FIXED.pack_into(head, 0, MAGIC, VERSION, 0, 0, pos, len(spec), len(shapes), len(sections), 0)
    buf = pool.take(pos) if pool is not None else new_bytes(pos)
    w = writable(buf)
    w[: len(head)] = torch.frombuffer(head, dtype=torch.uint8)
    for sec, off in zip(sections, offsets):
        w[off + sec.nbytes: off + _padded(sec.nbytes)] = 0
    return buf, Header(codec, list(shapes), list(dtypes), sections, offsets, pos)


def seal(buf: bytes) -> None:
    """Write the checksum once every section is filled in."""
    crc = struct.pack("<I", zlib.crc32(memoryview(buf)[12:]))
    writable(buf)[8:12] = torch.frombuffer(bytearray(crc), dtype=torch.uint8)


def section_views(buf: bytes | memoryview, header: Header) -> list[torch.Tensor]:
    """Zero-copy tensors over each section of `buf` (bytes views are never written)."""
    views = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read those
        for sec, off in zip(header.sections, header.offsets):
            if sec.count == 0:
                views.append(torch.empty(0, dtype=sec.dtype))
            else:
                views.append(torch.frombuffer(buf, dtype=sec.dtype, count=sec.count, offset=off))
    return views


class _Reader:
    def __init__(self, mv: memoryview, pos: int):
        self.mv, self.pos = mv, pos

    def take(self, fmt: struct.Struct | str, what: str) -> tuple:
        st = fmt if isinstance(fmt, struct.Struct) else struct.Struct(fmt)
        if self.pos + st.size > len(self.mv):
            raise CodecError(f"truncated: {what} needs {st.size} bytes at offset {self.pos}, payload has {len(self.mv)}")
        out = st.unpack_from(self.mv, self.pos)
        self.pos += st.size
        return out


def parse(mv: memoryview, *, max_bytes: int, expected_shapes: Sequence[Shape] | None) -> Header:
    """Validate the header of payload `mv` without allocating anything it declares (see the module
    docstring for every check) and return it; CodecError naming the first problem.
    """
    n = len(mv)
    if n > max_bytes:
        raise CodecError(f"too big: payload of {n} bytes exceeds max_bytes={max_bytes}")
    if n < FIXED_BYTES:
        raise CodecError(f"truncated: {n} bytes, shorter than the {FIXED_BYTES}-byte header")
    magic, version, flags, crc, total, spec_len, ntensors, nsections, _ = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError(f"magic: not a geofed update (starts {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise CodecError(f"version: {version} is not supported (this build reads version {VERSION})")
    if total != n:
        raise CodecError(f"truncated: header says {total} bytes, got {n}" if total > n
                         else f"length: header says {total} bytes but the payload has {n} (trailing bytes)")
    if zlib.crc32(mv[12:]) != crc:
        raise CodecError("checksum: CRC-32 mismatch (payload corrupted)")
    if flags:
        raise CodecError(f"flags: unknown flags {flags:#x}")
    codec = _read_codec(mv, spec_len)
    rd = _Reader(mv, FIXED_BYTES + spec_len)
    if ntensors > MAX_TENSORS:
        raise CodecError(f"tensor count: {ntensors} exceeds {MAX_TENSORS}")
    if ntensors > (n - rd.pos) // 2:
        raise CodecError(f"tensor count: {ntensors} tensors cannot fit in {n - rd.pos} remaining bytes")
    shapes, dtypes = _read_tensors(rd, ntensors)
    _check_shapes(shapes, expected_shapes, max_bytes)
    if nsections > MAX_SECTIONS:
        raise CodecError(f"section count: {nsections} exceeds {MAX_SECTIONS}")
    got = []
    for i in range(nsections):
        code, count = rd.take(_SECTION, f"section record {i}")
        if code not in SECTION_DTYPES:
            raise CodecError(f"dtype: section {i} has unknown dtype code {code}")
        got.append(Section(SECTION_DTYPES[code], count))
    want = codec.layout(shapes)
    if got != want:
        raise CodecError(f"sections: payload declares {_fmt(got)}, codec {codec.kind!r} for these shapes needs {_fmt(want)}")
    offsets, pos = [], _padded(rd.pos)
    for sec in want:
        offsets.append(pos)
        pos += _padded(sec.nbytes)
    if pos != n:
        raise CodecError(f"length: sections end at byte {pos}, payload has {n}")
    return Header(codec, shapes, dtypes, want, offsets, n)


def _read_codec(mv: memoryview, spec_len: int) -> Codec:
    if spec_len > MAX_SPEC_BYTES or FIXED_BYTES + spec_len > len(mv):
        raise CodecError(f"spec length: {spec_len} bytes does not fit (max {MAX_SPEC_BYTES}, payload {len(mv)})")
    try:
        spec = json.loads(bytes(mv[FIXED_BYTES: FIXED_BYTES + spec_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CodecError(f"codec: spec is not valid JSON ({exc})") from None
    try:
        return make_codec(spec)
    except (ValueError, TypeError) as exc:
        raise CodecError(f"codec: {exc}") from None


def _read_tensors(rd: _Reader, ntensors: int) -> tuple[list[Shape], list[torch.dtype]]:
    shapes, dtypes = [], []
    for i in range(ntensors):
        code, ndim = rd.take("<BB", f"tensor record {i}")
        if code not in TENSOR_DTYPES:
            raise CodecError(f"dtype: tensor {i} has unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise CodecError(f"shape: tensor {i} has {ndim} dimensions, at most {MAX_NDIM}")
        dims = rd.take(f"<{ndim}Q", f"shape of tensor {i}")
        if any(d > MAX_DIM for d in dims):
            raise CodecError(f"shape: tensor {i} has a dimension of {max(dims)}, more than {MAX_DIM}")
        shapes.append(tuple(dims))
        dtypes.append(TENSOR_DTYPES[code])
    return shapes, dtypes


def _check_shapes(shapes: list[Shape], expected: Sequence[Shape] | None, max_bytes: int) -> None:
    if expected is not None:
        expected = [tuple(s) for s in expected]
        if len(expected) != len(shapes):
            raise CodecError(f"shape: payload has {len(shapes)} tensors, expected {len(expected)}")
        for i, (got, want) in enumerate(zip(shapes, expected)):
            if got != want:
                raise CodecError(f"shape: tensor {i} is {got}, expected {want}")
    numel = 0
    for s in shapes:
        numel += math.prod(s)
        if 4 * numel > max_bytes:
            raise CodecError(f"too big: decoding needs more than {max_bytes} bytes (max_bytes) for {len(shapes)} tensors")


def _fmt(sections: list[Section]) -> str:
    return "[" + ", ".join(f"{str(s.dtype).removeprefix('torch.')}x{s.count}" for s in sections) + "]"
