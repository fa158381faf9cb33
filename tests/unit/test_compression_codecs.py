"""Round trips of every codec with error bounds, specs, ratio estimates, and property tests."""

from __future__ import annotations

import math

import pytest
import torch
from geofed.compression import (
    CodecError,
    CodecState,
    codec_names,
    decode_update,
    encode_and_decode,
    encode_update,
    inspect_update,
    make_codec,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch.set_num_threads(1)
MAX = 1 << 26


def _roundtrip(spec, tensors, state=None):
    payload, sent = encode_and_decode(spec, tensors, state)
    got = decode_update(payload, max_bytes=MAX, expected_shapes=[t.shape for t in tensors])
    for a, b in zip(sent, got):
        assert torch.equal(a, b)  # the sender's view of the update is what receivers decode
    return payload, got


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _chunks(x, chunk):
    return [x[s: s + chunk] for s in range(0, x.numel(), chunk)]


def test_registry_is_closed_and_complete():
    assert codec_names() == ["bf16", "fp16", "identity", "int3", "int4", "int8", "powersgd", "randomk", "sign", "sparseloco", "ternary", "topk"]


def test_identity_is_exact_for_mixed_shapes_and_dtypes():
    ts = [_randn(3, 4), _randn(5).double(), _randn(2, 3, 2).half(), _randn(0, 3), _randn(1).bfloat16()]
    _, got = _roundtrip("identity", ts)
    for t, g in zip(ts, got):
        assert g.dtype == torch.float32 and g.shape == t.shape
        assert torch.equal(g, t.float())


@pytest.mark.parametrize("kind,rel", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
def test_half_casts_are_within_half_an_ulp(kind, rel):
    x = _randn(10_000) * 3
    _, (got,) = _roundtrip(kind, [x])
    assert ((got - x).abs() <= rel * x.abs() + 1e-7).all()


def test_fp16_saturates_instead_of_sending_inf():
    x = torch.tensor([1e6, -1e6, 1.0])
    _, (got,) = _roundtrip("fp16", [x])
    assert got.tolist() == [65504.0, -65504.0, 1.0]
    state = CodecState(error_feedback=True)  # with EF the residual keeps the clipped part
    _, (got,) = _roundtrip("fp16", [x], state)
    assert got.tolist() == [65504.0, -65504.0, 1.0]
    assert state.residual.tolist() == [1e6 - 65504.0, -(1e6 - 65504.0), 0.0]
    _, (got,) = _roundtrip({"kind": "topk", "fraction": 0.5}, [torch.tensor([7e4, 1.0, -2.0])])
    assert got.tolist() == [65504.0, 0.0, -2.0]


@pytest.mark.parametrize("kind,levels", [("int8", 127), ("int4", 7), ("int3", 3)])
@pytest.mark.parametrize("n,chunk", [(10_001, 1024), (4096, 4096), (7, 8), (300, 1000)])
def test_chunked_quantizers_err_at_most_half_a_step(kind, levels, n, chunk):
    x = _randn(n) * torch.linspace(0.01, 10, n)  # chunks of very different scales
    _, (got,) = _roundtrip({"kind": kind, "chunk": chunk}, [x])
    for xc, gc in zip(_chunks(x, chunk), _chunks(got, chunk)):
        step = xc.abs().max() / levels
        assert (gc - xc).abs().max() <= step / 2 * (1 + 1e-5) + 1e-12
        assert gc.unique().numel() <= 2 * levels + 1


@pytest.mark.parametrize("kind", ["int8", "int4", "int3"])
def test_stochastic_rounding_is_unbiased_within_one_step(kind):
    x = _randn(512)
    state = CodecState(error_feedback=False, seed=3)
    spec = {"kind": kind, "chunk": 512, "stochastic": True}
    decs = torch.stack([_roundtrip(spec, [x], state)[1][0] for _ in range(400)])
    step = x.abs().max() / {"int8": 127, "int4": 7, "int3": 3}[kind]
    assert ((decs - x).abs() <= step * (1 + 1e-5)).all()
    # the mean of 400 draws sits within 4 standard errors (step/2/sqrt(400)) of x
    assert (decs.mean(0) - x).abs().max() <= 4 * step / 2 / 20
    assert not make_codec(spec).contractive


def test_sign_sends_the_sign_and_the_mean_magnitude_per_chunk():
    x = _randn(1000)
    _, (got,) = _roundtrip({"kind": "sign", "chunk": 300}, [x])
    for xc, gc in zip(_chunks(x, 300), _chunks(got, 300)):
        m = xc.abs().mean()
        assert torch.allclose(gc.abs(), m.expand_as(gc))
        assert torch.equal(gc > 0, xc >= 0)
    assert (got - x).norm() < x.norm()  # contractive


@pytest.mark.parametrize("n", [1000, 300_001])  # exact torch.topk, and the sampled threshold path
def test_topk_keeps_exactly_the_largest_magnitudes(n):
    x = _randn(n)
    payload, (got,) = _roundtrip({"kind": "topk", "fraction": 0.01}, [x])
    k = math.ceil(0.01 * n)
    want = set(torch.topk(x.abs(), k).indices.tolist())
    assert set(got.nonzero().squeeze(1).tolist()) == want
    idx = torch.tensor(sorted(want))
    assert ((got[idx] - x[idx]).abs() <= 2.0 ** -11 * x[idx].abs()).all()  # fp16 values
    assert (x - got).norm() ** 2 <= (1 - k / n) * x.norm() ** 2  # the contraction EF relies on
    assert n < 10_000 or 4 * n / len(payload) > 60  # small updates pay the header


@pytest.mark.parametrize("top", [40, 0])
def test_topk_sampled_path_keeps_exactly_k_among_ties(top):
    # Thousands of values share the k-th largest magnitude (all of them when top = 0): the
    # candidates' partition must keep exactly k of them, at distinct increasing indices
    # (decode_update refuses anything else).
    n = 400_003
    x = torch.randint(-top, top + 1, (n,), generator=torch.Generator().manual_seed(3)).float()
    k = math.ceil(0.01 * n)
    assert int((x.abs() == top).sum()) > 2 * k
    _, (got,) = _roundtrip({"kind": "topk", "fraction": 0.01, "inner": "identity"}, [x])
    kept = got != 0
    assert int(kept.sum()) == (k if top else 0)
    assert torch.equal(got[kept], x[kept]) and bool((got[kept].abs() == top).all())


def test_topk_inner_int8_quantizes_the_kept_values():
    x = _randn(50_000)
    _, (got,) = _roundtrip({"kind": "topk", "fraction": 0.02, "inner": "int8"}, [x])
    kept = got.nonzero().squeeze(1)
    assert kept.numel() == 1000
    step = x[kept].abs().max() / 127
    assert (got[kept] - x[kept]).abs().max() <= step / 2 * (1 + 1e-5)


def test_randomk_is_unbiased_and_needs_no_indices_on_the_wire():
    x = _randn(200)
    state = CodecState(error_feedback=True, seed=1)
    spec = {"kind": "randomk", "fraction": 0.1, "inner": "identity"}
    decs = torch.stack([_roundtrip(spec, [x], state)[1][0] for _ in range(3000)])
    assert not state.ef_applied  # EF is skipped for an unbiased codec
    assert (decs.mean(0) - x).abs().max() < 0.5  # sd of the mean: |x| * sqrt(n/k)/sqrt(3000) ~ 0.06|x|
    assert (decs.mean(0) - x).norm() / x.norm() < 0.1
    payload = encode_update(spec, [x], state)
    assert len(payload) < 4 * 20 + 8 + 200  # 20 fp32 values, a seed and the header


def test_powersgd_reconstructs_a_low_rank_matrix_and_sends_vectors_as_is():
    a, b = _randn(120, 3, seed=1), _randn(3, 80, seed=2)
    m = a @ b
    bias = _randn(80, seed=3)
    payload, (gm, gb) = _roundtrip({"kind": "powersgd", "rank": 4}, [m, bias])
    assert (gm - m).norm() / m.norm() < 1e-4
    assert torch.equal(gb, bias)
    assert len(payload) < 4 * (120 * 4 + 80 * 4 + 80) + 300


def test_powersgd_warm_start_approaches_the_best_rank_r_error():
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(200, 200, generator=g))
    v, _ = torch.linalg.qr(torch.randn(150, 150, generator=g))
    s = torch.tensor([0.7 ** i for i in range(150)])
    m = (u[:, :150] * s) @ v.T
    best = s[2:].norm() / s.norm()  # Eckart-Young: the best rank-2 error
    state = CodecState(error_feedback=False, seed=0)
    errs = []
    for _ in range(8):
        _, (got,) = _roundtrip({"kind": "powersgd", "rank": 2}, [m], state)
        errs.append(float((got - m).norm() / m.norm()))
    assert errs[-1] <= best * 1.01 + 1e-6
    assert errs[0] > errs[-1]


@pytest.mark.parametrize("spec,ratio", [("int8", 3.9), ("int4", 7.5), ("int3", 10.0), ("sign", 30), ({"kind": "topk", "fraction": 0.01}, 60),
                                        ({"kind": "topk", "fraction": 0.01, "inner": "int8"}, 100),
                                        ({"kind": "randomk", "fraction": 0.01}, 150), ("fp16", 1.99),
                                        ({"kind": "sparseloco", "fraction": 0.01}, 200), ("ternary", 19.0)])
def test_estimate_ratio_matches_actual_and_meets_the_target(spec, ratio):
    n = 1_000_003
    codec = make_codec(spec)
    actual = 4 * n / len(encode_update(codec, [torch.ones(n)]))
    assert actual >= ratio
    assert codec.estimate_ratio(n) == pytest.approx(actual, rel=0.01)


def test_powersgd_ratio_on_a_1000x1000_matrix():
    codec = make_codec({"kind": "powersgd", "rank": 4})
    actual = 4e6 / len(encode_update(codec, [_randn(1000, 1000)]))
    assert actual >= 100
    assert codec.estimate_ratio(1_000_000) == pytest.approx(actual, rel=0.01)
    assert codec.estimate_ratio(1000, shapes=[(1000,)]) < 1  # a vector goes uncompressed


def test_spec_round_trips_and_names():
    for name in codec_names():
        c = make_codec(name)
        assert make_codec(c.spec()) == c and c.name == name
    c = make_codec({"kind": "topk", "fraction": 0.001, "inner": {"kind": "int8", "chunk": 256}})
    assert c.spec() == {"kind": "topk", "fraction": 0.001, "inner": {"kind": "int8", "chunk": 256, "stochastic": False}}
    assert make_codec(c.spec()) == c
    assert c.name == "topk(fraction=0.001,inner=int8(chunk=256,stochastic=False))"  # CodecSpec.key
    assert make_codec({"kind": "topk", "fraction": 1}).fraction == 1.0  # YAML ints for floats


@pytest.mark.parametrize("spec,message", [
    ("zstd", "kind: unknown codec 'zstd' (known: bf16, fp16"),
    ({"fraction": 0.1}, "kind: missing"),
    ({"kind": "topk", "fraction": 0}, "fraction: must be in (0, 1]"),
    ({"kind": "topk", "fraction": 1.5}, "fraction: must be in (0, 1]"),
    ({"kind": "topk", "fraction": "1%"}, "fraction: must be a number"),
    ({"kind": "int8", "chunk": 0}, "chunk: must be in [1, 16777216]"),
    ({"kind": "int8", "chunk": 64.0}, "chunk: must be an integer"),
    ({"kind": "int8", "stochastic": "yes"}, "stochastic: must be true or false"),
    ({"kind": "int4", "chunk": 7}, "chunk: must be even"),
    ({"kind": "int3", "chunk": 12}, "chunk: must be a multiple of 8"),
    ({"kind": "int8", "chunks": 64}, "chunks: unknown parameter of codec 'int8' (known: chunk, stochastic)"),
    ({"kind": "powersgd", "rank": 0}, "rank: must be in [1, 64]"),
    ({"kind": "powersgd", "rank": 65}, "rank: must be in [1, 64]"),
    ({"kind": "topk", "inner": "topk"}, "inner: 'topk' cannot be the inner codec"),
    ({"kind": "topk", "inner": "powersgd"}, "inner: 'powersgd' cannot be the inner codec"),
    ({"kind": "topk", "inner": {"kind": "int8", "chunk": -1}}, "inner.chunk: must be in"),
    (42, "codec: expected a codec name or a mapping"),
])
def test_bad_specs_name_the_key(spec, message):
    with pytest.raises(ValueError) as exc:
        make_codec(spec)
    assert message in str(exc.value)


def test_flags():
    assert make_codec("identity").lossless and make_codec("identity").linear
    assert make_codec("topk").contractive and not make_codec("topk").linear
    assert not make_codec("randomk").contractive and make_codec("randomk").linear
    assert make_codec("powersgd").linear and make_codec("powersgd").contractive
    assert not make_codec({"kind": "topk", "inner": {"kind": "int8", "stochastic": True}}).contractive


def test_encode_refuses_nan_and_non_float_inputs():
    with pytest.raises(CodecError, match=r"tensors\[1\]: contains NaN or Inf"):
        encode_update("int8", [torch.ones(3), torch.tensor([1.0, float("nan")])])
    with pytest.raises(CodecError, match="dtype: cannot encode torch.int64"):
        encode_update("int8", [torch.arange(3)])
    with pytest.raises(TypeError, match="not one tensor"):
        encode_update("int8", torch.ones(3))
    big = torch.full((4,), 3e38)  # the sum overflows, the values are finite: accepted
    assert decode_update(encode_update("identity", [big]), max_bytes=MAX)[0].equal(big)


def test_state_counts_bytes_and_refuses_a_changed_layout():
    state = CodecState(error_feedback=True)
    p1 = encode_update("int8", [torch.ones(1000)], state)
    encode_update("fp16", [torch.ones(1000)], state)  # a ladder may switch codecs on one stream
    assert state.counter == 2 and state.bytes_raw == 8000 and state.bytes_wire > len(p1)
    with pytest.raises(ValueError, match="state: this CodecState encoded tensors of shapes"):
        encode_update("int8", [torch.ones(999)], state)
    state.reset()
    encode_update("int8", [torch.ones(999)], state)


def test_inspect_update_reads_the_header():
    p = encode_update({"kind": "int8", "chunk": 64}, [torch.ones(2, 3).half(), torch.ones(4)])
    h = inspect_update(p, max_bytes=MAX)
    assert h.codec == make_codec({"kind": "int8", "chunk": 64})
    assert h.shapes == [(2, 3), (4,)] and h.dtypes == [torch.float16, torch.float32]


# ---- properties over shapes, dtypes and sizes (0, 1, odd) ------------------------------
SPECS = ["identity", "fp16", "bf16", "int8", "int4", "int3", {"kind": "int3", "chunk": 8, "stochastic": True}, "sign", {"kind": "int8", "chunk": 3},
         {"kind": "int4", "chunk": 2, "stochastic": True}, {"kind": "sign", "chunk": 5},
         {"kind": "topk", "fraction": 0.3}, {"kind": "topk", "fraction": 1.0, "inner": "int4"},
         {"kind": "randomk", "fraction": 0.5}, {"kind": "powersgd", "rank": 1}, {"kind": "powersgd", "rank": 3},
         {"kind": "sparseloco", "fraction": 0.3, "chunk": 16}, {"kind": "sparseloco", "fraction": 1.0, "chunk": 16},
         "ternary", {"kind": "ternary", "chunk": 7}, {"kind": "ternary", "chunk": 3, "threshold": 0.0}]
shapes_st = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=0, max_size=4)
dtype_st = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(SPECS), shapes=shapes_st, dtype=dtype_st, seed=st.integers(0, 2 ** 31 - 1),
       ef=st.booleans(), scale=st.sampled_from([0.0, 1e-40, 1e-30, 1e-6, 1.0, 1e4]))
def test_every_codec_round_trips_any_layout(spec, shapes, dtype, seed, ef, scale):
    g = torch.Generator().manual_seed(seed)
    ts = [(torch.randn(s, generator=g) * scale).to(dtype) for s in shapes]
    codec = make_codec(spec)
    state = CodecState(error_feedback=ef, seed=seed)
    for _ in range(2):  # a second round exercises residuals and warm starts
        payload, got = _roundtrip(codec, ts, state)
        assert [g.shape for g in got] == [t.shape for t in ts]
        assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in got)
    n = sum(t.numel() for t in ts)
    if codec.lossless:
        assert all(torch.equal(g, t.float()) for g, t in zip(got, ts))
    if codec.contractive and n and scale and not ef:
        err = sum(((g - t.float()) ** 2).sum() for g, t in zip(got, ts))
        assert err <= sum((t.float() ** 2).sum() for t in ts) * (1 + 1e-5)
    if ef and codec.contractive and not codec.lossless:
        assert state.ef_applied and state.residual is not None and torch.isfinite(state.residual).all()
    if shapes and len(shapes) == 1 and len(shapes[0]) <= 1:
        assert codec.estimate_ratio(n) == pytest.approx(4 * n / len(payload), rel=0.5, abs=0.2)


def test_decode_into_a_reused_buffer():
    x = [_randn(30, 4), _randn(5)]
    payload = encode_update("int8", x)
    buf = torch.full((125,), float("nan"))
    got = decode_update(payload, max_bytes=MAX, out=buf)
    assert got[0].data_ptr() == buf.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(got, decode_update(payload, max_bytes=MAX)))
    with pytest.raises(CodecError, match="shape: payload holds 125 elements, out has 124"):
        decode_update(payload, max_bytes=MAX, out=torch.empty(124))
    with pytest.raises(ValueError, match="out: must be a flat contiguous CPU float32 tensor"):
        decode_update(payload, max_bytes=MAX, out=torch.empty(125, dtype=torch.float64))


def test_a_payload_names_the_codec_that_made_it():
    int8, fp16 = make_codec("int8"), make_codec("fp16")
    payload = encode_update(int8, [_randn(3, 5)])
    assert inspect_update(payload, max_bytes=MAX).codec == int8 != fp16


@pytest.mark.parametrize("spec", ["int8", "int4", "int3", {"kind": "int8", "stochastic": True}, "sign",
                                  {"kind": "topk", "fraction": 1.0, "inner": "int4"}, "ternary"])
def test_tiny_and_subnormal_values_never_decode_to_garbage(spec):
    x = torch.tensor([1e-38, -1e-39, 0.0, 3e-39, 1e-45, 2.0 ** -99])
    _, (got,) = _roundtrip(spec, [x])
    assert (got - x).abs().max() <= 2.0 ** -98  # sent as (near) zeros, never NaN-cast garbage


def test_huge_values_either_encode_finite_or_fail_loudly_at_the_sender():
    x = torch.full((64, 64), 3e37)
    for spec in ["identity", "fp16", "bf16", "int8", "int4", "int3", "topk", "ternary"]:
        _, (got,) = _roundtrip(spec, [x])
        assert torch.isfinite(got).all()
    with pytest.raises(CodecError, match="powersgd: tensor 0 overflows fp32"):
        encode_update("powersgd", [x])
    with pytest.raises(CodecError, match="sign: a chunk's mean magnitude overflows"):
        encode_update("sign", [torch.full((4096,), 3e38)])


def test_a_failed_encode_leaves_the_error_feedback_residual_as_it_was():
    state = CodecState(error_feedback=True)
    encode_update("sign", [torch.randn(4096)], state)
    before = state.residual.clone()
    with pytest.raises(CodecError):
        encode_update("sign", [torch.full((4096,), 3e38)], state)
    assert torch.equal(state.residual, before) and state.counter == 1


def test_randomk_decodes_in_blocks_with_the_senders_indices():
    n = 150_001  # k = n > one 65536-block of generated indices
    x = _randn(n).abs() + 1.0
    _, (got,) = _roundtrip({"kind": "randomk", "fraction": 1.0, "inner": "identity"}, [x])
    counts = got / x  # n/k = 1: each value comes back once per time its index was drawn
    assert torch.allclose(counts, counts.round(), atol=1e-4)
    assert int(counts.round().sum()) == n and 0.5 < float((counts.round() > 0).float().mean()) < 0.75  # ~1 - 1/e
