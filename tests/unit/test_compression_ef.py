"""Why error feedback and CHOCO exist: two small convex/consensus problems, run through the
public encode/decode API exactly as regions and the gossip layer will use it."""

from __future__ import annotations

import pytest
import torch
from geofed.compression import (
    CodecState,
    choco_encode,
    choco_update,
    decode_update,
    encode_and_decode,
    encode_update,
    make_codec,
)
from support.codecs import least_squares, train

torch.set_num_threads(1)


@pytest.mark.timeout(120)
def test_topk_one_percent_needs_error_feedback_to_match_uncompressed_training():
    data = least_squares(d=500)  # non-IID optima: top-k of each worker's gradient is biased at the joint one
    topk = make_codec({"kind": "topk", "fraction": 0.01})
    plain, _ = train(data, None, False, steps=1500)
    with_ef, states = train(data, topk, True, steps=1500)
    without_ef, _ = train(data, topk, False, steps=1500)
    assert all(s.ef_applied for s in states)
    assert states[0].bytes_wire / states[0].counter < 200  # 5 of 500 values per step (+ header), not 2000 bytes
    assert with_ef <= plain * 1.01, (with_ef, plain)
    assert without_ef > plain * 1.01, (without_ef, plain)  # biased: stalls away from the optimum


def test_error_feedback_residual_is_exactly_what_was_not_sent():
    codec = make_codec({"kind": "topk", "fraction": 0.1})
    state = CodecState(error_feedback=True)
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(100, generator=g), torch.randn(100, generator=g)
    _, (s1,) = encode_and_decode(codec, [x1], state)
    assert torch.allclose(state.residual, x1 - s1)
    payload = encode_update(codec, [x2], state)  # the sparse subtract path, not the decode path
    (s2,) = decode_update(payload, max_bytes=1 << 20)
    assert torch.allclose(state.residual, x1 + x2 - s1 - s2, atol=1e-6)
    # nothing is lost: what was sent plus what is left is everything that came in
    assert torch.allclose(s1 + s2 + state.residual, x1 + x2, atol=1e-6)


@pytest.mark.parametrize("spec", ["int8", "int4", "sign", "fp16", {"kind": "powersgd", "rank": 1}])
def test_error_feedback_keeps_the_running_sum_close_for_every_contractive_codec(spec):
    """Sum of what was sent tracks the sum of what came in, to within one residual."""
    codec = make_codec(spec)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(20, 30, generator=g) for _ in range(30)]
    errs = {}
    for ef in (True, False):
        state = CodecState(error_feedback=ef)
        sent = sum(encode_and_decode(codec, [x], state)[1][0] for x in xs)
        errs[ef] = float((sent - sum(xs)).norm())
        if ef:
            assert torch.allclose(sent + state.residual.view(20, 30), sum(xs), atol=1e-4)
    assert errs[True] < errs[False]


def test_choco_gossip_reaches_consensus_where_naive_compressed_gossip_stalls():
    n, d, gamma = 8, 200, 0.3
    g = torch.Generator().manual_seed(0)
    x0 = [torch.randn(d, generator=g) * 10 for _ in range(n)]
    ring = {i: {(i - 1) % n: 1 / 3, (i + 1) % n: 1 / 3} for i in range(n)}  # Metropolis-Hastings
    codec = make_codec({"kind": "topk", "fraction": 0.1})

    def consensus(x):
        mean = sum(x) / n
        return float(sum(((a - mean) ** 2).sum() for a in x))

    x = [a.clone() for a in x0]
    public = [torch.zeros(d) for _ in range(n)]  # x_hat_i, as node i and its neighbours know it
    states = [CodecState(error_feedback=False, seed=i) for i in range(n)]
    for _ in range(300):
        qs = []
        for i in range(n):
            payload, (q,) = choco_encode(codec, [x[i]], [public[i]], states[i])
            assert torch.equal(decode_update(payload, max_bytes=1 << 20)[0], q)  # receivers agree bit for bit
            qs.append(q)
        for i in range(n):
            choco_update([public[i]], [qs[i]])
        x = [x[i] + gamma * sum(w * (public[j] - public[i]) for j, w in ring[i].items()) for i in range(n)]
    assert consensus(x) < 1e-6 * consensus(x0)
    assert torch.allclose(sum(x) / n, sum(x0) / n, atol=1e-4)  # gossip keeps the average

    naive = [a.clone() for a in x0]
    for _ in range(300):
        q = [encode_and_decode(codec, [a])[1][0] for a in naive]
        naive = [naive[i] + gamma * sum(w * (q[j] - q[i]) for j, w in ring[i].items()) for i in range(n)]
    assert consensus(naive) > 1e-2 * consensus(x0)


def test_choco_refuses_error_feedback_and_mismatched_copies():
    with pytest.raises(ValueError, match="state: CHOCO needs CodecState"):
        choco_encode("int8", [torch.ones(3)], [torch.zeros(3)], CodecState(error_feedback=True))
    with pytest.raises(ValueError, match=r"x_hat: tensor 0 has shape \(4,\), x has \(3,\)"):
        choco_encode("int8", [torch.ones(3)], [torch.zeros(4)])
    with pytest.raises(ValueError, match="q: tensor 0 has shape"):
        choco_update([torch.zeros(3)], [torch.zeros(4)])
