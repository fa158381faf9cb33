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

torch.set_num_threads(1)


def _least_squares(workers=4, d=500, m=300, seed=0):
    """Each worker holds its own least-squares data with its own optimum (non-IID), so the
    workers' gradients do not vanish at the joint optimum: top-k of each is biased there."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(workers):
        a = torch.randn(m, d, generator=g) / d ** 0.5
        b = a @ (torch.randn(d, generator=g) * 2 + i) + 0.1 * torch.randn(m, generator=g)
        data.append((a, b))
    return data


def _loss(data, w):
    return sum(float(((a @ w - b) ** 2).mean() / 2) for a, b in data) / len(data)


def _train(data, codec, error_feedback, steps=1500, lr=2.0):
    w = torch.zeros(data[0][0].shape[1])
    states = [CodecState(error_feedback=error_feedback, seed=i) for i in range(len(data))]
    for _ in range(steps):
        update = torch.zeros_like(w)
        for (a, b), state in zip(data, states):
            grad = a.T @ (a @ w - b) / a.shape[0]
            if codec is None:
                update += grad
            else:
                _, (sent,) = encode_and_decode(codec, [grad], state)
                update += sent
        w -= lr * update / len(data)
    return _loss(data, w), states


@pytest.mark.timeout(120)
def test_topk_one_percent_needs_error_feedback_to_match_uncompressed_training():
    data = _least_squares()
    topk = make_codec({"kind": "topk", "fraction": 0.01})
    plain, _ = _train(data, None, False)
    with_ef, states = _train(data, topk, True)
    without_ef, _ = _train(data, topk, False)
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
