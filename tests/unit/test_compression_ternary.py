"""The ternary codec: -L, 0, +L per value, five values a byte, the least-squares level per chunk."""

from __future__ import annotations

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






@pytest.mark.parametrize("n,chunk", [(64, 64), (1000, 64), (1029, 1024), (333, 7)])
def test_sends_the_sign_of_the_values_above_the_threshold_at_their_mean_magnitude(n, chunk):
    x = randn(n) * torch.linspace(0.1, 10, n)  # chunks of very different scales
    _, got = roundtrip({"kind": "ternary", "chunk": chunk}, x)
    for s in range(0, n, chunk):
        xc, gc = x[s: s + chunk], got[s: s + chunk]
        kept = xc.abs() >= 0.75 * xc.abs().mean()
        assert torch.equal(gc != 0, kept)
        assert torch.equal(torch.sign(gc[kept]), torch.sign(xc[kept]))
        level = gc[kept].abs().unique()
        assert level.numel() == 1  # one magnitude per chunk: the mean |x| of what it stands for
        assert float(level) == pytest.approx(float(xc[kept].abs().mean()), rel=1e-5)


def test_round_trip_error_is_below_the_input_and_the_state_residual_is_what_was_not_sent():
    x = randn(50_000, seed=3)
    state = CodecState(error_feedback=True)
    _, got = roundtrip("ternary", x, state)
    err = float((got - x).norm() / x.norm())
    assert err < 0.45  # a Gaussian's least-squares ternary error is 0.44 of its norm
    assert torch.allclose(state.residual, x - got)
    x2 = randn(50_000, seed=4)
    payload = encode_update("ternary", [x2], state)
    (s2,) = decode_update(payload, max_bytes=MAX)
    assert torch.allclose(got + s2 + state.residual, x + x2, atol=1e-5)


def test_contractive_even_for_a_chunk_of_one_spike_and_zeros():
    x = torch.zeros(4096)
    x[7] = 1e3
    _, got = roundtrip("ternary", x)
    assert torch.equal(got, x)  # the spike is the only kept value: its level is itself, zeros stay zero
    y = torch.tensor([1e3] + [1e-3] * 1023)
    _, got = roundtrip("ternary", y)
    assert float((got - y).norm()) < float(y.norm())


def test_about_nineteen_times_smaller_than_fp32_and_twice_int3():
    n = 1_000_000
    x = randn(n)
    sizes = {spec: len(encode_update(spec, [x])) for spec in ["ternary", "int3", "sign"]}
    assert 4 * n / sizes["ternary"] == pytest.approx(19.5, rel=0.01)  # 1.6 bits + 32 / 1024
    assert make_codec("ternary").estimate_ratio(n) == pytest.approx(4 * n / sizes["ternary"], rel=0.01)
    assert sizes["int3"] > 1.85 * sizes["ternary"] > sizes["sign"]






def test_error_feedback_makes_ternary_train_like_uncompressed():
    data = least_squares()
    codec = make_codec({"kind": "ternary", "chunk": 128})
    plain, _ = train(data, None, False, steps=400)
    with_ef, _ = train(data, codec, True, steps=400)
    without_ef, _ = train(data, codec, False, steps=400)
    assert with_ef <= plain * 1.02, (with_ef, plain)
    assert without_ef > with_ef * 1.05, (without_ef, with_ef)  # what is dropped never arrives without EF






def test_lying_payloads_are_refused():
    p = payload({"kind": "ternary", "chunk": 16}, 31)  # 7 bytes of codes: the last holds 1 value and 4 of padding
    h = inspect_update(bytes(p), max_bytes=MAX)
    for index, value, message in [(0, 243, "ternary: a byte of codes is 243; five base-3 codes make at most 242"),
                                  (3, 0xFF, "a byte of codes is 255"),
                                  (6, 1 + 3 * 2, r"ternary: padding codes after the last value must be 1 \(zero\)"),
                                  (6, 0, "padding codes after the last value must be 1")]:
        q = bytearray(p)
        q[h.offsets[0] + index] = value
        with pytest.raises(CodecError, match=message):
            decode_update(reseal(q), max_bytes=MAX)
    for level in (-1.0, float("nan"), float("inf")):
        q = bytearray(p)
        struct.pack_into("<f", q, h.offsets[1] + 4, level)
        with pytest.raises(CodecError, match="ternary: chunk levels must be finite and >= 0"):
            decode_update(reseal(q), max_bytes=MAX)
    q = bytearray(p)
    q[h.offsets[0] + 6] = 1 + 3 + 9 + 27 + 81 - 1  # the last value -L, the padding zeros: valid
    (got,) = decode_update(reseal(q), max_bytes=MAX)
    assert float(got[-1]) <= 0


@pytest.mark.parametrize("spec,message", [
    ({"kind": "ternary", "chunk": 0}, "chunk: must be in [1, 16777216], got 0"),
    ({"kind": "ternary", "threshold": -0.5}, "threshold: must be in [0, 10]"),
    ({"kind": "topk", "inner": "ternary", "fraction": 0.1}, None),  # a flat codec: a valid inner
])
def test_bad_specs_name_the_key(spec, message):
    if message is None:
        make_codec(spec)
        return
    with pytest.raises(ValueError) as exc:
        make_codec(spec)
    assert message in str(exc.value)


def test_usable_from_the_config_and_ordered_by_bytes_in_a_policy_ladder():
    base = {"task": {"kind": "mlp-digits"}, "network": {"emulation": {"mode": "none"}}}
    cfg = config_from_mapping({**base, "compression": {
        "codec": "ternary", "ladder": ["sparseloco", "ternary", "int3", {"kind": "ternary", "chunk": 256}]}})
    c = cfg.compression
    assert c.codec == CodecSpec.parse("ternary") and c.codec.key == "ternary"
    rungs = Ladder(list(c.ladder)).rungs(1_000_000)
    assert [r.spec.key for r in rungs] == ["int3", "ternary(chunk=256,threshold=0.75)", "ternary", "sparseloco"]
    assert 18 < rungs[1].ratio < rungs[2].ratio < 20


def test_empty_small_huge_and_all_zero_updates():
    for x in [torch.zeros(0), torch.ones(1), torch.zeros(5000), torch.tensor([3e38, -3e38] * 40),
              torch.tensor([1e-45, -1e-40, 0.0] * 9)]:
        _, got = roundtrip("ternary", x, CodecState(error_feedback=True))
        assert torch.isfinite(got).all() and got.shape == x.shape
        assert float((got - x).norm()) <= float(x.norm())
