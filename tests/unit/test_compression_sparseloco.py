"""The SparseLoCo-style codec: chunked top-k, 2-bit values, packed indices, error feedback."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from geofed.compression import (
    CodecError,
    CodecSpec,
    CodecState,
    decode_update,
    encode_update,
    inspect_update,
    make_codec,
)
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.policies.cost import Ladder
from support.codecs import MAX, least_squares, payload, randn, reseal, roundtrip, train

torch.set_num_threads(1)






@pytest.mark.parametrize("n", [64, 1000, 4096 * 3 + 17])
def test_keeps_the_top_k_of_every_chunk_with_two_magnitudes_and_the_sign(n):
    chunk, fraction = 64, 0.1
    x = randn(n) * torch.linspace(0.1, 10, n)  # chunks of very different scales
    _, got = roundtrip({"kind": "sparseloco", "fraction": fraction, "chunk": chunk}, x)
    for s in range(0, n, chunk):
        xc, gc = x[s: s + chunk], got[s: s + chunk]
        k = math.ceil(fraction * xc.numel() - 1e-9)
        kept = gc != 0
        assert int(kept.sum()) == k
        assert xc.abs()[kept].min() >= xc.abs()[~kept].max() if (~kept).any() else True
        assert torch.equal(torch.sign(gc[kept]), torch.sign(xc[kept]))
        mags = gc[kept].abs().unique()
        assert 1 <= mags.numel() <= 2  # 2 bits: the sign and one of two magnitudes
        # each level is the mean |x| of the values it stands for
        for m in mags:
            group = (gc.abs() == m) & kept
            assert float(m) == pytest.approx(float(xc[group].abs().mean()), rel=1e-5)


def test_round_trip_error_is_below_the_input_and_the_state_residual_is_what_was_not_sent():
    x = randn(50_000, seed=3)
    state = CodecState(error_feedback=True)
    _, got = roundtrip("sparseloco", x, state)
    assert float((got - x).norm()) < float(x.norm())  # contractive
    assert torch.allclose(state.residual, x - got)
    x2 = randn(50_000, seed=4)
    payload = encode_update("sparseloco", [x2], state)  # the subtract_decoded path
    (s2,) = decode_update(payload, max_bytes=MAX)
    assert torch.allclose(got + s2 + state.residual, x + x2, atol=1e-5)


def test_bytes_per_element_beat_topk_by_about_two():
    n = 1_000_000
    x = randn(n)
    bpe = {}
    for spec in ["sparseloco", "topk(fraction=0.01)", "topk(fraction=0.01,inner=int8)"]:
        codec = make_codec(CodecSpec.parse(spec))
        payload = encode_update(codec, [x])
        bpe[spec] = len(payload) / n
        assert codec.estimate_ratio(n) == pytest.approx(4 * n / len(payload), rel=0.01)
    # 41 of every 4096 kept: 12-bit index + 2-bit value + 8 bytes of levels per chunk = ~1.95 B per kept value
    assert bpe["sparseloco"] == pytest.approx(0.0196, rel=0.02)
    assert bpe["sparseloco"] < 0.51 * bpe["topk(fraction=0.01)"]  # 0.0402 B/element
    assert bpe["sparseloco"] < 0.68 * bpe["topk(fraction=0.01,inner=int8)"]  # 0.0302 B/element






@pytest.mark.timeout(120)
@pytest.mark.slow  # 26 s of training: the slow pass (CI runs both)
def test_error_feedback_makes_two_percent_sparseloco_train_like_uncompressed():
    data = least_squares()
    codec = make_codec({"kind": "sparseloco", "fraction": 0.02, "chunk": 128})  # 3 of every 128 sent
    plain, _ = train(data, None, False, steps=1500)
    with_ef, states = train(data, codec, True, steps=1500)
    without_ef, _ = train(data, codec, False, steps=1500)
    assert all(s.ef_applied for s in states)
    assert with_ef <= plain * 1.01, (with_ef, plain)
    assert without_ef > plain * 1.01, (without_ef, plain)  # what was dropped never arrives






def _poke_byte(p, section, index, value):
    h = inspect_update(bytes(p), max_bytes=MAX)
    p[h.offsets[section] + (index if index >= 0 else h.sections[section].count + index)] = value
    return reseal(p)


@pytest.mark.parametrize("section,index,value,message", [
    (0, -1, 0xFF, "sparseloco: index padding bits are not zero"),  # 6 indices x 6 bits: 4 spare bits
    (1, -1, 0xFF, "sparseloco: value code padding bits are not zero"),  # 6 codes x 2 bits: 4 spare bits
    (0, 0, 0xFF, "not strictly increasing"),  # first index 63 in a chunk of 64: the next cannot follow
])
def test_lying_payloads_are_refused(section, index, value, message):
    p = payload({"kind": "sparseloco", "fraction": 0.05, "chunk": 64}, 100)  # 64 + a tail of 36: 4 + 2 kept
    with pytest.raises(CodecError, match=message):
        decode_update(_poke_byte(p, section, index, value), max_bytes=MAX)


def test_an_index_past_the_tail_chunk_and_bad_magnitudes_are_refused():
    spec = {"kind": "sparseloco", "fraction": 0.5, "chunk": 16}
    p = payload(spec, 20)  # a chunk of 16 (8 kept) and a tail of 4 (2 kept): 10 x 4 bits
    h = inspect_update(bytes(p), max_bytes=MAX)
    q = bytearray(p)
    q[h.offsets[0] + 4] = 0xF2  # the tail's indices: 2, then 15 (>= 4)
    with pytest.raises(CodecError, match="in-chunk index 15 out of range for a chunk of 4"):
        decode_update(reseal(q), max_bytes=MAX)
    for lo, hi in [(-1.0, 1.0), (2.0, 1.0), (0.0, float("inf")), (float("nan"), 1.0)]:
        q = bytearray(p)
        struct.pack_into("<ff", q, h.offsets[2], lo, hi)
        with pytest.raises(CodecError, match="chunk magnitudes must be finite with 0 <= low <= high"):
            decode_update(reseal(q), max_bytes=MAX)


@pytest.mark.parametrize("spec,message", [
    ({"kind": "sparseloco", "chunk": 100}, "chunk: must be a power of two in [16, 65536], got 100"),
    ({"kind": "sparseloco", "chunk": 8}, "chunk: must be a power of two"),
    ({"kind": "sparseloco", "chunk": 1 << 17}, "chunk: must be a power of two"),
    ({"kind": "sparseloco", "fraction": 0}, "fraction: must be in (0, 1]"),
    ({"kind": "topk", "inner": "sparseloco"}, "inner: 'sparseloco' cannot be the inner codec"),
])
def test_bad_specs_name_the_key(spec, message):
    with pytest.raises(ValueError) as exc:
        make_codec(spec)
    assert message in str(exc.value)


def test_usable_from_the_config_and_ordered_by_bytes_in_a_policy_ladder():
    base = {"task": {"kind": "mlp-digits"}, "network": {"emulation": {"mode": "none"}}}
    cfg = config_from_mapping({**base, "compression": {
        "codec": "sparseloco(fraction=0.01)",
        "ladder": ["sparseloco", "int8", "topk(fraction=0.01,inner=int8)", {"kind": "sparseloco", "fraction": 0.001}]}})
    c = cfg.compression
    assert c.codec == CodecSpec.parse("sparseloco") and c.codec.key == "sparseloco"  # 0.01 is the default
    rungs = Ladder(list(c.ladder)).rungs(1_000_000)
    assert [r.spec.key for r in rungs] == ["int8", "topk(fraction=0.01,inner=int8)", "sparseloco",
                                           "sparseloco(chunk=4096,fraction=0.001)"]
    assert rungs[2].ratio > 200 and rungs[3].ratio > 900  # at 0.1% the 8 bytes of levels per chunk are half


def test_empty_small_and_all_zero_updates():
    for x in [torch.zeros(0), torch.ones(1), torch.zeros(5000), torch.tensor([3e38, -3e38] * 40)]:
        _, got = roundtrip("sparseloco", x, CodecState(error_feedback=True))
        assert torch.isfinite(got).all() and got.shape == x.shape


@pytest.mark.parametrize("case", ["normal", "scales", "spiky", "sparse", "ties"])
def test_the_sampled_per_row_threshold_path_is_exact(case):
    from geofed.compression.sparseloco import rows_topk

    g = torch.Generator().manual_seed(5)
    y = torch.randn(80, 4096, generator=g)  # 327,680 values: above the exact-path size
    if case == "scales":
        y *= torch.logspace(-6, 2, 80)[:, None]
    elif case == "spiky":
        y[:, :100] *= 100  # the sample misses most spikes: rows fall back to torch.topk
    elif case == "sparse":
        y[::2, 30:] = 0  # fewer nonzeros than k in half the rows: zeros are never candidates
    elif case == "ties":
        y[::3] = torch.tensor([0.5, -0.5]).repeat(2048)  # every value of the row ties: the lowest columns win
        y[1::3, 1000:2000] = y[1::3, 1000:2000].round()  # ties at the k-th magnitude
    got, values = rows_topk(y, 41)
    assert torch.equal(values, y.gather(1, got))  # the values come with the indices, bit for bit
    want = torch.topk(y.abs(), 41, dim=1).indices.sort(dim=1).values
    if case == "ties":
        kth = torch.topk(y.abs(), 41, dim=1).values[:, -1:]
        assert bool((y.abs().gather(1, got) >= kth).all())  # a top k, whichever of the tied values
        assert all(len(set(r.tolist())) == 41 for r in got)
        assert torch.equal(got[::3], torch.arange(41).expand(len(got[::3]), 41))
        assert torch.equal(got[2::3], want[2::3])
    elif case == "sparse":
        assert torch.equal(got[1::2], want[1::2])
        assert all(set(range(30)) <= set(r.tolist()) and len(set(r.tolist())) == 41 for r in got[::2])
    else:
        assert torch.equal(got, want)
