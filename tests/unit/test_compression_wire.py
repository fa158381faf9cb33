"""The wire format: targeted malformed payloads, and a 1,000-payload fuzz under a memory limit.

The fuzz runs in a child process whose address space is capped a few hundred MiB above what
it uses at start, while the lying headers claim gigabytes: an allocation sized from a header
would fail there, surface as something other than a specific CodecError, and fail the test.
"""

from __future__ import annotations

import json
import random
import resource
import struct
import subprocess
import sys
import zlib
from collections import Counter

import pytest
import torch
from geofed.compression import CodecError, decode_update, encode_update, inspect_update

torch.set_num_threads(1)

BASES = [
    ("identity", [(6, 5), (7,)]),
    ("fp16", [(33,)]),
    ("bf16", [(2, 2, 2), (1,)]),
    ({"kind": "int8", "chunk": 16}, [(40,), (3, 3)]),
    ({"kind": "int4", "chunk": 8}, [(21,)]),
    ({"kind": "sign", "chunk": 8}, [(19,), (4, 4)]),
    ({"kind": "topk", "fraction": 0.2}, [(70000,)]),  # two 65536-blocks of indices
    ({"kind": "topk", "fraction": 0.3, "inner": "int8"}, [(10, 10)]),
    ({"kind": "randomk", "fraction": 0.25}, [(64,)]),
    ({"kind": "powersgd", "rank": 2}, [(20, 30), (30,)]),
    ({"kind": "sparseloco", "fraction": 0.1, "chunk": 64}, [(200,), (3, 7)]),  # 3 full chunks and a tail
    ({"kind": "int3", "chunk": 16}, [(21,), (2, 5)]),  # 31 values: three full groups of 8 and a tail
    ({"kind": "ternary", "chunk": 16}, [(21,), (2, 5)]),  # 31 values: six bytes of five codes, one of a code and padding
]


def _base(i, seed=0):
    spec, shapes = BASES[i % len(BASES)]
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g) for s in shapes]
    return bytearray(encode_update(spec, ts)), shapes


def _reseal(p: bytearray) -> bytes:
    struct.pack_into("<I", p, 8, zlib.crc32(bytes(p[12:])))
    return bytes(p)


def _cap(shapes):
    return 4 * sum(torch.Size(s).numel() for s in shapes) + 4096


def _decode(p, shapes, expected=True):
    return decode_update(bytes(p), max_bytes=_cap(shapes), expected_shapes=shapes if expected else None)


def _section(p, index):
    h = inspect_update(bytes(p), max_bytes=1 << 30)
    return h.offsets[index], h.sections[index]


def _rebuild(spec_bytes: bytes, tail: bytes) -> bytes:
    """A payload with this spec text and everything after the spec taken from `tail`
    (the format, written independently of wire.py: it checks the documented layout too)."""
    body = spec_bytes + tail
    total = 36 + len(body)
    p = bytearray(struct.pack("<4sHHIQIIII", b"GFCU", 1, 0, 0, total, len(spec_bytes), 0, 0, 0)) + body
    return p


def _with_spec(spec_bytes: bytes, i=0):
    p, shapes = _base(i)
    _, _, _, _, _, spec_len, nt, ns, _ = struct.unpack_from("<4sHHIQIIII", p, 0)
    q = _rebuild(spec_bytes, bytes(p[36 + spec_len:]))
    struct.pack_into("<II", q, 24, nt, ns)
    return _reseal(q), shapes


# ---- targeted cases: each names what is wrong ------------------------------------------
def test_valid_payloads_decode():
    for i in range(len(BASES)):
        p, shapes = _base(i)
        assert [tuple(t.shape) for t in _decode(p, shapes)] == [tuple(s) for s in shapes]


@pytest.mark.parametrize("mutate,message", [
    (lambda p: p[:20], "truncated: 20 bytes, shorter than the 36-byte header"),
    (lambda p: p[:-3], "truncated: header says"),
    (lambda p: p + b"\0", "trailing bytes"),
    (lambda p: b"XXXX" + p[4:], "magic: not a geofed update"),
    (lambda p: p[:4] + b"\x02\x00" + p[6:], "version: 2 is not supported"),
    (lambda p: p[:-1] + bytes([p[-1] ^ 1]), "checksum: CRC-32 mismatch"),
])
def test_framing_errors(mutate, message):
    p, shapes = _base(3)
    with pytest.raises(CodecError, match=message.replace("(", r"\(")):
        _decode(mutate(bytes(p)), shapes)


def test_shape_errors():
    p, _ = _base(0)
    with pytest.raises(CodecError, match=r"shape: tensor 1 is \(7,\), expected \(8,\)"):
        decode_update(bytes(p), max_bytes=1 << 20, expected_shapes=[(6, 5), (8,)])
    with pytest.raises(CodecError, match="shape: payload has 2 tensors, expected 1"):
        decode_update(bytes(p), max_bytes=1 << 20, expected_shapes=[(6, 5)])
    with pytest.raises(CodecError, match="too big: payload of"):
        decode_update(bytes(p), max_bytes=len(p) - 1)
    sparse, _ = _base(6)  # top-k: a small payload that decodes to 70,000 floats
    with pytest.raises(CodecError, match=f"too big: decoding needs more than {len(sparse)} bytes"):
        decode_update(bytes(sparse), max_bytes=len(sparse))


def _tensor_table_offset(p):
    spec_len = struct.unpack_from("<I", p, 20)[0]
    return 36 + spec_len


@pytest.mark.parametrize("patch,message", [
    (lambda p, o: p.__setitem__(o, 0), "dtype: tensor 0 has unknown dtype code 0"),
    (lambda p, o: p.__setitem__(o + 1, 40), "shape: tensor 0 has 40 dimensions"),
    (lambda p, o: struct.pack_into("<Q", p, o + 2, 1 << 41), "shape: tensor 0 has a dimension of"),
    (lambda p, o: struct.pack_into("<Q", p, o + 2, 1 << 35), "too big: decoding needs more than"),
    (lambda p, o: struct.pack_into("<I", p, 24, 1 << 30), "tensor count: 1073741824 exceeds 65536"),
    (lambda p, o: struct.pack_into("<I", p, 24, 1 << 15), "tensor count: 32768 tensors cannot fit"),
    (lambda p, o: struct.pack_into("<I", p, 28, 1000), "section count: 1000 exceeds 64"),
    (lambda p, o: struct.pack_into("<I", p, 28, 0), "sections: payload declares [], codec 'identity' for these shapes needs [float32x37]"),
    (lambda p, o: struct.pack_into("<I", p, 20, 5000), "spec length: 5000 bytes does not fit"),
    (lambda p, o: struct.pack_into("<H", p, 6, 1), "flags: unknown flags 0x1"),
])
def test_lying_headers(patch, message):
    p, _ = _base(0)
    patch(p, _tensor_table_offset(p))
    with pytest.raises(CodecError) as exc:
        decode_update(_reseal(p), max_bytes=1 << 20)
    assert message in str(exc.value)


@pytest.mark.parametrize("spec,message", [
    (b'{"kind":"zstd"}', "codec: kind: unknown codec 'zstd'"),
    (b'{"kind":"int8","chunk":0}', "codec: chunk: must be in [1, 16777216]"),
    (b'{"kind":"int8","chunk":16,"evil":1}', "codec: evil: unknown parameter"),
    (b"\xff\xfe", "codec: spec is not valid JSON"),
    (b"[" * 3000 + b"]" * 3000, "spec length"),
    (b"[" * 2000 + b"]" * 2000, "codec: spec is not valid JSON"),
    (b"[1]", "codec: codec: expected a codec name or a mapping"),
])
def test_lying_specs(spec, message):
    p, shapes = _with_spec(spec, 3)
    with pytest.raises(CodecError) as exc:
        decode_update(p, max_bytes=1 << 20, expected_shapes=shapes)
    assert message in str(exc.value)


def test_a_different_codec_spec_does_not_match_the_sections():
    p, shapes = _with_spec(json.dumps({"kind": "int8", "chunk": 8, "stochastic": False}).encode(), 3)  # sent with chunk 16
    with pytest.raises(CodecError, match=r"sections: payload declares \[int8x49, float32x4\], codec 'int8' for these shapes needs"):
        _decode(p, shapes)


def _poke(i, section, fmt, value, index=0):
    p, shapes = _base(i)
    off, _ = _section(p, section)
    struct.pack_into(fmt, p, off + index * struct.calcsize(fmt), value)
    return _reseal(p), shapes


@pytest.mark.parametrize("i,section,fmt,value,index,message", [
    (1, 0, "<e", float("nan"), 5, "values: decoded update has NaN/Inf (first at element 5)"),
    (0, 0, "<f", float("inf"), 0, "values: decoded update has NaN/Inf"),
    (3, 1, "<f", 1e38, 0, "values: decoded update has NaN/Inf"),  # 127 x 1e38 overflows
    (3, 1, "<f", float("nan"), 2, "values: decoded update has NaN/Inf"),
    (9, 0, "<f", float("inf"), 0, "values: decoded update has NaN/Inf"),
    (6, 0, "<i", -1, 0, "topk: block counts sum to"),
    (6, 0, "<i", 5, 0, "topk: block counts sum to"),
    (6, 1, "<H", 0, 1, "topk: indices are not strictly increasing"),
    (7, 1, "<H", 200, 29, "topk: index 200 out of range for 100 elements"),
    (10, 2, "<f", -1.0, 0, "sparseloco: chunk magnitudes must be finite with 0 <= low <= high"),
    (10, 2, "<f", float("nan"), 3, "sparseloco: chunk magnitudes must be finite"),
    (10, 0, "<B", 0xFF, 0, "sparseloco: indices within a chunk are not strictly increasing"),
    (10, 0, "<B", 0xFF, 17, "sparseloco: in-chunk index 63 out of range for a chunk of 29"),
    (12, 0, "<B", 250, 2, "ternary: a byte of codes is 250"),
    (12, 0, "<B", 2, 6, "ternary: padding codes after the last value must be 1 (zero)"),
    (12, 1, "<f", -2.0, 1, "ternary: chunk levels must be finite and >= 0"),
])
def test_lying_section_contents(i, section, fmt, value, index, message):
    p, shapes = _poke(i, section, fmt, value, index)
    with pytest.raises(CodecError) as exc:
        _decode(p, shapes)
    assert message in str(exc.value)


def test_topk_block_counts_cannot_point_past_the_end():
    p, shapes = _base(6)
    off, _ = _section(p, 0)
    a, b = struct.unpack_from("<ii", p, off)
    struct.pack_into("<ii", p, off, 0, a + b)  # every index into block 1: past 70000 for most
    with pytest.raises(CodecError, match="topk: index .* out of range|not strictly increasing"):
        _decode(_reseal(p), shapes)


def test_decode_accepts_memoryview_and_bytearray():
    p, _ = _base(2)
    a = decode_update(memoryview(bytes(p)), max_bytes=1 << 20)
    b = decode_update(bytearray(p), max_bytes=1 << 20)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="max_bytes: must be a positive integer"):
        decode_update(bytes(p), max_bytes=0)


# ---- the fuzz ----------------------------------------------------------------------------
def _truncate(rng, p, shapes):
    return bytes(p[: rng.randrange(len(p))]), True


def _extend(rng, p, shapes):
    return bytes(p) + rng.randbytes(rng.randint(1, 64)), True


def _flip(rng, p, shapes):  # not resealed: the checksum (or a fixed field) must catch it
    for _ in range(rng.randint(1, 4)):
        p[rng.randrange(len(p))] ^= rng.randint(1, 255)
    return bytes(p), True


def _header_field(rng, p, shapes):
    field, fmt = rng.choice([(12, "<Q"), (20, "<I"), (24, "<I"), (28, "<I"), (4, "<H"), (6, "<H")])
    old = struct.unpack_from(fmt, p, field)[0]
    new = rng.choice([0, 1, old + 1, old - 1 if old > 1 else old + 2, rng.getrandbits(8 * struct.calcsize(fmt))])
    struct.pack_into(fmt, p, field, new if new != old else old + 1)
    return _reseal(p), True


def _tensor_record(rng, p, shapes):
    o = _tensor_table_offset(p)
    what = rng.randrange(3)
    if what == 0:
        p[o] = rng.choice([0, 5, 9, 255])
    elif what == 1:
        p[o + 1] = rng.randint(p[o + 1] + 1, 255)
    elif rng.random() < 0.5:  # a small lie can keep the codec's layout: only expected_shapes catches it
        struct.pack_into("<Q", p, o + 2, struct.unpack_from("<Q", p, o + 2)[0] + 1)
    else:
        return _huge(rng, p, shapes)
    return _reseal(p), True


def _huge(rng, p, shapes):  # a big lie, no expected shapes: max_bytes alone must stop it
    struct.pack_into("<Q", p, _tensor_table_offset(p) + 2, rng.choice([1 << 28, 1 << 33, 1 << 39, (1 << 64) - 1]))
    return _reseal(p), False


def _section_record(rng, p, shapes):
    h = inspect_update(bytes(p), max_bytes=1 << 30)
    j = rng.randrange(len(h.sections))
    at = _section_table_end(p) - 9 * (len(h.sections) - j)
    if rng.random() < 0.5:
        p[at] = rng.choice([0, 10, 200])
    else:
        cnt = struct.unpack_from("<Q", p, at + 1)[0]
        struct.pack_into("<Q", p, at + 1, rng.choice([cnt + 1, cnt + 8, 1 << 40, (1 << 64) - 1, cnt - 1 if cnt else 3]))
    return _reseal(p), True


def _spec(rng, p, shapes):
    h = inspect_update(bytes(p), max_bytes=1 << 30)
    spec = rng.choice([b'{"kind":"nope"}', b'{"kind":"int8","chunk":-4}', b'{"kind":"topk","fraction":7}',
                       b"null", b"{", b'{"kind":"powersgd","rank":99999}', rng.randbytes(rng.randint(1, 40))])
    q = _rebuild(spec, bytes(p[36 + struct.unpack_from("<I", p, 20)[0]:]))
    struct.pack_into("<II", q, 24, len(shapes), len(h.sections))
    return _reseal(q), True


def _nan(rng, p, shapes):
    h = inspect_update(bytes(p), max_bytes=1 << 30)
    floats = [j for j, s in enumerate(h.sections) if s.dtype in (torch.float16, torch.float32, torch.bfloat16) and s.count]
    j = rng.choice(floats)
    s = h.sections[j]
    fmt = {torch.float16: "<e", torch.float32: "<f", torch.bfloat16: "<H"}[s.dtype]
    bad = rng.choice([float("nan"), float("inf"), float("-inf")]) if fmt != "<H" else rng.choice([0x7FC0, 0x7F80, 0xFF80])
    struct.pack_into(fmt, p, h.offsets[j] + struct.calcsize(fmt) * rng.randrange(s.count), bad)
    return _reseal(p), True


def _topk_indices(rng, p, shapes):
    h = inspect_update(bytes(p), max_bytes=1 << 30)
    if h.codec.kind == "sparseloco":
        return _sparseloco_contents(rng, p, h)
    if h.codec.kind == "ternary":
        return _ternary_contents(rng, p, h)
    if h.codec.kind != "topk":
        return _nan(rng, p, shapes)
    off_c, off_l, k = h.offsets[0], h.offsets[1], h.sections[1].count
    if rng.random() < 0.5:
        struct.pack_into("<i", p, off_c, struct.unpack_from("<i", p, off_c)[0] + rng.choice([-1, 1, 1 << 20]))
    elif k > 1:  # a duplicate
        j = rng.randrange(1, k)
        struct.pack_into("<H", p, off_l + 2 * j, struct.unpack_from("<H", p, off_l + 2 * (j - 1))[0])
    else:
        struct.pack_into("<H", p, off_l, 0xFFFF)
    return _reseal(p), True


def _sparseloco_contents(rng, p, h):
    """The sparseloco base keeps 7 of each of 3 chunks of 64, then 3 of a tail of 29 (6-bit indices)."""
    what = rng.randrange(3)
    if what == 0:  # index 0 := 63, first of its chunk's 7: the next ones cannot increase
        p[h.offsets[0]] = 0xFF
    elif what == 1:  # the last index := 63, past the tail of 29
        p[h.offsets[0] + h.sections[0].count - 1] = 0xFF
    else:  # a chunk's low level above its high one, or negative
        j = rng.randrange(h.sections[2].count // 2)
        struct.pack_into("<ff", p, h.offsets[2] + 8 * j, *rng.choice([(2.0, 1.0), (-1.0, 1.0), (-3.0, -2.0)]))
    return _reseal(p), True


def _ternary_contents(rng, p, h):
    """The ternary base: 31 values in 7 bytes of codes (the last: one code, four of padding), 2 levels."""
    what = rng.randrange(3)
    if what == 0:  # a byte past 242: no five base-3 codes make it
        p[h.offsets[0] + rng.randrange(h.sections[0].count)] = rng.randrange(243, 256)
    elif what == 1:  # a padding code other than 1 (zero)
        p[h.offsets[0] + h.sections[0].count - 1] = 1 + 3 * rng.choice([0, 2]) + 9
    else:  # a negative level
        struct.pack_into("<f", p, h.offsets[1] + 4 * rng.randrange(h.sections[1].count), -rng.uniform(1e-3, 1e3))
    return _reseal(p), True


# Every mutation is invalid by construction; the checksum is recomputed wherever a lie should
# get past it to the deeper checks. Each returns (payload, pass expected_shapes?).
MUTATIONS = [_truncate, _extend, _flip, _header_field, _tensor_record, _huge, _section_record, _spec, _nan, _topk_indices]


def _section_table_end(p):
    """Where the section records end: after the spec and the tensor records."""
    spec_len, nt, ns = struct.unpack_from("<III", p, 20)
    pos = 36 + spec_len
    for _ in range(nt):
        ndim = p[pos + 1]
        pos += 2 + 8 * ndim
    return pos + 9 * ns


def check_case(bad: bytes, shapes, expected: bool) -> str | None:
    """None when decoding raised a specific CodecError, else what went wrong."""
    try:
        _decode(bad, shapes, expected=expected)
    except CodecError as exc:
        msg = str(exc)
        return f"fell through to the catch-all: {msg}" if msg.startswith("malformed payload") else None
    except BaseException as exc:  # noqa: BLE001 - the point is to see anything else
        return f"{type(exc).__name__}: {exc}"
    return "decoded without error"


def run_fuzz(count: int, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    failures = []
    for case in range(count):
        i = rng.randrange(len(BASES))
        p, shapes = _base(i, seed=case)
        bad, expected = rng.choice(MUTATIONS)(rng, p, shapes)
        problem = check_case(bad, shapes, expected)
        if problem:
            failures.append((case, i, problem))
        else:
            try:
                _decode(bad, shapes, expected=expected)
            except CodecError as exc:
                outcomes[str(exc).split(":")[0]] += 1
    return {"count": count, "outcomes": dict(outcomes), "failures": failures[:20], "nfail": len(failures)}


def _child(count: int, seed: int) -> None:
    # Warm up (imports, allocator, codec paths), then cap the address space just above today's use.
    run_fuzz(20, seed + 1)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    headroom = 512 << 20
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
    try:  # prove the cap bites: an allocation of twice the headroom must fail here
        torch.empty(2 * headroom // 4)
        enforced = False
    except RuntimeError:
        enforced = True
    out = run_fuzz(count, seed)
    out["limit_enforced"] = enforced
    print(json.dumps(out))


@pytest.mark.timeout(180)
def test_fuzz_1000_malformed_payloads_each_raise_codec_error_within_the_memory_cap():
    proc = subprocess.run([sys.executable, __file__, "1000", "7"], capture_output=True, text=True, timeout=170, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["count"] == 1000
    assert out["limit_enforced"]
    assert out["nfail"] == 0, out["failures"]
    # The fuzz reaches the deep checks, not only the checksum.
    for category in ("checksum", "truncated", "codec", "sections", "values", "too big", "topk", "shape", "dtype",
                     "sparseloco", "ternary"):
        assert out["outcomes"].get(category, 0) >= 5, out["outcomes"]


def test_fuzz_harness_flags_success_and_foreign_exceptions():
    p, shapes = _base(3)
    assert check_case(bytes(p), shapes, True) == "decoded without error"
    assert check_case(bytes(p)[:-1], shapes, True) is None
    assert check_case(object(), shapes, True).startswith("TypeError")


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]))
